// Which (query head, query tile) pairs a Hopper backward CTA visits for its KV tile: causal and
// kv ranges skip the pairs that see none of its keys, a block mask lists them. Producer and
// consumers walk the same pairs (BwdWalk), so they agree on the ring's position.
#pragma once
#include "kernelgen/flash_bwd_sm80.cuh"  // BwdArgs
#include "kernelgen/bwd_sm90_config.cuh"
#include "kernelgen/tile_order.cuh"  // launch_index

namespace kg {

// The CTA's KV tile and the (query head, query tile) pairs it visits, head-major: the one place
// they are decided, so the producer's loads and the consumers' steps agree. Causal (bottom-right:
// query i sees keys <= i + shift) skips the query tiles above the diagonal, as flash_bwd_sm80.cuh.
struct BwdWork {
    int kv_head, batch, kv0, group, m_first, per_head, n_iter, n_block;
    int first_seen;  // a kv range: the first pair not ruled out (found with n_iter)
    __device__ __forceinline__ int head(int it) const { return kv_head * group + it / per_head; }
    __device__ __forceinline__ int m0(int it, int block_m) const {
        return (m_first + it % per_head) * block_m;
    }
};

// Pair `pair` of the walk with a kv range: whether its query tile's keys meet this KV tile (the
// test of flash_bwd_sm80.cuh).
template <class C, class Mods>
__device__ __forceinline__ bool bwd_pair_seen(const BwdArgs<typename C::Elem>& a, const Mods& mods,
                                              int kv_head, int batch, int kv0, int group,
                                              int m_first, int per_head, int pair) {
    const int head = kv_head * group + pair / per_head, m0 = (m_first + pair % per_head) * C::kBlockM;
    const int q_last = min(m0 + C::kBlockM, a.seqlen_q) - 1;
    const int lo = max(0, mods.kv_lo(m0, q_last, batch, head, a.seqlen_q, a.seqlen_k));
    int hi = min(a.seqlen_k, mods.kv_hi(m0, q_last, batch, head, a.seqlen_q, a.seqlen_k));
    if constexpr (C::kCausal) hi = min(hi, q_last + a.seqlen_k - a.seqlen_q + 1);
    return lo < hi && kv0 < hi && lo < kv0 + C::kBlockN;
}

template <class Mods>
constexpr bool kBwdSkipPairs = Mods::kKvRange && !Mods::kBlockSparse;

// Whether the grid's CTAs take their KV tiles from a block mask's launch order (bm_order): full
// attention only; a causal grid already runs each batch's longest tiles first.
template <class C, class Mods>
constexpr bool kBwdTileOrder = Mods::kBlockSparse && !C::kCausal;

// Whether finding a pair costs more than arithmetic (a kv range's warp-wide search, which loads
// per-token bounds where they are tensors; a block mask's lists, read from global memory). Then
// only the loads' warp walks, and writes each slot's pair into shared memory (BwdSlotPair) for
// the stats warp and the consumers, which read it once the slot is full: a global load
// and a branch on it at the top of every pair, before the slot's wait, left the consumers one
// L2 round trip per pair behind (PERF_NOTES §87). Not a block mask's at head dim 96: its
// consumers spill then (92 bytes causal), as the list entry they re-read per use let ptxas
// rematerialize head and m0, and a value read after an mbarrier wait cannot be.
template <class C, class Mods>
constexpr bool kBwdSlotPairs = Mods::kKvRange || (Mods::kBlockSparse && C::kHeadDim != 96);

// first_seen and count_seen (flash_bwd_sm80.cuh) kept rolled, the count by ballot: unrolled
// copies of the search, or a shuffle sum, cost registers the walking warp (24 of them) and, when
// they still walked, the consumers did not have (window at head_dim 128 spilled with either).
template <class Seen>
__device__ __forceinline__ int bwd_first_seen(int from, int count, int lane, const Seen& seen) {
    #pragma unroll 1
    for (int base = from; base < count; base += 32) {
        const int index = base + lane;
        int found = index < count && seen(index) ? index : count;
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            found = min(found, __shfl_xor_sync(0xffffffffu, found, offset));
        if (found < count) return found;
    }
    return count;
}

// How many of the `count` pairs are seen, and the first of them (count if none): one pass, so
// that the walk's first step needs no search of its own.
struct SeenPairs {
    int total, first;
};

// Four rounds of 32 pairs per step, their tests first (indices clamped into the pairs, so that
// none is branched around) and then their ballots: where a kv range's bounds are loads, the
// eight loads of a step are in flight together. One round at a time, each an L2 round trip, kept
// the whole CTA (K and V not yet asked for) waiting 8 trips for a KV tile of a 16k-token varlen
// batch (256 query tiles). It runs before the producer gives registers back (PERF_NOTES §90).
template <class Seen>
__device__ __forceinline__ SeenPairs bwd_count_seen(int count, int lane, const Seen& seen) {
    constexpr int kRounds = 4;
    SeenPairs found{0, count};
    #pragma unroll 1
    for (int base = 0; base < count; base += 32 * kRounds) {
        bool hit[kRounds];
        #pragma unroll
        for (int r = 0; r < kRounds; ++r) {
            const int index = base + 32 * r + lane;
            hit[r] = seen(min(index, count - 1)) && index < count;
        }
        #pragma unroll
        for (int r = 0; r < kRounds; ++r) {
            const u32 ballot = __ballot_sync(0xffffffffu, hit[r]);
            if (found.total == 0 && ballot != 0) found.first = base + 32 * r + __ffs(ballot) - 1;
            found.total += __popc(ballot);
        }
    }
    return found;
}

// The CTA's KV tile and its pairs before any are ruled out (n_iter: all of them); bwd_count
// then counts those walked where that reads memory.
template <class C, class Mods>
__device__ __forceinline__ BwdWork bwd_tile(const BwdArgs<typename C::Elem>& a, const Mods& mods) {
    // Causal grids put the KV tile in the middle (the spec's launch): per batch, every kv head's
    // tile 0 (the most query rows) first, then every tile 1, ..., so the tiles sharing a head's Q,
    // dO and dQ accumulators run close in time, in L2, and still longest first. (With the tile
    // slowest over all batches, a pair's tiles ran a whole round of pairs apart: at 512 keys the
    // kernel was slower causal than full.) blockIdx values, not computed ones: ptxas
    // rematerializes them, where three more live registers spill the tightest mods variants.
    int n_block = C::kCausal ? blockIdx.y : blockIdx.x;
    int kv_head = C::kCausal ? blockIdx.x : blockIdx.y;
    int batch = blockIdx.z;
    if constexpr (kBwdTileOrder<C, Mods>) {
        // A block mask's launch order (blockmask.BlockMask.tile_order): the grid's CTA i takes
        // tile bm_order[i], its shortest tiles last, so the last wave is not left to the long
        // ones (PERF_NOTES §99). Null: the grid's own order.
        if (mods.bm_order != nullptr) {
            const int n_blocks = gridDim.x, tile = mods.bm_order[launch_index()];
            n_block = tile % n_blocks;
            kv_head = tile / n_blocks % a.heads_k;
            batch = tile / (n_blocks * a.heads_k);
        }
    }
    const int kv0 = n_block * C::kBlockN, group = a.heads / a.heads_k;
    const int m_tiles = cdiv(a.seqlen_q, C::kBlockM);
    int m_first = 0;
    if constexpr (C::kCausal) m_first = min(max(kv0 - (a.seqlen_k - a.seqlen_q), 0) / C::kBlockM, m_tiles);
    const int per_head = m_tiles - m_first;
    return BwdWork{kv_head, batch, kv0, group, m_first, per_head, per_head * group, n_block, 0};
}

// Pairs walked: all of them; with a kv range those it does not rule out (counted by each warp,
// all threads still converged here); with a block mask the group's listed ones. Both read
// memory, so the kernel asks for K and V first (kBwdEarlyKv).
template <class C, class Mods>
__device__ __forceinline__ void bwd_count(const BwdArgs<typename C::Elem>& a, const Mods& mods,
                                          BwdWork& w) {
    if constexpr (Mods::kBlockSparse) {
        w.n_iter = 0;
        for (int g = 0; g < w.group; ++g)
            w.n_iter += mods.sparse_row(w.batch, w.kv_head * w.group + g, w.n_block).n_blocks;
    } else if constexpr (kBwdSkipPairs<Mods>) {
        const SeenPairs seen = bwd_count_seen(w.per_head * w.group, threadIdx.x % 32, [&](int pair) {
            return bwd_pair_seen<C>(a, mods, w.kv_head, w.batch, w.kv0, w.group, w.m_first,
                                    w.per_head, pair);
        });
        w.n_iter = seen.total;
        w.first_seen = seen.first;
    }
}

// Whether thread 0 asks for K and V before the pairs are counted, so that the count's round
// trips (a kv range's bounds, a block mask's list lengths) run while they load (PERF_NOTES
// §108); a tile that then has no pair waits for them before it exits.
template <class Mods>
constexpr bool kBwdEarlyKv = kBwdSkipPairs<Mods> || Mods::kBlockSparse;

// Causal, without a kv range or a block mask, and not at head dim 96 (whose consumers sit at the
// register limit: ptxas serialized the wgmmas of its modifier kernels, C7511): pair 0 is walked
// last, so that a consumer that sees none of it skips its GEMMs there (bwd_hidden_last).
template <class C, class Mods>
constexpr bool kBwdPeelDiagonal =
    C::kCausal && !Mods::kKvRange && !Mods::kBlockSparse && C::kHeadDim != 96;

// The pairs in walking order, the same for every role: step `it` visits pair(it), after next()
// found it (a kv range: the next pair not ruled out, a warp-wide search; else the next index).
// A block mask's entry is re-read from its lists (global memory, L1) per use, as in the sm80 kernel.
struct BwdPair {
    int head, m0;
    int partial;  // a block mask's partially visible tile: the mask_mod per element
};

template <class C, class Mods>
struct BwdWalk {
    const BwdArgs<typename C::Elem>& a;
    const Mods& mods;
    const BwdWork& w;
    int at = 0;  // the pair of the current step (a kv range)

    __device__ __forceinline__ void first() {
        if constexpr (kBwdSkipPairs<Mods>) at = w.first_seen;
    }
    // Pair of step `it`; with a kv range the walk then moves on to the next step's pair (none
    // after the last: the search would scan every pair left, for nothing).
    __device__ __forceinline__ BwdPair step(int it) {
        if constexpr (Mods::kBlockSparse) {
            int pair = it;
            for (int g = 0;; ++g) {
                const SparseRow row = mods.sparse_row(w.batch, w.kv_head * w.group + g, w.n_block);
                if (pair < row.n_blocks || g == w.group - 1)
                    return BwdPair{w.kv_head * w.group + g, row.block(pair) * C::kBlockM,
                                   pair < row.n_partial};
                pair -= row.n_blocks;
            }
        } else if constexpr (kBwdSkipPairs<Mods>) {
            const int pair = at;
            if (it + 1 < w.n_iter) at = find(pair + 1);
            return BwdPair{w.head(pair), w.m0(pair, C::kBlockM), false};
        } else {
            // Causal: pair 0, the first head's diagonal query tile, is walked last
            // (bwd_hidden_last).
            int pair = it;
            if constexpr (kBwdPeelDiagonal<C, Mods>)
                pair = it + 1 == w.per_head * w.group ? 0 : it + 1;
            return BwdPair{w.head(pair), w.m0(pair, C::kBlockM), false};
        }
    }
    // The next seen pair from `from` on. Most often it is `from` itself (a window's pairs are
    // consecutive), which one test, the same in every lane, settles without the warp search and
    // its chain of shuffles.
    __device__ __forceinline__ int find(int from) const {
        const auto seen = [&](int pair) {
            return bwd_pair_seen<C>(a, mods, w.kv_head, w.batch, w.kv0, w.group, w.m_first,
                                    w.per_head, pair);
        };
        const int count = w.per_head * w.group;
        if (from >= count || seen(from)) return min(from, count);
        return bwd_first_seen(from + 1, count, int(threadIdx.x % 32), seen);
    }
};

// Whether none of the second consumer's 64 keys is seen by the rows of pair 0, the first head's
// diagonal query tile (so in every KV tile where seqlen_k - seqlen_q is a multiple of 64, in most
// otherwise; the first consumer's keys always meet the diagonal), which the walk visits last
// (kBwdPeelDiagonal) so that the consumer takes it after its loop without its GEMMs
// (flash_bwd_sm90.cuh).
template <class C, class Mods>
__device__ __forceinline__ bool bwd_hidden_last(const BwdArgs<typename C::Elem>& a,
                                                const BwdWork& w) {
    if constexpr (!kBwdPeelDiagonal<C, Mods>) {
        return false;
    } else {
        const int q_last = min(w.m0(0, C::kBlockM) + C::kBlockM, a.seqlen_q) - 1;
        return w.kv0 + 64 > q_last + a.seqlen_k - a.seqlen_q;
    }
}

// A slot's pair as the producer leaves it for the consumers (kBwdSlotPairs): 16 bytes, one
// shared-memory load each. `partial`: a block mask's partially visible tile.
struct alignas(16) BwdSlotPair {
    int head, m0, partial, unused;
};

// The ring's slot pairs (kBwdSlotPairs; [STAGES]) and the consumers' dQ pairs ([kConsumers]).
template <class C>
__device__ __forceinline__ BwdSlotPair* slot_pairs(unsigned char* tiles) {
    return reinterpret_cast<BwdSlotPair*>(tiles + C::kOffPairs);
}
template <class C>
__device__ __forceinline__ BwdSlotPair* dq_pairs(unsigned char* tiles) {
    return reinterpret_cast<BwdSlotPair*>(tiles + C::kOffDqPairs);
}

}  // namespace kg
