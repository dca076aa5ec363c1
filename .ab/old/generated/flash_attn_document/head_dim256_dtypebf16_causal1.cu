// Generated from specs/flash_attn_document.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_document__head_dim256_dtypebf16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0
// flash_attn_fwd: exact attention forward, FlashAttention-2 on mma.sync (see kernelgen/flash_fwd_sm80.cuh).
//   O[b, i, h, :] = sum_j softmax_j(scale * Q[b, i, h, :] . K[b, j, h / (heads / heads_k), :]) V[b, j, ...]
//   LSE[b, h, i]  = logsumexp_j(scale * Q[b, i, h, :] . K[b, j, ...])      (natural log, fp32)
//   causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned).
// Variant: head_dim=256 dtype=bf16 causal=true arch=sm_80
// Config:  block_m=128 block_n=32 warps=8 stages=2 grid_order=0
#include "kernelgen/flash_fwd_sm80.cuh"

using elem_t = kg::bf16_t;
using Config = kg::FwdConfig<elem_t, /*HEAD_DIM=*/256, /*BLOCK_M=*/128,
                             /*BLOCK_N=*/32, /*WARPS=*/8,
                             /*STAGES=*/2, /*CAUSAL=*/true,
                             /*GRID_ORDER=*/0>;
static_assert(Config::kSmemBytes == 135168, "spec's smem formula disagrees with the kernel");

// The spec's attention modifiers (kernelgen/flash_fwd_sm80.cuh says what each one does).
using kg::tanh_approx;  // a math function expressions may call, like the libm ones
struct Mods {
    const int* doc_q;
    const int* doc_k;
    const int* bm_num;
    const int* bm_idx;
    const int* bm_full_num;
    const int* bm_full_idx;
    int bm_stride_b;
    int bm_stride_h;
    int bm_width;
    const int* bm_order;
    static constexpr int head_dim = 256;
    static constexpr bool causal = true;
    static constexpr bool kScoreMod = false;
    static constexpr bool kMaskMod = true;
    static constexpr bool kKvRange = false;
    static constexpr bool kExactRange = false;
    static constexpr bool kBlockSparse = true;
    // Whether score_mod / mask_mod read memory at a per-token index (kg::mod_index).
    static constexpr bool kClampIndices = true;
    // Whether a kv_range bound reads a tensor (the exact path then clamps its rows).
    static constexpr bool kRangeReadsMemory = false;
    // Whether score_bound() bounds |score_mod| (the Hopper forward may skip the running max).
    static constexpr bool kScoreBound = false;
    // Whether score_mod is score_factor() * score_mod_inner(), the factor uniform over a tile
    // (the Hopper forward's bounded softmax folds it into its exp2's scale).
    static constexpr bool kScoreFactor = false;
    // Whether slope_before() / slope_after() give score_mod as a bias linear in the key's
    // distance from the diagonal (the Hopper forward's DistanceBias).
    static constexpr bool kDistanceSlopes = false;

    // The block mask's lists of one row (kernelgen/blockmask.py): the blocks `block` of (batch,
    // head) meets, partially visible ones first (mask_mod per element), then fully visible ones.
    __device__ __forceinline__ kg::SparseRow sparse_row(int batch, int head, int block) const {
        const int row = batch * bm_stride_b + head * bm_stride_h + block;
        const int n_partial = bm_num[row];
        return kg::SparseRow{bm_idx + kg::i64(row) * bm_width, bm_full_idx + kg::i64(row) * bm_width,
                             n_partial, n_partial + bm_full_num[row]};
    }

    // A row of grouped lists' two more entries (wg_skip: blockmask.group_for_warpgroups): the
    // leading group's size | the leading warpgroup << 16, the trailing group's size.
    __device__ __forceinline__ kg::SparseGroups sparse_groups(const kg::SparseRow& row) const {
        const int lead = row.partial[bm_width - 2];
        return kg::SparseGroups{lead & 0xffff, lead >> 16, row.partial[bm_width - 1]};
    }

    // qk: the raw dot product q.k; the expressions see score = softmax_scale * qk, or start from
    // qk (an unused score costs nothing: the compiler drops it).
    __device__ __forceinline__ float score_mod(float qk, float softmax_scale, int batch, int head,
                                               int q_idx, int kv_idx, int seqlen_q,
                                               int seqlen_k) const {
        [[maybe_unused]] const float score = qk * softmax_scale;
        return score;
    }
    __device__ __forceinline__ float score_bound(int batch, int head) const {
        return 0.0f;
    }
    __device__ __forceinline__ float slope_before(int batch, int head) const {
        return 0.0f;
    }
    __device__ __forceinline__ float slope_after(int batch, int head) const {
        return 0.0f;
    }
    __device__ __forceinline__ bool mask_mod(int batch, int head, int q_idx, int kv_idx,
                                             int seqlen_q, int seqlen_k) const {
#line 12 "specs/flash_attn_document.yaml"
        return (doc_q[batch * seqlen_q + q_idx] == doc_k[batch * seqlen_k + kv_idx]);
#line 87 "flash_attn_document__head_dim256_dtypebf16_causal1__sm_80__block_m128_block_n32_warps8_stages2_grid_order0.cu"
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
flash_attn_fwd(const elem_t* q, const elem_t* k, const elem_t* v, elem_t* o, float* lse, long long q_stride_b, long long q_stride_s, long long q_stride_h, long long k_stride_b, long long k_stride_s, long long k_stride_h, long long v_stride_b, long long v_stride_s, long long v_stride_h, long long o_stride_b, long long o_stride_s, long long o_stride_h, int batch, int heads, int heads_k, int seqlen_q, int seqlen_k, float softmax_scale, const int* doc_q, const int* doc_k, const int* bm_num, const int* bm_idx, const int* bm_full_num, const int* bm_full_idx, int bm_stride_b, int bm_stride_h, int bm_width, const int* bm_order) {
    const kg::FwdArgs<elem_t> args{q, k, v, o, lse,
                                   q_stride_b, q_stride_s, q_stride_h,
                                   k_stride_b, k_stride_s, k_stride_h,
                                   v_stride_b, v_stride_s, v_stride_h,
                                   o_stride_b, o_stride_s, o_stride_h,
                                   batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale};
    const Mods mods{doc_q, doc_k, bm_num, bm_idx, bm_full_num, bm_full_idx, bm_stride_b, bm_stride_h, bm_width, bm_order};
    kg::flash_fwd_sm80<Config>(args, mods);
}
