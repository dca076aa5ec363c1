// Generated from specs/flash_attn_bwd_prep.yaml by `kernelgen render --generated`; do not edit.
// flash_attn_bwd_prep__dtypefp16__sm_80__warps4
// flash_attn_bwd_prep: backward preprocessing (see kernelgen/flash_bwd_prep.cuh).
//   dsum[b, h, i] = sum_d dout[b, i, h, d] * o[b, i, h, d]   (fp32)
//   dq_accum[b, i, h, :] = 0                                  (when dq_accum is not null)
// Variant: dtype=fp16 arch=sm_80    Config: warps=4
#include "kernelgen/flash_bwd_prep.cuh"

using elem_t = kg::half_t;

extern "C" __global__ void __launch_bounds__(128)
flash_attn_bwd_prep(const elem_t* o, const elem_t* dout, float* dsum, float* dq_accum, long long o_stride_b, long long o_stride_s, long long o_stride_h, long long do_stride_b, long long do_stride_s, long long do_stride_h, int batch, int heads, int seqlen_q, int head_dim) {
    const kg::BwdPrepArgs<elem_t> args{o, dout, dsum, dq_accum,
                                       o_stride_b, o_stride_s, o_stride_h,
                                       do_stride_b, do_stride_s, do_stride_h,
                                       heads, seqlen_q, head_dim};
    kg::flash_bwd_prep<elem_t, /*WARPS=*/4>(args);
}
