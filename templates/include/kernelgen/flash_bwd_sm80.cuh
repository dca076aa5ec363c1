// FlashAttention-2 backward on mma.sync tensor cores (sm_80 .. sm_90): dK and dV of one KV tile,
// and the tile's share of dQ added into an fp32 accumulator.
//
// One CTA owns BLOCK_N keys of one (kv head, batch). K_j and V_j are loaded once, dK_j and dV_j
// stay in fp32 registers, and the CTA walks every query head of its GQA group and every query
// tile i that sees these keys, with Q_i, dO_i, LSE_i and D_i coming through a STAGES-deep
// cp.async ring:
//     S^T = K_j Q_i^T,   P^T = exp2(S^T * scale * log2e - LSE_i * log2e)   (LSE is exact: no max)
//     dV_j += P^T dO_i,  dP^T = V_j dO_i^T,  dS^T = P^T * (dP^T - D_i)
//     dK_j += dS^T Q_i,  dQ_i += dS K_j  (red.global.add.f32; skipped when dq_accum is null)
// The scores are computed transposed, keys as rows: a warp then owns whole rows of P^T and dS^T,
// the A operands of the dV and dK products, so those come straight from registers (the C layout
// of two adjacent n8 tiles is the A layout of one k16 step, as P in the forward). Only dS goes
// through shared memory, for dQ = dS K, which all warps share.
//
// Warp w owns KV rows [(w / DSPLIT) * kRowsPerWarp, +kRowsPerWarp). With DSPLIT = 2 two warps
// share those rows: each computes S^T and dP^T for half of the query columns and keeps dK and dV
// for half of head_dim, which halves the accumulators (head_dim 192 and 256 fit in registers);
// P^T and dS^T then pass through shared memory so that both warps see whole rows.
// Shared-memory rows are padded by 16 bytes as in the forward (conflict-free ldmatrix).
//
// With a spec's mods (the Mods struct mods.inc.j2 renders; NoMods without) the scores are those
// of the forward: x = scale * q.k, P = exp(score_mod(x) - LSE), zero where the built-in masks or
// mask_mod hide the pair, and dS = P (dP - D) * score_mod_grad(x) (the chain rule through the
// score_mod; the one through x is the scale that dK and dQ take at the end, as without mods).
// A kv range skips the query tiles whose keys miss this KV tile (evaluated per tile, 32 tiles per
// step, one per lane) and the mask_mod on tiles inside its [full_lo, full_hi); a block mask
// (mods.block_sparse: kernelgen/blockmask.py) lists the query tiles instead, per KV tile.
#pragma once
#include "kernelgen/flash_fwd_sm80.cuh"  // TileLoader
#include "kernelgen/warp_mma.cuh"

namespace kg {

template <class Elem>
struct BwdArgs {
    const Elem* q; const Elem* k; const Elem* v; const Elem* dout;
    const float* lse;   // (batch, heads, seqlen_q), natural log, from the forward
    const float* dsum;  // (batch, heads, seqlen_q), D = rowsum(dO * O)
    float* dq_accum;    // (batch, seqlen_q, heads, head_dim) fp32, or null: no dQ
    Elem* dk; Elem* dv;
    i64 q_stride_b, q_stride_s, q_stride_h;
    i64 k_stride_b, k_stride_s, k_stride_h;
    i64 v_stride_b, v_stride_s, v_stride_h;
    i64 do_stride_b, do_stride_s, do_stride_h;
    i64 dk_stride_b, dk_stride_s, dk_stride_h;
    i64 dv_stride_b, dv_stride_s, dv_stride_h;
    int batch, heads, heads_k, seqlen_q, seqlen_k;
    float softmax_scale;
};

// Warps along the query rows of dQ = dS K: 32-row warp tiles where that leaves each warp 16 or 32
// head-dim columns (at most 32 accumulators), else 16 rows. Squarer warp tiles read fewer
// shared-memory bytes per mma (32x32 reads 16 KB per 64 mma where 16x64 reads 20 KB at BLOCK_N 128).
constexpr int dq_warps_m(int warps, int block_m, int head_dim) {
    const int m32 = block_m / 32, cols = m32 >= 1 ? head_dim * m32 / warps : 0;
    if (m32 >= 1 && m32 <= warps && warps % m32 == 0 && (cols == 16 || cols == 32)) return m32;
    return warps < block_m / 16 ? warps : block_m / 16;
}
// Columns of dQ one warp accumulates at a time: at most 64 (32 registers per 16 rows).
constexpr int dq_chunk(int cols) { return cols <= 64 ? cols : cols % 64 == 0 ? 64 : 48; }

// GRID_ORDER 0: grid (n_blocks, heads_k, batch), the KV tiles of one head side by side (its Q, dO
// and dQ accumulator stay in L2 for them). 1: grid (heads_k, batch, n_blocks), every head's tile
// of one KV block together; causal (bottom-right) gives the first KV tiles the most query rows,
// so that is longest-first over the whole grid, and the short tiles fill the last wave.
template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int DSPLIT, int STAGES,
          bool CAUSAL, int GRID_ORDER = 0>
struct BwdConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kWarps = WARPS, kThreads = WARPS * 32, kStages = STAGES, kDSplit = DSPLIT;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kGridOrder = GRID_ORDER;
    static constexpr int kRowsPerWarp = BLOCK_N * DSPLIT / WARPS;  // KV rows
    static constexpr int kMTiles = kRowsPerWarp / 16;
    static constexpr int kSliceM = BLOCK_M / DSPLIT, kSTiles = kSliceM / 8;     // query columns
    static constexpr int kSliceD = HEAD_DIM / DSPLIT, kDTiles = kSliceD / 8;   // dK/dV columns
    // dQ = dS K: the BLOCK_M x HEAD_DIM product tiled over the warps, kDqWarpsM along the rows.
    static constexpr int kDqWarpsM = dq_warps_m(WARPS, BLOCK_M, HEAD_DIM);
    static constexpr int kDqWarpsD = WARPS / kDqWarpsM;
    static constexpr int kDqRows = BLOCK_M / kDqWarpsM, kDqMTiles = kDqRows / 16;
    static constexpr int kDqCols = HEAD_DIM / kDqWarpsD, kDqChunk = dq_chunk(kDqCols);

    static constexpr int kPitch = HEAD_DIM + 8;   // Q, K, V, dO rows (elements)
    static constexpr int kPitchS = BLOCK_M + 8;   // P^T, dS^T rows
    static constexpr int kTileQ = BLOCK_M * kPitch, kTileKV = BLOCK_N * kPitch;
    static constexpr int kTileS = BLOCK_N * kPitchS;
    // Byte offsets: K, V, STAGES x Q, STAGES x dO, dS^T, P^T (DSPLIT > 1), STAGES x LSE, STAGES x D.
    static constexpr int kOffV = kTileKV * 2, kOffQ = 2 * kTileKV * 2;
    static constexpr int kOffDo = kOffQ + STAGES * kTileQ * 2;
    static constexpr int kOffDs = kOffDo + STAGES * kTileQ * 2;
    static constexpr int kOffP = kOffDs + kTileS * 2;
    static constexpr int kOffStats = kOffP + (DSPLIT > 1 ? kTileS * 2 : 0);
    static constexpr int kSmemBytes = kOffStats + 2 * STAGES * BLOCK_M * 4;

    static_assert(DSPLIT == 1 || DSPLIT == 2, "rows are shared by at most two warps");
    static_assert(BLOCK_N * DSPLIT % WARPS == 0 && kRowsPerWarp % 16 == 0, "whole m16 tiles of keys");
    static_assert(BLOCK_M % 16 == 0 && kSliceM % 8 == 0, "k16 steps over queries, n8 tiles of S^T");
    static_assert(HEAD_DIM % 16 == 0 && kSliceD % 16 == 0, "k16 steps and n8 pairs over head_dim");
    static_assert(WARPS % kDqWarpsM == 0 && BLOCK_M / 16 % kDqWarpsM == 0 &&
                  kDqCols % 16 == 0 && kDqCols % kDqChunk == 0, "dQ tiles the warps evenly");
    static_assert(STAGES >= 2, "a ring of one stage cannot overlap loads with math");
    static_assert(GRID_ORDER == 0 || GRID_ORDER == 1, "two grid orders");
};

// f(mt, nt, e, key, query) for each element (mt, nt, e) of a lane's MT x NT n8 tiles of scores:
// it sits mt*16 + (e/2)*8 rows and nt*8 + (e&1) columns from the lane's first element, and
// KEYS_ARE_ROWS says which of the two offsets is the key's and which the query's.
template <bool KEYS_ARE_ROWS, int MT, int NT, class F>
__device__ __forceinline__ void for_each_pair(F&& f) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = mt * 16 + (e / 2) * 8, col = nt * 8 + (e & 1);
                f(mt, nt, e, KEYS_ARE_ROWS ? row : col, KEYS_ARE_ROWS ? col : row);
            }
}

// P = 0 for masked (key, query) pairs: keys at or past seqlen_k and, for causal, keys past the
// query's diagonal. `tail` is the key offset of seqlen_k, `diag` is key - query - (seqlen_k -
// seqlen_q) at offset 0. Both tests compare against one per-lane number, so the unrolled
// compares take immediates.
template <bool KEYS_ARE_ROWS, bool CAUSAL, int MT, int NT>
__device__ __forceinline__ void mask_probs(float (&p)[MT][NT][4], int tail, int diag) {
    for_each_pair<KEYS_ARE_ROWS, MT, NT>([&](int mt, int nt, int e, int key, int query) {
        bool masked = key >= tail;
        if constexpr (CAUSAL) masked |= diag + key - query > 0;
        if (masked) p[mt][nt][e] = 0.f;
    });
}

// ---- attention modifiers ------------------------------------------------------------------------
// What a pair's mods need besides its head and indices.
struct ModSite {
    int batch, seqlen_q, seqlen_k;
    float scale;
};

// P and dS of one (query, key) pair, from the raw score acc = q.k, dP - D and lse2 = LSE * log2e,
// as the forward computes P (flash_fwd_sm80.cuh): the score_mod sees the scaled score, the
// softmax then runs on the modified one. Indices are clamped so that a mod reading per-token
// tensors stays in bounds on padding rows and columns (those are masked or never stored).
template <class Mods>
__device__ __forceinline__ float2 mod_prob_grad(const Mods& mods, const ModSite& at, int head,
                                                int query, int key, float acc, float dp_minus_d,
                                                float lse2) {
    const int q_idx = min(query, at.seqlen_q - 1), kv_idx = min(key, at.seqlen_k - 1);
    if constexpr (Mods::kScoreMod) {
        const float p = exp2_approx(fmaf(mods.score_mod(acc, at.scale, at.batch, head, q_idx,
                                                        kv_idx, at.seqlen_q, at.seqlen_k),
                                         kLog2e, -lse2));
        return {p, p * dp_minus_d * mods.score_mod_grad(acc, at.scale, at.batch, head, q_idx,
                                                        kv_idx, at.seqlen_q, at.seqlen_k)};
    } else {
        const float p = exp2_approx(fmaf(acc, at.scale * kLog2e, -lse2));
        return {p, p * dp_minus_d};
    }
}

template <class Mods>
__device__ __forceinline__ bool mod_hides(const Mods& mods, const ModSite& at, int head, int query,
                                          int key) {
    return !mods.mask_mod(at.batch, head, min(query, at.seqlen_q - 1), min(key, at.seqlen_k - 1),
                          at.seqlen_q, at.seqlen_k);
}

// P = 0 where the mask_mod hides the pair (elements as in for_each_pair); the lane's first
// element is at (query, key) = (q0, k0).
template <bool KEYS_ARE_ROWS, class Mods, int MT, int NT>
__device__ __forceinline__ void mod_mask_probs(float (&p)[MT][NT][4], const Mods& mods,
                                               const ModSite& at, int head, int q0, int k0) {
    for_each_pair<KEYS_ARE_ROWS, MT, NT>([&](int mt, int nt, int e, int key, int query) {
        if (mod_hides(mods, at, head, q0 + query, k0 + key)) p[mt][nt][e] = 0.f;
    });
}

// P and dS in place of S (the raw scores) and dP with a score_mod: each pair as mod_prob_grad
// says, zero where a mask hides it (`masked`: the built-in masks; the mask_mod where
// need_mod_mask). lse2_d(mt, nt, e) gives that element's (LSE * log2e, D); the lane's first
// element is at (query, key) = (q0, k0).
template <bool KEYS_ARE_ROWS, class Mods, int MT, int NT, class Masked, class Stats>
__device__ __forceinline__ void mod_probs_grads(float (&s)[MT][NT][4], float (&dp)[MT][NT][4],
                                                const Mods& mods, const ModSite& at, int head,
                                                int q0, int k0, bool need_mod_mask,
                                                const Masked& masked, const Stats& lse2_d) {
    for_each_pair<KEYS_ARE_ROWS, MT, NT>([&](int mt, int nt, int e, int key, int query) {
        bool hidden = masked(key, query);
        if constexpr (Mods::kMaskMod)
            hidden |= need_mod_mask && mod_hides(mods, at, head, q0 + query, k0 + key);
        const float2 stats = lse2_d(mt, nt, e);
        const float2 pd = mod_prob_grad(mods, at, head, q0 + query, k0 + key, s[mt][nt][e],
                                        dp[mt][nt][e] - stats.y, stats.x);
        s[mt][nt][e] = hidden ? 0.f : pd.x;
        dp[mt][nt][e] = hidden ? 0.f : pd.y;
    });
}

// Whether the mask_mod must be evaluated per element on the keys [kv0, kv0 + BLOCK_N) of the
// query rows q_first..q_last: always, unless the kv range says all of them are visible.
template <int BLOCK_N, class Mods>
__device__ __forceinline__ bool mod_mask_needed(const Mods& mods, int kv0, int q_first, int q_last,
                                                int batch, int head, int seqlen_q, int seqlen_k) {
    if constexpr (Mods::kMaskMod && Mods::kKvRange)
        return kv0 < mods.full_lo(q_first, q_last, batch, head, seqlen_q, seqlen_k) ||
               kv0 + BLOCK_N > mods.full_hi(q_first, q_last, batch, head, seqlen_q, seqlen_k);
    return Mods::kMaskMod;
}

// The first index in [from, count) for which seen(index) holds, else count: each step tries 32
// indices, one per lane, and takes the least with a warp min (uniform over the warp), so a long
// run of skipped tiles costs little.
template <class Seen>
__device__ __forceinline__ int first_seen(int from, int count, int lane, const Seen& seen) {
    for (int base = from; base < count; base += 32) {
        const int index = base + lane;
        int found = index < count && seen(index) ? index : count;
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            found = min(found, __shfl_xor_sync(0xffffffffu, found, offset));
        if (found < count) return found;
    }
    return count;
}

// How many indices in [0, count) satisfy seen (a warp sum per 32 indices).
template <class Seen>
__device__ __forceinline__ int count_seen(int count, int lane, const Seen& seen) {
    int total = 0;
    for (int base = 0; base < count; base += 32) {
        const int index = base + lane;
        int hits = index < count && seen(index) ? 1 : 0;
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            hits += __shfl_xor_sync(0xffffffffu, hits, offset);
        total += hits;
    }
    return total;
}

// dQ[m0 + rows, :] += scale * dS K for the query tile at m0: dS^T is in shared memory as [key][query]
// (read transposed: the A operand), K as [key][d].
template <class C>
__device__ __forceinline__ void add_dq_tile(const BwdArgs<typename C::Elem>& a, u32 s_ds, u32 s_k,
                                            int m0, int head, int batch, int warp, int lane) {
    using Elem = typename C::Elem;
    const int row0 = (warp / C::kDqWarpsD) * C::kDqRows, col0 = (warp % C::kDqWarpsD) * C::kDqCols;
    const u32 a_lane = s_ds + lane_offset_rows_b<C::kPitchS>(lane) + row0 * 2;
    const i64 row_stride = i64(a.heads) * C::kHeadDim;
    const int lane_row = m0 + row0 + lane / 4;
    float* dq = a.dq_accum + (i64(batch) * a.seqlen_q + lane_row) * row_stride +
                head * C::kHeadDim + col0 + 2 * (lane % 4);
    #pragma unroll
    for (int chunk = 0; chunk < C::kDqCols / C::kDqChunk; ++chunk) {
        constexpr int kTiles = C::kDqChunk / 8;
        float acc[C::kDqMTiles][kTiles][4] = {};
        #pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
            u32 dsa[C::kDqMTiles][4];
            #pragma unroll
            for (int mt = 0; mt < C::kDqMTiles; ++mt)
                ldmatrix_x4_trans(dsa[mt], a_lane + (kk * 16 * C::kPitchS + mt * 16) * 2);
            warp_mma_step_kn<Elem, C::kDqMTiles, kTiles, C::kPitch>(
                acc, dsa, s_k + (kk * 16 * C::kPitch + col0 + chunk * C::kDqChunk) * 2, lane);
        }
        #pragma unroll
        for (int mt = 0; mt < C::kDqMTiles; ++mt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (lane_row + mt * 16 + 8 * h >= a.seqlen_q) continue;
                float* row = dq + (mt * 16 + 8 * h) * row_stride + chunk * C::kDqChunk;
                #pragma unroll
                for (int nt = 0; nt < kTiles; ++nt)
                    red_add_f32x2(row + nt * 8, acc[mt][nt][2 * h] * a.softmax_scale,
                                  acc[mt][nt][2 * h + 1] * a.softmax_scale);
            }
    }
}

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_bwd_sm80(const BwdArgs<typename C::Elem>& a,
                                               const Mods& mods = Mods{}) {
    using Elem = typename C::Elem;
    extern __shared__ __align__(128) unsigned char smem[];

    const int n_block = C::kGridOrder == 0 ? blockIdx.x : blockIdx.z;
    const int kv_head = C::kGridOrder == 0 ? blockIdx.y : blockIdx.x;
    const int batch = C::kGridOrder == 0 ? blockIdx.z : blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = a.heads / a.heads_k;
    const int kv0 = n_block * C::kBlockN;
    const int shift = a.seqlen_k - a.seqlen_q;  // causal: query i sees keys <= i + shift

    // Query tiles that see at least one of these keys: all, or for causal those from the tile of
    // query kv0 - shift on (the last query sees every key, so there is at least one).
    const int m_tiles = cdiv(a.seqlen_q, C::kBlockM);
    int m_first = 0;
    if constexpr (C::kCausal) m_first = min(max(kv0 - shift, 0) / C::kBlockM, m_tiles);
    const int per_head = m_tiles - m_first;
    // (query head, query tile) pairs, head-major. With a kv range only the pairs whose keys meet
    // this KV tile are visited: `n_iter` counts them, and load_at / math_at walk them. A block
    // mask lists them instead (causal folded in): pair p is the p-th entry of the group's heads'
    // lists for this KV tile, each head's partially visible query tiles first. The lists stay in
    // global memory (L1) and are re-read per use: this loop has no registers to spare.
    constexpr bool kSkipPairs = Mods::kKvRange && !Mods::kBlockSparse;
    struct ListedPair { int head, m_block; bool partial; };
    auto listed_pair = [&](int pair) {
        for (int g = 0;; ++g) {
            const SparseRow row = mods.sparse_row(batch, kv_head * group + g, n_block);
            if (pair < row.n_blocks || g == group - 1)
                return ListedPair{kv_head * group + g, row.block(pair), pair < row.n_partial};
            pair -= row.n_blocks;
        }
    };
    auto pair_head = [&](int pair) {
        if constexpr (Mods::kBlockSparse) return listed_pair(pair).head;
        else return kv_head * group + pair / per_head;
    };
    auto pair_m0 = [&](int pair) {
        if constexpr (Mods::kBlockSparse) return listed_pair(pair).m_block * C::kBlockM;
        else return (m_first + pair % per_head) * C::kBlockM;
    };
    auto pair_seen = [&](int pair) {
        const int head = pair_head(pair), m0 = pair_m0(pair);
        const int q_last = min(m0 + C::kBlockM, a.seqlen_q) - 1;
        const int lo = max(0, mods.kv_lo(m0, q_last, batch, head, a.seqlen_q, a.seqlen_k));
        int hi = min(a.seqlen_k, mods.kv_hi(m0, q_last, batch, head, a.seqlen_q, a.seqlen_k));
        if constexpr (C::kCausal) hi = min(hi, q_last + shift + 1);
        return lo < hi && kv0 < hi && lo < kv0 + C::kBlockN;
    };
    const int n_pairs = per_head * group;
    const int n_iter = [&] {
        if constexpr (Mods::kBlockSparse) {
            int listed = 0;
            for (int g = 0; g < group; ++g)
                listed += mods.sparse_row(batch, kv_head * group + g, n_block).n_blocks;
            return listed;
        } else if constexpr (kSkipPairs) {
            return count_seen(n_pairs, lane, pair_seen);
        } else {
            return n_pairs;
        }
    }();
    auto next_pair = [&](int from) {
        if constexpr (kSkipPairs) return first_seen(from, n_pairs, lane, pair_seen);
        else return from;
    };
    int load_at = next_pair(0), math_at = load_at;

    const u32 s_k = smem_addr(smem), s_v = s_k + C::kOffV, s_q = s_k + C::kOffQ;
    const u32 s_do = s_k + C::kOffDo, s_ds = s_k + C::kOffDs, s_p = s_k + C::kOffP;
    const u32 s_stats = s_k + C::kOffStats;
    const float* stats = reinterpret_cast<const float*>(smem + C::kOffStats);

    const TileLoader<C> loader(tid);
    auto load_query_tile = [&](int it, int pair) {  // iteration `it` (the slot) loads `pair`
        const int slot = it % C::kStages, head = pair_head(pair);
        const int m0 = pair_m0(pair), rows = a.seqlen_q - m0;
        loader.template load<C::kBlockM>(
            s_q + slot * C::kTileQ * 2,
            a.q + batch * a.q_stride_b + head * a.q_stride_h + m0 * a.q_stride_s, a.q_stride_s, rows);
        loader.template load<C::kBlockM>(
            s_do + slot * C::kTileQ * 2,
            a.dout + batch * a.do_stride_b + head * a.do_stride_h + m0 * a.do_stride_s,
            a.do_stride_s, rows);
        // LSE and D: one float per thread (rows past seqlen_q read as 0, see the P below).
        const i64 stat_row = (i64(batch) * a.heads + head) * a.seqlen_q + m0;
        #pragma unroll
        for (int j = 0; j < cdiv(2 * C::kBlockM, C::kThreads); ++j) {
            const int i = tid + j * C::kThreads, which = i / C::kBlockM, r = i % C::kBlockM;
            if (2 * C::kBlockM % C::kThreads == 0 || i < 2 * C::kBlockM) {
                const float* src = (which ? a.dsum : a.lse) + stat_row + r;
                cp_async_4(s_stats + ((which * C::kStages + slot) * C::kBlockM + r) * 4,
                           r < rows ? src : a.lse, r < rows);
            }
        }
    };

    // Prologue: K and V with the first query tile in one group, then STAGES-2 more groups.
    const Elem* k = a.k + batch * a.k_stride_b + kv_head * a.k_stride_h + kv0 * a.k_stride_s;
    const Elem* v = a.v + batch * a.v_stride_b + kv_head * a.v_stride_h + kv0 * a.v_stride_s;
    loader.template load<C::kBlockN>(s_k, k, a.k_stride_s, a.seqlen_k - kv0);
    loader.template load<C::kBlockN>(s_v, v, a.v_stride_s, a.seqlen_k - kv0);
    #pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < n_iter) {
            load_query_tile(s, kSkipPairs ? load_at : s);
            if constexpr (kSkipPairs) load_at = next_pair(load_at + 1);
        }
        cp_async_commit();  // empty groups keep the wait_group arithmetic uniform
    }

    const int warp_row = (warp / C::kDSplit) * C::kRowsPerWarp;  // first KV row (in the tile)
    const int warp_col = (warp % C::kDSplit) * C::kSliceM;       // first query column of S^T
    const int warp_dcol = (warp % C::kDSplit) * C::kSliceD;      // first head-dim column of dK/dV
    // Element (mt, nt, e) of S^T: key kv0 + lane_key + mt*16 + (e/2)*8,
    // query m0 + lane_col + nt*8 + (e&1).
    const int lane_key = warp_row + lane / 4, lane_col = warp_col + 2 * (lane % 4);
    const float scale_log2 = a.softmax_scale * kLog2e;
    const bool need_dq = a.dq_accum != nullptr;

    float acc_dk[C::kMTiles][C::kDTiles][4] = {}, acc_dv[C::kMTiles][C::kDTiles][4] = {};

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile `it` visible to all warps; the slot of it-1 is free again
        if (it + C::kStages - 1 < n_iter) {
            load_query_tile(it + C::kStages - 1, kSkipPairs ? load_at : it + C::kStages - 1);
            if constexpr (kSkipPairs) load_at = next_pair(load_at + 1);
        }
        cp_async_commit();

        const int pair = kSkipPairs ? math_at : it;
        if constexpr (kSkipPairs) math_at = next_pair(math_at + 1);
        const int slot = it % C::kStages, head = pair_head(pair);
        const int m0 = pair_m0(pair);
        // Whether the mask_mod is evaluated per element here: in the block mask's partially
        // visible tiles, else unless the kv range vouches for the whole tile.
        const auto mod_mask_here = [&] {
            if constexpr (Mods::kBlockSparse) return listed_pair(pair).partial;
            else return mod_mask_needed<C::kBlockN>(mods, kv0, m0, min(m0 + C::kBlockM, a.seqlen_q) - 1,
                                                    batch, head, a.seqlen_q, a.seqlen_k);
        };
        const u32 q_tile = s_q + slot * C::kTileQ * 2, do_tile = s_do + slot * C::kTileQ * 2;
        const float* lse = stats + slot * C::kBlockM;
        const float* dsum = stats + (C::kStages + slot) * C::kBlockM;

        // S^T = K Q^T, then P^T in place. Query rows past seqlen_q are zero in Q, dO, LSE and D:
        // their P is 1 but meets zero dO and Q rows, and their dS is 1 * (0 - 0).
        float acc_s[C::kMTiles][C::kSTiles][4] = {};
        warp_mma_rows<Elem, C::kMTiles, C::kSTiles, C::kHeadDim / 16, C::kPitch>(
            acc_s, s_k + warp_row * C::kPitch * 2, q_tile + warp_col * C::kPitch * 2, lane);
        // P in place, as without mods; with a score_mod, P and dS come from the raw scores after
        // dP instead (one pass with every mask), since dS needs score_mod_grad of the raw score.
        if constexpr (!Mods::kScoreMod) {
            #pragma unroll
            for (int nt = 0; nt < C::kSTiles; ++nt) {
                const float2 l = *reinterpret_cast<const float2*>(lse + lane_col + nt * 8);
                #pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc_s[mt][nt][e] = exp2_approx(
                            fmaf(acc_s[mt][nt][e], scale_log2, -(e & 1 ? l.y : l.x) * kLog2e));
            }
        }
        // Keys past seqlen_k and, for causal, keys past a query's diagonal get P = 0. That also
        // covers rows that see no key at all (LSE = -inf, P = inf before this): they only occur
        // in tiles that straddle the diagonal. Only those tiles pay (a CTA-uniform branch).
        bool need_mask = kv0 + C::kBlockN > a.seqlen_k;
        if constexpr (C::kCausal) need_mask |= kv0 + C::kBlockN - 1 > m0 + shift;
        if constexpr (!Mods::kScoreMod) {
            if (need_mask)
                mask_probs</*KEYS_ARE_ROWS=*/true, C::kCausal>(
                    acc_s, a.seqlen_k - kv0 - lane_key, kv0 + lane_key - (m0 + lane_col) - shift);
            if constexpr (Mods::kMaskMod) {
                if (mod_mask_here())
                    mod_mask_probs</*KEYS_ARE_ROWS=*/true>(
                        acc_s, mods, ModSite{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale}, head,
                        m0 + lane_col, kv0 + lane_key);
            }
        }

        // dP^T = V dO^T, then P^T and dS^T = P^T (dP^T - D) packed to 16 bits.
        float acc_dp[C::kMTiles][C::kSTiles][4] = {};
        warp_mma_rows<Elem, C::kMTiles, C::kSTiles, C::kHeadDim / 16, C::kPitch>(
            acc_dp, s_v + warp_row * C::kPitch * 2, do_tile + warp_col * C::kPitch * 2, lane);
        u32 p16[C::kMTiles][C::kSTiles][2], ds16[C::kMTiles][C::kSTiles][2];
        if constexpr (Mods::kScoreMod) {
            // P and dS from the raw scores, every mask in one pass (the mask_mod only where the
            // kv range does not vouch for the whole tile).
            const int tail = a.seqlen_k - kv0 - lane_key;
            const int diag = kv0 + lane_key - (m0 + lane_col) - shift;
            mod_probs_grads</*KEYS_ARE_ROWS=*/true>(
                acc_s, acc_dp, mods, ModSite{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale}, head,
                m0 + lane_col, kv0 + lane_key,
                mod_mask_here(),
                [&](int key, int query) {
                    return need_mask && (key >= tail || (C::kCausal && diag + key - query > 0));
                },
                [&](int, int nt, int e) {
                    const int query = lane_col + nt * 8 + (e & 1);
                    return float2{lse[query] * kLog2e, dsum[query]};
                });
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        p16[mt][nt][h] = pack2<Elem>(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]);
                        ds16[mt][nt][h] = pack2<Elem>(acc_dp[mt][nt][2 * h], acc_dp[mt][nt][2 * h + 1]);
                    }
        } else {
            #pragma unroll
            for (int nt = 0; nt < C::kSTiles; ++nt) {
                const float2 d = *reinterpret_cast<const float2*>(dsum + lane_col + nt * 8);
                #pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float* p = acc_s[mt][nt] + 2 * h;
                        const float* dp = acc_dp[mt][nt] + 2 * h;
                        p16[mt][nt][h] = pack2<Elem>(p[0], p[1]);
                        ds16[mt][nt][h] = pack2<Elem>(p[0] * (dp[0] - d.x), p[1] * (dp[1] - d.y));
                    }
            }
        }

        // dS^T (for dQ, and for the partner warp with DSPLIT = 2) and P^T to shared memory.
        if (C::kDSplit > 1 || need_dq) {
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int offset = ((lane_key + mt * 16 + 8 * h) * C::kPitchS + lane_col + nt * 8) * 2;
                        *reinterpret_cast<u32*>(smem + C::kOffDs + offset) = ds16[mt][nt][h];
                        if constexpr (C::kDSplit > 1)
                            *reinterpret_cast<u32*>(smem + C::kOffP + offset) = p16[mt][nt][h];
                    }
        }
        if constexpr (C::kDSplit > 1) __syncthreads();  // both halves of every row are written

        // dV += P^T dO and dK += dS^T Q, k16 steps over the tile's queries.
        #pragma unroll
        for (int kk = 0; kk < C::kBlockM / 16; ++kk) {
            u32 pa[C::kMTiles][4], dsa[C::kMTiles][4];
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt) {
                if constexpr (C::kDSplit == 1) {
                    pa[mt][0] = p16[mt][2 * kk][0];      pa[mt][1] = p16[mt][2 * kk][1];
                    pa[mt][2] = p16[mt][2 * kk + 1][0];  pa[mt][3] = p16[mt][2 * kk + 1][1];
                    dsa[mt][0] = ds16[mt][2 * kk][0];    dsa[mt][1] = ds16[mt][2 * kk][1];
                    dsa[mt][2] = ds16[mt][2 * kk + 1][0]; dsa[mt][3] = ds16[mt][2 * kk + 1][1];
                } else {
                    const u32 offset = lane_offset_rows_a<C::kPitchS>(lane) +
                                       ((warp_row + mt * 16) * C::kPitchS + kk * 16) * 2;
                    ldmatrix_x4(pa[mt], s_p + offset);
                    ldmatrix_x4(dsa[mt], s_ds + offset);
                }
            }
            const u32 row = (kk * 16 * C::kPitch + warp_dcol) * 2;
            warp_mma_step_kn<Elem, C::kMTiles, C::kDTiles, C::kPitch>(acc_dv, pa, do_tile + row, lane);
            warp_mma_step_kn<Elem, C::kMTiles, C::kDTiles, C::kPitch>(acc_dk, dsa, q_tile + row, lane);
        }

        if (need_dq) {
            if constexpr (C::kDSplit == 1) __syncthreads();  // every warp's dS^T is written
            add_dq_tile<C>(a, s_ds, s_k, m0, head, batch, warp, lane);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K and V: their tiles now stage dK and dV

    // dK * scale and dV to 16 bits in this warp's rows and columns of the K and V tiles, then
    // 16-byte coalesced stores (with DSPLIT = 2 a row's halves come from two warps).
    #pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt)
        #pragma unroll
        for (int dt = 0; dt < C::kDTiles; ++dt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = lane_key + mt * 16 + 8 * h, c = warp_dcol + dt * 8 + 2 * (lane % 4);
                const float* dk = acc_dk[mt][dt] + 2 * h;
                const float* dv = acc_dv[mt][dt] + 2 * h;
                *reinterpret_cast<u32*>(smem + (r * C::kPitch + c) * 2) =
                    pack2<Elem>(dk[0] * a.softmax_scale, dk[1] * a.softmax_scale);
                *reinterpret_cast<u32*>(smem + C::kOffV + (r * C::kPitch + c) * 2) =
                    pack2<Elem>(dv[0], dv[1]);
            }
    __syncthreads();
    const int kv_rows = min(a.seqlen_k - kv0, C::kBlockN);
    Elem* dk = a.dk + batch * a.dk_stride_b + kv_head * a.dk_stride_h + kv0 * a.dk_stride_s;
    Elem* dv = a.dv + batch * a.dv_stride_b + kv_head * a.dv_stride_h + kv0 * a.dv_stride_s;
    constexpr int kChunksPerRow = C::kHeadDim / 8;
    for (int i = tid; i < C::kBlockN * kChunksPerRow; i += C::kThreads) {
        const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
        if (r < kv_rows) {
            *reinterpret_cast<uint4*>(dk + r * a.dk_stride_s + c) =
                *reinterpret_cast<const uint4*>(smem + (r * C::kPitch + c) * 2);
            *reinterpret_cast<uint4*>(dv + r * a.dv_stride_s + c) =
                *reinterpret_cast<const uint4*>(smem + C::kOffV + (r * C::kPitch + c) * 2);
        }
    }
}

}  // namespace kg
