// FlashAttention forward for Hopper (sm_90a): TMA loads, an mbarrier pipeline, wgmma, and warp
// specialization, following FA3 (its schedules: plain, intra-warpgroup overlap, pingpong).
//
// One CTA computes BLOCK_M query rows of one (batch, head). Warpgroup 0 is the producer: after
// setmaxnreg.dec one thread issues every TMA load (Q once, then K and V tiles of BLOCK_N rows
// through a STAGES-deep ring). Warpgroups 1..BLOCK_M/64 are consumers (setmaxnreg.inc), 64 query
// rows each: S = Q K^T by wgmma with both operands in shared memory (SS), the online softmax in
// fp32 registers (the math of flash_fwd_sm80.cuh), then O += P V by wgmma with P straight from
// registers (RS) and V read MN-major (transposed) from shared memory. The schedule (SCHEDULE)
// decides how much of that is in flight at once.
//
// Rings: for each stage s, full_k[s] / full_v[s] (one arrival from the producer's expect_tx plus
// the tile's TMA bytes) and empty_k[s] / empty_v[s] (one arrival per consumer warp once its wgmmas
// that read the slot have completed). Iteration i uses stage i % STAGES with parity (i / STAGES) & 1
// on full barriers; the producer waits on empty barriers with the opposite parity, which a fresh
// barrier already satisfies, so the first round starts at once.
//
// Shared memory (1024-aligned): Q [panels][BLOCK_M][SWIZZLE B] | K [STAGES][panels][BLOCK_N][SWIZZLE B]
// | V (same) | barriers. A panel holds SWIZZLE/2 columns of head_dim (64 for 128B swizzle, 32 for
// head dims that are not a multiple of 64) for every row of the tile, as TMA writes it with a
// rank-5 box {SWIZZLE/2, rows, panels, 1, 1}. KV blocks are visited last to first (the masked
// tail and causal diagonal first), like FA3.
//
// PERSISTENT: a CTA per SM loops over tiles (TileSchedule); the K/V ring and the barrier phases
// run on from tile to tile, and empty_q tells the producer when the epilogue (which stages O in
// the Q tile) is done with Q. With one Q buffer (Q_BUFFERS 1) the next tile's Q, and so its first
// QK^T, waits for this tile's epilogue. Q_BUFFERS 2 (persistent only): tiles use Q buffers in
// turn (full_q[j] / empty_q[j] per buffer), so tile t+1's Q lands while tile t computes; tile t's
// epilogue stages O in its own Q buffer and one thread per consumer warpgroup stores it with TMA
// (the O map), and that thread hands the buffer back (empty_q) only once the store has read it,
// which it waits for after tile t+1's first block: the store overlaps tile t+1's first GEMMs.
// PERSISTENT 2 (dynamic): the same loop, but after its first tile (blockIdx.x) a CTA claims the
// next one from a global counter when its producer gets to it (TileQueue), so CTAs that drew
// short tiles take more of them: the hardware's balance of a grid per tile, with the persistent
// overlap of one tile's epilogue and the next one's loads. Tiles are claimed in the static order
// (longest first for causal), so the tail is short tiles.
//
// Mods (a spec's `mods`, the struct mods.inc.j2 renders; NoMods without): exactly the sm80
// family's. kv_range bounds the KV blocks of a tile ([kv_lo, kv_hi) of its rows, in tile_work,
// which producer and consumers share, so they agree on every tile's blocks and the ring position);
// score_mod rewrites each scaled score right after its QK^T (the softmax then runs in log2 units
// without the scale); mask_mod hides elements, evaluated only in blocks not inside [full_lo,
// full_hi) of the warpgroup's rows. With everything off the code is the plain kernel's.
#pragma once
#include "kernelgen/flash_fwd_sm80.cuh"  // FwdArgs: the argument list both families share
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tma.cuh"
#include "kernelgen/tile_order.cuh"
#include "kernelgen/tma_store.cuh"
#include "kernelgen/wgmma.cuh"

namespace kg {

// QkGemm::mma(float (&)[BLOCK_N / 2], u64 desc_q, u64 desc_k, int accumulate) and
// PvGemm::mma(float (&)[HEAD_DIM / 2], const u32 (&p)[4], u64 desc_v): one k16 step each, rendered
// by the template for this variant's N.
// SCHEDULE 0: plain (QK^T, softmax, PV in turn); 1: intra-warpgroup overlap; 2: overlap plus
// pingpong between the consumer warpgroups (see sm90_consume).
template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL,
          int SCHEDULE, int PERSISTENT, int Q_BUFFERS, int SUM_MMA, int RESCALE, int Q_SPLIT,
          class QkGemm_, class PvGemm_>
struct Sm90Config {
    using Elem = Elem_;
    using QkGemm = QkGemm_;
    using PvGemm = PvGemm_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kSchedule = SCHEDULE;
    static constexpr bool kPingpong = SCHEDULE == 2;
    static constexpr bool kPersistent = PERSISTENT > 0;  // loop over tiles (TileSchedule)
    static constexpr bool kDynamic = PERSISTENT == 2;    // ... claimed from a counter (TileQueue)
    static constexpr int kQBuffers = Q_BUFFERS;        // Q tiles used in turn by successive tiles
    static constexpr bool kTmaStore = Q_BUFFERS == 2;  // O stored from its Q buffer by TMA
    // The row sums of P from the P V wgmma: N = HEAD_DIM + 8, B's last 8 columns read a panel of
    // ones (kOffOnes), so accumulators kHeadDim / 2 .. + 3 hold each row's sum, rescaled with O.
    static constexpr bool kSumMma = SUM_MMA != 0;
    static constexpr int kAccO = (HEAD_DIM + (kSumMma ? 8 : 0)) / 2;  // O's fp32 per thread
    // RESCALE 1: O is rescaled by a block's alpha in the shadow of the next block's QK^T (FA3's
    // order: after that issue, before the P V issue), not after the wait for the P V that wrote
    // it. Overlapped schedules only (the plain one has no QK^T in flight there).
    static constexpr bool kRescaleEarly = RESCALE == 1;
    // Q_SPLIT (one Q buffer): each consumer warpgroup's 64 rows of Q load and go back on their
    // own barriers (one TMA box per panel of 64 rows), so a warpgroup done with its epilogue gets
    // the next tile's Q without waiting for the others', and the producer loads the next tile's
    // first K between the first warpgroup's rows and the rest.
    static constexpr bool kQSplit = Q_SPLIT == 1;
    static constexpr int kQBarriers = kQSplit ? BLOCK_M / 64 : Q_BUFFERS;  // full_q / empty_q each
    static constexpr int kConsumers = BLOCK_M / 64;          // one warpgroup per 64 query rows
    static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
    // Per-thread register budgets after setmaxnreg (FA3's: 24/240 for 2 consumers, 32/160 for 3).
    static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
    static constexpr int kSwizzle = HEAD_DIM % 64 == 0 ? 128 : 64;  // bytes per panel row
    static constexpr int kPanel = kSwizzle / 2;                     // head_dim columns per panel
    static constexpr int kPanels = HEAD_DIM / kPanel;
    static constexpr int kStepsPerPanel = kPanel / 16;              // k16 steps inside a panel
    static constexpr u32 kTileQ = BLOCK_M * HEAD_DIM * 2, kTileKV = BLOCK_N * HEAD_DIM * 2;
    static constexpr u32 kOffK = Q_BUFFERS * kTileQ, kOffV = kOffK + STAGES * kTileKV;
    static constexpr u32 kOffOnes = kOffV + STAGES * kTileKV;  // sum_mma: BLOCK_N rows of ones
    static constexpr u32 kOffBarriers = kOffOnes + (kSumMma ? BLOCK_N * kSwizzle : 0);
    // full_q[], empty_q[] (one per Q buffer), full_k[], empty_k[], full_v[], empty_v[], and
    // (dynamic) full_t[2], empty_t[2] of the tile queue, whose two slots follow the barriers.
    static constexpr int kBarriers = 2 * kQBarriers + 4 * STAGES + (kDynamic ? 4 : 0);
    static constexpr u32 kOffQueue = kOffBarriers + 8 * kBarriers;
    static constexpr u32 kSmemBytes = 1024 + kOffQueue + (kDynamic ? 8 : 0);  // + 1024: realignment

    static_assert(BLOCK_M == 128 || BLOCK_M == 192, "two or three consumer warpgroups");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "P splits into k16 steps; wgmma N <= 256");
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "whole 64B panels; wgmma N <= 256");
    static_assert(kTileQ % 1024 == 0 && kTileKV % 1024 == 0, "every panel stays 1024-aligned");
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");
    static_assert(STAGES >= 2, "a ring of one stage cannot overlap loads with math");
    static_assert(!kSumMma || HEAD_DIM == 64, "sum_mma: the ones are the panel after V's one");
    static_assert(SCHEDULE >= 0 && SCHEDULE <= 2, "plain, overlapped, overlapped + pingpong");
    static_assert(PERSISTENT >= 0 && PERSISTENT <= 2, "a CTA per tile, static or dynamic loop");
    static_assert(Q_BUFFERS == 1 || (Q_BUFFERS == 2 && PERSISTENT),
                  "a second Q buffer serves the next tile of a persistent CTA");
    static_assert(!kRescaleEarly || SCHEDULE > 0, "rescale 1: a QK^T in flight to hide behind");
    static_assert(!kQSplit || Q_BUFFERS == 1, "q_split: the rows of the one Q buffer");
};

template <class C>
struct Sm90Barriers {
    static constexpr int kQ = 2 * C::kQBarriers;  // the Q barriers come first
    u32 base;
    // j: the Q buffer, or with kQSplit the consumer warpgroup whose rows they cover.
    __device__ __forceinline__ u32 full_q(int j) const { return base + 8 * j; }
    __device__ __forceinline__ u32 empty_q(int j) const { return base + 8 * (C::kQBarriers + j); }
    __device__ __forceinline__ u32 full_k(int s) const { return base + 8 * (kQ + s); }
    __device__ __forceinline__ u32 empty_k(int s) const { return base + 8 * (kQ + C::kStages + s); }
    __device__ __forceinline__ u32 full_v(int s) const { return base + 8 * (kQ + 2 * C::kStages + s); }
    __device__ __forceinline__ u32 empty_v(int s) const { return base + 8 * (kQ + 3 * C::kStages + s); }
    __device__ __forceinline__ u32 full_t(int j) const { return base + 8 * (kQ + 4 * C::kStages + j); }
    __device__ __forceinline__ u32 empty_t(int j) const { return base + 8 * (kQ + 4 * C::kStages + 2 + j); }
};

// The Q buffer of a CTA's `tile`-th tile with work, and the parity of its barriers' phase.
template <class C>
__device__ __forceinline__ int q_slot(int tile) { return tile % C::kQBuffers; }
template <class C>
__device__ __forceinline__ u32 q_parity(int tile) { return u32(tile / C::kQBuffers) & 1; }

// One tile: BLOCK_M query rows of one (batch, head), and the KV blocks they see: n_blocks of
// them from block n_first on (visited last to first).
// With a block mask the blocks are those of its lists instead (sparse, partial ones first); its
// pointers are null otherwise, a constant that folds away, so plain kernels keep their code.
struct TileWork {
    int head, batch, row0, q_rows, n_first, n_blocks;
    SparseRow sparse;
    // The first key column of the tile's i-th KV block in visiting order.
    __device__ __forceinline__ int col0(int i, int block_n) const {
        if (sparse.partial != nullptr) return sparse.block(i) * block_n;
        return (n_first + n_blocks - 1 - i) * block_n;
    }
};

// The one place a tile's KV blocks are decided for this kernel: the producer's loads, the
// consumers' steps and the ring positions of later tiles all follow it. kv_blocks
// (flash_fwd_sm80.cuh) for causal and kv ranges; a block mask gives the blocks itself (its
// classify kernel folded causal, the sequence ends and any kv range in).
template <class C, class Mods>
__device__ __forceinline__ TileWork tile_work(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                              int m_block, int head, int batch) {
    const int row0 = m_block * C::kBlockM;
    const int q_rows = min(a.seqlen_q - row0, C::kBlockM);
    if constexpr (Mods::kBlockSparse) {
        const SparseRow sparse = mods.sparse_row(batch, head, m_block);
        return TileWork{head, batch, row0, q_rows, 0, sparse.n_blocks, sparse};
    }
    const KvBlocks blocks = kv_blocks<C::kBlockN, C::kCausal>(mods, row0, q_rows, batch, head,
                                                              a.seqlen_q, a.seqlen_k);
    return TileWork{head, batch, row0, q_rows, blocks.n_first, blocks.n_blocks,
                    SparseRow{nullptr, nullptr, 0, 0}};
}

// The tiles one CTA computes, in order. Not persistent: the one tile of its blockIdx (causal: the
// last query tiles, which see the most keys, launch first). Persistent (at most one CTA per SM):
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
        if constexpr (!C::kPersistent)
            return tile_work<C>(a, mods, C::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x,
                                blockIdx.y, blockIdx.z);
        int m_block, hb;
        if constexpr (C::kCausal) {
            const SectionItem item = section_item(t, count / m_blocks, m_blocks, section);
            m_block = m_blocks - 1 - item.rank;
            hb = item.pair;
        } else {
            m_block = t % m_blocks;
            hb = t / m_blocks;
        }
        return tile_work<C>(a, mods, m_block, hb % heads, hb / heads);
    }
    // Whether a tile after t in this CTA's list has a KV block to compute (t = first() - step():
    // whether any has).
    __device__ __forceinline__ bool more_work(const FwdArgs<typename C::Elem>& a, int t) const {
        for (int u = t + step(); u < count; u += step())
            if (at(a, u).n_blocks > 0) return true;
        return false;
    }
};

// The dynamic schedule's hand-off (PERSISTENT 2): the producer thread claims a CTA's tiles after
// the first from a global counter (zero at launch) and publishes each one's index t (count: no
// more) in a two-slot ring in shared memory, in order; every consumer thread takes each
// publication once. full_t[slot]: the producer's one arrival after writing the slot; empty_t[slot]:
// one arrival per consumer warp once its lanes have read it. Publication j uses slot j % 2 with
// parity (j / 2) & 1, so the producer can publish a tile's successor while the tile is computed.
template <class C>
struct TileQueue {
    Sm90Barriers<C> bar;
    int* slots;  // the two slots, in shared memory
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
};

// The producer thread, for the `tile`-th tile of this CTA whose first KV block is the ring's
// `it0`-th: Q once the consumers are done with the Q buffer's previous tile (its epilogue stages O
// there), then K and V of every KV block this tile sees, last block first.
template <class C>
__device__ __forceinline__ void sm90_produce(u32 base, Sm90Barriers<C> bar, const TensorMap& map_q,
                                             const TensorMap& map_k, const TensorMap& map_v,
                                             const TileWork& w, int kv_head, int it0, int tile) {
    const int row0 = w.row0, head = w.head, batch = w.batch, n_blocks = w.n_blocks;
    const int j = q_slot<C>(tile);
    // Split: warpgroup g's rows, a box of 64 rows per panel (the map's box), where the tile's
    // layout puts them: panel p at p * BLOCK_M rows, the rows at g * 64 inside it.
    // Rows wholly past seqlen_q are not loaded (their barrier completes on the arrival alone):
    // that warpgroup's scores are then of stale rows, and none of its rows is stored.
    const auto load_q_rows = [&](int g) {
        mbarrier_wait(bar.empty_q(g), q_parity<C>(tile) ^ 1);
        if (g * 64 >= w.q_rows) {
            mbarrier_arrive(bar.full_q(g));
            return;
        }
        mbarrier_arrive_expect_tx(bar.full_q(g), C::kTileQ / C::kConsumers);
        #pragma unroll
        for (int p = 0; p < C::kPanels; ++p)
            tma_load_5d(base + (p * C::kBlockM + g * 64) * C::kSwizzle, map_q, bar.full_q(g), 0,
                        row0 + g * 64, p, head, batch, kEvictFirst);
    };
    if constexpr (C::kQSplit) {
        load_q_rows(0);
    } else {
        mbarrier_wait(bar.empty_q(j), q_parity<C>(tile) ^ 1);
        mbarrier_arrive_expect_tx(bar.full_q(j), C::kTileQ);
        tma_load_5d(base + j * C::kTileQ, map_q, bar.full_q(j), 0, row0, 0, head, batch, kEvictFirst);
    }
    for (int i = 0; i < n_blocks; ++i) {
        const int s = (it0 + i) % C::kStages;
        const u32 parity = ((it0 + i) / C::kStages) & 1;
        const int col0 = w.col0(i, C::kBlockN);
        mbarrier_wait(bar.empty_k(s), parity ^ 1);
        mbarrier_arrive_expect_tx(bar.full_k(s), C::kTileKV);
        tma_load_5d(base + C::kOffK + s * C::kTileKV, map_k, bar.full_k(s), 0, col0, 0, kv_head,
                    batch, kEvictLast);
        // The first K goes before the other warpgroups' rows of Q: the first warpgroup may be
        // ready for both while the others still finish the previous tile's epilogue.
        if constexpr (C::kQSplit)
            if (i == 0)
                for (int g = 1; g < C::kConsumers; ++g) load_q_rows(g);
        mbarrier_wait(bar.empty_v(s), parity ^ 1);
        mbarrier_arrive_expect_tx(bar.full_v(s), C::kTileKV);
        tma_load_5d(base + C::kOffV + s * C::kTileKV, map_v, bar.full_v(s), 0, col0, 0, kv_head,
                    batch, kEvictLast);
    }
}

// Byte offset of element (row, col) in a panel-swizzled tile of `rows` rows.
template <class C>
__device__ __forceinline__ u32 panel_offset(int rows, int row, int col) {
    return (col / C::kPanel) * rows * C::kSwizzle +
           swizzle<C::kSwizzle>(row * C::kSwizzle + (col % C::kPanel) * 2);
}

// ---- the steps of one consumer warpgroup ----------------------------------------------------

// S = Q K^T for one KV block, issued and committed as one wgmma group (head_dim / 16 k-steps; the
// first overwrites S). desc_k is the block's stage.
template <class C>
__device__ __forceinline__ void issue_qk(float (&acc_s)[C::kBlockN / 2], u64 desc_q, u64 desc_k) {
    #pragma unroll
    for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
        const int panel = kk / C::kStepsPerPanel, step = kk % C::kStepsPerPanel;
        C::QkGemm::mma(acc_s, desc_q + ((panel * C::kBlockM * C::kSwizzle + step * 32) >> 4),
                       desc_k + ((panel * C::kBlockN * C::kSwizzle + step * 32) >> 4), kk > 0);
    }
    wgmma_commit();
}

// O += P V for one KV block, one wgmma group: BLOCK_N / 16 k-steps of 16 V rows (16 * SWIZZLE
// bytes) each. P is read from registers while it runs: it must not change until the group is done.
template <class C>
__device__ __forceinline__ void issue_pv(float (&acc_o)[C::kAccO],
                                         const u32 (&p)[C::kBlockN / 16][4], u64 desc_v) {
    #pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk)
        C::PvGemm::mma(acc_o, p[kk], desc_v + ((kk * 16 * C::kSwizzle) >> 4));
    wgmma_commit();
}

// The keys every row of a warpgroup surely sees, [lo, hi) (the spec's full_lo / full_hi of its
// rows): blocks inside skip the mask_mod. Without a mask_mod or a kv range, nothing is skipped.
struct FullRange {
    int lo, hi;
};

// The warpgroup's rows of the tile (a warpgroup past the tile's end takes its last row; padding
// rows are never stored).
template <class C, class Mods>
__device__ __forceinline__ FullRange full_range(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                                const TileWork& w, int wg_row0) {
    const int q_last = w.row0 + w.q_rows - 1;
    const int first = min(wg_row0, q_last), last = min(wg_row0 + 63, q_last);
    return FullRange{mods.full_lo(first, last, w.batch, w.head, a.seqlen_q, a.seqlen_k),
                     mods.full_hi(first, last, w.batch, w.head, a.seqlen_q, a.seqlen_k)};
}

// The query or key index `idx` (of a sequence of `seqlen`) that the Hopper forward passes a
// mod: clamped into the sequence when the mod reads memory at a per-token index
// (Mods.clamps_indices), so that the padding rows and columns of a tile read in bounds (their
// results are masked or never stored); else as it is, which saves a min per index and score
// (ALiBi's forward: 3440 -> 3040 instructions). The backwards always clamp: their padding rows'
// probabilities meet dO's zero rows, where a NaN that a mod makes out of range would spread into
// dK and dV. So does the mma.sync forward (flash_fwd_sm80.cuh says why).
template <class Mods>
__device__ __forceinline__ int mod_index(int idx, int seqlen) {
    if constexpr (Mods::kClampIndices) return min(idx, seqlen - 1);
    else return idx;
}

// Element (i, e) of this thread's S accumulators: row lane_row + (e / 2) * 8, key
// col0 + 2 * (lane % 4) + 8 * i + (e & 1) (wgmma.cuh). A score_mod rewrites every scaled score,
// the indices clamped into the sequences where it may read memory at them (mod_index).
template <class C, class Mods>
__device__ __forceinline__ void modify_scores(float (&acc_s)[C::kBlockN / 2],
                                              const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                              const TileWork& w, int col0, int lane_row) {
    const int lane_col = col0 + 2 * (threadIdx.x % 4);
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            acc_s[4 * i + e] = mods.score_mod(
                acc_s[4 * i + e], a.softmax_scale, w.batch, w.head,
                mod_index<Mods>(lane_row + (e / 2) * 8, a.seqlen_q),
                mod_index<Mods>(lane_col + i * 8 + (e & 1), a.seqlen_k), a.seqlen_q, a.seqlen_k);
}

// Which blocks evaluate the mask_mod per element: all of them, or with a block mask only its
// partially visible blocks (the first w.sparse.n_partial of the tile's visiting order; `block` is
// this one's index in it), or with a kv range the blocks not inside the full range.
template <class C, class Mods>
__device__ __forceinline__ bool needs_mod_mask(const TileWork& w, FullRange full, int col0,
                                               int block) {
    if constexpr (!Mods::kMaskMod) return false;
    else if constexpr (Mods::kBlockSparse) return block < w.sparse.n_partial;
    else if constexpr (Mods::kKvRange) return col0 < full.lo || col0 + C::kBlockN > full.hi;
    else return true;
}

// Which of this thread's elements of one block the block's query rows see, a bit each (element
// k = 4 i + e of the S accumulators is bit k % 32 of word k / 32; 1: visible): the mask_mod, the
// sequence end and the causal diagonal together. The consumer evaluates it between issuing the
// block's QK^T and waiting for it, so a mask_mod that reads memory (document ids: 34 loads a
// thread per block at N = 128) loads while the tensor cores work, and after the wait the mask
// is one test and select per score (PERF_NOTES §26). `active` false: the block needs no mask_mod
// (mask_scores then applies the built-in masks alone), and `word` is not read; nor is it with
// kv_range.exact, whose bounds stand for the mask_mod.
template <class C>
struct ModBits {
    static constexpr int kWords = (C::kBlockN / 2 + 31) / 32;
    u32 word[kWords];
    bool active;
};

// Whether a block straddles the sequence end or (causal) a row's diagonal of the warpgroup's rows,
// so that the built-in masks hide some of its elements.
template <class C>
__device__ __forceinline__ bool needs_builtin_mask(const FwdArgs<typename C::Elem>& a, int col0,
                                                   int wg_row0) {
    bool need = col0 + C::kBlockN > a.seqlen_k;
    if constexpr (C::kCausal) need |= col0 + C::kBlockN - 1 > wg_row0 + a.seqlen_k - a.seqlen_q;
    return need;
}

// Element (i, e)'s key is past the end if i*8 + (e&1) >= tail, past its row's diagonal if
// diag + i*8 + (e&1) - (e/2)*8 > 0 (tail = seqlen_k - lane_col, diag = lane_col - lane_row -
// (seqlen_k - seqlen_q)).
template <class C>
__device__ __forceinline__ bool builtin_masked(int i, int e, int tail, int diag) {
    bool masked = i * 8 + (e & 1) >= tail;
    if constexpr (C::kCausal) masked |= diag + i * 8 + (e & 1) - (e / 2) * 8 > 0;
    return masked;
}

// The bits of one block, with the built-in masks folded in (kEdge) or not (a block that
// straddles no boundary: one compare per element fewer).
template <bool kEdge, class C, class Mods>
__device__ __forceinline__ void fill_mask_bits(ModBits<C>& bits, const FwdArgs<typename C::Elem>& a,
                                               const Mods& mods, const TileWork& w, int lane_col,
                                               int lane_row) {
    const int tail = a.seqlen_k - lane_col;
    const int diag = lane_col - lane_row - (a.seqlen_k - a.seqlen_q);
    #pragma unroll
    for (int j = 0; j < ModBits<C>::kWords; ++j) bits.word[j] = 0;
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            // `&`, not `&&`: the mask_mod runs on every element (its indices are clamped where it
            // reads memory), so its loads are unconditional and ptxas loads each id once
            // (2 + N/4 loads, not one pair per element).
            bool visible = mods.mask_mod(
                w.batch, w.head, mod_index<Mods>(lane_row + (e / 2) * 8, a.seqlen_q),
                mod_index<Mods>(lane_col + i * 8 + (e & 1), a.seqlen_k), a.seqlen_q, a.seqlen_k);
            if constexpr (kEdge) visible &= !builtin_masked<C>(i, e, tail, diag);
            const int k = 4 * i + e;
            bits.word[k / 32] |= u32(visible) << (k % 32);
        }
}

template <class C, class Mods>
__device__ __forceinline__ ModBits<C> mod_mask_bits(const FwdArgs<typename C::Elem>& a,
                                                    const Mods& mods, const TileWork& w,
                                                    FullRange full, int col0, int wg_row0,
                                                    int lane_row, int block) {
    ModBits<C> bits;
    bits.active = needs_mod_mask<C, Mods>(w, full, col0, block);
    if constexpr (Mods::kMaskMod && !Mods::kExactRange) {
        if (!bits.active) return bits;
        const int lane_col = col0 + 2 * (threadIdx.x % 4);
        if (needs_builtin_mask<C>(a, col0, wg_row0))
            fill_mask_bits<true>(bits, a, mods, w, lane_col, lane_row);
        else
            fill_mask_bits<false>(bits, a, mods, w, lane_col, lane_row);
    }
    return bits;
}

// Keys past seqlen_k, for causal past each row's diagonal (bottom-right aligned: row r sees keys
// <= r + seqlen_k - seqlen_q), and those the mask_mod hides get -inf. Only blocks that straddle a
// boundary pay for the built-in masks, and only blocks outside the full range for the mask_mod
// (needs_mod_mask; its verdicts, with the built-in masks', are `bits`: mod_mask_bits).
template <class C, class Mods>
__device__ __forceinline__ void mask_scores(float (&acc_s)[C::kBlockN / 2],
                                            const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                            const TileWork& w, const ModBits<C>& bits, int col0,
                                            int wg_row0, int lane_row) {
    const bool need_mask = needs_builtin_mask<C>(a, col0, wg_row0);
    if (!need_mask && !bits.active) return;
    const int lane_col = col0 + 2 * (threadIdx.x % 4);
    if constexpr (Mods::kMaskMod && Mods::kExactRange) {
        // kv_range.exact: a row's range is exactly the keys it sees. With the sequence end and
        // the causal diagonal folded into each row's bounds (as offsets from the lane's first
        // key), a score is two compares against immediates, not the mask_mod's expression.
        int lo[2], hi[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = lane_row + 8 * h;
            int top = min(mods.kv_hi(row, row, w.batch, w.head, a.seqlen_q, a.seqlen_k), a.seqlen_k);
            if constexpr (C::kCausal) top = min(top, row + a.seqlen_k - a.seqlen_q + 1);
            lo[h] = mods.kv_lo(row, row, w.batch, w.head, a.seqlen_q, a.seqlen_k) - lane_col;
            hi[h] = top - lane_col;
        }
        #pragma unroll
        for (int i = 0; i < C::kBlockN / 8; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = i * 8 + (e & 1);
                if (key < lo[e / 2] || key >= hi[e / 2]) acc_s[4 * i + e] = neg_inf();
            }
        return;
    } else if constexpr (Mods::kMaskMod) {
        if (bits.active) {
            #pragma unroll
            for (int k = 0; k < C::kBlockN / 2; ++k)
                if (!((bits.word[k / 32] >> (k % 32)) & 1u)) acc_s[k] = neg_inf();
            return;
        }
        if (!need_mask) return;
    }
    const int tail = a.seqlen_k - lane_col;
    const int diag = lane_col - lane_row - (a.seqlen_k - a.seqlen_q);
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            if (builtin_masked<C>(i, e, tail, diag)) acc_s[4 * i + e] = neg_inf();
}

// Online softmax on this thread's rows (h = 0: lane_row, h = 1: lane_row + 8), the math of
// flash_fwd_sm80.cuh: new running max, alpha = exp2((m_old - m_new) * c) for O and l, and
// S -> P = exp2(S * c - m_new * c) in place (fp32).
template <class C>
__device__ __forceinline__ void softmax_step(float (&acc_s)[C::kBlockN / 2], float (&row_max)[2],
                                             float (&row_sum)[2], float scale_log2,
                                             float (&alpha)[2]) {
    // A row's max over this thread's block_n / 4 scores runs as kParts independent chains and
    // then a tree: one chain of dependent FMNMX made every exp2 wait out block_n / 8 FMNMX
    // latencies (PERF_NOTES §30: hd64 +1-5% at >= 4k). The sum stays one chain: it runs behind
    // the MUFU.EX2 that feed it, and split into parts it measured 1-3% slower at hd64.
    constexpr int kParts = 4, kPairs = C::kBlockN / 8;
    static_assert(kPairs >= kParts, "block_n >= 32");
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float part[kParts];
        #pragma unroll
        for (int i = 0; i < kPairs; ++i) {
            const float pair = fmaxf(acc_s[4 * i + 2 * h], acc_s[4 * i + 2 * h + 1]);
            part[i % kParts] = i < kParts ? pair : fmaxf(part[i % kParts], pair);
        }
        float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
        mx = fmaxf(mx, row_max[h]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen only masked keys keeps m = -inf: use 0 so that (-inf) - (-inf)
        // never happens; its p and alpha are then exp2(-inf) = 0.
        const float m_scaled = mx == neg_inf() ? 0.f : mx * scale_log2;
        alpha[h] = exp2_approx(row_max[h] * scale_log2 - m_scaled);
        row_max[h] = mx;
        float sum = 0.f;
        #pragma unroll
        for (int i = 0; i < kPairs; ++i)
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                float& x = acc_s[4 * i + 2 * h + j];
                x = exp2_approx(fmaf(x, scale_log2, -m_scaled));
                if constexpr (!C::kSumMma) sum += x;  // else the P V wgmma sums P
            }
        if constexpr (!C::kSumMma)
            row_sum[h] = row_sum[h] * alpha[h] + sum;  // per-lane partial; the quad reduces at the end
    }
}

template <class C>
__device__ __forceinline__ void rescale_o(float (&acc_o)[C::kAccO], const float (&alpha)[2]) {
    #pragma unroll
    for (int i = 0; i < C::kAccO / 4; ++i)  // with sum_mma the row sums too
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[4 * i + e] *= alpha[e / 2];
}

// P (fp32) -> 16-bit pairs in the register A layout of k-step i / 2 (wgmma.cuh).
template <class C>
__device__ __forceinline__ void pack_p(u32 (&p)[C::kBlockN / 16][4],
                                       const float (&acc_s)[C::kBlockN / 2]) {
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            p[i / 2][(i % 2) * 2 + h] =
                pack2<typename C::Elem>(acc_s[4 * i + 2 * h], acc_s[4 * i + 2 * h + 1]);
}

// Pingpong: consumer warpgroups take turns issuing their GEMMs, so one runs softmax while another's
// GEMMs occupy the tensor cores. Warpgroup w waits on barrier kSchedBarrier + w (its 128 threads
// and the 128 of the previous warpgroup's arrive) before it issues and hands the turn on after.
template <class C>
struct IssueTurns {
    static constexpr u32 kSchedBarrier = 4;  // ids 4.. (1..3 are the epilogue's per warpgroup)
    int wg;
    __device__ __forceinline__ void start() const {
        if constexpr (C::kPingpong)
            if (wg == 0) named_barrier_arrive(kSchedBarrier, 256);  // the first turn is warpgroup 0's
    }
    __device__ __forceinline__ void acquire() const {
        if constexpr (C::kPingpong) named_barrier_sync(kSchedBarrier + wg, 256);
    }
    // The last warpgroup's last hand-off of the CTA's last tile would have no taker: skip it.
    __device__ __forceinline__ void release(bool last) const {
        if constexpr (C::kPingpong)
            if (!(last && wg == C::kConsumers - 1))
                named_barrier_arrive(kSchedBarrier + (wg + 1) % C::kConsumers, 256);
    }
};

// One consumer warpgroup: query rows 64 * wg .. 64 * wg + 63 of the tile.
// `it0`: the ring position of the tile's first KV block; `tile`: how many tiles this CTA has
// done (its Q buffer and the parity of full_q); `is_final()`: whether no later tile of this CTA
// takes a turn (pingpong's last hand-off), called exactly once, after the last GEMM's issue (the
// dynamic schedule learns its next tile there).
template <class C, class Mods, class IsFinal>
__device__ __forceinline__ void sm90_consume(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                             unsigned char* tiles, u32 smem_u32, Sm90Barriers<C> bar,
                                             const TensorMap& map_o, IssueTurns<C> turns,
                                             const TileWork& w, int it0, int tile,
                                             const IsFinal& is_final) {
    const int wg = turns.wg, row0 = w.row0, q_rows = w.q_rows, n_blocks = w.n_blocks;
    typename C::Elem* o = a.o + w.batch * a.o_stride_b + w.head * a.o_stride_h + row0 * a.o_stride_s;
    float* lse = a.lse + (i64(w.batch) * a.heads + w.head) * a.seqlen_q + row0;
    using Elem = typename C::Elem;
    constexpr int kSw = C::kSwizzle;
    constexpr int kAccS = C::kBlockN / 2, kAccO = C::kAccO;  // fp32 registers per thread
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;

    const int slot = q_slot<C>(tile);
    unsigned char* const q_tile = tiles + slot * C::kTileQ;
    // Descriptors of each operand's first k16 step; steps and stages add their byte offset >> 4.
    const u64 desc_q = desc_k_major<kSw>(smem_u32 + slot * C::kTileQ + wg * 64 * kSw);
    const u64 desc_k = desc_k_major<kSw>(smem_u32 + C::kOffK);
    // With sum_mma the leading offset is the distance from stage 0's V to the ones panel, and
    // each stage's descriptor takes its offset off that distance again (stage_desc_v).
    const u64 desc_v = desc_mn_major<kSw>(smem_u32 + C::kOffV,
                                          C::kSumMma ? C::kOffOnes - C::kOffV : C::kBlockN * kSw);
    const auto stage = [it0](int i) { return (it0 + i) % C::kStages; };
    const auto parity = [it0](int i) { return u32((it0 + i) / C::kStages) & 1; };
    const auto stage_desc = [it0](u64 desc, int i) {
        return desc + (((it0 + i) % C::kStages) * C::kTileKV >> 4);
    };
    const auto stage_desc_v = [&](u64 desc, int i) {
        const u64 stepped = stage_desc(desc, i);
        return C::kSumMma ? stepped - ((stepped - desc) << 16) : stepped;
    };
    const auto col0 = [&w](int i) { return w.col0(i, C::kBlockN); };

    float acc_o[kAccO], acc_s[kAccS], alpha[2];
    u32 p[C::kBlockN / 16][4];
    #pragma unroll
    for (int i = 0; i < kAccO; ++i) acc_o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    // With a score_mod the scale is applied before it (the mod sees scaled scores), and the
    // softmax then works on the modified scores in log2 units.
    const float scale_log2 = Mods::kScoreMod ? kLog2e : a.softmax_scale * kLog2e;
    const int wg_row0 = row0 + wg * 64;
    const int lane_row = wg_row0 + warp * 16 + lane / 4;  // this thread's rows: lane_row, +8
    FullRange full{0, 1 << 30};
    if constexpr (Mods::kMaskMod && Mods::kKvRange && !Mods::kBlockSparse)
        full = full_range<C>(a, mods, w, wg_row0);

    // Block i's first key, read before the wait for its S where that is a load (a block mask's
    // list): issued between the QK^T and the wait, `early` is what the wait would else stall on.
    // Else computed after the wait, where the plain kernels always have: taking col0(i) before
    // the wait for every kernel would be simpler, but it changes the plain kernels' SASS.
    const auto early_col0 = [&](int i) { return Mods::kBlockSparse ? col0(i) : 0; };
    const auto block_col0 = [&](int i, int early) { return Mods::kBlockSparse ? early : col0(i); };
    // Block i's mask_mod bits, called between the issue of its QK^T and the wait for it.
    const auto mask_bits = [&](int i, int early) {
        if constexpr (Mods::kMaskMod)
            return mod_mask_bits<C>(a, mods, w, full, block_col0(i, early), wg_row0, lane_row, i);
        else
            return ModBits<C>{};
    };
    // After the wait for S of block i: its K slot is free; the mods rewrite and mask S.
    const auto finish_qk = [&](int i, int early, const ModBits<C>& bits) {
        fence_operands(acc_s);
        if (lane == 0) mbarrier_arrive(bar.empty_k(stage(i)));
        const int c0 = block_col0(i, early);
        if constexpr (Mods::kScoreMod) modify_scores<C>(acc_s, a, mods, w, c0, lane_row);
        mask_scores<C>(acc_s, a, mods, w, bits, c0, wg_row0, lane_row);
    };
    const auto fence_pv_operands = [&] {
        fence_operands(acc_o);
        #pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) fence_operands(p[kk]);
    };
    // TMA store: the warpgroup's storing thread hands the previous tile's Q buffer back once that
    // tile's O store has read it; called after this tile's first block, so the store runs behind
    // its first GEMMs and softmax, and the producer still has a whole tile to load the next Q.
    const bool storer = threadIdx.x % 128 == 0;
    const auto release_previous_q = [&] {
        if constexpr (C::kTmaStore)
            if (storer && tile > 0) {
                bulk_wait_group_read<0>();
                mbarrier_arrive(bar.empty_q(q_slot<C>(tile - 1)));
            }
    };

    const int q_bar = C::kQSplit ? wg : slot;  // the barriers of this warpgroup's rows of Q
    mbarrier_wait(bar.full_q(q_bar), q_parity<C>(tile));
    if constexpr (C::kSchedule == 0) {
        // Plain: S, softmax, O += P V, one block after the other (the other warpgroups fill in).
        for (int i = 0; i < n_blocks; ++i) {
            mbarrier_wait(bar.full_k(stage(i)), parity(i));
            fence_operands(acc_s);
            wgmma_fence();
            issue_qk<C>(acc_s, desc_q, stage_desc(desc_k, i));
            const int c0 = early_col0(i);
            const ModBits<C> bits = mask_bits(i, c0);  // loads run while the QK^T does
            wgmma_wait<0>();
            finish_qk(i, c0, bits);
            softmax_step<C>(acc_s, row_max, row_sum, scale_log2, alpha);
            if (i == 0) release_previous_q();
            rescale_o<C>(acc_o, alpha);
            pack_p<C>(p, acc_s);
            mbarrier_wait(bar.full_v(stage(i)), parity(i));
            fence_pv_operands();
            wgmma_fence();
            issue_pv<C>(acc_o, p, stage_desc_v(desc_v, i));
            wgmma_wait<0>();
            fence_operands(acc_o);
            if (lane == 0) mbarrier_arrive(bar.empty_v(stage(i)));
        }
        (void)is_final();  // no turns to hand on
    } else {
        // Overlapped (FA3's IntraWGOverlap): S of block i and O += P V of block i - 1 are in flight
        // together; softmax of block i runs while the P V group still occupies the tensor cores.
        // (FA3 rescales O in the S group's shadow, after its issue: measured no faster here, and
        // a 4-byte spill in the document spec's hd256 causal variant; PERF_NOTES §16.)
        mbarrier_wait(bar.full_k(stage(0)), parity(0));
        turns.acquire();
        fence_operands(acc_s);
        wgmma_fence();
        issue_qk<C>(acc_s, desc_q, stage_desc(desc_k, 0));
        turns.release(false);
        const int c00 = early_col0(0);
        const ModBits<C> bits0 = mask_bits(0, c00);
        wgmma_wait<0>();
        finish_qk(0, c00, bits0);
        softmax_step<C>(acc_s, row_max, row_sum, scale_log2, alpha);  // O is 0: alpha unused
        release_previous_q();
        pack_p<C>(p, acc_s);
        for (int i = 1; i < n_blocks; ++i) {
            mbarrier_wait(bar.full_k(stage(i)), parity(i));
            turns.acquire();
            fence_operands(acc_s);
            fence_pv_operands();
            wgmma_fence();
            issue_qk<C>(acc_s, desc_q, stage_desc(desc_k, i));
            if constexpr (C::kRescaleEarly) rescale_o<C>(acc_o, alpha);  // block i - 1's alpha
            mbarrier_wait(bar.full_v(stage(i - 1)), parity(i - 1));
            issue_pv<C>(acc_o, p, stage_desc_v(desc_v, i - 1));
            turns.release(false);
            const int c0 = early_col0(i);
            const ModBits<C> bits = mask_bits(i, c0);
            wgmma_wait<1>();  // S done, P V still running: p and acc_o stay untouched
            finish_qk(i, c0, bits);
            softmax_step<C>(acc_s, row_max, row_sum, scale_log2, alpha);
            wgmma_wait<0>();
            fence_operands(acc_o);
            if (lane == 0) mbarrier_arrive(bar.empty_v(stage(i - 1)));
            if constexpr (!C::kRescaleEarly) rescale_o<C>(acc_o, alpha);
            pack_p<C>(p, acc_s);
        }
        const int last = n_blocks - 1;
        mbarrier_wait(bar.full_v(stage(last)), parity(last));
        // Early: the last block's alpha has no QK^T left to hide behind. (A tile of one block
        // rescales O = 0 by its alpha of 0, here and in the loop's first step.)
        if constexpr (C::kRescaleEarly) rescale_o<C>(acc_o, alpha);
        turns.acquire();
        fence_pv_operands();
        wgmma_fence();
        issue_pv<C>(acc_o, p, stage_desc_v(desc_v, last));
        turns.release(is_final());
        wgmma_wait<0>();
        fence_operands(acc_o);
        if (lane == 0) mbarrier_arrive(bar.empty_v(stage(last)));
    }

    // Epilogue: O /= l, LSE = (m*c + log2 l) * ln2; rows with l == 0 saw no key: O = 0, LSE = -inf.
    // O is staged in this warpgroup's own rows of its Q tile (every warp of it is past its last
    // QK^T once the named barrier opens), then each warp stores its 16 rows in 16-byte chunks, or
    // (kTmaStore) one thread stores the warpgroup's 64 rows by TMA, one box per panel.
    named_barrier_sync(1 + wg, 128);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = row_sum[h];
        if constexpr (C::kSumMma) {
            l = acc_o[C::kHeadDim / 2 + 2 * h];  // the whole row's sum, in every lane of the quad
        } else {
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
        }
        const bool empty = !(l > 0.f);
        const float inv = empty ? 0.f : 1.f / l;
        const int r = wg * 64 + warp * 16 + lane / 4 + 8 * h;  // row inside the tile
        if (lane % 4 == 0 && r < q_rows)
            lse[r] = empty ? neg_inf() : (row_max[h] * scale_log2 + log2_approx(l)) * kLn2;
        #pragma unroll
        for (int i = 0; i < C::kHeadDim / 8; ++i)
            *reinterpret_cast<u32*>(q_tile + panel_offset<C>(C::kBlockM, r, i * 8 + 2 * (lane % 4))) =
                pack2<Elem>(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
    }
    if constexpr (C::kTmaStore) {
        // The TMA reads what the generic proxy wrote: fence, then every thread's O is in place.
        // Rows past seqlen_q fall outside the map and are not written.
        fence_proxy_async_shared();
        named_barrier_sync(1 + wg, 128);
        if (storer) {
            const u32 rows = smem_u32 + slot * C::kTileQ + wg * 64 * kSw;
            #pragma unroll
            for (int panel = 0; panel < C::kPanels; ++panel)
                tma_store_5d(map_o, rows + panel * C::kBlockM * kSw, 0, row0 + wg * 64, panel,
                             w.head, w.batch);
            bulk_commit_group();
        }
        return;  // the buffer goes back to the producer in the next tile (release_previous_q)
    }
    __syncwarp();
    constexpr int kChunks = C::kHeadDim / 8;  // 16-byte chunks per row
    #pragma unroll
    for (int idx = lane; idx < 16 * kChunks; idx += 32) {
        const int r = wg * 64 + warp * 16 + idx / kChunks, c = (idx % kChunks) * 8;
        if (r < q_rows)
            *reinterpret_cast<uint4*>(o + r * a.o_stride_s + c) =
                *reinterpret_cast<const uint4*>(q_tile + panel_offset<C>(C::kBlockM, r, c));
    }
    // The staging reads are done: the next tile's Q may land here (one arrival per warp).
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) mbarrier_arrive(bar.empty_q(q_bar));
}

// A tile whose rows all see no key: O = 0, LSE = -inf, by `threads` threads numbered from 0.
template <class C>
__device__ __forceinline__ void write_empty_tile(const FwdArgs<typename C::Elem>& a,
                                                 const TileWork& w, int thread, int threads) {
    typename C::Elem* o = a.o + w.batch * a.o_stride_b + w.head * a.o_stride_h + w.row0 * a.o_stride_s;
    float* lse = a.lse + (i64(w.batch) * a.heads + w.head) * a.seqlen_q + w.row0;
    for (int i = thread; i < w.q_rows * C::kHeadDim; i += threads)
        o[(i / C::kHeadDim) * a.o_stride_s + i % C::kHeadDim] = typename C::Elem{0};
    for (int i = thread; i < w.q_rows; i += threads) lse[i] = neg_inf();
}

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_fwd_sm90(const FwdArgs<typename C::Elem>& a,
                                               const TensorMap& map_q, const TensorMap& map_k,
                                               const TensorMap& map_v, const TensorMap& map_o,
                                               int* tile_counter, const Mods& mods = Mods{}) {
    extern __shared__ __align__(1024) unsigned char smem[];

    const TileSchedule<C, Mods> tiles_of_cta(a, mods);
    const int group = a.heads / a.heads_k;
    if constexpr (!C::kPersistent) {
        const TileWork w = tiles_of_cta.at(a, 0);
        if (w.n_blocks == 0) {  // every row of the tile sees no key: no barriers, no loads
            write_empty_tile<C>(a, w, threadIdx.x, C::kThreads);
            return;
        }
    }

    // Swizzled tiles need 1024-byte alignment; the dynamic smem base is only guaranteed 16.
    const u32 raw = smem_addr(smem), base = (raw + 1023) & ~1023u;
    unsigned char* tiles = smem + (base - raw);
    const Sm90Barriers<C> bar{base + C::kOffBarriers};
    if (threadIdx.x == 0) {
        for (int j = 0; j < C::kQBarriers; ++j) {
            mbarrier_init(bar.full_q(j), 1);
            // One arrival per consumer warp (split: of the warpgroup), or per warpgroup's
            // storing thread (kTmaStore).
            mbarrier_init(bar.empty_q(j), C::kTmaStore ? C::kConsumers
                                                       : C::kQSplit ? 4 : 4 * C::kConsumers);
        }
        for (int s = 0; s < C::kStages; ++s) {
            mbarrier_init(bar.full_k(s), 1);
            mbarrier_init(bar.full_v(s), 1);
            mbarrier_init(bar.empty_k(s), 4 * C::kConsumers);
            mbarrier_init(bar.empty_v(s), 4 * C::kConsumers);
        }
        if constexpr (C::kDynamic)
            for (int j = 0; j < 2; ++j) {
                mbarrier_init(bar.full_t(j), 1);
                mbarrier_init(bar.empty_t(j), 4 * C::kConsumers);
            }
        mbarrier_fence_init();
    }
    if constexpr (C::kSumMma) {
        // sum_mma's panel of ones, written once; wgmma reads it through the async proxy.
        const u32 one = pack2<typename C::Elem>(1.f, 1.f);
        for (u32 i = threadIdx.x; i < C::kBlockN * C::kSwizzle / 16; i += C::kThreads)
            reinterpret_cast<uint4*>(tiles + C::kOffOnes)[i] = uint4{one, one, one, one};
        fence_proxy_async_shared();
    }
    __syncthreads();  // the last CTA-wide barrier: the producer's idle threads exit below

    // `it`: KV blocks through the ring so far; `done`: tiles with work so far (Q's buffer, phase).
    int it = 0, done = 0;
    const TileQueue<C> queue{bar, reinterpret_cast<int*>(tiles + C::kOffQueue), tile_counter};
    if (threadIdx.x < 128) {
        setmaxnreg_dec<C::kProducerRegs>();
        if (threadIdx.x == 0) {
            tma_prefetch(map_q);
            tma_prefetch(map_k);
            tma_prefetch(map_v);
            if constexpr (C::kTmaStore) tma_prefetch(map_o);
            const auto produce = [&](int t) {
                const TileWork w = tiles_of_cta.at(a, t);
                if (w.n_blocks == 0) return;
                sm90_produce<C>(base, bar, map_q, map_k, map_v, w, w.head / group, it, done);
                it += w.n_blocks;
                ++done;
            };
            if constexpr (C::kDynamic) {
                // The successor is claimed before this tile's loads and published after them:
                // the atomic's round trip hides behind the loads, and the consumers, who learn
                // it at the tile's last GEMM (is_final), find it published.
                int j = 0;
                queue.publish(j++, blockIdx.x);
                for (int t = blockIdx.x;;) {
                    const int next = queue.claim();
                    produce(t);
                    queue.publish(j++, min(next, tiles_of_cta.count));
                    if (next >= tiles_of_cta.count) break;
                    t = next;
                }
            } else {
                for (int t = tiles_of_cta.first(); t < tiles_of_cta.count; t += tiles_of_cta.step())
                    produce(t);
            }
        }
        return;
    }
    setmaxnreg_inc<C::kConsumerRegs>();
    const IssueTurns<C> turns{int(threadIdx.x / 128) - 1};
    if constexpr (C::kDynamic) {
        // Every tile, with work or not, takes one turn per warpgroup (an empty one hands it on
        // at once), so the turns stay in step without knowing the tiles ahead; each CTA has a
        // first tile (the grid is at most the tile count), so the first turn is always taken.
        turns.start();
        int j = 0;
        for (int t = queue.take(j++); t < tiles_of_cta.count;) {
            const TileWork w = tiles_of_cta.at(a, t);
            int next = tiles_of_cta.count;
            const auto is_final = [&] {
                next = queue.take(j++);
                return next >= tiles_of_cta.count;
            };
            if (w.n_blocks == 0) {
                write_empty_tile<C>(a, w, threadIdx.x - 128, C::kThreads - 128);
                const bool final = is_final();
                turns.acquire();
                turns.release(final);
            } else {
                sm90_consume<C>(a, mods, tiles, base, bar, map_o, turns, w, it, done, is_final);
                it += w.n_blocks;
                ++done;
            }
            t = next;
        }
        if constexpr (C::kTmaStore)
            if (threadIdx.x % 128 == 0) bulk_wait_group_read<0>();
        return;
    }
    // Pingpong's first turn, only in a CTA with a tile to compute: persistent, every tile of a
    // CTA may be empty (causal or a kv range), and an arrival no one waits for would stay on the
    // barrier past the CTA's exit.
    if constexpr (C::kPingpong)
        if (!C::kPersistent || tiles_of_cta.more_work(a, tiles_of_cta.first() - tiles_of_cta.step()))
            turns.start();
    for (int t = tiles_of_cta.first(); t < tiles_of_cta.count; t += tiles_of_cta.step()) {
        const TileWork w = tiles_of_cta.at(a, t);
        if (w.n_blocks == 0) {   // persistent only: the other case returned above
            write_empty_tile<C>(a, w, threadIdx.x - 128, C::kThreads - 128);
            continue;
        }
        sm90_consume<C>(a, mods, tiles, base, bar, map_o, turns, w, it, done,
                        [&] { return !tiles_of_cta.more_work(a, t); });
        it += w.n_blocks;
        ++done;
    }
    // The last tile's O store must have read shared memory before the CTA gives it up.
    if constexpr (C::kTmaStore)
        if (threadIdx.x % 128 == 0) bulk_wait_group_read<0>();
}

}  // namespace kg
