// P^T of one (query tile, KV tile) pair in the Hopper backward: fp32 accumulators packed into
// wgmma's register A layout, and with mods the probabilities every mask and score_mod shaped
// (their gradient factor left in place for dS^T).
#pragma once
#include "kernelgen/flash_bwd_sm80.cuh"  // BwdArgs, mod_hides
#include "kernelgen/bwd_sm90_config.cuh"
#include "kernelgen/wgmma.cuh"  // fence_operands

namespace kg {

// fp32 accumulators (m64 C layout) -> 16-bit pairs in the register A layout of k-step i / 2.
template <int N>
struct Packed {
    u32 r[N / 16][4];
};

template <class Elem, int N>
__device__ __forceinline__ void pack_a(Packed<N>& out, const float (&acc)[N / 2]) {
    #pragma unroll
    for (int i = 0; i < N / 8; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            out.r[i / 2][(i % 2) * 2 + h] = pack2<Elem>(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
}

template <int N>
__device__ __forceinline__ void fence_packed(Packed<N>& p) {
    #pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) fence_operands(p.r[kk]);
}

// This lane's two queries' stats (LSE * log2e, or D) in each of the pair's BLOCK_M / 8 column
// groups, [i] giving group i's pair (the lane's lane_col and lane_col + 1; stats + 8 i in the
// slot). Read into registers by load(), before the waits for S^T and dP^T, so the loads run
// beside the GEMMs (PERF_NOTES §90): packed and varlen 1.5-2.5% faster, full attention flat. Not
// causal (read from shared memory where used): there the early reads cost 2% (plain hd128 1k)
// to 8% (softcap) (§92); nor at head_dim 96, whose consumers sit at the register limit (ptxas
// spilled 24-132 bytes with them).
template <class C, bool EARLY = C::kHeadDim != 96 && !C::kCausal>
struct LaneStats {
    float2 v[C::kBlockM / 8];
    __device__ __forceinline__ void load(const float* stats) {
        #pragma unroll
        for (int i = 0; i < C::kBlockM / 8; ++i)
            v[i] = *reinterpret_cast<const float2*>(stats + 8 * i);
    }
    __device__ __forceinline__ float2 operator[](int i) const { return v[i]; }
};

template <class C>
struct LaneStats<C, false> {
    const float* p;
    __device__ __forceinline__ void load(const float* stats) { p = stats; }
    __device__ __forceinline__ float2 operator[](int i) const {
        return *reinterpret_cast<const float2*>(p + 8 * i);
    }
};

// Whether the mask_mod's verdicts are taken before the wait for S^T (bwd_mod_hidden_bits), or per
// element in bwd_mod_probs_pass: head_dim 96's consumers sit at the register limit, and the
// document's causal variant spills 4 bytes with the bits, before the wait or after it.
template <class C>
constexpr bool kEarlyModBits = C::kHeadDim != 96;

// With mods: P^T in place of the raw scores S^T (acc_s) of one pair, every mask applied, packed
// into p16 for dV; acc_s then holds P^T * score_mod_grad, which dS^T = acc_s * (dP^T - D) takes
// as without mods. Element (i, e) is key key0 + 8 * (e / 2), query query0 + 8 * i + (e & 1);
// lse2 holds the lane's queries' LSE * log2e (LaneStats). Indices are clamped into the sequences
// for the mods (padding rows and columns are masked or never stored), as in flash_bwd_sm80.cuh.
// MASKED: the pair needs a mask (need_mask, need_mod_mask say which); the pairs that need none
// (all but the edges of a window or a document) take the copy without the per-element tests,
// which cost the window's backward a quarter of its time when every pair paid for them. Not at
// head_dim 96, whose consumers sit at the register limit: there the second copy spills (alibi
// and document causal), and every pair takes the masked one.
template <bool MASKED, class C, class Mods>
__device__ __forceinline__ void bwd_mod_probs_pass(float (&acc_s)[C::kBlockM / 2],
                                                   Packed<C::kBlockM>& p16,
                                                   const BwdArgs<typename C::Elem>& a,
                                                   const Mods& mods, int batch, int head, int key0,
                                                   int query0, const LaneStats<C>& lse2,
                                                   bool need_mask,
                                                   bool need_mod_mask, u32 mod_hidden) {
    const ModSite at{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale};
    const int shift = a.seqlen_k - a.seqlen_q;
    #pragma unroll
    for (int i = 0; i < C::kBlockM / 8; ++i) {
        const float2 l = lse2[i];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float p[2];
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int e = 2 * h + c, key = key0 + 8 * h, query = query0 + 8 * i + c;
                bool hidden = false;
                if constexpr (MASKED) {
                    hidden = need_mask && key >= a.seqlen_k;
                    if constexpr (C::kCausal) hidden |= need_mask && key > query + shift;
                    if constexpr (Mods::kMaskMod && kEarlyModBits<C>)
                        hidden |= need_mod_mask && ((mod_hidden >> (4 * i + e)) & 1u);
                    else if constexpr (Mods::kMaskMod)
                        hidden |= need_mod_mask && mod_hides(mods, at, head, query, key);
                }
                const float lse = c ? l.y : l.x;
                float grad = 1.f;
                if constexpr (Mods::kScoreMod) {
                    const int q_idx = min(query, a.seqlen_q - 1), kv_idx = min(key, a.seqlen_k - 1);
                    const float qk = acc_s[4 * i + e];
                    p[c] = exp2_approx(fmaf(mods.score_mod(qk, a.softmax_scale, batch, head, q_idx,
                                                           kv_idx, a.seqlen_q, a.seqlen_k),
                                            kLog2e, -lse));
                    grad = mods.score_mod_grad(qk, a.softmax_scale, batch, head, q_idx, kv_idx,
                                               a.seqlen_q, a.seqlen_k);
                } else {
                    p[c] = exp2_approx(fmaf(acc_s[4 * i + e], a.softmax_scale * kLog2e, -lse));
                }
                p[c] = hidden ? 0.f : p[c];
                acc_s[4 * i + e] = Mods::kScoreMod ? p[c] * grad : p[c];
            }
            p16.r[i / 2][(i % 2) * 2 + h] = pack2<typename C::Elem>(p[0], p[1]);
        }
    }
}

template <class C, class Mods>
__device__ __forceinline__ void bwd_mod_probs(float (&acc_s)[C::kBlockM / 2], Packed<C::kBlockM>& p16,
                                              const BwdArgs<typename C::Elem>& a, const Mods& mods,
                                              int batch, int head, int key0, int query0,
                                              const LaneStats<C>& lse2, bool need_mask,
                                              bool need_mod_mask,
                                              u32 mod_hidden) {
    if (C::kHeadDim == 96 || need_mask || need_mod_mask)
        bwd_mod_probs_pass<true, C>(acc_s, p16, a, mods, batch, head, key0, query0, lse2,
                                    need_mask, need_mod_mask, mod_hidden);
    else
        bwd_mod_probs_pass<false, C>(acc_s, p16, a, mods, batch, head, key0, query0, lse2,
                                     false, false, 0u);
}

// The mask_mod's verdicts on this thread's elements of one pair, bit 4 i + e set where it hides
// element (i, e) (bwd_mod_probs_pass's numbering; BLOCK_M / 2 <= 32 elements). Evaluated between
// the issue of the pair's S^T and dP^T and the wait for S^T, so that a mask_mod that reads memory
// (document ids: 2 + BLOCK_M / 4 loads a thread) loads while the tensor cores work, as the
// forward does (fwd_sm90_masks.cuh, mod_mask_bits; PERF_NOTES §26). Every element is evaluated
// (indices clamped, as mod_hides does), so ptxas loads each id once.
template <class C, class Mods>
__device__ __forceinline__ u32 bwd_mod_hidden_bits(const BwdArgs<typename C::Elem>& a,
                                                   const Mods& mods, int batch, int head, int key0,
                                                   int query0) {
    static_assert(C::kBlockM / 2 <= 32, "one word of bits");
    const ModSite at{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale};
    u32 bits = 0;
    #pragma unroll
    for (int i = 0; i < C::kBlockM / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            bits |= u32(mod_hides(mods, at, head, query0 + 8 * i + (e & 1), key0 + 8 * (e / 2)))
                    << (4 * i + e);
    return bits;
}

}  // namespace kg
