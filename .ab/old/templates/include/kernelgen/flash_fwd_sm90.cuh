// FlashAttention forward for Hopper (sm_90a): TMA loads, an mbarrier pipeline, wgmma, and warp
// specialization, following FA3 (its schedules: plain, intra-warpgroup overlap, pingpong).
//
// One CTA computes BLOCK_M query rows of one (batch, head). Warpgroup 0 is the producer: after
// setmaxnreg.dec one thread issues every TMA load (Q once, then K and V tiles of BLOCK_N rows
// through a STAGES-deep ring). Warpgroups 1..BLOCK_M/64 are consumers (setmaxnreg.inc), 64 query
// rows each: S = Q K^T by wgmma with both operands in shared memory (SS), the online softmax in
// fp32 registers (the math of flash_fwd_sm80.cuh), then O += P V by wgmma with P straight from
// registers (RS) and V read MN-major (transposed) from shared memory. The schedule (SCHEDULE)
// decides how much of that is in flight at once.
//
// Rings: for each stage s, full_k[s] / full_v[s] (one arrival from the producer's expect_tx plus
// the tile's TMA bytes) and empty_k[s] / empty_v[s] (one arrival per consumer warp once its wgmmas
// that read the slot have completed). Iteration i uses stage i % STAGES with parity (i / STAGES) & 1
// on full barriers; the producer waits on empty barriers with the opposite parity, which a fresh
// barrier already satisfies, so the first round starts at once.
//
// Shared memory (1024-aligned): Q [panels][BLOCK_M][SWIZZLE B] | K [STAGES][panels][BLOCK_N][SWIZZLE B]
// | V (same) | barriers. A panel holds SWIZZLE/2 columns of head_dim (64 for 128B swizzle, 32 for
// head dims that are not a multiple of 64) for every row of the tile, as TMA writes it with a
// rank-5 box {SWIZZLE/2, rows, panels, 1, 1}. KV blocks are visited last to first (the masked
// tail and causal diagonal first), like FA3.
//
// PERSISTENT: a CTA per SM loops over tiles (TileSchedule); the K/V ring and the barrier phases
// run on from tile to tile, and empty_q tells the producer when the epilogue (which stages O in
// the Q tile) is done with Q. With one Q buffer (Q_BUFFERS 1) the next tile's Q, and so its first
// QK^T, waits for this tile's epilogue. Q_BUFFERS 2 (persistent only): tiles use Q buffers in
// turn (full_q[j] / empty_q[j] per buffer), so tile t+1's Q lands while tile t computes; tile t's
// epilogue stages O in its own Q buffer and one thread per consumer warpgroup stores it with TMA
// (the O map), and that thread hands the buffer back (empty_q) only once the store has read it,
// which it waits for after tile t+1's first block: the store overlaps tile t+1's first GEMMs.
// So with two buffers tile t+2's Q can load only once tile t+1's first block is done: a tile of
// one or two blocks leaves it too little time to land. Q_BUFFERS 3: tile t+2 takes tile t-1's
// buffer, handed back during tile t, so the producer loads it as soon as its ring lets it.
// PERSISTENT 2 (dynamic): the same loop, but after its first tile (blockIdx.x) a CTA claims the
// next one from a global counter when its producer gets to it (TileQueue), so CTAs that drew
// short tiles take more of them: the hardware's balance of a grid per tile, with the persistent
// overlap of one tile's epilogue and the next one's loads. Tiles are claimed in the static order
// (longest first for causal), so the tail is short tiles.
//
// Mods (a spec's `mods`, the struct mods.inc.j2 renders; NoMods without): exactly the sm80
// family's. kv_range bounds the KV blocks of a tile ([kv_lo, kv_hi) of its rows, in tile_work,
// which producer and consumers share, so they agree on every tile's blocks and the ring position);
// score_mod rewrites each scaled score right after its QK^T (the softmax then runs in log2 units
// without the scale); mask_mod hides elements, evaluated only in blocks not inside [full_lo,
// full_hi) of the warpgroup's rows. With everything off the code is the plain kernel's.
#pragma once
#include "kernelgen/flash_fwd_sm80.cuh"  // FwdArgs: the argument list both families share
#include "kernelgen/fwd_sm90_config.cuh"
#include "kernelgen/fwd_sm90_masks.cuh"
#include "kernelgen/fwd_sm90_softmax.cuh"
#include "kernelgen/fwd_sm90_steps.cuh"
#include "kernelgen/fwd_sm90_tiles.cuh"
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tma.cuh"
#include "kernelgen/tile_order.cuh"
#include "kernelgen/tma_store.cuh"
#include "kernelgen/wgmma.cuh"

namespace kg {

// One consumer warpgroup: query rows 64 * wg .. 64 * wg + 63 of the tile.
// `it0`: the ring position of the tile's first KV block; `tile`: how many tiles this CTA has
// done (its Q buffer and the parity of full_q); `is_final()`: whether no later tile of this CTA
// takes a turn (pingpong's last hand-off), called exactly once, after the last GEMM's issue (the
// dynamic schedule learns its next tile there; carry_qk: before it, and "later" means with work:
// the empty tiles between are not the consumers' turns then). `carried_s`: S's accumulators
// with carry_qk, the caller's, in flight from one tile with work to the next.
template <class C, class Mods, class IsFinal>
__device__ __forceinline__ void sm90_consume(const FwdArgs<typename C::Elem>& a, const Mods& mods,
                                             unsigned char* tiles, u32 smem_u32, Sm90Barriers<C> bar,
                                             const TensorMap& map_o, IssueTurns<C> turns,
                                             const TileWork& w, int it0, int tile,
                                             float (&carried_s)[C::kBlockN / 2],
                                             const IsFinal& is_final) {
    const int wg = turns.wg, row0 = w.row0, q_rows = w.q_rows;
    const int wg_row0 = row0 + wg * 64;
    // The tile's blocks at either end of its visiting order that no row of this warpgroup sees
    // are the other warpgroups' alone: their K and V slots are waited for and released, and
    // (pingpong) their turns passed on empty, the leading ones here and the trailing ones after
    // the last P V, so that both warpgroups take n_blocks + 1 turns per tile in the blocks' order
    // (trailing turns taken first would wait on the other warpgroup's last blocks, whose slots
    // this one releases only at its end: a deadlock the emulator showed). The warpgroup computes
    // the rest (`it`, `n_blocks`; its block i is the tile's i + skip).
    // Causal skips with blocks as long as the tile (128 x 128) only where seqlen_k - seqlen_q
    // is not a multiple of them: those kernels keep their code (the per-tile count measured
    // -1% / -2% at hd64 causal 512 / 1k, where it never skipped).
    constexpr bool kSkips = (Mods::kBlockSparse && C::kWgSkip) ||
                            (!Mods::kBlockSparse &&
                             ((C::kCausal && C::kBlockN < C::kBlockM) || Mods::kKvRange));
    const SkippedBlocks skipped = kSkips ? skipped_blocks<C>(a, mods, w, wg_row0)
                                         : SkippedBlocks{0, 0};
    constexpr bool kCarry = C::kCarryQk;  // this tile's first S is in flight already
    static_assert(!kCarry || (!kSkips && !Mods::kBlockSparse && C::kSchedule != 0),
                  "carry_qk: every warpgroup's first block is the tile's");
    for (int i = 0; i < skipped.lead; ++i) {
        pass_kv_slot<C>(bar, it0 + i);
        turns.acquire();
        turns.release(false);
    }
    const int skip = skipped.lead, it = it0 + skip;
    bool final_turn = false;  // is_final(), asked once after the last GEMM's issue
    const int n_blocks = w.n_blocks - skip - skipped.trail;
    typename C::Elem* o = a.o + w.batch * a.o_stride_b + w.head * a.o_stride_h + row0 * a.o_stride_s;
    float* lse = a.lse + (i64(w.batch) * a.heads + w.head) * a.seqlen_q + row0;
    using Elem = typename C::Elem;
    constexpr int kSw = C::kSwizzle;
    constexpr int kAccS = C::kBlockN / 2, kAccO = C::kAccO;  // fp32 registers per thread
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;

    const int slot = q_slot<C>(tile);
    unsigned char* const q_tile = tiles + slot * C::kTileQ;
    // Descriptors of each operand's first k16 step; steps and stages add their byte offset >> 4.
    const u64 desc_q = desc_k_major<kSw>(smem_u32 + slot * C::kTileQ + wg * 64 * kSw);
    const u64 desc_k = desc_k_major<kSw>(smem_u32 + C::kOffK);
    // With sum_mma the leading offset is the distance from stage 0's V to the ones panel, and
    // each stage's descriptor takes its offset off that distance again (stage_desc_v).
    const u64 desc_v = desc_mn_major<kSw>(smem_u32 + C::kOffV,
                                          C::kSumMma ? C::kOffOnes - C::kOffV : C::kBlockN * kSw);
    const auto stage = [it](int i) { return (it + i) % C::kStages; };
    const auto parity = [it](int i) { return u32((it + i) / C::kStages) & 1; };
    const auto stage_desc = [it](u64 desc, int i) {
        return desc + (((it + i) % C::kStages) * C::kTileKV >> 4);
    };
    const auto stage_desc_v = [&](u64 desc, int i) {
        const u64 stepped = stage_desc(desc, i);
        return C::kSumMma ? stepped - ((stepped - desc) << 16) : stepped;
    };
    const auto col0 = [&w, skip](int i) { return w.col0(i + skip, C::kBlockN); };
    // half_diag (causal): the warpgroup's first block is the diagonal's; where its upper half of
    // keys lies past every one of the warpgroup's rows' diagonal (square tiles: warpgroup 0's,
    // a quarter of the tile's tensor work at 512 keys), S and P V of that block run over its
    // lower half only (issue_qk, issue_pv). Lane 0's test, so that ptxas sees the branches
    // around the wgmma as warp-uniform.
    constexpr bool kHalfDiag = C::kHalfDiag && C::kCausal && C::kSchedule != 0 &&
                               !Mods::kBlockSparse;
    bool half0 = false;
    if constexpr (kHalfDiag) {
        const int last_diagonal = wg_row0 + 63 + a.seqlen_k - a.seqlen_q;  // its last row's
        half0 = __shfl_sync(0xffffffffu, col0(0) + C::kBlockN / 2 > last_diagonal, 0);
    }

    // S's accumulators: the caller's with carry_qk (in flight from tile to tile), else this
    // tile's own (the caller's array then unused: the code as before the key).
    float own_s[kAccS];
    float (&acc_s)[kAccS] = Pick<kCarry>::from(carried_s, own_s);
    float acc_o[kAccO], alpha[2];
    u32 p[C::kBlockN / 16][4];
    // O += P V of block i (half_diag: the first block's lower half, its upper P being 0).
    const auto pv = [&](int i) {
        if (kHalfDiag && i == 0 && half0)
            issue_pv<C, true>(acc_o, p, stage_desc_v(desc_v, i));
        else
            issue_pv<C>(acc_o, p, stage_desc_v(desc_v, i));
    };
    #pragma unroll
    for (int i = 0; i < kAccO; ++i) acc_o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
    // With a score_mod the scale is applied before it (the mod sees scaled scores), and the
    // softmax then works on the modified scores in log2 units.
    // (A distance bias put into S before the QK^T keeps raw dot products, as without a
    // score_mod: DistanceBias, kBiasBeforeQk.)
    constexpr bool kBiasInit = Mods::kDistanceSlopes && kBiasBeforeQk<C>;
    const float scale_log2 = Mods::kScoreMod && !kBiasInit ? kLog2e : a.softmax_scale * kLog2e;
    // A score_mod bounded by B small enough for the 16-bit P (softcap's cap, mods.score_bound):
    // every row subtracts B for good instead of its running max, so no max is taken and O is
    // never rescaled (exact: P = exp(s - B) stays a normal number). Uniform over the tile.
    // Head dims from 128 only: softcap measured +4% at hd128, +9-12% at hd192 and +13% at
    // hd256, but -9% (full) and -2% (causal) at hd64 and -1.5% / -0.4% at hd96, where the two
    // softmax paths cost more than the max they save (PERF_NOTES §41, §42).
    constexpr bool kBounded = Mods::kScoreBound && C::kHeadDim >= 128;
    const float bound = kBounded ? mods.score_bound(w.batch, w.head) : 0.f;
    // A bounded score_mod that is factor * inner (softcap: the cap times a tanh): S holds inner,
    // and the factor goes into the exp2's scale once a tile, one multiply a score fewer
    // (PERF_NOTES §106). Only for a positive factor (masked scores are -inf times it); else, or
    // where the bound does not apply, S is multiplied by it before the masks and the softmax.
    constexpr bool kFold = kBounded && Mods::kScoreFactor;
    float factor = 1.f;
    if constexpr (kFold)
        factor = mods.score_factor(a.softmax_scale, w.batch, w.head, a.seqlen_q, a.seqlen_k);
    const bool fixed = kBounded && bound >= 0.f && bound <= MaxScoreBound<Elem>::value &&
                       (!kFold || factor > 0.f);
    if (fixed) row_max[0] = row_max[1] = bound;
    const auto rescale = [&](const float (&by)[2]) {
        if (!fixed) rescale_o<C>(acc_o, by);
    };
    const int lane_row = wg_row0 + warp * 16 + lane / 4;  // this thread's rows: lane_row, +8
    // A distance bias (mods.distance_slopes): per-column terms put into S before a one-sided
    // block's QK^T (kBiasInit: long QK^Ts) or added after it, the rows' terms as the softmax's
    // shifts (`shift`, set with each block's scores).
    const DistanceBias bias = distance_bias<C>(mods, w.batch, w.head, wg_row0, lane_row,
                                            a.seqlen_k - a.seqlen_q, a.softmax_scale);
    float shift[2] = {0.f, 0.f};
    FullRange full{0, 1 << 30};
    if constexpr (Mods::kMaskMod && Mods::kKvRange && !Mods::kBlockSparse)
        full = full_range<C>(a, mods, w, wg_row0);

    // Block i's first key, read before the wait for its S where that is a load (a block mask's
    // list): issued between the QK^T and the wait, `early` is what the wait would else stall on.
    // Else computed after the wait, where the plain kernels always have: taking col0(i) before
    // the wait for every kernel would be simpler, but it changes the plain kernels' SASS.
    const auto early_col0 = [&](int i) { return Mods::kBlockSparse ? col0(i) : 0; };
    const auto block_col0 = [&](int i, int early) { return Mods::kBlockSparse ? early : col0(i); };
    // Block i's mask_mod bits, called between the issue of its QK^T and the wait for it.
    const auto mask_bits = [&](int i, int early) {
        if constexpr (Mods::kMaskMod)
            return mod_mask_bits<C>(a, mods, w, full, block_col0(i, early), wg_row0, lane_row,
                                    i + skip);   // the tile's index (wg_skip's lists skip some)
        else
            return ModBits<C>{};
    };
    // After the wait for S of block i: its K slot is free; the mods rewrite and mask S.
    // (half: half_diag's first block, whose upper half is -inf already: no score_mod there.)
    const auto finish_qk = [&](int i, int early, const ModBits<C>& bits, auto half) {
        fence_operands(acc_s);
        release_kv_slot<C>(bar.empty_k(stage(i)), lane);
        const int c0 = block_col0(i, early);
        if constexpr (Mods::kDistanceSlopes)
            bias_scores<C>(acc_s, shift, a, mods, bias, w, c0, lane_row);
        else if constexpr (Mods::kScoreMod) {
            constexpr int kPairs = C::kBlockN / (decltype(half)::value ? 16 : 8);
            modify_scores<C, Mods, kPairs, kFold>(acc_s, a, mods, w, c0, lane_row);
            if constexpr (kFold) {
                if (!fixed) {
                    #pragma unroll
                    for (int k = 0; k < 4 * kPairs; ++k) acc_s[k] *= factor;
                }
            }
        }
        mask_scores<C>(acc_s, a, mods, w, bits, c0, wg_row0, lane_row);
    };
    const auto softmax = [&](float (&alpha_out)[2]) {
        softmax_step<C, Mods::kDistanceSlopes>(acc_s, row_max, row_sum, scale_log2, alpha_out,
                                               fixed, shift, factor);
    };
    const auto fence_pv_operands = [&] {
        fence_operands(acc_o);
        #pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) fence_operands(p[kk]);
    };
    // TMA store: the warpgroup's storing thread hands the previous tile's Q buffer back once that
    // tile's O store has read it; called after this tile's first block, so the store runs behind
    // its first GEMMs and softmax, and the producer still has a whole tile to load the next Q.
    const bool storer = threadIdx.x % 128 == 0;
    const auto release_previous_q = [&] {
        if constexpr (C::kTmaStore)
            if (storer && tile > 0) {
                bulk_wait_group_read<0>();
                mbarrier_arrive(bar.empty_q(q_slot<C>(tile - 1)));
            }
    };

    const int q_bar = C::kQSplit ? wg : slot;  // the barriers of this warpgroup's rows of Q
    if constexpr (!kCarry) mbarrier_wait(bar.full_q(q_bar), q_parity<C>(tile));
    if constexpr (C::kSchedule == 0) {
        // Plain: S, softmax, O += P V, one block after the other (the other warpgroups fill in).
        for (int i = 0; i < n_blocks; ++i) {
            mbarrier_wait(bar.full_k(stage(i)), parity(i));
            if constexpr (kBiasInit) init_bias_columns<C>(acc_s, bias, col0(i));
            fence_operands(acc_s);
            wgmma_fence();
            issue_qk<C>(acc_s, desc_q, stage_desc(desc_k, i), kBiasInit);
            const int c0 = early_col0(i);
            const ModBits<C> bits = mask_bits(i, c0);  // loads run while the QK^T does
            wgmma_wait<0>();
            finish_qk(i, c0, bits, Bool<false>{});
            softmax(alpha);
            if (i == 0) release_previous_q();
            rescale(alpha);
            pack_p<C>(p, acc_s);
            mbarrier_wait(bar.full_v(stage(i)), parity(i));
            fence_pv_operands();
            wgmma_fence();
            pv(i);
            wgmma_wait<0>();
            fence_operands(acc_o);
            release_kv_slot<C>(bar.empty_v(stage(i)), lane);
        }
        final_turn = is_final();  // no turns to hand on
    } else {
        // Overlapped (FA3's IntraWGOverlap): S of block i and O += P V of block i - 1 are in flight
        // together; softmax of block i runs while the P V group still occupies the tensor cores.
        // (FA3 rescales O in the S group's shadow, after its issue: measured no faster here, and
        // a 4-byte spill in the document spec's hd256 causal variant; PERF_NOTES §16.)
        if constexpr (!kCarry) mbarrier_wait(bar.full_k(stage(0)), parity(0));
        // Block 0 up to its P, whole or (half_diag) over its lower half. The two are separate
        // copies up to P, so that no S accumulator leaves a wgmma on one path and a move on the
        // other (ptxas then serialized every wgmma: C7511).
        const auto first_block = [&](auto half) {
            if constexpr (kBiasInit) init_bias_columns<C>(acc_s, bias, col0(0));
            // (carry_qk: S is in flight already, over the whole block; the half's softmax
            // reads its lower half only, and its upper half of P is 0 all the same.)
            if constexpr (decltype(half)::value && !kCarry) {
                #pragma unroll
                for (int k = C::kBlockN / 4; k < C::kBlockN / 2; ++k) acc_s[k] = neg_inf();
            }
            if constexpr (!kCarry) {  // (carry_qk: issued in the previous tile's last turn)
                turns.acquire();
                fence_operands(acc_s);
                wgmma_fence();
                issue_qk<C, decltype(half)::value>(acc_s, desc_q, stage_desc(desc_k, 0), kBiasInit);
                turns.release(false);
            }
            const int c00 = early_col0(0);
            const ModBits<C> bits0 = mask_bits(0, c00);
            wgmma_wait<0>();
            finish_qk(0, c00, bits0, half);
            // O is 0: alpha unused. Half: the upper half's P is 0 without its exp2s.
            softmax_step<C, Mods::kDistanceSlopes, C::kBlockN / (decltype(half)::value ? 16 : 8)>(
                acc_s, row_max, row_sum, scale_log2, alpha, fixed, shift, factor);
            release_previous_q();
            pack_p<C>(p, acc_s);
            // pv_wait: block 0's V now, as every later block's at the end of its softmax.
            if constexpr (C::kPvWait) mbarrier_wait(bar.full_v(stage(0)), parity(0));
        };
        if (kHalfDiag && half0)
            first_block(Bool<true>{});
        else
            first_block(Bool<false>{});
        for (int i = 1; i < n_blocks; ++i) {
            mbarrier_wait(bar.full_k(stage(i)), parity(i));
            if constexpr (kBiasInit) init_bias_columns<C>(acc_s, bias, col0(i));
            turns.acquire();
            fence_operands(acc_s);
            fence_pv_operands();
            wgmma_fence();
            issue_qk<C>(acc_s, desc_q, stage_desc(desc_k, i), kBiasInit);
            if constexpr (C::kRescaleEarly) rescale(alpha);  // block i - 1's alpha
            if constexpr (!C::kPvWait) mbarrier_wait(bar.full_v(stage(i - 1)), parity(i - 1));
            pv(i - 1);
            turns.release(false);
            // carry_qk on the dynamic schedule takes the next tile while the last block's GEMMs
            // run, so that the hand-off stays off the tail's issue. (The static schedule's
            // is_final there, a loop over the CTA's later tiles, made ptxas serialize, C7519.)
            if constexpr (kCarry && C::kDynamic)
                if (i == n_blocks - 1) final_turn = is_final();
            const int c0 = early_col0(i);
            const ModBits<C> bits = mask_bits(i, c0);
            wgmma_wait<1>();  // S done, P V still running: p and acc_o stay untouched
            finish_qk(i, c0, bits, Bool<false>{});
            softmax(alpha);
            // pv_wait: the wait for this block's V (due before its P V, in the next turn) is a
            // branch, which ptxas does not schedule the wait for the P V group across. Without
            // it ptxas places that wait before the softmax, which then starts only when the
            // previous block's P V is done (PERF_NOTES §79).
            if constexpr (C::kPvWait) mbarrier_wait(bar.full_v(stage(i)), parity(i));
            wgmma_wait<0>();
            fence_operands(acc_o);
            release_kv_slot<C>(bar.empty_v(stage(i - 1)), lane);
            if constexpr (!C::kRescaleEarly) rescale(alpha);
            pack_p<C>(p, acc_s);
        }
        const int last = n_blocks - 1;
        if constexpr (!C::kPvWait) mbarrier_wait(bar.full_v(stage(last)), parity(last));
        // Early: the last block's alpha has no QK^T left to hide behind. (A tile of one block
        // rescales O = 0 by its alpha of 0, here and in the loop's first step.)
        if constexpr (C::kRescaleEarly) rescale(alpha);
        // carry_qk: the next tile's first S goes into this turn, after the P V (the epilogue
        // waits for that group only), so the next tile is known before it; its Q buffer and
        // first ring slot are the ones after this tile's, real or (no next tile) a dummy's.
        if constexpr (kCarry) {
            if (!C::kDynamic || n_blocks == 1) final_turn = is_final();  // (else asked above)
            if (!final_turn) wait_carried_operands<C>(bar, tile + 1, it + n_blocks);
        }
        turns.acquire();
        if constexpr (kCarry) fence_operands(acc_s);
        fence_pv_operands();
        wgmma_fence();
        pv(last);
        if constexpr (kCarry)
            issue_qk<C>(acc_s, carried_desc_q<C>(smem_u32, wg, tile + 1),
                        carried_desc_k<C>(smem_u32, it + n_blocks));
        else
            final_turn = is_final();
        turns.release(skipped.trail == 0 && final_turn);  // else the last trailing turn's
        if constexpr (kCarry)
            wgmma_wait<1>();
        else
            wgmma_wait<0>();
        fence_operands(acc_o);
        release_kv_slot<C>(bar.empty_v(stage(last)), lane);
    }

    for (int i = 0; i < skipped.trail; ++i) {
        pass_kv_slot<C>(bar, it + n_blocks + i);
        if constexpr (C::kSchedule != 0) {  // the plain schedule takes no turns
            turns.acquire();
            turns.release(i == skipped.trail - 1 && final_turn);
        }
    }

    // Epilogue: O /= l, LSE = (m*c + log2 l) * ln2; rows with l == 0 saw no key: O = 0, LSE = -inf.
    // O is staged in this warpgroup's own rows of its Q tile (every warp of it is past its last
    // QK^T once the named barrier opens), then each warp stores its 16 rows in 16-byte chunks, or
    // (kTmaStore) one thread stores the warpgroup's 64 rows by TMA, one box per panel.
    named_barrier_sync(1 + wg, 128);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = row_sum[h];
        if constexpr (C::kSumMma) {
            l = acc_o[C::kHeadDim / 2 + 2 * h];  // the whole row's sum, in every lane of the quad
        } else {
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
        }
        const bool empty = !(l > 0.f);
        const float inv = empty ? 0.f : 1.f / l;
        const int r = wg * 64 + warp * 16 + lane / 4 + 8 * h;  // row inside the tile
        if (lane % 4 == 0 && r < q_rows) {
            float row_lse = empty ? neg_inf() : (row_max[h] * scale_log2 + log2_approx(l)) * kLn2;
            if constexpr (Mods::kDistanceSlopes) row_lse -= bias.rho[h] * bias.scale;  // the shift
            lse[r] = row_lse;
        }
        #pragma unroll
        for (int i = 0; i < C::kHeadDim / 8; ++i)
            *reinterpret_cast<u32*>(q_tile + panel_offset<C>(C::kBlockM, r, i * 8 + 2 * (lane % 4))) =
                pack2<Elem>(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
    }
    if constexpr (C::kTmaStore) {
        // The TMA reads what the generic proxy wrote: fence, then every thread's O is in place.
        // Rows past seqlen_q fall outside the map and are not written.
        fence_proxy_async_shared();
        named_barrier_sync(1 + wg, 128);
        if (storer) {
            const u32 rows = smem_u32 + slot * C::kTileQ + wg * 64 * kSw;
            #pragma unroll
            for (int panel = 0; panel < C::kPanels; ++panel)
                tma_store_5d(map_o, rows + panel * C::kBlockM * kSw, 0, row0 + wg * 64, panel,
                             w.head, w.batch);
            bulk_commit_group();
        }
        return;  // the buffer goes back to the producer in the next tile (release_previous_q)
    }
    __syncwarp();
    constexpr int kChunks = C::kHeadDim / 8;  // 16-byte chunks per row
    #pragma unroll
    for (int idx = lane; idx < 16 * kChunks; idx += 32) {
        const int r = wg * 64 + warp * 16 + idx / kChunks, c = (idx % kChunks) * 8;
        if (r < q_rows)
            *reinterpret_cast<uint4*>(o + r * a.o_stride_s + c) =
                *reinterpret_cast<const uint4*>(q_tile + panel_offset<C>(C::kBlockM, r, c));
    }
    // The staging reads are done: the next tile's Q may land here (one arrival per warp).
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) mbarrier_arrive(bar.empty_q(q_bar));
}

// A tile whose rows all see no key: O = 0, LSE = -inf, by `threads` threads numbered from 0.
template <class C>
__device__ __forceinline__ void write_empty_tile(const FwdArgs<typename C::Elem>& a,
                                                 const TileWork& w, int thread, int threads) {
    typename C::Elem* o = a.o + w.batch * a.o_stride_b + w.head * a.o_stride_h + w.row0 * a.o_stride_s;
    float* lse = a.lse + (i64(w.batch) * a.heads + w.head) * a.seqlen_q + w.row0;
    for (int i = thread; i < w.q_rows * C::kHeadDim; i += threads)
        o[(i / C::kHeadDim) * a.o_stride_s + i % C::kHeadDim] = typename C::Elem{0};
    for (int i = thread; i < w.q_rows; i += threads) lse[i] = neg_inf();
}

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_fwd_sm90(const FwdArgs<typename C::Elem>& a,
                                               const TensorMap& map_q, const TensorMap& map_k,
                                               const TensorMap& map_v, const TensorMap& map_o,
                                               int* tile_counter, const Mods& mods = Mods{}) {
    extern __shared__ __align__(1024) unsigned char smem[];
    static_assert(C::kCluster == 1 || (!Mods::kKvRange && !Mods::kBlockSparse),
                  "a cluster's CTAs must see the same KV blocks");

    const TileSchedule<C, Mods> tiles_of_cta(a, mods);
    constexpr bool kDefer = TileSchedule<C, Mods>::kDefer;
    const int group = a.heads / a.heads_k;
    if constexpr (!C::kPersistent) {
        const TileWork w = tiles_of_cta.at(a, 0);
        // Every row of the tile sees no key: no barriers, no loads. (With a cluster, the other
        // CTA's tile sees the same keys, none: it returns here too.)
        if (w.n_blocks == 0) {
            write_empty_tile<C>(a, w, threadIdx.x, C::kThreads);
            return;
        }
    }

    // Swizzled tiles need 1024-byte alignment; the dynamic smem base is only guaranteed 16.
    const u32 raw = smem_addr(smem), base = (raw + 1023) & ~1023u;
    unsigned char* tiles = smem + (base - raw);
    const Sm90Barriers<C> bar{base + C::kOffBarriers};
    if (threadIdx.x == 0) {
        for (int j = 0; j < C::kQBarriers; ++j) {
            mbarrier_init(bar.full_q(j), 1);
            // One arrival per consumer warp (split: of the warpgroup), or per warpgroup's
            // storing thread (kTmaStore).
            mbarrier_init(bar.empty_q(j), C::kTmaStore ? C::kConsumers
                                                       : C::kQSplit ? 4 : 4 * C::kConsumers);
        }
        for (int s = 0; s < C::kStages; ++s) {
            mbarrier_init(bar.full_k(s), 1);
            mbarrier_init(bar.full_v(s), 1);
            mbarrier_init(bar.empty_k(s), 4 * C::kConsumers * C::kCluster);
            mbarrier_init(bar.empty_v(s), 4 * C::kConsumers * C::kCluster);
        }
        if constexpr (C::kDynamic)
            for (int j = 0; j < 2; ++j) {
                mbarrier_init(bar.full_t(j), 1);
                // + the producer thread's, when a scheduler thread publishes (kDefer).
                mbarrier_init(bar.empty_t(j), 4 * C::kConsumers + (kDefer ? 1 : 0));
            }
        mbarrier_fence_init();
    }
    if constexpr (C::kSumMma) {
        // sum_mma's panel of ones, written once; wgmma reads it through the async proxy.
        const u32 one = pack2<typename C::Elem>(1.f, 1.f);
        for (u32 i = threadIdx.x; i < C::kBlockN * C::kSwizzle / 16; i += C::kThreads)
            reinterpret_cast<uint4*>(tiles + C::kOffOnes)[i] = uint4{one, one, one, one};
        fence_proxy_async_shared();
    }
    // The last CTA-wide barrier: the producer's idle threads exit below. With a cluster, over
    // both CTAs: neither multicasts into or arrives on the other's barriers before their init.
    if constexpr (C::kCluster > 1)
        cluster_sync();
    else
        __syncthreads();

    // `it`: KV blocks through the ring so far; `done`: tiles with work so far (Q's buffer, phase).
    int it = 0, done = 0;
    const TileQueue<C> queue{bar, reinterpret_cast<int*>(tiles + C::kOffQueue), tile_counter};
    if (threadIdx.x < 128) {
        setmaxnreg_dec<C::kProducerRegs>();
        if constexpr (kDefer)
            if (threadIdx.x == 32) {  // the scheduler thread (TileQueue), in a warp of its own
                int j = 0, sum = tiles_of_cta.at(a, blockIdx.x).n_blocks, seen = 1;
                queue.publish(j++, blockIdx.x);
                for (int t; (t = queue.claim_longer(tiles_of_cta, a, sum, seen)) < tiles_of_cta.count;)
                    queue.publish(j++, t);
                for (int t; (t = queue.take_deferred(tiles_of_cta.count)) < tiles_of_cta.count;)
                    queue.publish(j++, t);
                queue.publish(j++, tiles_of_cta.count);
            }
        if (threadIdx.x == 0) {
            tma_prefetch(map_q);
            tma_prefetch(map_k);
            tma_prefetch(map_v);
            if constexpr (C::kTmaStore) tma_prefetch(map_o);
            const auto produce = [&](int t) {
                const TileWork w = tiles_of_cta.at(a, t);
                if (w.n_blocks == 0) return;
                sm90_produce<C>(base, bar, map_q, map_k, map_v, w, w.head / group, it, done);
                it += w.n_blocks;
                ++done;
            };
            if constexpr (kDefer) {
                int j = 0;
                for (int t = queue.take_alone(j++); t < tiles_of_cta.count; t = queue.take_alone(j++))
                    produce(t);
            } else if constexpr (C::kDynamic) {
                // The successor is claimed before this tile's loads and published after them:
                // the atomic's round trip hides behind the loads, and the consumers, who learn
                // it at the tile's last GEMM (is_final), find it published.
                int j = 0;
                queue.publish(j++, blockIdx.x);
                for (int t = blockIdx.x;;) {
                    const int next = queue.claim();
                    produce(t);
                    queue.publish(j++, min(next, tiles_of_cta.count));
                    if (next >= tiles_of_cta.count) break;
                    t = next;
                }
            } else {
                for (int t = tiles_of_cta.first(); tiles_of_cta.valid(t); t += tiles_of_cta.step())
                    produce(t);
            }
        }
        return;
    }
    setmaxnreg_inc<C::kConsumerRegs>();
    if constexpr (C::kCluster > 1) {   // a CTA per tile: the one tile of this CTA
        const TileWork w = tiles_of_cta.at(a, 0);
        if (w.q_rows <= 0) {
            pass_kv_ring<C>(bar, w.n_blocks);
            cluster_sync();
            return;
        }
    }
    const IssueTurns<C> turns{int(threadIdx.x / 128) - 1};
    // S's accumulators. carry_qk: an S group is in flight from the first turn on, that of the
    // next tile with work (first_carried_qk, then each tile's last turn), or after the last one
    // a dummy; a tile without work (written at once) then takes no turn, dynamic or not.
    float acc_s[C::kBlockN / 2];
    constexpr bool kCarry = C::kCarryQk;
    if constexpr (C::kDynamic) {
        // Every tile, with work or not, takes one turn per warpgroup (an empty one hands it on
        // at once), so the turns stay in step without knowing the tiles ahead; each CTA has a
        // first tile (the grid is at most the tile count), so the first turn is always taken.
        // (carry_qk: the tiles without work are written while the next tile is looked for.)
        turns.start();
        int j = 0;
        const auto take_work = [&] {
            int t = queue.take(j++);
            if constexpr (kCarry)
                for (; t < tiles_of_cta.count && !tiles_of_cta.has_work(a, t); t = queue.take(j++))
                    write_empty_tile<C>(a, tiles_of_cta.at(a, t), threadIdx.x - 128,
                                        C::kThreads - 128);
            return t;
        };
        int t = take_work();
        if constexpr (kCarry) first_carried_qk<C>(acc_s, base, bar, turns, t < tiles_of_cta.count);
        while (t < tiles_of_cta.count) {
            const TileWork w = tiles_of_cta.at(a, t);
            int next = tiles_of_cta.count;
            const auto is_final = [&] {
                next = take_work();
                return next >= tiles_of_cta.count;
            };
            if (!kCarry && w.n_blocks == 0) {
                write_empty_tile<C>(a, w, threadIdx.x - 128, C::kThreads - 128);
                const bool final = is_final();
                turns.acquire();
                turns.release(final);
            } else {
                sm90_consume<C>(a, mods, tiles, base, bar, map_o, turns, w, it, done, acc_s,
                                is_final);
                it += w.n_blocks;
                ++done;
            }
            t = next;
        }
    } else {
        // Pingpong's first turn, only in a CTA with a tile to compute: persistent, every tile of
        // a CTA may be empty (causal or a kv range), and an arrival no one waits for would stay
        // on the barrier past the CTA's exit.
        // (carry_qk: always, and a turn for its first S, a dummy in a CTA without work.)
        const bool work = !C::kPersistent ||
                          tiles_of_cta.more_work(a, tiles_of_cta.first() - tiles_of_cta.step());
        if constexpr (C::kPingpong)
            if (kCarry || work) turns.start();
        if constexpr (kCarry) first_carried_qk<C>(acc_s, base, bar, turns, work);
        for (int t = tiles_of_cta.first(); tiles_of_cta.valid(t); t += tiles_of_cta.step()) {
            const TileWork w = tiles_of_cta.at(a, t);
            if (w.n_blocks == 0) {   // persistent only: the other case returned above
                write_empty_tile<C>(a, w, threadIdx.x - 128, C::kThreads - 128);
                continue;
            }
            sm90_consume<C>(a, mods, tiles, base, bar, map_o, turns, w, it, done, acc_s,
                            [&] { return !tiles_of_cta.more_work(a, t); });
            it += w.n_blocks;
            ++done;
        }
    }
    if constexpr (kCarry) {
        wgmma_wait<0>();  // the dummy S after the CTA's last tile
        turns.drain();
    }
    // A cluster's CTAs leave together: the other one's consumers may still arrive on this CTA's
    // empty barriers (exited threads count as arrived at a cluster barrier, so the producer's
    // returned ones do not hold it up).
    if constexpr (C::kCluster > 1) cluster_sync();
    // The last tile's O store must have read shared memory before the CTA gives it up.
    if constexpr (C::kTmaStore)
        if (threadIdx.x % 128 == 0) bulk_wait_group_read<0>();
}

}  // namespace kg
