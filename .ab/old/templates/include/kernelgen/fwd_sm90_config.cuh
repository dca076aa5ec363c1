// The Hopper forward's compile-time configuration (one variant's tile shape, schedule and
// buffers, and the shared-memory layout they imply) and its mbarriers (flash_fwd_sm90.cuh
// says how the pipeline uses them).
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

// One of two references chosen at compile time: Pick<true>::from(a, b) is a, else b.
template <bool First>
struct Pick {
    template <class T>
    __device__ __forceinline__ static T& from(T& a, T&) { return a; }
};
template <>
struct Pick<false> {
    template <class T>
    __device__ __forceinline__ static T& from(T&, T& b) { return b; }
};

// QkGemm::mma(float (&)[BLOCK_N / 2], u64 desc_q, u64 desc_k, int accumulate), QkGemmHalf::mma
// (the same with N = BLOCK_N / 2) and PvGemm::mma(float (&)[HEAD_DIM / 2], const u32 (&p)[4],
// u64 desc_v): one k16 step each, rendered by the template for this variant's N.
// SCHEDULE 0: plain (QK^T, softmax, PV in turn); 1: intra-warpgroup overlap; 2: overlap plus
// pingpong between the consumer warpgroups (see sm90_consume).
template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL,
          int SCHEDULE, int PERSISTENT, int Q_BUFFERS, int SUM_MMA, int RESCALE, int Q_SPLIT,
          int CLUSTER, int KV_ALIGN, int GRID_ORDER, int HALF_DIAG, int CARRY_QK, int Q_PREFETCH,
          int PV_WAIT, int WG_SKIP,
          class QkGemm_, class QkGemmHalf_, class PvGemm_>
struct Sm90Config {
    using Elem = Elem_;
    using QkGemm = QkGemm_;
    using QkGemmHalf = QkGemmHalf_;
    using PvGemm = PvGemm_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kSchedule = SCHEDULE;
    static constexpr bool kPingpong = SCHEDULE == 2;
    static constexpr bool kPersistent = PERSISTENT > 0;  // loop over tiles (TileSchedule)
    static constexpr bool kDynamic = PERSISTENT == 2;    // ... claimed from a counter (TileQueue)
    static constexpr int kQBuffers = Q_BUFFERS;        // Q tiles used in turn by successive tiles
    static constexpr bool kTmaStore = Q_BUFFERS >= 2;  // O stored from its Q buffer by TMA
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
    // CLUSTER 2 (FA3's cluster along M): the two CTAs of a cluster compute adjacent query tiles
    // of one (batch, head), which see the same KV blocks (non-causal, no kv range), and share
    // every K and V tile: each CTA's producer loads kPanels / CLUSTER panels of it and multicasts
    // them to both, so each tile leaves L2 once for two SMs. A slot is refilled only when the
    // consumers of both CTAs have released it (their empty barriers count both CTAs' warps).
    static constexpr int kCluster = CLUSTER;
    // KV_ALIGN 1 (kv ranges only): a tile's KV blocks start at its range's first key, not at the
    // multiple of BLOCK_N below it, so only the tile's last block runs past the range: BLOCK_N / 2
    // keys fewer per tile on average (tile_work).
    static constexpr bool kKvAlign = KV_ALIGN == 1;
    // GRID_ORDER 1 (causal, a CTA per tile): blockIdx in launch order maps to the tiles in the
    // dynamic schedule's order, not pair by pair (TileSchedule::at).
    static constexpr bool kSectionedGrid = GRID_ORDER == 1;
    // HALF_DIAG 1 (causal, overlapped schedules): a warpgroup's diagonal block whose upper half
    // its rows do not see runs S and P V over the lower half only (QkGemmHalf; sm90_consume).
    static constexpr bool kHalfDiag = HALF_DIAG == 1;
    // CARRY_QK 1 (persistent, two Q buffers, overlapped schedules): a tile's first QK^T is
    // issued in the previous tile's last turn, with its last P V, so that it runs during that
    // tile's epilogue (sm90_consume, issue_carried_qk).
    static constexpr bool kCarryQk = CARRY_QK == 1;
    // Q_PREFETCH 1 (persistent, one Q buffer): once a tile's loads are issued, the producer
    // prefetches the next tile's Q into L2, so that its load after this tile's epilogue reads
    // L2 rather than DRAM (prefetch_q).
    static constexpr bool kQPrefetch = Q_PREFETCH == 1;
    // PV_WAIT 1 (overlapped schedules): the wait for a block's V moves from the turn that
    // issues its P V to the end of its softmax, where it keeps ptxas from hoisting the wait
    // for the previous P V to the softmax's start (sm90_consume).
    static constexpr bool kPvWait = PV_WAIT == 1;
    // WG_SKIP 1 (block masks, two consumer warpgroups): the mask's lists come grouped (kernelgen/
    // blockmask.py group_for_warpgroups): each warpgroup skips the blocks its 64 rows do not see,
    // one warpgroup's first in the tile's visiting order, the other's last (skipped_blocks).
    static constexpr bool kWgSkip = WG_SKIP == 1;
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
    // One CTA's share of a K or V tile with CLUSTER > 1: its panels, contiguous in the tile.
    static constexpr int kClusterPanels = kPanels / CLUSTER;
    static constexpr u32 kClusterSlice = kClusterPanels * BLOCK_N * kSwizzle;
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
    static_assert(Q_BUFFERS == 1 || ((Q_BUFFERS == 2 || Q_BUFFERS == 3) && PERSISTENT),
                  "more Q buffers serve the next tiles of a persistent CTA");
    static_assert(!kRescaleEarly || SCHEDULE > 0, "rescale 1: a QK^T in flight to hide behind");
    static_assert(!kQSplit || Q_BUFFERS == 1, "q_split: the rows of the one Q buffer");
    static_assert(!kCarryQk || (PERSISTENT && Q_BUFFERS == 2 && SCHEDULE > 0 &&
                                !(CAUSAL && BLOCK_N < BLOCK_M)),
                  "carry_qk: the next tile's Q in its own buffer, an overlapped schedule and no "
                  "skipped first blocks");
    static_assert(!kQPrefetch || (PERSISTENT && Q_BUFFERS == 1),
                  "q_prefetch: a persistent CTA's next tile, whose Q loads after the epilogue");
    static_assert(!kPvWait || SCHEDULE > 0, "pv_wait: a P V in flight during the softmax");
    static_assert(!kWgSkip || BLOCK_M == 128, "wg_skip: the lists' groups are of two 64-row halves");
    static_assert(CLUSTER == 1 || (CLUSTER == 2 && !PERSISTENT && !CAUSAL && kPanels % 2 == 0),
                  "a cluster's CTAs share the KV blocks of a CTA per tile, non-causal, by panels");
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

}  // namespace kg
