// The Hopper forward's score_mod and masks on one block of S accumulators: the built-in masks
// (sequence end, causal diagonal), a spec's mask_mod as per-thread bits evaluated while the
// block's QK^T runs, kv ranges, and which blocks need any of it.
#pragma once
#include "kernelgen/flash_fwd_sm80.cuh"  // FwdArgs
#include "kernelgen/fwd_sm90_tiles.cuh"  // TileWork

namespace kg {

// The keys every row of a warpgroup surely sees, [lo, hi) (the spec's full_lo / full_hi of its
// rows): blocks inside skip the mask_mod. Without a mask_mod or a kv range, nothing is skipped.
struct FullRange {
    int lo, hi;
};

// The warpgroup's rows of the tile (a warpgroup past the tile's end takes its last row; padding
// rows are never stored).
template <class C, class Mods>
__device__ __forceinline__ FullRange full_range(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                                const TileWork& w, int wg_row0) {
    const int q_last = w.row0 + w.q_rows - 1;
    const int first = min(wg_row0, q_last), last = min(wg_row0 + 63, q_last);
    return FullRange{mods.full_lo(first, last, w.batch, w.head, a.seqlen_q, a.seqlen_k),
                     mods.full_hi(first, last, w.batch, w.head, a.seqlen_q, a.seqlen_k)};
}

// The query or key index `idx` (of a sequence of `seqlen`) that the Hopper forward passes a
// mod: clamped into the sequence when the mod reads memory at a per-token index
// (Mods.clamps_indices), so that the padding rows and columns of a tile read in bounds (their
// results are masked or never stored); else as it is, which saves a min per index and score
// (ALiBi's forward: 3440 -> 3040 instructions). The backwards always clamp: their padding rows'
// probabilities meet dO's zero rows, where a NaN that a mod makes out of range would spread into
// dK and dV. So does the mma.sync forward (flash_fwd_sm80.cuh says why).
template <class Mods>
__device__ __forceinline__ int mod_index(int idx, int seqlen) {
    if constexpr (Mods::kClampIndices) return min(idx, seqlen - 1);
    else return idx;
}

// Element (i, e) of this thread's S accumulators: row lane_row + (e / 2) * 8, key
// col0 + 2 * (lane % 4) + 8 * i + (e & 1) (wgmma.cuh). A score_mod rewrites every scaled score,
// the indices clamped into the sequences where it may read memory at them (mod_index).
// kPairs < BLOCK_N / 8 (half_diag): only the first kPairs 8-column groups, the rest masked.
// kInner: score_mod_inner instead (score_mod without its uniform factor, Mods::kScoreFactor).
template <class C, class Mods, int kPairs = C::kBlockN / 8, bool kInner = false>
__device__ __forceinline__ void modify_scores(float (&acc_s)[C::kBlockN / 2],
                                              const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                              const TileWork& w, int col0, int lane_row) {
    const int lane_col = col0 + 2 * (threadIdx.x % 4);
    #pragma unroll
    for (int i = 0; i < kPairs; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int q_idx = mod_index<Mods>(lane_row + (e / 2) * 8, a.seqlen_q);
            const int kv_idx = mod_index<Mods>(lane_col + i * 8 + (e & 1), a.seqlen_k);
            float& s = acc_s[4 * i + e];
            if constexpr (kInner)
                s = mods.score_mod_inner(s, a.softmax_scale, w.batch, w.head, q_idx, kv_idx,
                                         a.seqlen_q, a.seqlen_k);
            else
                s = mods.score_mod(s, a.softmax_scale, w.batch, w.head, q_idx, kv_idx, a.seqlen_q,
                                   a.seqlen_k);
        }
}

// A score_mod that is a bias linear in the key's distance d = kv_idx - (q_idx + seqlen_k -
// seqlen_q) from the diagonal, slope `before` where d <= 0 and `after` where d >= 0
// (mods.distance_slopes; ALiBi). With ref = the diagonal key of the warpgroup's first row,
// slope * d = slope * (kv_idx - ref) - slope * (q_idx + seqlen_k - seqlen_q - ref): a term per
// key column and a term per query row. On a block wholly on one side of every row's diagonal the
// column terms cost one FFMA per column: either they go into S before its QK^T, which
// accumulates onto them (one move per score before the issue, nothing after the wait; the
// scores stay raw dot products, units of 1 / softmax_scale, and the softmax scales them as in
// the plain kernel), or they are added after it, qk * scale + term (one FFMA per score). The
// rows' terms become shifts of the rows in the softmax (its max and exp2's offset, a few
// instructions per row and block): every block keeps its rows' scores as s + rho (in the
// scores' unit), rho the row's `before` term, whatever side it is on; a block across the
// diagonal runs the score_mod itself; the epilogue takes rho back out of the LSE.
//
// Whether the column terms go into S before the QK^T (init_bias_columns, raw dot products) or
// are added after it (bias_scores, scaled scores). Measured on the H200 (PERF_NOTES §55): before
// is +3-4% at hd128 (full and causal, 4k and 16k); at hd64 it lost 2.5-3% (four k-steps hide
// little behind the moves before the issue; raw units with the adds after lost 5-7%), and at
// hd256 full 5-7% (causal +1-2%, within the spread). Other head dims keep the adds after, and
// so do carry_qk, whose first QK^T of a tile is issued before S could be set for it, and
// half_diag, whose diagonal block's upper half set to -inf before a QK^T that accumulates onto S
// made ptxas serialize the wgmmas (C7511: every hd128 causal ALiBi config with it failed).
template <class C>
constexpr bool kBiasBeforeQk = C::kHeadDim == 128 && !C::kCarryQk && !C::kHalfDiag;

struct DistanceBias {
    float before, after;  // the slopes / scale
    float rho[2];         // this thread's rows: before * (row - wg_row0) / scale
    float delta[2];       // (before - after) * (row - wg_row0) / scale: `after` blocks
    float scale, inv_scale;  // the scores' unit: softmax_scale (raw dot products) or 1
    int ref;              // wg_row0 + seqlen_k - seqlen_q
};

template <class C, class Mods>
__device__ __forceinline__ DistanceBias distance_bias(const Mods& mods, int batch, int head,
                                                      int wg_row0, int lane_row, int diag_off,
                                                      float scale) {
    DistanceBias b{};  // (unused without distance slopes)
    if constexpr (Mods::kDistanceSlopes) {
        b.scale = kBiasBeforeQk<C> ? scale : 1.f;  // the scores' unit
        b.inv_scale = kBiasBeforeQk<C> ? 1.f / scale : 1.f;
        b.before = mods.slope_before(batch, head) * b.inv_scale;
        b.after = mods.slope_after(batch, head) * b.inv_scale;
        b.ref = wg_row0 + diag_off;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float rel = float(lane_row + 8 * h - wg_row0);  // 0..63: small, exact
            b.rho[h] = b.before * rel;
            b.delta[h] = (b.before - b.after) * rel;
        }
    }
    return b;
}

// Which side of the warpgroup's rows' diagonal the block at col0 lies on: 1 wholly before it, 2
// wholly after it, 0 across it.
template <class C>
__device__ __forceinline__ int distance_side(const DistanceBias& b, int col0) {
    return col0 + C::kBlockN - 1 <= b.ref ? 1 : col0 >= b.ref + 63 ? 2 : 0;
}

// Before the block's QK^T (kBiasBeforeQk): S = the column terms slope * (kv_idx - ref) of a
// one-sided block, 0 across the diagonal; the QK^T accumulates onto S from its first k-step.
// Branch-free and for every block: an accumulator that a conditional write or a runtime
// accumulate flag leaves half-defined made ptxas serialize the wgmma (C7512) and spill.
template <class C>
__device__ __forceinline__ void init_bias_columns(float (&acc_s)[C::kBlockN / 2],
                                                  const DistanceBias& b, int col0) {
    const int side = distance_side<C>(b, col0);
    const float slope = side == 1 ? b.before : side == 2 ? b.after : 0.f;
    const int lane_col = col0 + 2 * int(threadIdx.x % 4);  // int: col0 - ref may be negative
    const float base = slope * float(lane_col - b.ref);
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[4 * i + e] = fmaf(slope, float(i * 8 + (e & 1)), base);
}

// After the block's QK^T: the rows' shifts for softmax_step (0 before, delta after, rho across);
// across the diagonal the score_mod itself (back in raw units where S holds them); on one side,
// without kBiasBeforeQk, qk * scale + the column's term (one FFMA per column and one per score).
// Keys past the block's columns' ref stay small where they matter: a score far from the
// diagonal is far below the row's max (its p is 0).
template <class C, class Mods>
__device__ __forceinline__ void bias_scores(float (&acc_s)[C::kBlockN / 2], float (&shift)[2],
                                            const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                            const DistanceBias& b, const TileWork& w, int col0,
                                            int lane_row) {
    const bool before = col0 + C::kBlockN - 1 <= b.ref, after = col0 >= b.ref + 63;
    if (!before && !after) {
        modify_scores<C>(acc_s, a, mods, w, col0, lane_row);
        if constexpr (kBiasBeforeQk<C>) {
            #pragma unroll
            for (int k = 0; k < C::kBlockN / 2; ++k) acc_s[k] *= b.inv_scale;
        }
        shift[0] = b.rho[0];
        shift[1] = b.rho[1];
        return;
    }
    shift[0] = before ? 0.f : b.delta[0];
    shift[1] = before ? 0.f : b.delta[1];
    if constexpr (!kBiasBeforeQk<C>) {
        const float slope = before ? b.before : b.after;
        const int lane_col = col0 + 2 * int(threadIdx.x % 4);  // int: col0 - ref may be negative
        const float base = slope * float(lane_col - b.ref);
        #pragma unroll
        for (int i = 0; i < C::kBlockN / 8; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float column = fmaf(slope, float(i * 8 + (e & 1)), base);  // one per column
                acc_s[4 * i + e] = fmaf(acc_s[4 * i + e], a.softmax_scale, column);
            }
    }
}

// Which blocks evaluate the mask_mod per element: all of them, or with a block mask only its
// partially visible blocks (the first w.sparse.n_partial of the tile's visiting order, and with
// wg_skip's grouped lists its last w.n_trailing; `block` is this one's index in it), or with a
// kv range the blocks not inside the full range.
template <class C, class Mods>
__device__ __forceinline__ bool needs_mod_mask(const TileWork& w, FullRange full, int col0,
                                               int block) {
    if constexpr (!Mods::kMaskMod) return false;
    else if constexpr (Mods::kBlockSparse && C::kWgSkip)   // grouped: partial at both ends
        return block < w.sparse.n_partial || block >= w.sparse.n_blocks - w.n_trailing;
    else if constexpr (Mods::kBlockSparse) return block < w.sparse.n_partial;
    else if constexpr (Mods::kKvRange) return col0 < full.lo || col0 + C::kBlockN > full.hi;
    else return true;
}

// Which of this thread's elements of one block the block's query rows see, a bit each (element
// k = 4 i + e of the S accumulators is bit k % 32 of word k / 32; 1: visible): the mask_mod, the
// sequence end and the causal diagonal together. The consumer evaluates it between issuing the
// block's QK^T and waiting for it, so a mask_mod that reads memory (document ids: 34 loads a
// thread per block at N = 128) loads while the tensor cores work, and after the wait the mask
// is one test and select per score (PERF_NOTES §26). `active` false: the block needs no mask_mod
// (mask_scores then applies the built-in masks alone), and `word` is not read; nor is it with
// kv_range.exact, whose bounds stand for the mask_mod.
template <class C>
struct ModBits {
    static constexpr int kWords = (C::kBlockN / 2 + 31) / 32;
    u32 word[kWords];
    bool active;
};

// Whether a block straddles the sequence end or (causal) a row's diagonal of the warpgroup's rows,
// so that the built-in masks hide some of its elements.
template <class C>
__device__ __forceinline__ bool needs_builtin_mask(const FwdArgs<typename C::Elem>& a, int col0,
                                                   int wg_row0) {
    bool need = col0 + C::kBlockN > a.seqlen_k;
    if constexpr (C::kCausal) need |= col0 + C::kBlockN - 1 > wg_row0 + a.seqlen_k - a.seqlen_q;
    return need;
}

// Element (i, e)'s key is past the end if i*8 + (e&1) >= tail, past its row's diagonal if
// diag + i*8 + (e&1) - (e/2)*8 > 0 (tail = seqlen_k - lane_col, diag = lane_col - lane_row -
// (seqlen_k - seqlen_q)).
template <class C>
__device__ __forceinline__ bool builtin_masked(int i, int e, int tail, int diag) {
    bool masked = i * 8 + (e & 1) >= tail;
    if constexpr (C::kCausal) masked |= diag + i * 8 + (e & 1) - (e / 2) * 8 > 0;
    return masked;
}

// The bits of one block, with the built-in masks folded in (kEdge) or not (a block that
// straddles no boundary: one compare per element fewer).
template <bool kEdge, class C, class Mods>
__device__ __forceinline__ void fill_mask_bits(ModBits<C>& bits, const FwdArgs<typename C::Elem>& a,
                                               const Mods& mods, const TileWork& w, int lane_col,
                                               int lane_row) {
    const int tail = a.seqlen_k - lane_col;
    const int diag = lane_col - lane_row - (a.seqlen_k - a.seqlen_q);
    #pragma unroll
    for (int j = 0; j < ModBits<C>::kWords; ++j) bits.word[j] = 0;
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            // `&`, not `&&`: the mask_mod runs on every element (its indices are clamped where it
            // reads memory), so its loads are unconditional and ptxas loads each id once
            // (2 + N/4 loads, not one pair per element).
            bool visible = mods.mask_mod(
                w.batch, w.head, mod_index<Mods>(lane_row + (e / 2) * 8, a.seqlen_q),
                mod_index<Mods>(lane_col + i * 8 + (e & 1), a.seqlen_k), a.seqlen_q, a.seqlen_k);
            if constexpr (kEdge) visible &= !builtin_masked<C>(i, e, tail, diag);
            const int k = 4 * i + e;
            bits.word[k / 32] |= u32(visible) << (k % 32);
        }
}

template <class C, class Mods>
__device__ __forceinline__ ModBits<C> mod_mask_bits(const FwdArgs<typename C::Elem>& a,
                                                    const Mods& mods, const TileWork& w,
                                                    FullRange full, int col0, int wg_row0,
                                                    int lane_row, int block) {
    ModBits<C> bits;
    bits.active = needs_mod_mask<C, Mods>(w, full, col0, block);
    if constexpr (Mods::kMaskMod && !Mods::kExactRange) {
        if (!bits.active) return bits;
        const int lane_col = col0 + 2 * (threadIdx.x % 4);
        if (needs_builtin_mask<C>(a, col0, wg_row0))
            fill_mask_bits<true>(bits, a, mods, w, lane_col, lane_row);
        else
            fill_mask_bits<false>(bits, a, mods, w, lane_col, lane_row);
    }
    return bits;
}

// Keys past seqlen_k, for causal past each row's diagonal (bottom-right aligned: row r sees keys
// <= r + seqlen_k - seqlen_q), and those the mask_mod hides get -inf. Only blocks that straddle a
// boundary pay for the built-in masks, and only blocks outside the full range for the mask_mod
// (needs_mod_mask; its verdicts, with the built-in masks', are `bits`: mod_mask_bits).
template <class C, class Mods>
__device__ __forceinline__ void mask_scores(float (&acc_s)[C::kBlockN / 2],
                                            const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                            const TileWork& w, const ModBits<C>& bits, int col0,
                                            int wg_row0, int lane_row) {
    const bool need_mask = needs_builtin_mask<C>(a, col0, wg_row0);
    if (!need_mask && !bits.active) return;
    const int lane_col = col0 + 2 * (threadIdx.x % 4);
    if constexpr (Mods::kMaskMod && Mods::kExactRange) {
        // kv_range.exact: a row's range is exactly the keys it sees. With the sequence end and
        // the causal diagonal folded into each row's bounds (as offsets from the lane's first
        // key), a score is two compares against immediates, not the mask_mod's expression.
        int lo[2], hi[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = lane_row + 8 * h;
            // A padding row (past seqlen_q, never stored) takes the last row's bounds where the
            // range reads a per-token tensor, which it would else read past its end.
            const int at = Mods::kRangeReadsMemory ? min(row, a.seqlen_q - 1) : row;
            int top = min(mods.kv_hi(at, at, w.batch, w.head, a.seqlen_q, a.seqlen_k), a.seqlen_k);
            if constexpr (C::kCausal) top = min(top, row + a.seqlen_k - a.seqlen_q + 1);
            lo[h] = mods.kv_lo(at, at, w.batch, w.head, a.seqlen_q, a.seqlen_k) - lane_col;
            hi[h] = top - lane_col;
        }
        #pragma unroll
        for (int i = 0; i < C::kBlockN / 8; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = i * 8 + (e & 1);
                if (key < lo[e / 2] || key >= hi[e / 2]) acc_s[4 * i + e] = neg_inf();
            }
        return;
    } else if constexpr (Mods::kMaskMod) {
        if (bits.active) {
            #pragma unroll
            for (int k = 0; k < C::kBlockN / 2; ++k)
                if (!((bits.word[k / 32] >> (k % 32)) & 1u)) acc_s[k] = neg_inf();
            return;
        }
        if (!need_mask) return;
    }
    const int tail = a.seqlen_k - lane_col;
    const int diag = lane_col - lane_row - (a.seqlen_k - a.seqlen_q);
    #pragma unroll
    for (int i = 0; i < C::kBlockN / 8; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            if (builtin_masked<C>(i, e, tail, diag)) acc_s[4 * i + e] = neg_inf();
}

}  // namespace kg
