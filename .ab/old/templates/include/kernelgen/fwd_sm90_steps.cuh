// The Hopper forward's steps (flash_fwd_sm90.cuh puts them together): the producer's loads of a
// tile, and the consumer warpgroups' building blocks: the two GEMMs' issue, the K/V ring's slots,
// pingpong's turns, and carry_qk's S issued ahead of its tile.
#pragma once
#include "kernelgen/fwd_sm90_config.cuh"
#include "kernelgen/fwd_sm90_tiles.cuh"   // TileWork
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tma.cuh"
#include "kernelgen/wgmma.cuh"       // (and wgmma_desc.cuh: the descriptors)

namespace kg {

// One K or V tile (`off`: its slot's offset) for the KV block at key col0: the whole tile, or
// with a cluster this CTA's panels of it, multicast to every CTA of the cluster. Either way each
// CTA's full barrier waits for the whole tile's bytes.
template <class C>
__device__ __forceinline__ void load_kv_tile(u32 base, u32 off, const TensorMap& map, u32 full,
                                             int col0, int kv_head, int batch) {
    mbarrier_arrive_expect_tx(full, C::kTileKV);
    if constexpr (C::kCluster == 1) {
        tma_load_5d(base + off, map, full, 0, col0, 0, kv_head, batch, kEvictLast);
    } else {
        const u32 rank = cluster_rank();
        tma_load_5d_multicast(base + off + rank * C::kClusterSlice, map, full, 0, col0,
                              int(rank) * C::kClusterPanels, kv_head, batch,
                              u16((1u << C::kCluster) - 1), kEvictLast);
    }
}

// The producer thread, for the `tile`-th tile of this CTA whose first KV block is the ring's
// `it0`-th: Q once the consumers are done with the Q buffer's previous tile (its epilogue stages O
// there), then K and V of every KV block this tile sees, last block first.
template <class C>
__device__ __forceinline__ void sm90_produce(u32 base, Sm90Barriers<C> bar, const TensorMap& map_q,
                                             const TensorMap& map_k, const TensorMap& map_v,
                                             const TileWork& w, int kv_head, int it0, int tile) {
    const int row0 = w.row0, head = w.head, batch = w.batch, n_blocks = w.n_blocks;
    const int j = q_slot<C>(tile);
    // q_prefetch: this tile's Q into L2 (the boxes below, no shared memory, no barrier) before
    // the wait for its buffer, which the previous tile's epilogue hands back: the producer gets
    // here as soon as that tile's loads are issued, `stages` blocks ahead of its consumers, so
    // the load after the epilogue reads L2 rather than DRAM.
    if constexpr (C::kQPrefetch) {
        if (tile > 0) {
            if constexpr (C::kQSplit) {
                for (int g = 0; g < C::kConsumers; ++g)
                    if (g * 64 < w.q_rows)  // (rows wholly past seqlen_q are not loaded either)
                        for (int p = 0; p < C::kPanels; ++p)
                            tma_prefetch_5d(map_q, 0, row0 + g * 64, p, head, batch);
            } else {
                tma_prefetch_5d(map_q, 0, row0, 0, head, batch);
            }
        }
    }
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
        // A cluster's CTA past seqlen_q has no rows: nobody waits for its Q (pass_kv_ring).
        bool load_q = true;
        if constexpr (C::kCluster > 1) load_q = w.q_rows > 0;
        if (load_q) {
            mbarrier_arrive_expect_tx(bar.full_q(j), C::kTileQ);
            tma_load_5d(base + j * C::kTileQ, map_q, bar.full_q(j), 0, row0, 0, head, batch,
                        kEvictFirst);
        }
    }
    for (int i = 0; i < n_blocks; ++i) {
        const int s = (it0 + i) % C::kStages;
        const u32 parity = ((it0 + i) / C::kStages) & 1;
        const int col0 = w.col0(i, C::kBlockN);
        mbarrier_wait(bar.empty_k(s), parity ^ 1);
        load_kv_tile<C>(base, C::kOffK + s * C::kTileKV, map_k, bar.full_k(s), col0, kv_head, batch);
        // The first K goes before the other warpgroups' rows of Q: the first warpgroup may be
        // ready for both while the others still finish the previous tile's epilogue.
        if constexpr (C::kQSplit)
            if (i == 0)
                for (int g = 1; g < C::kConsumers; ++g) load_q_rows(g);
        mbarrier_wait(bar.empty_v(s), parity ^ 1);
        load_kv_tile<C>(base, C::kOffV + s * C::kTileKV, map_v, bar.full_v(s), col0, kv_head, batch);
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
// first overwrites S). desc_k is the block's stage. kHalf: over the block's first BLOCK_N / 2
// keys only (QkGemmHalf, the first BLOCK_N / 4 accumulators; K's rows are the same from its
// first on), for a causal diagonal block whose upper half no row of the warpgroup sees; the
// caller sets the other accumulators first (before its wgmma fence: C7515 otherwise).
template <class C, bool kHalf = false>
__device__ __forceinline__ void issue_qk(float (&acc_s)[C::kBlockN / 2], u64 desc_q, u64 desc_k,
                                         bool accumulate = false) {
    #pragma unroll
    for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
        const int panel = kk / C::kStepsPerPanel, step = kk % C::kStepsPerPanel;
        const u64 q = desc_q + ((panel * C::kBlockM * C::kSwizzle + step * 32) >> 4);
        const u64 k = desc_k + ((panel * C::kBlockN * C::kSwizzle + step * 32) >> 4);
        if constexpr (kHalf)
            C::QkGemmHalf::mma(reinterpret_cast<float (&)[C::kBlockN / 4]>(acc_s), q, k,
                               kk > 0 || accumulate);
        else
            C::QkGemm::mma(acc_s, q, k, kk > 0 || accumulate);
    }
    wgmma_commit();
}

// O += P V for one KV block, one wgmma group: BLOCK_N / 16 k-steps of 16 V rows (16 * SWIZZLE
// bytes) each (kHalf: those of the block's first BLOCK_N / 2 keys, P being 0 past them). P is
// read from registers while it runs: it must not change until the group is done.
template <class C, bool kHalf = false>
__device__ __forceinline__ void issue_pv(float (&acc_o)[C::kAccO],
                                         const u32 (&p)[C::kBlockN / 16][4], u64 desc_v) {
    #pragma unroll
    for (int kk = 0; kk < (kHalf ? cdiv(C::kBlockN / 2, 16) : C::kBlockN / 16); ++kk)
        C::PvGemm::mma(acc_o, p[kk], desc_v + ((kk * 16 * C::kSwizzle) >> 4));
    wgmma_commit();
}

// A consumer warp is done with a K or V slot (`empty`: its barrier): one arrival, from lane 0;
// with a cluster, on that barrier in every CTA of the cluster (lane r arrives at rank r's), whose
// producers multicast into this CTA's slot too.
template <class C>
__device__ __forceinline__ void release_kv_slot(u32 empty, int lane) {
    if constexpr (C::kCluster == 1) {
        if (lane == 0) mbarrier_arrive(empty);
    } else {
        if (lane < C::kCluster) mbarrier_arrive_cluster(empty, u32(lane));
    }
}

// A consumer warp passes on the K and V of the block at ring position `position` without using
// them: it waits for their full barriers (the slot's previous use is then over for every warp,
// and no copy may still land there once the CTA exits) and releases them. Every lane gets past
// each wait before lane 0 releases the slot, or a refill could complete the barrier's next phase
// too and leave a late lane waiting on a parity that has come round again (the emulator's lanes
// showed it).
template <class C>
__device__ __forceinline__ void pass_kv_slot(Sm90Barriers<C> bar, int position) {
    const int s = position % C::kStages, lane = threadIdx.x % 32;
    const u32 parity = (position / C::kStages) & 1;
    mbarrier_wait(bar.full_k(s), parity);
    __syncwarp();
    release_kv_slot<C>(bar.empty_k(s), lane);
    mbarrier_wait(bar.full_v(s), parity);
    __syncwarp();
    release_kv_slot<C>(bar.empty_v(s), lane);
}

// The consumers of a cluster's CTA past seqlen_q (the second of the last cluster when a head has
// an odd number of query tiles): no rows to compute, but this CTA's producer fills its half of
// every K and V tile for the other CTA, whose producer in turn writes into this one's slots. So
// each block's K and V are passed on, released to both CTAs at once.
template <class C>
__device__ __forceinline__ void pass_kv_ring(Sm90Barriers<C> bar, int n_blocks) {
    for (int i = 0; i < n_blocks; ++i) pass_kv_slot<C>(bar, i);
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
    // carry_qk: every hand-off is made, and warpgroup 0 takes the last one after the CTA's last
    // tile (drain): a branch on `last` with the next tile's S in flight across it made ptxas
    // serialize every wgmma (C7519), predicated or not.
    __device__ __forceinline__ void release(bool last) const {
        if constexpr (C::kPingpong && C::kCarryQk)
            named_barrier_arrive(kSchedBarrier + (wg + 1) % C::kConsumers, 256);
        else if constexpr (C::kPingpong)
            if (!(last && wg == C::kConsumers - 1))
                named_barrier_arrive(kSchedBarrier + (wg + 1) % C::kConsumers, 256);
    }
    // carry_qk, once no wgmma is in flight: the turn the last warpgroup handed on last.
    __device__ __forceinline__ void drain() const {
        if constexpr (C::kPingpong && C::kCarryQk)
            if (wg == 0) named_barrier_sync(kSchedBarrier, 256);
    }
};

// The descriptors of a carried S: warpgroup wg's rows of the Q buffer of the CTA's `tile`-th tile
// with work, and the K slot at ring position `position`.
template <class C>
__device__ __forceinline__ u64 carried_desc_q(u32 smem_u32, int wg, int tile) {
    return desc_k_major<C::kSwizzle>(smem_u32 + q_slot<C>(tile) * C::kTileQ + wg * 64 * C::kSwizzle);
}
template <class C>
__device__ __forceinline__ u64 carried_desc_k(u32 smem_u32, int position) {
    return desc_k_major<C::kSwizzle>(smem_u32 + C::kOffK + (position % C::kStages) * C::kTileKV);
}

// The operands of a carried S have landed: Q of the `tile`-th tile with work, K at `position`.
template <class C>
__device__ __forceinline__ void wait_carried_operands(Sm90Barriers<C> bar, int tile, int position) {
    mbarrier_wait(bar.full_q(q_slot<C>(tile)), q_parity<C>(tile));
    mbarrier_wait(bar.full_k(position % C::kStages), u32(position / C::kStages) & 1);
}

// carry_qk: the S of a CTA's first tile with work, issued in a turn of its own before it
// (`work`: the CTA has one). From then on every path into a tile with work has exactly one S
// group in flight, its own, which ptxas needs to keep the wgmmas asynchronous (an issue under a
// condition made it serialize them all: PERF_NOTES §31). Where no tile with work follows, the
// S issued is a dummy nobody reads, over shared memory no copy or store writes any more (the
// Q buffer and ring slot the next tile would have used), waited for after the CTA's last tile.
template <class C>
__device__ __forceinline__ void first_carried_qk(float (&acc_s)[C::kBlockN / 2], u32 smem_u32,
                                                 Sm90Barriers<C> bar, IssueTurns<C> turns,
                                                 bool work) {
    if (work) wait_carried_operands<C>(bar, 0, 0);
    turns.acquire();
    fence_operands(acc_s);
    wgmma_fence();
    issue_qk<C>(acc_s, carried_desc_q<C>(smem_u32, turns.wg, 0), carried_desc_k<C>(smem_u32, 0));
    turns.release(false);
}

}  // namespace kg
