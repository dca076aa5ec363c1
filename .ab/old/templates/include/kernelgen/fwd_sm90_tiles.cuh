// Which tiles a Hopper forward CTA computes and in what order: a tile's KV blocks (tile_work)
// and those a consumer warpgroup skips (skipped_blocks), the static list of a CTA
// (TileSchedule), and the dynamic schedule's hand-off from the producer to the consumers
// (TileQueue). Producer and consumers walk the same list, so they agree on every tile's blocks
// and on the K/V ring's position.
#pragma once
#include "kernelgen/flash_fwd_sm80.cuh"  // FwdArgs, kv_keys, SparseRow
#include "kernelgen/fwd_sm90_config.cuh"
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tile_order.cuh"

namespace kg {

// One tile: BLOCK_M query rows of one (batch, head), and the KV blocks they see: n_blocks of
// them, the lowest from key col_first on (visited last to first).
// With a block mask the blocks are those of its lists instead (sparse, partial ones first); its
// pointers are null otherwise, a constant that folds away, so plain kernels keep their code.
struct TileWork {
    int head, batch, row0, q_rows, col_first, n_blocks;
    SparseRow sparse;
    // wg_skip's grouped lists: the last n_trailing blocks of the visiting order are partial too.
    int n_trailing = 0;
    // The first key column of the tile's i-th KV block in visiting order.
    __device__ __forceinline__ int col0(int i, int block_n) const {
        if (sparse.partial != nullptr) return sparse.block(i) * block_n;
        return col_first + (n_blocks - 1 - i) * block_n;
    }
};

// The one place a tile's KV blocks are decided for this kernel: the producer's loads, the
// consumers' steps and the ring positions of later tiles all follow it. The blocks cover the
// tile's keys (kv_keys, flash_fwd_sm80.cuh) from the multiple of BLOCK_N at or below their first
// (as the sm80 family's kv_blocks), or with kKvAlign from their first exactly: a range's keys then waste
// only the last block's overhang, BLOCK_N / 2 on average instead of BLOCK_N (documents of
// about 1k keys in 144-key blocks: 4% of the work). TMA takes any row as a box's start, and
// the masks test each block's own columns, so no block needs to sit on a multiple of BLOCK_N.
// A block mask gives the blocks itself (its classify kernel folded causal, the sequence ends
// and any kv range in).
template <class C, class Mods>
__device__ __forceinline__ TileWork tile_work(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                              int m_block, int head, int batch) {
    const int row0 = m_block * C::kBlockM;
    const int q_rows = min(a.seqlen_q - row0, C::kBlockM);
    if constexpr (Mods::kBlockSparse) {
        const SparseRow sparse = mods.sparse_row(batch, head, m_block);
        if constexpr (C::kWgSkip)
            return TileWork{head, batch, row0, q_rows, 0, sparse.n_blocks, sparse,
                            mods.sparse_groups(sparse).trail};
        return TileWork{head, batch, row0, q_rows, 0, sparse.n_blocks, sparse};
    }
    const KeyRange keys = kv_keys<C::kCausal>(mods, row0, q_rows, batch, head, a.seqlen_q,
                                              a.seqlen_k);
    const int first = C::kKvAlign ? keys.lo : keys.lo / C::kBlockN * C::kBlockN;
    const int n_blocks = keys.hi > keys.lo ? cdiv(keys.hi - first, C::kBlockN) : 0;
    return TileWork{head, batch, row0, q_rows, first, n_blocks, SparseRow{nullptr, nullptr, 0, 0}};
}

// The tile's KV blocks that no row of the warpgroup whose first row is wg_row0 sees, at the
// two ends of its visiting order: `lead`, its first (the highest keys: with causal, the
// diagonal's blocks past the warpgroup's own rows, with 64-key blocks and 128-row tiles one per
// tile for warpgroup 0, a tenth of the tensor work at 512 tokens; with a kv range the keys past
// its rows' own range, documents: the next document's), and `trail`, its last (a kv range's
// keys before its rows' range: the previous document's). With a block mask none, whose lists
// are not contiguous, unless they come grouped for the warpgroups (wg_skip). A warpgroup keeps
// one block at least (where its rows see no key: O = 0, as without the skips); one of padding
// rows skips none (its per-token ranges would read past the sequence). Lane 0's counts, so
// that ptxas sees the branches around the wgmma as warp-uniform (else C7519: every wgmma
// serialized).
struct SkippedBlocks {
    int lead, trail;
};

template <class C, class Mods>
__device__ __forceinline__ SkippedBlocks skipped_blocks(const FwdArgs<typename C::Elem>& a,
                                                        const Mods& mods, const TileWork& w,
                                                        int wg_row0) {
    if constexpr (Mods::kBlockSparse && C::kWgSkip) {
        // The grouped lists' leading group is the leading warpgroup's to skip, the trailing
        // group the other's (as many as the cap below allows: the rest it computes, masked).
        const SparseGroups groups = mods.sparse_groups(w.sparse);
        const bool leads = (wg_row0 - w.row0) / 64 == groups.lead_wg;
        const int lead = min(leads ? groups.lead : 0, w.n_blocks - 1);
        const int trail = leads ? 0 : min(groups.trail, min(w.n_blocks - 1, C::kStages - 1));
        const int both = __shfl_sync(0xffffffffu, lead | (trail << 16), 0);
        return SkippedBlocks{both & 0xffff, both >> 16};
    } else if constexpr (Mods::kBlockSparse || (!C::kCausal && !Mods::kKvRange)) {  // (block lists)
        return SkippedBlocks{0, 0};
    } else {
        const int wg_rows = min(64, w.row0 + w.q_rows - wg_row0);
        int lead = 0, trail = 0;
        if (wg_rows > 0) {
            const KeyRange own = kv_keys<C::kCausal>(mods, wg_row0, wg_rows, w.batch, w.head,
                                                     a.seqlen_q, a.seqlen_k);
            if (own.hi > own.lo) {   // the tile's blocks wholly past own.hi, and before own.lo
                lead = max(0, w.n_blocks - cdiv(own.hi - w.col_first, C::kBlockN));
                trail = max(0, (own.lo - w.col_first) / C::kBlockN);
            } else {
                lead = w.n_blocks;
            }
            lead = min(lead, w.n_blocks - 1);
            // At most kStages - 1 trailing: the dynamic schedule publishes a CTA's next tile
            // only once this tile's loads are issued, and a warpgroup asks for it (is_final) at
            // its last P V, before its trailing passes; with more, the last loads would wait
            // for those passes' releases (a deadlock the emulator showed).
            trail = min(trail, min(w.n_blocks - 1 - lead, C::kStages - 1));
        }
        const int both = __shfl_sync(0xffffffffu, lead | (trail << 16), 0);
        // Trailing blocks only with a kv range (causal rows all start at key 0): a compile-time 0
        // keeps the other kernels' code as it was (the end-of-tile passes grew their loops).
        return SkippedBlocks{both & 0xffff, Mods::kKvRange ? both >> 16 : 0};
    }
}

// The tiles one CTA computes, in order. Not persistent: the one tile of its blockIdx (causal: the
// last query tiles, which see the most keys, launch first; with kSectionedGrid the tile its
// place in the launch order has in the dynamic schedule's order). Persistent (at most one CTA per SM):
// linear tiles blockIdx.x, blockIdx.x + gridDim.x, ...; otherwise the query tiles of one head are
// neighbours and share its K and V in L2; causal runs longest first in sections of (batch, head)
// pairs whose K and V fit in L2 (tile_order.cuh). The producer and every consumer walk the same
// list, and the smem rings and barrier phases run on across tiles, so the next tile's loads
// overlap this tile's epilogue.
template <class C, class Mods>
struct TileSchedule {
    const Mods& mods;
    int m_blocks, heads, count, section;
    __device__ __forceinline__ TileSchedule(const FwdArgs<typename C::Elem>& a, const Mods& m)
        : mods(m), m_blocks(cdiv(a.seqlen_q, C::kBlockM)), heads(a.heads),
          count(C::kPersistent ? m_blocks * a.heads * a.batch : 1) {
        // Consecutive pairs are consecutive heads of one batch, `group` of which share a K/V head
        // (4 * seqlen_k * head_dim bytes of K and V).
        const int group = a.heads / a.heads_k;
        section = section_pairs(4ll * a.seqlen_k * C::kHeadDim) * group;
    }
    __device__ __forceinline__ int first() const { return C::kPersistent ? blockIdx.x : 0; }
    __device__ __forceinline__ int step() const { return C::kPersistent ? gridDim.x : 1; }
    __device__ __forceinline__ TileWork at(const FwdArgs<typename C::Elem>& a, int t) const {
        // t: the t-th item of the CTAs' round robin (first(), first() + step(), ...).
        // A CTA per tile (kSectionedGrid aside): the tile of its blockIdx.
        constexpr bool kSectioned = C::kCausal && C::kSectionedGrid;
        if constexpr (!C::kPersistent && !C::kCausal && Mods::kBlockSparse) {
            // A block mask's launch order (blockmask.BlockMask.tile_order): CTA i takes tile
            // bm_order[i], the shortest eighth last, so the last wave is not left to long
            // tiles (PERF_NOTES §99-§101). Null: the grid's own order.
            // One tile_work either way (two inlined copies cost 256 instructions).
            int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
            if (mods.bm_order != nullptr) {
                const int tile = mods.bm_order[launch_index()];
                const int hb = tile / int(gridDim.x);
                m_block = tile % int(gridDim.x);
                head = hb % heads;
                batch = hb / heads;
            }
            return tile_work<C>(a, mods, m_block, head, batch);
        }
        if constexpr (!C::kPersistent && !kSectioned)
            return tile_work<C>(a, mods, C::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x,
                                blockIdx.y, blockIdx.z);
        // kSectionedGrid: the GPU starts the CTAs in blockIdx order (x fastest) as SMs free up,
        // as the dynamic schedule's CTAs claim tiles; so the t-th started takes that schedule's
        // t-th tile.
        if constexpr (!C::kPersistent)
            t = launch_index();
        const int pairs = C::kPersistent ? count / m_blocks : gridDim.y * gridDim.z;
        int m_block, hb;
        if constexpr (kZigzag) t = zigzag_item(t, gridDim.x, zigzag());
        if constexpr (C::kCausal) {
            // With a kv range or a block mask a tile's rank (its position) only bounds its work,
            // and the dynamic schedule's CTAs claim the last section's long tiles while the others
            // run dry: there the shortest ranks run after the sections (tile_order.cuh).
            SectionItem item;
            if constexpr (Mods::kKvRange || Mods::kBlockSparse || C::kDynamic || kSectioned)
                item = section_item(t, pairs, m_blocks, section, m_blocks / KG_TAIL_RANKS_DIV);
            else
                item = section_item(t, pairs, m_blocks, section);
            m_block = m_blocks - 1 - item.rank;
            hb = item.pair;
        } else {
            m_block = t % m_blocks;
            hb = t / m_blocks;
        }
        return tile_work<C>(a, mods, m_block, hb % heads, hb / heads);
    }
    // Non-causal with a kv range read from memory or a block mask, a tile's work is its rows'
    // documents (or lists), which its position does not bound: the dynamic schedule's claims defer
    // the short ones (TileQueue::claim_longer), so that the claims at the end are short. Not for
    // an analytic range (a window): its tiles are shorter only at the sequence's edges, and the
    // deferral lost 2-3% there (window hd128 full 4k, PERF_NOTES §62).
    static constexpr bool kDefer =
        C::kDynamic && !C::kCausal && (Mods::kRangeReadsMemory || Mods::kBlockSparse);
    // The static causal schedule's round robin in a zigzag (tile_order.cuh): the slot t of the
    // CTAs' walk (first(), first() + step(), ...) holds the tile zigzag_item(t) where valid(t);
    // the straight order below KG_ZIGZAG_M_BLOCKS query tiles per (batch, head) (zigzag_item
    // says why).
    static constexpr bool kZigzag = C::kPersistent && C::kCausal && !C::kDynamic;
    __device__ __forceinline__ bool zigzag() const { return m_blocks >= KG_ZIGZAG_M_BLOCKS; }
    __device__ __forceinline__ bool valid(int t) const {
        // The round bound is implied by the item test (an item lies in its slot's round), but
        // without it ptxas spilled the hd256 causal 128 x 80 static config once
        // tools/wip/wg_skip.patch was applied (PERF_NOTES §53).
        if constexpr (kZigzag)
            return t / int(gridDim.x) < cdiv(count, int(gridDim.x)) &&
                   zigzag_item(t, gridDim.x, zigzag()) < count;
        else
            return t < count;
    }
    // Whether a tile after t in this CTA's list has a KV block to compute (t = first() - step():
    // whether any has).
    __device__ __forceinline__ bool more_work(const FwdArgs<typename C::Elem>& a, int t) const {
        for (int u = t + step(); valid(u); u += step())
            if (C::kCarryQk ? has_work(a, u) : at(a, u).n_blocks > 0) return true;
        return false;
    }
    // Whether tile t has a KV block. Without a causal mask, a kv range or a block mask every
    // tile sees every key, so no tile's bounds need working out: carry_qk asks this before the
    // tail's issue (more_work, the dynamic loop's search for the next tile with work). The
    // other configs' more_work keeps the tile's full TileWork test only so that their SASS,
    // measured on the H200, stays as it was until a device session measures the change.
    __device__ __forceinline__ bool has_work(const FwdArgs<typename C::Elem>& a, int t) const {
        if constexpr (!C::kCausal && !Mods::kKvRange && !Mods::kBlockSparse)
            return a.seqlen_k > 0;
        else
            return at(a, t).n_blocks > 0;
    }
};

// The dynamic schedule's hand-off (PERSISTENT 2): the producer thread claims a CTA's tiles after
// the first from a global counter (zero at launch) and publishes each one's index t (count: no
// more) in a two-slot ring in shared memory, in order; every consumer thread takes each
// publication once. full_t[slot]: the producer's one arrival after writing the slot; empty_t[slot]:
// one arrival per consumer warp once its lanes have read it. Publication j uses slot j % 2 with
// parity (j / 2) & 1, so the producer can publish a tile's successor while the tile is computed.
// With TileSchedule::kDefer a scheduler thread of the producer warpgroup claims and publishes
// instead, and the producer thread takes each publication too (one more arrival on empty_t): a
// claim then waits on the tile's bounds, and possibly on further claims, which the producer's
// loads must not wait behind.
template <class C>
struct TileQueue {
    Sm90Barriers<C> bar;
    int* slots;  // the two slots, in shared memory
    // [0] the claims. With kDefer [0, 1] one 64-bit word instead: the claims (low half) and the
    // claims still undecided, kept or deferred (high half); [2] tiles deferred, [3] tickets to the
    // list handed out, [4..] the list (hopper.tile_counter's size).
    int* counter;

    // The next tile nobody has claimed (every CTA's first tile is its blockIdx.x).
    __device__ __forceinline__ int claim() const { return gridDim.x + atomicAdd(counter, 1); }
    __device__ __forceinline__ void publish(int j, int t) const {
        mbarrier_wait(bar.empty_t(j % 2), u32((j / 2) & 1) ^ 1);
        slots[j % 2] = t;
        mbarrier_arrive(bar.full_t(j % 2));  // release: the consumers' wait acquires the slot
    }
    __device__ __forceinline__ int take(int j) const {
        mbarrier_wait(bar.full_t(j % 2), u32(j / 2) & 1);
        const int t = slots[j % 2];
        __syncwarp();  // every lane has read it
        if (threadIdx.x % 32 == 0) mbarrier_arrive(bar.empty_t(j % 2));
        return t;
    }
    // take() for a thread alone in its warp (the producer thread; its lanes have returned).
    __device__ __forceinline__ int take_alone(int j) const {
        mbarrier_wait(bar.full_t(j % 2), u32(j / 2) & 1);
        const int t = slots[j % 2];
        mbarrier_arrive(bar.empty_t(j % 2));
        return t;
    }

    // kDefer's claims: the next claimed tile with at least 3/4 of this CTA's mean work so far
    // (`sum` KV blocks over `seen` tiles, its first included; the mean itself deferred more and
    // gained less, §62), the shorter ones put on a global list that every CTA takes from once
    // the claims run out (take_deferred); `count` when the claims are done. Simulated on the bench's documents (non-causal, 128-row tiles, 132 CTAs,
    // tools/schedule_sim.py --defer): 0.93-0.95 of a perfect balance in claim order, 0.97 with
    // the deferral, 0.98-0.99 for longest first overall (which needs every tile's work before
    // the launch). A claim counts as undecided (the word's high half) until its tile is kept or
    // listed, so that a taker can tell when the list is final.
    static constexpr unsigned long long kClaim = 1ull + (1ull << 32), kDecided = ~0ull << 32;
    template <class Schedule, class Args>
    __device__ __forceinline__ int claim_longer(const Schedule& tiles, const Args& a, int& sum,
                                                int& seen) const {
        auto* const word = reinterpret_cast<unsigned long long*>(counter);
        for (;;) {
            const int t = gridDim.x + int(u32(atomicAdd(word, kClaim)));
            if (t >= tiles.count) break;
            const int n = tiles.at(a, t).n_blocks;
            sum += n;
            ++seen;
            if (4 * n * seen >= 3 * sum) {  // at least 3/4 of the mean: kept (§62)
                atomicAdd(word, kDecided);
                return t;
            }
            atomicExch(counter + 4 + atomicAdd(counter + 2, 1), t + 1);
            __threadfence();  // the entry and its count before the decision
            atomicAdd(word, kDecided);
        }
        atomicAdd(word, kDecided);
        return tiles.count;
    }
    // After claim_longer's `count`: the next tile of the list (`count`: the list is done). Each
    // taker draws a ticket, its index into the list, with one fetch-and-add: the first version
    // compared-and-swapped the count taken instead, so that it never passed the count deferred,
    // and its takers queued behind each other (one success per round trip to L2 with 132
    // contenders) while the tiles they took are a few microseconds each: packed hd128 full 4k
    // -35% (PERF_NOTES §61, §62). A ticket past the list's end waits for its entry or for the
    // list to be final (every claim made and decided); it never waits on another CTA's tiles.
    __device__ __forceinline__ int take_deferred(int count) const {
        auto* const word = reinterpret_cast<unsigned long long*>(counter);
        const int k = atomicAdd(counter + 3, 1);
        for (;;) {
            const unsigned long long w = atomicAdd(word, 0ull);
            __threadfence();  // the word before the count: a final word means a final count
            if (k < atomicAdd(counter + 2, 0)) {
                int entry;
                while ((entry = atomicAdd(counter + 4 + k, 0)) == 0) {}  // its writer is between two atomics
                return entry - 1;
            }
            if (gridDim.x + int(u32(w)) >= count && (w >> 32) == 0) return count;
            __nanosleep(256);
        }
    }
};

}  // namespace kg
