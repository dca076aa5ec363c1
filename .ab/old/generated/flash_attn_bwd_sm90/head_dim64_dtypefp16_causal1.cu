// Generated from specs/flash_attn_bwd_sm90.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_bwd_sm90__head_dim64_dtypefp16_causal1__sm_90a__block_m64_block_n128_stages2
// flash_attn_bwd_sm90: exact attention backward for Hopper, dK and dV of one KV tile per CTA and dQ added
// into an fp32 accumulator (kernelgen/flash_bwd_sm90.cuh; the math of flash_attn_bwd):
//   P[i, j]  = exp(scale * Q[i] . K[j] - LSE[i])     (causal: j <= i + seqlen_k - seqlen_q, else 0)
//   dV[j]   += sum_i P[i, j] dO[i]          dS[i, j] = P[i, j] * (dO[i] . V[j] - D[i])
//   dK[j]   += scale * sum_i dS[i, j] Q[i]  dQacc[i] += scale * sum_j dS[i, j] K[j]
// summed over the heads / heads_k query heads of each kv head (GQA). q, dout: (batch, seqlen_q,
// heads, head_dim); k, v, dk, dv: (batch, seqlen_k, heads_k, head_dim); lse, dsum: (batch, heads,
// seqlen_q) fp32; dq_accum: (batch, seqlen_q, heads, head_dim) fp32. Q, K, V, dO are read through
// the tensor maps (their pointers and strides are for the host), dQ added through tmap_dq.
// A spec's mods (the Mods struct below, if it has any; their arguments follow the tensor maps)
// apply as in flash_attn_bwd:
//   P[i, j] = exp(score_mod(scale * Q[i] . K[j]) - LSE[i]) (0 where mask_mod hides the pair),
//   dS[i, j] = P[i, j] * (dO[i] . V[j] - D[i]) * score_mod_grad(scale * Q[i] . K[j]).
// Variant: head_dim=64 dtype=fp16 causal=true arch=sm_90a
// Config:  block_m=64 block_n=128 stages=2
#include "kernelgen/flash_bwd_sm90.cuh"

using elem_t = kg::half_t;

// One k16 step of S^T = K Q^T or dP^T = V dO^T: m64n64k16, both operands from shared
// memory, K-major. scale_d = 0 overwrites the accumulators (the first step), 1 adds to them.
struct SdpGemm {
    __device__ __forceinline__ static void mma(float (&d)[32], kg::u64 desc_a, kg::u64 desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, "
            "%8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31"
            "}, %32, %33, p, 1, 1, 0, 0;\n}"
            :
              "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
};

// One k16 step of dV += P^T dO or dK += dS^T Q: m64n64k16, A (P^T, dS^T) from
// registers, B (dO, Q) from shared memory MN-major (imm-trans-b = 1).
struct DkvGemm {
    __device__ __forceinline__ static void mma(float (&d)[32], const kg::u32 (&a)[4],
                                               kg::u64 desc_b) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, "
            "%8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31"
            "}, {" "%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
            :
              "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    }
};

// One k16 step of dQ = dS K: m64n64k16, both from shared memory MN-major: dS^T stored
// [key][query] is A transposed (imm-trans-a = 1), K stored [key][d] is B transposed.
struct DqGemm {
    __device__ __forceinline__ static void mma(float (&d)[32], kg::u64 desc_a, kg::u64 desc_b,
                                               int scale_d) {
        asm volatile(
            "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, "
            "%8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31"
            "}, %32, %33, p, 1, 1, 1, 1;\n}"
            :
              "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
};

using Config = kg::BwdSm90Config<elem_t, /*HEAD_DIM=*/64, /*BLOCK_M=*/64,
                                 /*BLOCK_N=*/128, /*STAGES=*/2,
                                 /*CAUSAL=*/true, SdpGemm, DkvGemm, DqGemm>;
static_assert(Config::kSmemBytes == 133272, "spec's smem formula disagrees with the kernel");
static_assert(Config::kThreads == 384, "spec's thread count disagrees with the kernel");
static_assert(Config::kSwizzle == 128, "the host's tensor maps use the spec's swizzle");
static_assert(Config::kConsumerRegs == 240, "spec's register budget disagrees");
static_assert(Config::kDqN == 64, "spec's dQ split disagrees with the kernel");
static_assert(Config::kDqTma == true, "spec's dQ path disagrees with the kernel");

// minBlocksPerSM = 1 gives ptxas the entry register count, without which setmaxnreg is dropped.
extern "C" __global__ void __launch_bounds__(Config::kThreads, 1)
flash_attn_bwd_sm90(const elem_t* q, const elem_t* k, const elem_t* v, const elem_t* dout, const float* lse, const float* dsum, float* dq_accum, elem_t* dk, elem_t* dv, long long q_stride_b, long long q_stride_s, long long q_stride_h, long long k_stride_b, long long k_stride_s, long long k_stride_h, long long v_stride_b, long long v_stride_s, long long v_stride_h, long long do_stride_b, long long do_stride_s, long long do_stride_h, long long dk_stride_b, long long dk_stride_s, long long dk_stride_h, long long dv_stride_b, long long dv_stride_s, long long dv_stride_h, int batch, int heads, int heads_k, int seqlen_q, int seqlen_k, float softmax_scale, const __grid_constant__ kg::TensorMap tmap_q, const __grid_constant__ kg::TensorMap tmap_k, const __grid_constant__ kg::TensorMap tmap_v, const __grid_constant__ kg::TensorMap tmap_do, const __grid_constant__ kg::TensorMap tmap_dq) {
    const kg::BwdArgs<elem_t> args{q, k, v, dout, lse, dsum, dq_accum, dk, dv,
                                   q_stride_b, q_stride_s, q_stride_h,
                                   k_stride_b, k_stride_s, k_stride_h,
                                   v_stride_b, v_stride_s, v_stride_h,
                                   do_stride_b, do_stride_s, do_stride_h,
                                   dk_stride_b, dk_stride_s, dk_stride_h,
                                   dv_stride_b, dv_stride_s, dv_stride_h,
                                   batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale};
    kg::flash_bwd_sm90<Config>(args, tmap_q, tmap_k, tmap_v, tmap_do, tmap_dq);
}
