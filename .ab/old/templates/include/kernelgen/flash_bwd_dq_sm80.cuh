// FlashAttention-2 backward, dQ alone, on mma.sync tensor cores (sm_80 .. sm_90): deterministic
// by construction (no atomics: each dQ element is summed by one thread in a fixed order).
//
// One CTA owns BLOCK_M query rows of one (head, batch), laid out like the forward: each warp owns
// whole query rows, Q_i and dO_i are loaded once, dQ_i stays in fp32 registers, and the KV tiles
// the rows can see stream through a STAGES-deep cp.async ring:
//     S = Q_i K_j^T,  P = exp2(S * scale * log2e - LSE * log2e),  dP = dO_i V_j^T,
//     dS = P * (dP - D),  dQ_i += dS K_j    (dS from registers: the C layout is the A layout)
// It recomputes S and dP that the main kernel (flash_bwd_sm80.cuh, run without dq_accum) also
// computes: two extra GEMMs per tile pair, the price of determinism. A spec's mods apply as in
// the main kernel (see there), and its kv range (or block mask) picks the KV tiles as in the
// forward.
#pragma once
#include "kernelgen/flash_bwd_sm80.cuh"  // TileLoader, mask_probs, the mods helpers

namespace kg {

template <class Elem>
struct BwdDqArgs {
    const Elem* q; const Elem* k; const Elem* v; const Elem* dout;
    const float* lse;   // (batch, heads, seqlen_q)
    const float* dsum;  // (batch, heads, seqlen_q), D = rowsum(dO * O)
    Elem* dq;
    i64 q_stride_b, q_stride_s, q_stride_h;
    i64 k_stride_b, k_stride_s, k_stride_h;
    i64 v_stride_b, v_stride_s, v_stride_h;
    i64 do_stride_b, do_stride_s, do_stride_h;
    i64 dq_stride_b, dq_stride_s, dq_stride_h;
    int batch, heads, heads_k, seqlen_q, seqlen_k;
    float softmax_scale;
};

template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL>
struct BwdDqConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kWarps = WARPS, kThreads = WARPS * 32, kStages = STAGES;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kRowsPerWarp = BLOCK_M / WARPS, kMTiles = kRowsPerWarp / 16;
    static constexpr int kSTiles = BLOCK_N / 8, kDTiles = HEAD_DIM / 8;
    static constexpr int kPitch = HEAD_DIM + 8;
    static constexpr int kTileQ = BLOCK_M * kPitch, kTileKV = BLOCK_N * kPitch;
    // Q, dO, then STAGES x K and STAGES x V.
    static constexpr int kSmemBytes = (2 * kTileQ + 2 * STAGES * kTileKV) * 2;

    static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "k16 steps over keys and head dim");
    static_assert(STAGES >= 2, "a ring of one stage cannot overlap loads with math");
};

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_bwd_dq_sm80(const BwdDqArgs<typename C::Elem>& a,
                                                  const Mods& mods = Mods{}) {
    using Elem = typename C::Elem;
    extern __shared__ __align__(128) unsigned char smem[];

    // Causal: the last query tiles see the most keys; they go first (the forward's order).
    const int m_block = C::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int kv_head = head / (a.heads / a.heads_k);
    const int row0 = m_block * C::kBlockM;
    const int shift = a.seqlen_k - a.seqlen_q;  // causal: query i sees keys <= i + shift

    const Elem* k = a.k + batch * a.k_stride_b + kv_head * a.k_stride_h;
    const Elem* v = a.v + batch * a.v_stride_b + kv_head * a.v_stride_h;
    Elem* dq = a.dq + batch * a.dq_stride_b + head * a.dq_stride_h + row0 * a.dq_stride_s;

    const int q_rows = min(a.seqlen_q - row0, C::kBlockM);
    // KV tiles [n_first, n_first + n_blocks), as in the forward (kv_blocks).
    const KvBlocks blocks = kv_blocks<C::kBlockN, C::kCausal>(mods, row0, q_rows, batch, head,
                                                              a.seqlen_q, a.seqlen_k);
    const int n_first = blocks.n_first;
    int n_blocks = blocks.n_blocks;
    // A block mask lists the tiles instead, as in the forward: iteration nb visits kv_tile(nb).
    SparseRow sparse{nullptr, nullptr, 0, 0};
    if constexpr (Mods::kBlockSparse) {
        sparse = mods.sparse_row(batch, head, m_block);
        n_blocks = sparse.n_blocks;
    }
    const auto kv_tile = [&](int i) {
        if constexpr (Mods::kBlockSparse) return sparse.block(i);
        else return n_first + i;
    };
    if (n_blocks == 0) {  // no row of the tile sees a key: dQ = 0
        for (int i = tid; i < q_rows * C::kHeadDim; i += C::kThreads)
            dq[(i / C::kHeadDim) * a.dq_stride_s + i % C::kHeadDim] = Elem{0};
        return;
    }

    const u32 s_q = smem_addr(smem), s_do = s_q + C::kTileQ * 2;
    const u32 s_k = s_do + C::kTileQ * 2, s_v = s_k + C::kStages * C::kTileKV * 2;

    const TileLoader<C> loader(tid);
    loader.template load<C::kBlockM>(
        s_q, a.q + batch * a.q_stride_b + head * a.q_stride_h + row0 * a.q_stride_s, a.q_stride_s, q_rows);
    loader.template load<C::kBlockM>(
        s_do, a.dout + batch * a.do_stride_b + head * a.do_stride_h + row0 * a.do_stride_s,
        a.do_stride_s, q_rows);
    #pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < n_blocks) {
            const int tile = kv_tile(s), rows = a.seqlen_k - tile * C::kBlockN;
            loader.template load<C::kBlockN>(s_k + s * C::kTileKV * 2,
                                             k + tile * C::kBlockN * a.k_stride_s, a.k_stride_s, rows);
            loader.template load<C::kBlockN>(s_v + s * C::kTileKV * 2,
                                             v + tile * C::kBlockN * a.v_stride_s, a.v_stride_s, rows);
        }
        cp_async_commit();
    }

    // Rows of this lane: row0 + lane_row + mt*16 + 8h (tile-relative lane_row). Rows past
    // seqlen_q take LSE = D = 0; Q and dO are zero there, so nothing but finite values flows.
    const int warp_row = warp * C::kRowsPerWarp, lane_row = warp_row + lane / 4;
    float lse2[C::kMTiles][2], dsum[C::kMTiles][2];
    const i64 stat_row = (i64(batch) * a.heads + head) * a.seqlen_q + row0;
    #pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = lane_row + mt * 16 + 8 * h;
            lse2[mt][h] = r < q_rows ? a.lse[stat_row + r] * kLog2e : 0.f;
            dsum[mt][h] = r < q_rows ? a.dsum[stat_row + r] : 0.f;
        }
    const float scale_log2 = a.softmax_scale * kLog2e;

    float acc_dq[C::kMTiles][C::kDTiles][4] = {};
    for (int nb = 0; nb < n_blocks; ++nb) {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile nb visible to all warps; slot (nb-1) % STAGES is free again
        {
            const int pf = nb + C::kStages - 1;
            if (pf < n_blocks) {
                const int slot = pf % C::kStages, tile = kv_tile(pf);
                const int rows = a.seqlen_k - tile * C::kBlockN;
                loader.template load<C::kBlockN>(s_k + slot * C::kTileKV * 2,
                                                 k + tile * C::kBlockN * a.k_stride_s, a.k_stride_s, rows);
                loader.template load<C::kBlockN>(s_v + slot * C::kTileKV * 2,
                                                 v + tile * C::kBlockN * a.v_stride_s, a.v_stride_s, rows);
            }
            cp_async_commit();
        }
        const int slot = nb % C::kStages;
        const u32 k_tile = s_k + slot * C::kTileKV * 2, v_tile = s_v + slot * C::kTileKV * 2;

        float acc_s[C::kMTiles][C::kSTiles][4] = {};
        warp_mma_rows<Elem, C::kMTiles, C::kSTiles, C::kHeadDim / 16, C::kPitch>(
            acc_s, s_q + warp_row * C::kPitch * 2, k_tile, lane);
        // P in place, as without mods; with a score_mod, dS comes from the raw scores after dP
        // instead (one pass with every mask), since it needs score_mod_grad of the raw score.
        if constexpr (!Mods::kScoreMod) {
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc_s[mt][nt][e] = exp2_approx(fmaf(acc_s[mt][nt][e], scale_log2, -lse2[mt][e / 2]));
        }

        // P = 0 for keys past seqlen_k and, for causal, past a row's diagonal (that includes the
        // rows with LSE = -inf, which see no key). Only straddling tiles pay for the test.
        const int col0 = kv_tile(nb) * C::kBlockN;
        // The mask_mod per element: in the block mask's partially visible tiles, else unless
        // the kv range vouches for the whole tile.
        const auto mod_mask_here = [&] {
            if constexpr (Mods::kBlockSparse) return nb < sparse.n_partial;
            else return mod_mask_needed<C::kBlockN>(mods, col0, row0, row0 + q_rows - 1, batch,
                                                    head, a.seqlen_q, a.seqlen_k);
        };
        bool need_mask = col0 + C::kBlockN > a.seqlen_k;
        if constexpr (C::kCausal) need_mask |= col0 + C::kBlockN - 1 > row0 + shift;
        if constexpr (!Mods::kScoreMod) {
            if (need_mask) {
                const int lane_col = col0 + 2 * (lane % 4);
                mask_probs</*KEYS_ARE_ROWS=*/false, C::kCausal>(
                    acc_s, a.seqlen_k - lane_col, lane_col - (row0 + lane_row) - shift);
            }
            if constexpr (Mods::kMaskMod) {
                if (mod_mask_here())
                    mod_mask_probs</*KEYS_ARE_ROWS=*/false>(
                        acc_s, mods, ModSite{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale}, head,
                        row0 + lane_row, col0 + 2 * (lane % 4));
            }
        }

        float acc_dp[C::kMTiles][C::kSTiles][4] = {};
        warp_mma_rows<Elem, C::kMTiles, C::kSTiles, C::kHeadDim / 16, C::kPitch>(
            acc_dp, s_do + warp_row * C::kPitch * 2, v_tile, lane);
        if constexpr (Mods::kScoreMod) {
            // P and dS from the raw scores (every mask in one pass, the mask_mod only where the
            // kv range does not vouch for the whole tile); dS is packed below.
            const int lane_q = row0 + lane_row, lane_kv = col0 + 2 * (lane % 4);
            const int tail = a.seqlen_k - lane_kv, diag = lane_kv - lane_q - shift;
            mod_probs_grads</*KEYS_ARE_ROWS=*/false>(
                acc_s, acc_dp, mods, ModSite{batch, a.seqlen_q, a.seqlen_k, a.softmax_scale}, head,
                lane_q, lane_kv, mod_mask_here(),
                [&](int key, int query) {
                    return need_mask && (key >= tail || (C::kCausal && diag + key - query > 0));
                },
                [&](int mt, int, int e) { return float2{lse2[mt][e / 2], dsum[mt][e / 2]}; });
        }

        // dQ += dS K over this tile's keys; dS packed to 16 bits per k16 step of keys.
        #pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
            u32 dsa[C::kMTiles][4];
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {  // a0..a3: (row g, n-tile 2kk), (g+8, 2kk), (g, 2kk+1), (g+8, 2kk+1)
                    const int nt = 2 * kk + i / 2, h = i % 2;
                    const float* p = acc_s[mt][nt] + 2 * h;
                    const float* dp = acc_dp[mt][nt] + 2 * h;
                    const float d = dsum[mt][h];
                    dsa[mt][i] = Mods::kScoreMod ? pack2<Elem>(dp[0], dp[1])
                                              : pack2<Elem>(p[0] * (dp[0] - d), p[1] * (dp[1] - d));
                }
            warp_mma_step_kn<Elem, C::kMTiles, C::kDTiles, C::kPitch>(
                acc_dq, dsa, k_tile + kk * 16 * C::kPitch * 2, lane);
        }
    }
    cp_async_wait<0>();

    // dQ * scale through this warp's own rows of the Q tile (no other warp reads them), then
    // 16-byte coalesced stores.
    #pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt)
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            #pragma unroll
            for (int dt = 0; dt < C::kDTiles; ++dt) {
                const int r = lane_row + mt * 16 + 8 * h, c = dt * 8 + 2 * (lane % 4);
                *reinterpret_cast<u32*>(smem + (r * C::kPitch + c) * 2) =
                    pack2<Elem>(acc_dq[mt][dt][2 * h] * a.softmax_scale,
                                acc_dq[mt][dt][2 * h + 1] * a.softmax_scale);
            }
    __syncwarp();
    constexpr int kChunksPerRow = C::kHeadDim / 8;
    #pragma unroll
    for (int i = lane; i < C::kRowsPerWarp * kChunksPerRow; i += 32) {
        const int r = warp_row + i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
        if (r < q_rows)
            *reinterpret_cast<uint4*>(dq + r * a.dq_stride_s + c) =
                *reinterpret_cast<const uint4*>(smem + (r * C::kPitch + c) * 2);
    }
}

}  // namespace kg
