// Generated from specs/flash_attn_bwd.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_bwd__head_dim192_dtypebf16_causal0__sm_80__block_m32_block_n64_warps8_dsplit2_stages2_grid_order0
// flash_attn_bwd: exact attention backward, dK and dV (FlashAttention-2, see kernelgen/flash_bwd_sm80.cuh)
// and dQ added into an fp32 accumulator, for one KV tile per CTA:
//   P[i, j]  = exp(scale * Q[i] . K[j] - LSE[i])        (masked: 0; causal: j <= i + seqlen_k - seqlen_q)
//   dV[j]   += sum_i P[i, j] dO[i]          dS[i, j] = P[i, j] * (dO[i] . V[j] - D[i])
//   dK[j]   += scale * sum_i dS[i, j] Q[i]  dQacc[i] += scale * sum_j dS[i, j] K[j]
// summed over the heads / heads_k query heads of each kv head (GQA). q, dout: (batch, seqlen_q,
// heads, head_dim); k, v, dk, dv: (batch, seqlen_k, heads_k, head_dim); lse, dsum: (batch, heads,
// seqlen_q) fp32; dq_accum: (batch, seqlen_q, heads, head_dim) fp32 or null (then no dQ).
// A spec's mods (the Mods struct below, if it has any) apply as in the forward:
//   P[i, j] = exp(score_mod(scale * Q[i] . K[j]) - LSE[i]) (0 where mask_mod hides the pair),
//   dS[i, j] = P[i, j] * (dO[i] . V[j] - D[i]) * score_mod_grad(scale * Q[i] . K[j]).
// Variant: head_dim=192 dtype=bf16 causal=false arch=sm_80
// Config:  block_m=32 block_n=64 warps=8 dsplit=2 stages=2 grid_order=0
#include "kernelgen/flash_bwd_sm80.cuh"

using elem_t = kg::bf16_t;
using Config = kg::BwdConfig<elem_t, /*HEAD_DIM=*/192, /*BLOCK_M=*/32,
                             /*BLOCK_N=*/64, /*WARPS=*/8, /*DSPLIT=*/2,
                             /*STAGES=*/2, /*CAUSAL=*/false,
                             /*GRID_ORDER=*/0>;
static_assert(Config::kSmemBytes == 113152, "spec's smem formula disagrees with the kernel");
static_assert(Config::kDqWarpsM == 2, "spec's dQ warp tiling disagrees with the kernel");

extern "C" __global__ void __launch_bounds__(Config::kThreads)
flash_attn_bwd(const elem_t* q, const elem_t* k, const elem_t* v, const elem_t* dout, const float* lse, const float* dsum, float* dq_accum, elem_t* dk, elem_t* dv, long long q_stride_b, long long q_stride_s, long long q_stride_h, long long k_stride_b, long long k_stride_s, long long k_stride_h, long long v_stride_b, long long v_stride_s, long long v_stride_h, long long do_stride_b, long long do_stride_s, long long do_stride_h, long long dk_stride_b, long long dk_stride_s, long long dk_stride_h, long long dv_stride_b, long long dv_stride_s, long long dv_stride_h, int batch, int heads, int heads_k, int seqlen_q, int seqlen_k, float softmax_scale) {
    const kg::BwdArgs<elem_t> args{q, k, v, dout, lse, dsum, dq_accum, dk, dv,
                                   q_stride_b, q_stride_s, q_stride_h,
                                   k_stride_b, k_stride_s, k_stride_h,
                                   v_stride_b, v_stride_s, v_stride_h,
                                   do_stride_b, do_stride_s, do_stride_h,
                                   dk_stride_b, dk_stride_s, dk_stride_h,
                                   dv_stride_b, dv_stride_s, dv_stride_h,
                                   batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale};
    kg::flash_bwd_sm80<Config>(args);
}
