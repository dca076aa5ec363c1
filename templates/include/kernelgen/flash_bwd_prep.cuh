// Backward preprocessing (sm_80 .. sm_90): D = rowsum(dO * O) in fp32 per (batch, head, query
// row), the term the backward subtracts from dP (dS = P * (dP - D)); and, when given, zeroing
// of the fp32 dQ accumulator that the main backward kernel adds into.
#pragma once
#include "kernelgen/mma_sm80.cuh"

namespace kg {

template <class Elem>
struct BwdPrepArgs {
    const Elem* o; const Elem* dout;
    float* dsum;      // (batch, heads, seqlen_q)
    float* dq_accum;  // (batch, seqlen_q, heads, head_dim) or null
    i64 o_stride_b, o_stride_s, o_stride_h;
    i64 do_stride_b, do_stride_s, do_stride_h;
    int heads, seqlen_q, head_dim;  // head_dim: a multiple of 32
};

// Each warp takes 16 query rows. The dot products along head_dim run on the tensor cores: D for
// those rows is the diagonal of the 16x16 block dO O^T, one k16 step at a time (16x the FLOPs
// needed, free in a kernel bound by reading O and dO, and no shuffles). The order of the
// contraction index is free as long as both operands use the same one, so every lane loads 16
// contiguous bytes of a row and hands its four words to two k16 steps.
template <class Elem, int WARPS>
__device__ __forceinline__ void flash_bwd_prep(const BwdPrepArgs<Elem>& a) {
    // Consecutive CTAs take the same rows of consecutive heads (the grid is (row blocks, heads),
    // numbered head first): a row's heads lie side by side in O, dO and the dQ accumulator, so
    // the CTAs in flight read and write whole rows rather than one head's 256 bytes of each of
    // many rows 4 KB apart (PERF_NOTES §120).
    const int linear = blockIdx.y * gridDim.x + blockIdx.x;
    const int head = linear % a.heads, block = linear / a.heads, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = (block * WARPS + warp) * 16;
    if (row0 >= a.seqlen_q) return;  // a whole warp: mma needs all 32 lanes

    const Elem* o = a.o + batch * a.o_stride_b + head * a.o_stride_h + row0 * a.o_stride_s;
    const Elem* dout = a.dout + batch * a.do_stride_b + head * a.do_stride_h + row0 * a.do_stride_s;
    const bool lo_ok = row0 + g < a.seqlen_q, hi_ok = row0 + g + 8 < a.seqlen_q;
    const uint4 zero = {0u, 0u, 0u, 0u};

    // acc_lo: C = dO[rows 0..15] . O[rows 0..7]^T; acc_hi the same against O rows 8..15.
    float acc_lo[4] = {0.f, 0.f, 0.f, 0.f}, acc_hi[4] = {0.f, 0.f, 0.f, 0.f};
    // Two steps in flight hide load latency; full unrolling of this runtime loop made ptxas spill.
    #pragma unroll 2
    for (int c = 8 * t; c < a.head_dim; c += 32) {
        const uint4 x_lo = lo_ok ? *reinterpret_cast<const uint4*>(dout + g * a.do_stride_s + c) : zero;
        const uint4 x_hi = hi_ok ? *reinterpret_cast<const uint4*>(dout + (g + 8) * a.do_stride_s + c) : zero;
        const uint4 y_lo = lo_ok ? *reinterpret_cast<const uint4*>(o + g * a.o_stride_s + c) : zero;
        const uint4 y_hi = hi_ok ? *reinterpret_cast<const uint4*>(o + (g + 8) * a.o_stride_s + c) : zero;
        const u32 step0[4] = {x_lo.x, x_hi.x, x_lo.y, x_hi.y};
        const u32 step1[4] = {x_lo.z, x_hi.z, x_lo.w, x_hi.w};
        mma_16816(acc_lo, step0, y_lo.x, y_lo.y, Elem{});
        mma_16816(acc_hi, step0, y_hi.x, y_hi.y, Elem{});
        mma_16816(acc_lo, step1, y_lo.z, y_lo.w, Elem{});
        mma_16816(acc_hi, step1, y_hi.z, y_hi.w, Elem{});
    }
    // C[r][r] for r = g sits in lane (g, t = g/2), element g%2 of acc_lo; for r = g+8 in the same
    // lane, element 2 + g%2 of acc_hi.
    float* dsum = a.dsum + (i64(batch) * a.heads + head) * a.seqlen_q + row0;
    if (t == g / 2) {
        if (lo_ok) dsum[g] = g % 2 ? acc_lo[1] : acc_lo[0];
        if (hi_ok) dsum[g + 8] = g % 2 ? acc_hi[3] : acc_hi[2];
    }

    if (a.dq_accum != nullptr) {
        const i64 row_stride = i64(a.heads) * a.head_dim;
        float* dq = a.dq_accum + (i64(batch) * a.seqlen_q + row0) * row_stride + i64(head) * a.head_dim;
        const int rows = min(16, a.seqlen_q - row0), chunks = a.head_dim / 4;
        const float4 zeros = {0.f, 0.f, 0.f, 0.f};
        for (int i = lane; i < rows * chunks; i += 32)
            *reinterpret_cast<float4*>(dq + (i / chunks) * row_stride + (i % chunks) * 4) = zeros;
    }
}

}  // namespace kg
