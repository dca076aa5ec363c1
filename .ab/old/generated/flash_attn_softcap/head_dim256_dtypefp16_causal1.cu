// Generated from specs/flash_attn_softcap.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_softcap__head_dim256_dtypefp16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0
// flash_attn_fwd: exact attention forward, FlashAttention-2 on mma.sync (see kernelgen/flash_fwd_sm80.cuh).
//   O[b, i, h, :] = sum_j softmax_j(scale * Q[b, i, h, :] . K[b, j, h / (heads / heads_k), :]) V[b, j, ...]
//   LSE[b, h, i]  = logsumexp_j(scale * Q[b, i, h, :] . K[b, j, ...])      (natural log, fp32)
//   causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned).
// Variant: head_dim=256 dtype=fp16 causal=true arch=sm_80
// Config:  block_m=128 block_n=32 warps=8 stages=2 grid_order=0
#include "kernelgen/flash_fwd_sm80.cuh"

using elem_t = kg::half_t;
using Config = kg::FwdConfig<elem_t, /*HEAD_DIM=*/256, /*BLOCK_M=*/128,
                             /*BLOCK_N=*/32, /*WARPS=*/8,
                             /*STAGES=*/2, /*CAUSAL=*/true,
                             /*GRID_ORDER=*/0>;
static_assert(Config::kSmemBytes == 135168, "spec's smem formula disagrees with the kernel");

// The spec's attention modifiers (kernelgen/flash_fwd_sm80.cuh says what each one does).
using kg::tanh_approx;  // a math function expressions may call, like the libm ones
struct Mods {
    float softcap;
    static constexpr int head_dim = 256;
    static constexpr bool causal = true;
    static constexpr bool kScoreMod = true;
    static constexpr bool kMaskMod = false;
    static constexpr bool kKvRange = false;
    static constexpr bool kExactRange = false;
    static constexpr bool kBlockSparse = false;
    // Whether score_mod / mask_mod read memory at a per-token index (kg::mod_index).
    static constexpr bool kClampIndices = false;
    // Whether a kv_range bound reads a tensor (the exact path then clamps its rows).
    static constexpr bool kRangeReadsMemory = false;
    // Whether score_bound() bounds |score_mod| (the Hopper forward may skip the running max).
    static constexpr bool kScoreBound = true;
    // Whether score_mod is score_factor() * score_mod_inner(), the factor uniform over a tile
    // (the Hopper forward's bounded softmax folds it into its exp2's scale).
    static constexpr bool kScoreFactor = true;
    // Whether slope_before() / slope_after() give score_mod as a bias linear in the key's
    // distance from the diagonal (the Hopper forward's DistanceBias).
    static constexpr bool kDistanceSlopes = false;
    __device__ __forceinline__ kg::SparseRow sparse_row(int, int, int) const {
        return kg::SparseRow{nullptr, nullptr, 0, 0};  // no block mask: never called
    }

    // qk: the raw dot product q.k; the expressions see score = softmax_scale * qk, or start from
    // qk (an unused score costs nothing: the compiler drops it).
    __device__ __forceinline__ float score_mod(float qk, float softmax_scale, int batch, int head,
                                               int q_idx, int kv_idx, int seqlen_q,
                                               int seqlen_k) const {
        [[maybe_unused]] const float score = qk * softmax_scale;
#line 12 "specs/flash_attn_softcap.yaml"
        return (softcap * tanh_approx(qk * (softmax_scale / softcap)));
#line 52 "flash_attn_softcap__head_dim256_dtypefp16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0.cu"
    }
    // score_mod split at its top-level product: the factor that reads no score or index, and
    // the rest (score_mod = score_factor() * score_mod_inner()).
    __device__ __forceinline__ float score_factor(float softmax_scale, int batch, int head,
                                                  int seqlen_q, int seqlen_k) const {
#line 12 "specs/flash_attn_softcap.yaml"
        return (softcap);
#line 60 "flash_attn_softcap__head_dim256_dtypefp16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0.cu"
    }
    __device__ __forceinline__ float score_mod_inner(float qk, float softmax_scale, int batch,
                                                     int head, int q_idx, int kv_idx, int seqlen_q,
                                                     int seqlen_k) const {
        [[maybe_unused]] const float score = qk * softmax_scale;
#line 12 "specs/flash_attn_softcap.yaml"
        return (tanh_approx(qk * (softmax_scale / softcap)));
#line 68 "flash_attn_softcap__head_dim256_dtypefp16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0.cu"
    }
    __device__ __forceinline__ float score_bound(int batch, int head) const {
#line 19 "specs/flash_attn_softcap.yaml"
        return (fabsf(softcap));
#line 73 "flash_attn_softcap__head_dim256_dtypefp16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0.cu"
    }
    __device__ __forceinline__ float slope_before(int batch, int head) const {
        return 0.0f;
    }
    __device__ __forceinline__ float slope_after(int batch, int head) const {
        return 0.0f;
    }
    __device__ __forceinline__ bool mask_mod(int batch, int head, int q_idx, int kv_idx,
                                             int seqlen_q, int seqlen_k) const {
        return true;
    }
    __device__ __forceinline__ int kv_lo(int q_first, int q_last, int batch, int head,
                                        int seqlen_q, int seqlen_k) const {
        return 0;
    }
    __device__ __forceinline__ int kv_hi(int q_first, int q_last, int batch, int head,
                                        int seqlen_q, int seqlen_k) const {
        return 1 << 30;
    }
    __device__ __forceinline__ int full_lo(int q_first, int q_last, int batch, int head,
                                        int seqlen_q, int seqlen_k) const {
        return 0;
    }
    __device__ __forceinline__ int full_hi(int q_first, int q_last, int batch, int head,
                                        int seqlen_q, int seqlen_k) const {
        return 1 << 30;
    }
};

extern "C" __global__ void __launch_bounds__(Config::kThreads)
flash_attn_fwd(const elem_t* q, const elem_t* k, const elem_t* v, elem_t* o, float* lse, long long q_stride_b, long long q_stride_s, long long q_stride_h, long long k_stride_b, long long k_stride_s, long long k_stride_h, long long v_stride_b, long long v_stride_s, long long v_stride_h, long long o_stride_b, long long o_stride_s, long long o_stride_h, int batch, int heads, int heads_k, int seqlen_q, int seqlen_k, float softmax_scale, float softcap) {
    const kg::FwdArgs<elem_t> args{q, k, v, o, lse,
                                   q_stride_b, q_stride_s, q_stride_h,
                                   k_stride_b, k_stride_s, k_stride_h,
                                   v_stride_b, v_stride_s, v_stride_h,
                                   o_stride_b, o_stride_s, o_stride_h,
                                   batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale};
    const Mods mods{softcap};
    kg::flash_fwd_sm80<Config>(args, mods);
}
