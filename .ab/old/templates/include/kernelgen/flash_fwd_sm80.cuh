// FlashAttention-2 forward on mma.sync tensor cores (sm_80 .. sm_90).
//
// One CTA computes a BLOCK_M x HEAD_DIM tile of O for one (batch, head): it streams K/V tiles of
// BLOCK_N rows through a STAGES-deep cp.async ring in shared memory and keeps the online-softmax
// state (running max m, running sum l) and the fp32 O accumulator in registers. Each warp owns
// BLOCK_M / WARPS whole query rows, so softmax needs only quad shuffles, never shared memory.
// P = exp2(S * scale * log2e - m * scale * log2e) goes from the S accumulators straight into the
// A operand of P.V (the m16n8 C layout of two adjacent n-tiles is the m16k16 A layout).
//
// Shared memory rows are padded by 16 bytes: with a row pitch of 2*HEAD_DIM+16 bytes the eight row
// addresses of every ldmatrix (and the rows of every cp.async wavefront) fall in eight distinct
// 16-byte bank groups for every head dim we ship (64, 96, 128, 192, 256).
#pragma once
#include "kernelgen/mma_sm80.cuh"

namespace kg {

template <class Elem>
struct FwdArgs {
    const Elem* q; const Elem* k; const Elem* v; Elem* o; float* lse;
    i64 q_stride_b, q_stride_s, q_stride_h;
    i64 k_stride_b, k_stride_s, k_stride_h;
    i64 v_stride_b, v_stride_s, v_stride_h;
    i64 o_stride_b, o_stride_s, o_stride_h;
    int batch, heads, heads_k, seqlen_q, seqlen_k;
    float softmax_scale;
};

// GRID_ORDER 0: grid (m_blocks, heads, batch), the query tiles of one head side by side (K/V reuse
// in L2). 1: grid (heads, batch, m_blocks), all heads' tiles of one query block together: with the
// m order reversed that is longest-first over the whole grid, which balances causal work.
template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL,
          int GRID_ORDER = 0>
struct FwdConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kWarps = WARPS, kStages = STAGES, kThreads = WARPS * 32;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kGridOrder = GRID_ORDER;
    static constexpr int kRowsPerWarp = BLOCK_M / WARPS;
    static constexpr int kMTiles = kRowsPerWarp / 16;   // m16 tiles per warp
    static constexpr int kSTiles = BLOCK_N / 8;          // n8 tiles of S per row block
    static constexpr int kOTiles = HEAD_DIM / 8;         // n8 tiles of O
    static constexpr int kPitch = HEAD_DIM + 8;          // smem row pitch in elements (+16 bytes)
    static constexpr int kTileQ = BLOCK_M * kPitch, kTileKV = BLOCK_N * kPitch;
    static constexpr int kSmemBytes = (kTileQ + 2 * STAGES * kTileKV) * 2;

    static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "k16 steps over keys and head dim");
    static_assert(STAGES >= 2, "a ring of one stage cannot overlap loads with math");
};

// Copy `ROWS` x HEAD_DIM elements (row stride `stride`) into a padded smem tile with 16-byte
// cp.async; rows at or past `valid_rows` are zero-filled so later math sees finite values.
// A row's CHUNKS 16-byte chunks are spread over kThreadsPerRow threads (the largest power of two
// dividing CHUNKS), so each thread's chunks sit at fixed offsets from one smem address and one
// global offset: immediates, not a register per chunk (those were hoisted out of the main loop
// and spilled).
template <class C>
struct TileLoader {
    static constexpr int kChunksPerRow = C::kHeadDim / 8;
    static constexpr int kThreadsPerRow = kChunksPerRow & -kChunksPerRow;
    static constexpr int kRowsPerPass = C::kThreads / kThreadsPerRow;
    static_assert(C::kThreads % kThreadsPerRow == 0, "threads cover whole rows");
    int row;   // first row of this thread
    u32 smem;  // byte offset of its first chunk inside a tile
    int col;   // element offset of its first chunk inside a row

    __device__ __forceinline__ explicit TileLoader(int tid)
        : row(tid / kThreadsPerRow), smem(0), col((tid % kThreadsPerRow) * 8) {
        smem = (row * C::kPitch + col) * 2;
    }

    template <int ROWS>
    __device__ __forceinline__ void load(u32 smem_tile, const typename C::Elem* gmem, i64 stride,
                                         int valid_rows) const {
        // The pass stride goes through an opaque move: otherwise the compiler hoists one 64-bit
        // address per chunk out of the main loop and keeps them all live (spills at 255 regs).
        const i64 pass_stride = opaque(kRowsPerPass * stride);
        const auto* src = gmem + row * stride + col;
        #pragma unroll
        for (int pass = 0; pass < cdiv(ROWS, kRowsPerPass); ++pass) {
            const int r = row + pass * kRowsPerPass;
            if (ROWS % kRowsPerPass == 0 || r < ROWS) {
                const bool valid = r < valid_rows;
                #pragma unroll
                for (int j = 0; j < kChunksPerRow / kThreadsPerRow; ++j)
                    cp_async_16(smem_tile + smem + (pass * kRowsPerPass * C::kPitch + j * kThreadsPerRow * 8) * 2,
                                valid ? src + j * kThreadsPerRow * 8 : gmem, valid);
            }
            src += pass_stride;
        }
    }
};

// Attention modifiers (a spec's `mods`, rendered into a struct like this one by the template):
// score_mod rewrites each scaled score, mask_mod hides (q_idx, kv_idx) pairs, and the kv range
// bounds the keys a query tile can see ([kv_lo, kv_hi)) and those it surely sees ([full_lo,
// full_hi)), so that tiles outside are skipped and tiles inside skip the per-element mask.
// With a block mask (a spec's `mods.block_sparse`) the kernel visits only the blocks of its
// row's lists (SparseRow), partially visible ones first; fully visible ones skip the mask_mod.
struct SparseRow {
    const int* partial; const int* full;
    int n_partial, n_blocks;  // blocks [0, n_partial) are partial, [n_partial, n_blocks) full
    __device__ __forceinline__ int block(int i) const {
        return i < n_partial ? partial[i] : full[i - n_partial];
    }
};

// A row of grouped lists' extra entries (the Hopper forward's wg_skip: blockmask.py
// group_for_warpgroups): the leading group's size and warpgroup, the trailing group's size.
struct SparseGroups {
    int lead, lead_wg, trail;
};

struct NoMods {
    static constexpr bool kScoreMod = false, kMaskMod = false, kKvRange = false;
    static constexpr bool kBlockSparse = false, kClampIndices = false, kExactRange = false;
    static constexpr bool kRangeReadsMemory = false, kScoreBound = false, kDistanceSlopes = false;
    static constexpr bool kScoreFactor = false;
    __device__ SparseRow sparse_row(int, int, int) const { return SparseRow{nullptr, nullptr, 0, 0}; }
    __device__ float score_mod(float qk, float scale, int, int, int, int, int, int) const {
        return qk * scale;
    }
    __device__ bool mask_mod(int, int, int, int, int, int) const { return true; }
    __device__ float score_bound(int, int) const { return 0.f; }
    __device__ float slope_before(int, int) const { return 0.f; }
    __device__ float slope_after(int, int) const { return 0.f; }
    __device__ int kv_lo(int, int, int, int, int, int) const { return 0; }
    __device__ int kv_hi(int, int, int, int, int, int) const { return 1 << 30; }
    __device__ int full_lo(int, int, int, int, int, int) const { return 0; }
    __device__ int full_hi(int, int, int, int, int, int) const { return 1 << 30; }
};

// The keys [lo, hi) that the query rows [row0, row0 + rows) of (batch, head) see between them:
// the one place every kernel that walks a query tile's keys (this forward, the Hopper one, the
// backward's dQ kernel) decides them. Causal is aligned bottom-right (query i sees keys <= i +
// seqlen_k - seqlen_q); a kv range narrows that to [kv_lo, kv_hi) of the rows, and lo is a
// compile-time 0 without one. (With a block mask its lists give the blocks instead: the callers
// take them from sparse_row.)
struct KeyRange {
    int lo, hi;
};

template <bool CAUSAL, class Mods>
__device__ __forceinline__ KeyRange kv_keys(const Mods& mods, int row0, int rows, int batch,
                                            int head, int seqlen_q, int seqlen_k) {
    int lo = 0, hi = seqlen_k;
    if constexpr (CAUSAL) hi = min(hi, row0 + rows + seqlen_k - seqlen_q);
    if constexpr (Mods::kKvRange && !Mods::kBlockSparse) {
        const int last = row0 + rows - 1;
        lo = max(0, mods.kv_lo(row0, last, batch, head, seqlen_q, seqlen_k));
        hi = min(hi, mods.kv_hi(row0, last, batch, head, seqlen_q, seqlen_k));
    }
    return KeyRange{lo, hi};
}

// Those keys as KV blocks of BLOCK_N on multiples of BLOCK_N: [n_first, n_first + n_blocks).
struct KvBlocks {
    int n_first, n_blocks;
};

template <int BLOCK_N, bool CAUSAL, class Mods>
__device__ __forceinline__ KvBlocks kv_blocks(const Mods& mods, int row0, int q_rows, int batch,
                                              int head, int seqlen_q, int seqlen_k) {
    const KeyRange keys = kv_keys<CAUSAL>(mods, row0, q_rows, batch, head, seqlen_q, seqlen_k);
    const int n_first = keys.lo / BLOCK_N;
    return KvBlocks{n_first, keys.hi > keys.lo ? cdiv(keys.hi, BLOCK_N) - n_first : 0};
}

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_fwd_sm80(const FwdArgs<typename C::Elem>& a,
                                               const Mods& mods = Mods{}) {
    using Elem = typename C::Elem;
    extern __shared__ __align__(128) unsigned char smem[];

    // Causal: the last query tiles see the most keys; launch them first so that the short tiles
    // fill the tail of the grid instead of the long ones.
    const int m_tile = C::kGridOrder == 0 ? blockIdx.x : blockIdx.z;
    const int m_tiles = C::kGridOrder == 0 ? gridDim.x : gridDim.z;
    const int m_block = C::kCausal ? m_tiles - 1 - m_tile : m_tile;
    const int head = C::kGridOrder == 0 ? blockIdx.y : blockIdx.x;
    const int batch = C::kGridOrder == 0 ? blockIdx.z : blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int kv_head = head / (a.heads / a.heads_k);
    const int row0 = m_block * C::kBlockM;               // first query row of this CTA

    const Elem* q = a.q + batch * a.q_stride_b + head * a.q_stride_h + row0 * a.q_stride_s;
    const Elem* k = a.k + batch * a.k_stride_b + kv_head * a.k_stride_h;
    const Elem* v = a.v + batch * a.v_stride_b + kv_head * a.v_stride_h;
    Elem* o = a.o + batch * a.o_stride_b + head * a.o_stride_h + row0 * a.o_stride_s;
    float* lse = a.lse + (i64(batch) * a.heads + head) * a.seqlen_q;

    // The KV tiles this CTA's rows see: [n_first, n_first + n_blocks).
    const int q_rows = min(a.seqlen_q - row0, C::kBlockM);
    const KvBlocks blocks = kv_blocks<C::kBlockN, C::kCausal>(mods, row0, q_rows, batch, head,
                                                              a.seqlen_q, a.seqlen_k);
    const int n_first = blocks.n_first;
    int n_blocks = blocks.n_blocks;
    // A block mask lists the tiles instead (its classify kernel folded in causal, the sequence
    // ends and any kv range): iteration i visits KV tile kv_tile(i).
    SparseRow sparse{nullptr, nullptr, 0, 0};
    if constexpr (Mods::kBlockSparse) {
        sparse = mods.sparse_row(batch, head, m_block);
        n_blocks = sparse.n_blocks;
    }
    const auto kv_tile = [&](int i) {
        if constexpr (Mods::kBlockSparse) return sparse.block(i);
        else return n_first + i;
    };

    if (n_blocks == 0) {  // every row of the tile sees no key: O = 0, LSE = -inf
        for (int i = tid; i < q_rows * C::kHeadDim; i += C::kThreads)
            o[(i / C::kHeadDim) * a.o_stride_s + i % C::kHeadDim] = Elem{0};
        for (int i = tid; i < q_rows; i += C::kThreads) lse[row0 + i] = neg_inf();
        return;
    }

    const u32 s_q = smem_addr(smem);
    const u32 s_k = s_q + C::kTileQ * 2;
    const u32 s_v = s_k + C::kStages * C::kTileKV * 2;

    // Prologue: Q with the first K/V tile in one group, then STAGES-2 more groups.
    const TileLoader<C> loader(tid);
    loader.template load<C::kBlockM>(s_q, q, a.q_stride_s, q_rows);
    #pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < n_blocks) {
            const int tile = kv_tile(s), rows = a.seqlen_k - tile * C::kBlockN;
            loader.template load<C::kBlockN>(s_k + s * C::kTileKV * 2,
                                             k + tile * C::kBlockN * a.k_stride_s, a.k_stride_s, rows);
            loader.template load<C::kBlockN>(s_v + s * C::kTileKV * 2,
                                             v + tile * C::kBlockN * a.v_stride_s, a.v_stride_s, rows);
        }
        cp_async_commit();  // empty groups keep the wait_group arithmetic uniform
    }

    // Per-lane ldmatrix row offsets (bytes), see mma_sm80.cuh for the fragment layouts.
    const int warp_row = warp * C::kRowsPerWarp;
    const u32 q_lane = ((warp_row + lane % 16) * C::kPitch + (lane / 16) * 8) * 2;
    const u32 k_lane = ((lane % 8 + (lane / 16) * 8) * C::kPitch + ((lane / 8) % 2) * 8) * 2;
    const u32 v_lane = ((lane % 8 + ((lane / 8) % 2) * 8) * C::kPitch + (lane / 16) * 8) * 2;

    float acc_o[C::kMTiles][C::kOTiles][4];
    float row_max[C::kMTiles][2], row_sum[C::kMTiles][2];
    #pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
        #pragma unroll
        for (int nt = 0; nt < C::kOTiles; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][nt][e] = 0.f;
        #pragma unroll
        for (int h = 0; h < 2; ++h) { row_max[mt][h] = neg_inf(); row_sum[mt][h] = 0.f; }
    }
    // With a score_mod the kernel applies the scale itself (the mod sees scaled scores), and the
    // softmax then works on the modified scores in log2 units.
    const float scale_log2 = Mods::kScoreMod ? kLog2e : a.softmax_scale * kLog2e;
    // Rows of this lane: row0 + warp_row + mt*16 + lane/4 + 8h. Causal limit for a row r: r + shift.

    for (int i = 0; i < n_blocks; ++i) {
        const int nb = kv_tile(i);  // the KV tile; i counts iterations (ring slots)
        cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile i visible to all warps; slot (i-1) % STAGES is free again

        {   // prefetch iteration i + STAGES - 1 into the slot the previous iteration released
            const int pf = i + C::kStages - 1;
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

        const int slot = i % C::kStages;
        const u32 k_tile = s_k + slot * C::kTileKV * 2, v_tile = s_v + slot * C::kTileKV * 2;

        // S = Q K^T for this warp's rows (fp32, unscaled).
        float acc_s[C::kMTiles][C::kSTiles][4];
        #pragma unroll
        for (int mt = 0; mt < C::kMTiles; ++mt)
            #pragma unroll
            for (int nt = 0; nt < C::kSTiles; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
            u32 qa[C::kMTiles][4];
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                ldmatrix_x4(qa[mt], s_q + q_lane + (mt * 16 * C::kPitch + kk * 16) * 2);
            #pragma unroll
            for (int np = 0; np < C::kSTiles / 2; ++np) {
                u32 kb[4];
                ldmatrix_x4(kb, k_tile + k_lane + (np * 16 * C::kPitch + kk * 16) * 2);
                #pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt) {
                    mma_16816(acc_s[mt][2 * np], qa[mt], kb[0], kb[1], Elem{});
                    mma_16816(acc_s[mt][2 * np + 1], qa[mt], kb[2], kb[3], Elem{});
                }
            }
        }

        const int col0 = nb * C::kBlockN;
        // Index of element (mt, nt, e): q = lane_q + mt*16 + (e/2)*8, kv = lane_kv + nt*8 + (e&1).
        if constexpr (Mods::kScoreMod) {
            const int lane_q = row0 + warp_row + lane / 4, lane_kv = col0 + 2 * (lane % 4);
            // Indices are clamped so a mod that reads per-token tensors stays in bounds on the
            // padding rows and columns (those are masked or never stored): always here, not as
            // the Hopper forward's mod_index does (unclamped, the window's head_dim 64 default
            // spills 8 bytes).
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc_s[mt][nt][e] = mods.score_mod(
                            acc_s[mt][nt][e], a.softmax_scale, batch, head,
                            min(lane_q + mt * 16 + (e / 2) * 8, a.seqlen_q - 1),
                            min(lane_kv + nt * 8 + (e & 1), a.seqlen_k - 1), a.seqlen_q, a.seqlen_k);
        }

        // Mask keys past seqlen_k, for causal keys past each row's diagonal, and what the
        // mask_mod hides. Only tiles that straddle a boundary pay for it (a CTA-uniform branch).
        // Both built-in tests are against one per-lane number, so the unrolled compares use
        // immediates and the masking state costs two registers only inside this branch.
        bool need_mask = col0 + C::kBlockN > a.seqlen_k;
        if constexpr (C::kCausal)
            need_mask |= col0 + C::kBlockN - 1 > row0 + a.seqlen_k - a.seqlen_q;
        bool need_mod_mask = Mods::kMaskMod;
        if constexpr (Mods::kMaskMod && Mods::kBlockSparse) {
            need_mod_mask = i < sparse.n_partial;  // the block mask vouches for full tiles
        } else if constexpr (Mods::kMaskMod && Mods::kKvRange) {
            const int q_last = row0 + q_rows - 1;
            need_mod_mask =
                col0 < mods.full_lo(row0, q_last, batch, head, a.seqlen_q, a.seqlen_k) ||
                col0 + C::kBlockN > mods.full_hi(row0, q_last, batch, head, a.seqlen_q, a.seqlen_k);
        }
        if (need_mask || need_mod_mask) {
            const int lane_q = row0 + warp_row + lane / 4, lane_kv = col0 + 2 * (lane % 4);
            const int tail = a.seqlen_k - lane_kv;  // element (nt, e) is past the end if >= tail
            // col - row - (sk - sq) for element (mt, nt, e) is diag + nt*8 + (e&1) - mt*16 - (e/2)*8
            const int diag = lane_kv - lane_q - (a.seqlen_k - a.seqlen_q);
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        bool masked = nt * 8 + (e & 1) >= tail;
                        if constexpr (C::kCausal)
                            masked |= diag + nt * 8 + (e & 1) - mt * 16 - (e / 2) * 8 > 0;
                        if constexpr (Mods::kMaskMod)
                            masked |= need_mod_mask && !mods.mask_mod(
                                batch, head, min(lane_q + mt * 16 + (e / 2) * 8, a.seqlen_q - 1),
                                min(lane_kv + nt * 8 + (e & 1), a.seqlen_k - 1), a.seqlen_q,
                                a.seqlen_k);
                        if (masked) acc_s[mt][nt][e] = neg_inf();
                    }
        }

        // Online softmax: new running max, rescale l and O by alpha = exp2((m_old - m_new)*c),
        // then P = exp2(S*c - m_new*c) packed to 16-bit at once so the fp32 S registers die here.
        u32 p_frag[C::kMTiles][C::kSTiles][2];
        #pragma unroll
        for (int mt = 0; mt < C::kMTiles; ++mt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = row_max[mt][h];
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // A row that has seen only masked keys keeps m = -inf; use 0 so that
                // (-inf) - (-inf) never happens: its p and alpha are then exp2(-inf) = 0.
                const float m_scaled = mx == neg_inf() ? 0.f : mx * scale_log2;
                const float alpha = exp2_approx(row_max[mt][h] * scale_log2 - m_scaled);
                row_max[mt][h] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int nt = 0; nt < C::kSTiles; ++nt) {
                    const float p0 = exp2_approx(fmaf(acc_s[mt][nt][2 * h], scale_log2, -m_scaled));
                    const float p1 = exp2_approx(fmaf(acc_s[mt][nt][2 * h + 1], scale_log2, -m_scaled));
                    p_frag[mt][nt][h] = pack2<Elem>(p0, p1);
                    sum += p0 + p1;
                }
                // Each lane keeps a partial sum over its own columns; the quad reduces at the end.
                row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
                #pragma unroll
                for (int nt = 0; nt < C::kOTiles; ++nt) {
                    acc_o[mt][nt][2 * h] *= alpha;
                    acc_o[mt][nt][2 * h + 1] *= alpha;
                }
            }

        // O += P V, P from registers, V fragments by transposed ldmatrix.
        #pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
            // The C layout of n-tiles 2kk and 2kk+1 is the A layout of k-step kk.
            u32 pa[C::kMTiles][4];
            #pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt) {
                pa[mt][0] = p_frag[mt][2 * kk][0];
                pa[mt][1] = p_frag[mt][2 * kk][1];
                pa[mt][2] = p_frag[mt][2 * kk + 1][0];
                pa[mt][3] = p_frag[mt][2 * kk + 1][1];
            }
            #pragma unroll
            for (int dp = 0; dp < C::kHeadDim / 16; ++dp) {
                u32 vb[4];
                ldmatrix_x4_trans(vb, v_tile + v_lane + (kk * 16 * C::kPitch + dp * 16) * 2);
                #pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt) {
                    mma_16816(acc_o[mt][2 * dp], pa[mt], vb[0], vb[1], Elem{});
                    mma_16816(acc_o[mt][2 * dp + 1], pa[mt], vb[2], vb[3], Elem{});
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: O /= l, LSE = (m*c + log2 l) * ln2. Rows with l == 0 saw no key: O = 0, LSE = -inf.
    // O goes through this warp's own rows of the Q tile (no other warp reads them) so that global
    // stores are 16-byte and coalesced.
    unsigned char* s_o = smem;
    #pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = row_sum[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const bool empty = !(l > 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            const int r = warp_row + mt * 16 + lane / 4 + 8 * h;
            if (lane % 4 == 0 && r < q_rows)
                lse[row0 + r] = empty ? neg_inf()
                                      : (row_max[mt][h] * scale_log2 + log2_approx(l)) * kLn2;
            #pragma unroll
            for (int nt = 0; nt < C::kOTiles; ++nt) {
                const int c = nt * 8 + 2 * (lane % 4);
                *reinterpret_cast<u32*>(s_o + (r * C::kPitch + c) * 2) =
                    pack2<Elem>(acc_o[mt][nt][2 * h] * inv, acc_o[mt][nt][2 * h + 1] * inv);
            }
        }
    __syncwarp();
    constexpr int kChunksPerRow = C::kHeadDim / 8;
    #pragma unroll
    for (int i = lane; i < C::kRowsPerWarp * kChunksPerRow; i += 32) {
        const int r = warp_row + i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
        if (r < q_rows)
            *reinterpret_cast<uint4*>(o + r * a.o_stride_s + c) =
                *reinterpret_cast<const uint4*>(s_o + (r * C::kPitch + c) * 2);
    }
}

}  // namespace kg
