// The Hopper backward's dQ hand-off (flash_bwd_sm90.cuh): each consumer warpgroup's scale * dQ of
// a pair goes to its own fp32 buffer in shared memory (bwd_stage_dq), and one thread of the
// producer adds the buffer into dq_accum with a TMA reduce-add (bwd_reduce_dq); dq_full[wg] and
// dq_empty[wg] pass the buffer back and forth, dq_pairs[wg] says which (head, query tile) it
// holds. Without kDqTma (head dim 96) the consumers add with fp32 atomics instead (bwd_red_dq).
#pragma once
#include "kernelgen/flash_bwd_sm80.cuh"  // BwdArgs, red_add_f32x2
#include "kernelgen/bwd_sm90_config.cuh"
#include "kernelgen/bwd_sm90_pairs.cuh"  // BwdWork, BwdSlotPair
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tma_store.cuh"

namespace kg {

// This warpgroup's scale * dQ (use `use` of its buffer) into its fp32 buffer for bwd_reduce_dq,
// once the buffer's last add has read it; then the pair it belongs to, and dq_full. The buffer
// is 128B-swizzled panels of 32 columns as the map's box lands: the accumulator's float2 stores
// from a warp's 8 rows meet no bank twice.
template <class C>
__device__ __forceinline__ void bwd_stage_dq(unsigned char* tiles, BwdSm90Barriers<C> bar,
                                             const float (&acc_dq)[C::kDqN / 2], float scale, int wg,
                                             int use, int head, int m0) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    mbarrier_wait(bar.dq_empty(wg), (u32(use) & 1) ^ 1);
    unsigned char* dq_tile = tiles + C::kOffDq + wg * C::kTileDq;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
    #pragma unroll
    for (int h = 0; h < 2; ++h)
        #pragma unroll
        for (int i = 0; i < C::kDqN / 8; ++i)
            *reinterpret_cast<float2*>(dq_tile + panel_offset_bwd<C::kDqSwizzle, 4>(
                C::kBlockM, row + 8 * h, col + 8 * i)) =
                make_float2(acc_dq[4 * i + 2 * h] * scale, acc_dq[4 * i + 2 * h + 1] * scale);
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
        if (warp == 0) dq_pairs<C>(tiles)[wg] = BwdSlotPair{head, m0, 0, 0};
        mbarrier_arrive(bar.dq_full(wg));
    }
}

// Without kDqTma: dq_accum[q_row (and + 8), head, col..] += scale * dQ by fp32 atomics, rows past
// seqlen_q skipped.
template <class C>
__device__ __forceinline__ void bwd_red_dq(const BwdArgs<typename C::Elem>& a,
                                           const float (&acc_dq)[C::kDqN / 2], int batch, int head,
                                           int q_row, int col) {
    const i64 row_stride = i64(a.heads) * C::kHeadDim;
    float* dq = a.dq_accum + (i64(batch) * a.seqlen_q + q_row) * row_stride + head * C::kHeadDim + col;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (q_row + 8 * h >= a.seqlen_q) continue;
        #pragma unroll
        for (int i = 0; i < C::kDqN / 8; ++i)
            red_add_f32x2(dq + 8 * h * row_stride + 8 * i, acc_dq[4 * i + 2 * h] * a.softmax_scale,
                          acc_dq[4 * i + 2 * h + 1] * a.softmax_scale);
    }
}

// Warp 2's lane 0: each consumer's dQ part, once its buffer is written (dq_full), added into
// dq_accum by one TMA reduce-add of the box (rows past seqlen_q are outside the map: not
// written); the buffer is handed back (dq_empty) once the copy has read it.
template <class C>
__device__ __forceinline__ void bwd_reduce_dq(unsigned char* tiles, u32 base, BwdSm90Barriers<C> bar,
                                              const TensorMap& map_dq, const BwdWork& w) {
    tma_prefetch(map_dq);
    for (int it = 0; it < w.n_iter; ++it) {
        #pragma unroll
        for (int wg = 0; wg < C::kConsumers; ++wg) {
            if (!C::kDqHalves && it % 2 != wg) continue;  // dQ taken in turns
            const u32 use = C::kDqHalves ? it : it / 2;    // the buffer's uses so far
            mbarrier_wait(bar.dq_full(wg), use & 1);
            const BwdSlotPair pair = dq_pairs<C>(tiles)[wg];
            const int col0 = C::kDqHalves ? wg * C::kDqN : 0;
            tma_reduce_add_5d(map_dq, base + C::kOffDq + wg * C::kTileDq, 0, pair.m0,
                              col0 / C::kDqPanel, pair.head, w.batch);
            bulk_commit_group();
            bulk_wait_group_read<0>();
            mbarrier_arrive(bar.dq_empty(wg));
        }
    }
}

}  // namespace kg
