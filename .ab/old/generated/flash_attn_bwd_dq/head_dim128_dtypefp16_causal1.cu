// Generated from specs/flash_attn_bwd_dq.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_bwd_dq__head_dim128_dtypefp16_causal1__sm_80__block_m128_block_n64_warps8_stages2
// flash_attn_bwd_dq: exact attention backward, dQ alone and without atomics (deterministic; see
// kernelgen/flash_bwd_dq_sm80.cuh), for one query tile per CTA:
//   P[i, j] = exp(scale * Q[i] . K[j] - LSE[i])   (masked: 0; causal: j <= i + seqlen_k - seqlen_q)
//   dQ[i]   = scale * sum_j P[i, j] * (dO[i] . V[j] - D[i]) K[j]
// q, dout, dq: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim);
// lse, dsum: (batch, heads, seqlen_q) fp32. A spec's mods (the Mods struct below, if it has any)
// apply as in flash_attn_bwd: P from the score_mod's scores, dS times score_mod_grad.
// Variant: head_dim=128 dtype=fp16 causal=true arch=sm_80
// Config:  block_m=128 block_n=64 warps=8 stages=2
#include "kernelgen/flash_bwd_dq_sm80.cuh"

using elem_t = kg::half_t;
using Config = kg::BwdDqConfig<elem_t, /*HEAD_DIM=*/128, /*BLOCK_M=*/128,
                               /*BLOCK_N=*/64, /*WARPS=*/8,
                               /*STAGES=*/2, /*CAUSAL=*/true>;
static_assert(Config::kSmemBytes == 139264, "spec's smem formula disagrees with the kernel");

extern "C" __global__ void __launch_bounds__(Config::kThreads)
flash_attn_bwd_dq(const elem_t* q, const elem_t* k, const elem_t* v, const elem_t* dout, const float* lse, const float* dsum, elem_t* dq, long long q_stride_b, long long q_stride_s, long long q_stride_h, long long k_stride_b, long long k_stride_s, long long k_stride_h, long long v_stride_b, long long v_stride_s, long long v_stride_h, long long do_stride_b, long long do_stride_s, long long do_stride_h, long long dq_stride_b, long long dq_stride_s, long long dq_stride_h, int batch, int heads, int heads_k, int seqlen_q, int seqlen_k, float softmax_scale) {
    const kg::BwdDqArgs<elem_t> args{q, k, v, dout, lse, dsum, dq,
                                     q_stride_b, q_stride_s, q_stride_h,
                                     k_stride_b, k_stride_s, k_stride_h,
                                     v_stride_b, v_stride_s, v_stride_h,
                                     do_stride_b, do_stride_s, do_stride_h,
                                     dq_stride_b, dq_stride_s, dq_stride_h,
                                     batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale};
    kg::flash_bwd_dq_sm80<Config>(args);
}
