// The Hopper forward's online softmax on one block of S accumulators, O's rescale, and P's
// packing into wgmma's register A layout.
#pragma once
#include "kernelgen/types.cuh"  // exp2_approx, pack2, neg_inf

namespace kg {

// The largest score bound B for which P = exp(s - B) of every |s| <= B is a normal number of
// the 16-bit type P is packed to (and of fp32, whose ex2.approx.ftz flushes below 2^-126), so
// that subtracting B instead of the row's max loses nothing: exp(-2 B) >= 2^-115 for bf16
// (fp32's exponent range: B <= 39.8), >= 2^-13 for fp16 (smallest normal 2^-14: B <= 4.5).
template <class Elem> struct MaxScoreBound { static constexpr float value = 39.8f; };
template <> struct MaxScoreBound<half_t> { static constexpr float value = 4.5f; };

// Online softmax on this thread's rows (h = 0: lane_row, h = 1: lane_row + 8), the math of
// flash_fwd_sm80.cuh: new running max, alpha = exp2((m_old - m_new) * c) for O and l, and
// S -> P = exp2(S * c - m_new * c) in place (fp32). `fixed` (a bounded score_mod, uniform over
// the tile): row_max holds the bound B for good, so P = exp2(S * c - B * c), alpha = 1 and no max
// is taken; the caller then skips O's rescale. kShift: row h's scores are acc_s + shift[h] (a
// distance bias's row terms, DistanceBias), added to the row's max and exp2's offset rather
// than to each score. kPairs < BLOCK_N / 8 (half_diag): only the first kPairs 8-column groups
// hold scores, the rest are masked; their P is 0 without an exp2. score_scale: `fixed` only, a
// factor the scores still lack (a score_mod's uniform factor, Mods::kScoreFactor), taken into
// the exp2's scale (P = exp2(S * c * score_scale - B * c)); the bound B is already in units of
// the modified score.
template <class C, bool kShift = false, int kPairs = C::kBlockN / 8>
__device__ __forceinline__ void softmax_step(float (&acc_s)[C::kBlockN / 2], float (&row_max)[2],
                                             float (&row_sum)[2], float scale_log2,
                                             float (&alpha)[2], bool fixed = false,
                                             const float (&shift)[2] = {0.f, 0.f},
                                             float score_scale = 1.f) {
    // A row's max over this thread's block_n / 4 scores runs as kParts independent chains and
    // then a tree: one chain of dependent FMNMX made every exp2 wait out block_n / 8 FMNMX
    // latencies (PERF_NOTES §30: hd64 +1-5% at >= 4k). The sum stays one chain: it runs behind
    // the MUFU.EX2 that feed it, and split into parts it measured 1-3% slower at hd64.
    constexpr int kParts = 4;
    static_assert(kPairs >= kParts, "block_n >= 32 (half_diag: >= 64)");
    #pragma unroll
    for (int i = kPairs; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[4 * i + e] = 0.f;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float m_scaled;
        if (fixed) {
            m_scaled = row_max[h] * scale_log2;
            alpha[h] = 1.f;
        } else {
            float part[kParts];
            #pragma unroll
            for (int i = 0; i < kPairs; ++i) {
                const float pair = fmaxf(acc_s[4 * i + 2 * h], acc_s[4 * i + 2 * h + 1]);
                part[i % kParts] = i < kParts ? pair : fmaxf(part[i % kParts], pair);
            }
            float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
            if constexpr (kShift) mx += shift[h];
            mx = fmaxf(mx, row_max[h]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // A row that has seen only masked keys keeps m = -inf: use 0 so that (-inf) - (-inf)
            // never happens; its p and alpha are then exp2(-inf) = 0.
            m_scaled = mx == neg_inf() ? 0.f : mx * scale_log2;
            alpha[h] = exp2_approx(row_max[h] * scale_log2 - m_scaled);
            row_max[h] = mx;
        }
        const float offset = kShift ? fmaf(shift[h], scale_log2, -m_scaled) : -m_scaled;
        const float exp_scale = fixed ? scale_log2 * score_scale : scale_log2;
        float sum = 0.f;
        #pragma unroll
        for (int i = 0; i < kPairs; ++i)
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                float& x = acc_s[4 * i + 2 * h + j];
                x = exp2_approx(fmaf(x, exp_scale, offset));
                if constexpr (!C::kSumMma) sum += x;  // else the P V wgmma sums P
            }
        if constexpr (!C::kSumMma)
            row_sum[h] = row_sum[h] * alpha[h] + sum;  // per-lane partial; the quad reduces at the end
    }
}

template <class C>
__device__ __forceinline__ void rescale_o(float (&acc_o)[C::kAccO], const float (&alpha)[2]) {
    #pragma unroll
    for (int i = 0; i < C::kAccO / 4; ++i)  // with sum_mma the row sums too
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[4 * i + e] *= alpha[e / 2];
}

// P (fp32) -> 16-bit pairs in the register A layout of k-step i / 2 (wgmma.cuh).
template <class C>
__device__ __forceinline__ void pack_p(u32 (&p)[C::kBlockN / 16][4],
                                       const float (&acc_s)[C::kBlockN / 2]) {
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            p[i / 2][(i % 2) * 2 + h] =
                pack2<typename C::Elem>(acc_s[4 * i + 2 * h], acc_s[4 * i + 2 * h + 1]);
}

}  // namespace kg
