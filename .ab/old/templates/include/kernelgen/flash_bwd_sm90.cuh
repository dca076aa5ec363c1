// FlashAttention backward for Hopper (sm_90a), main kernel: TMA loads, an mbarrier ring, wgmma and
// warp specialization, following FA3's backward. It computes what flash_bwd_sm80.cuh computes
// (same BwdArgs; dK, dV per KV tile, dQ added in fp32 into dq_accum, which must not be null here),
// so the prep kernel and the dQ cast around it stay the same.
//
// One CTA owns BLOCK_N = 128 keys of one (kv head, batch). Warpgroup 0 is the producer (after
// setmaxnreg.dec): thread 0 loads K and V once and then, through a STAGES-deep ring, the Q and dO
// tiles (BLOCK_M rows) of every (query head of the GQA group, query tile) pair that sees these
// keys; warp 1 fills the same ring slot with LSE * log2e and D of those rows (plain loads: rows
// past seqlen_q must read 0, which a 1D bulk copy cannot do). Warpgroups 1 and 2 are consumers
// (setmaxnreg.inc), 64 keys each, and per pair compute, with the scores transposed (keys as rows):
//     S^T = K Q^T, dP^T = V dO^T               SS wgmma, both operands K-major
//     P^T = exp2(S^T * scale * log2e - LSE * log2e),  dS^T = P^T * (dP^T - D)
//     dV += P^T dO, dK += dS^T Q               RS wgmma: the S^T accumulator layout is the A
//                                              register layout (wgmma.cuh); dO, Q read MN-major
//     dQ = dS K                                SS wgmma with A = dS^T from shared memory read
//                                              transposed (imm-trans-a, 16-bit types only) and
//                                              B = K MN-major; then * scale into the consumer's
//                                              fp32 buffer, which warp 2 of the producer adds
//                                              into dq_accum by a TMA reduce-add
// dQ needs every key's dS, so both consumers write their dS^T rows to shared memory and meet at a
// named barrier; then warpgroup w computes head_dim columns w * HEAD_DIM / 2.. of it (head_dim
// 128), or all of it for the pairs it with it % 2 == w (head dims 64 and 96: half of head_dim is
// not a whole number of panels of K). dS^T is double-buffered by pair parity: a warpgroup writes
// buffer it % 2 only after both passed the barrier of pair it - 1, by which time each had retired
// its dQ wgmma of pair it - 2, the last reader of that buffer.
// The dQ adds went out as red.global.add.v2.f32 from the consumers before: per pair 16 (head dim
// 128) to 32 of them a thread, and their stalls on releasing address and data registers made
// about a fifth of the stall samples (hd128) (PERF_NOTES §88). Now a consumer stores its dQ
// part to shared memory, arrives on dq_full[wg] (with the pair in dq_pairs), and the reducing
// thread issues one bulk reduce-add of the box, waits until it has read the buffer and arrives on
// dq_empty[wg], which the consumer waits on before its next dQ store (one buffer each: the
// reduce reads 16 KiB in well under a pair's time). Not at head dim 96 (kDqTma: its consumers
// spilled), which keeps the atomics.
//
// Ring: full[s] completes on the producer's expect_tx (Q + dO bytes) plus one arrival per lane of
// the stats warp; empty[s] on one arrival per consumer warp once its wgmmas that read the slot
// are retired; pair[s] (kBwdSlotPairs) on warp 0's arrival once it wrote the slot's pair. Pair
// `it` uses slot it % STAGES with parity (it / STAGES) & 1; the producer waits on empty with the
// opposite parity, which a fresh barrier already satisfies.
//
// Mods (a spec's `mods`, the struct mods.inc.j2 renders; NoMods without) apply as in
// flash_bwd_sm80.cuh: P = exp(score_mod(scale * q.k) - LSE), 0 where a built-in mask or the
// mask_mod hides the pair, dS = P (dP - D) score_mod_grad(scale * q.k). One pass over the S^T
// accumulators (bwd_mod_probs) packs P for dV and leaves P * score_mod_grad in their place, so dS
// costs no registers more than without mods. A kv range skips the pairs whose keys miss this KV
// tile: warp 0 walks the pairs, finding the next one 32 at a time (first_seen), so the
// producer's loads are issued by lane 0 of a whole warp then, which also hands each slot's pair
// to the stats warp and the consumers (bwd_sm90_pairs.cuh, kBwdSlotPairs). A block mask
// (mods.block_sparse) lists the pairs instead: the query tiles of this KV block for each head of
// the GQA group, partial ones (mask_mod per element) first; thread 0 reads the lists and hands
// the pairs on the same way (but at head dim 96, where every role reads them).
//
// The dQ hand-off (buffers, reducer, the hd96 atomics) is bwd_sm90_dq.cuh.
//
// Shared memory (1024-aligned): K | V | STAGES x Q | STAGES x dO | 2 x dS^T | 2 x dQ (fp32) |
// STAGES x (LSE, D) | STAGES x the pair (kBwdSlotPairs) | 2 x dQ's pair | barriers. Q, K, V, dO tiles are panels of 64
// (128B-swizzled) or 32 (64B) head_dim columns as TMA writes them (the forward's layout,
// flash_fwd_sm90.cuh); dS^T is [key][query], one 128B panel of 64 queries.
#pragma once
#include "kernelgen/flash_bwd_sm80.cuh"  // BwdArgs
#include "kernelgen/bwd_sm90_config.cuh"
#include "kernelgen/bwd_sm90_dq.cuh"
#include "kernelgen/bwd_sm90_pairs.cuh"
#include "kernelgen/bwd_sm90_probs.cuh"
#include "kernelgen/mbarrier.cuh"
#include "kernelgen/tma.cuh"
#include "kernelgen/wgmma.cuh"

namespace kg {

// ---- the producer warpgroup -----------------------------------------------------------------

// K and V of the CTA's tile, once (thread 0: the producer's issuing thread, or, kBwdEarlyKv,
// before the pairs are counted).
// kPrefetch: their descriptors' prefetch first (the producer's path prefetches all four first).
template <class C, bool kPrefetch = true>
__device__ __forceinline__ void bwd_load_kv(u32 base, BwdSm90Barriers<C> bar, const TensorMap& map_k,
                                            const TensorMap& map_v, const BwdWork& w) {
    if constexpr (kPrefetch) {
        tma_prefetch(map_k);
        tma_prefetch(map_v);
    }
    mbarrier_arrive_expect_tx(bar.full_kv(), 2 * C::kTileKV);
    tma_load_5d(base + C::kOffK, map_k, bar.full_kv(), 0, w.kv0, 0, w.kv_head, w.batch, kEvictFirst);
    tma_load_5d(base + C::kOffV, map_v, bar.full_kv(), 0, w.kv0, 0, w.kv_head, w.batch, kEvictFirst);
}

// Thread 0: K and V once, then Q and dO of every pair through the ring.
// With a kv range the whole warp 0 walks the pairs (the search is warp-wide) and its lane 0
// issues; otherwise thread 0 alone runs this. With kBwdSlotPairs (a kv range, a block mask) the
// issuing thread writes each slot's pair for the stats warp and the consumers: the one walk (the
// stats warp's own, beside its loads, did not fit 24 registers).
template <class C, class Mods>
__device__ __forceinline__ void bwd_produce_tiles(u32 base, BwdSlotPair* slot_pairs,
                                                  BwdSm90Barriers<C> bar,
                                                  const TensorMap& map_q, const TensorMap& map_k,
                                                  const TensorMap& map_v, const TensorMap& map_do,
                                                  BwdWalk<C, Mods> walk) {
    const BwdWork& w = walk.w;
    const bool issue = !kBwdSkipPairs<Mods> || threadIdx.x % 32 == 0;
    if (issue) {
        tma_prefetch(map_q);
        if constexpr (!kBwdEarlyKv<Mods>) {
            tma_prefetch(map_k);
            tma_prefetch(map_v);
        }
        tma_prefetch(map_do);
        if constexpr (!kBwdEarlyKv<Mods>) bwd_load_kv<C, false>(base, bar, map_k, map_v, w);
    }
    walk.first();
    for (int it = 0; it < w.n_iter; ++it) {
        const BwdPair pair = walk.step(it);
        const int s = it % C::kStages, head = pair.head, m0 = pair.m0;
        if (!issue) continue;
        mbarrier_wait(bar.empty(s), (u32(it / C::kStages) & 1) ^ 1);
        if constexpr (kBwdSlotPairs<C, Mods>) {  // for the stats warp and the consumers
            slot_pairs[s] = BwdSlotPair{head, m0, pair.partial, 0};
            mbarrier_arrive(bar.pair(s));
        }
        mbarrier_arrive_expect_tx(bar.full(s), 2 * C::kTileQ);
        // Q and dO are read again by the CTAs of the other KV tiles of this head.
        tma_load_5d(base + C::kOffQ + s * C::kTileQ, map_q, bar.full(s), 0, m0, 0, head, w.batch,
                    kEvictLast);
        tma_load_5d(base + C::kOffDo + s * C::kTileQ, map_do, bar.full(s), 0, m0, 0, head, w.batch,
                    kEvictLast);
    }
}

// Warp 1 (`lane` 0..31): LSE * log2e and D of every pair's rows into its slot; rows past seqlen_q
// get 0, so their P and dS stay finite (they meet zero rows of Q and dO and are never stored).
// With kBwdSlotPairs it takes the pairs from warp 0 (bar.pair) instead of walking itself.
template <class C, class Mods>
__device__ __forceinline__ void bwd_produce_stats(const BwdArgs<typename C::Elem>& a,
                                                  unsigned char* tiles, BwdSm90Barriers<C> bar,
                                                  BwdWalk<C, Mods> walk, int lane) {
    const BwdWork& w = walk.w;
    if constexpr (!kBwdSlotPairs<C, Mods>) walk.first();
    for (int it = 0; it < w.n_iter; ++it) {
        BwdPair pair;
        if constexpr (kBwdSlotPairs<C, Mods>) {  // the loads' warp has waited for the slot's empty
            mbarrier_wait(bar.pair(it % C::kStages), u32(it / C::kStages) & 1);
            const BwdSlotPair found = slot_pairs<C>(tiles)[it % C::kStages];
            pair = BwdPair{found.head, found.m0, found.partial};
        } else {
            pair = walk.step(it);
        }
        const int s = it % C::kStages, m0 = pair.m0;
        const i64 row0 = (i64(w.batch) * a.heads + pair.head) * a.seqlen_q + m0;
        float* stats = reinterpret_cast<float*>(tiles + C::kOffStats) + s * 2 * C::kBlockM;
        if constexpr (!kBwdSlotPairs<C, Mods>)
            mbarrier_wait(bar.empty(s), (u32(it / C::kStages) & 1) ^ 1);
        #pragma unroll
        for (int r = lane; r < C::kBlockM; r += 32) {
            const bool inside = m0 + r < a.seqlen_q;
            stats[r] = inside ? a.lse[row0 + r] * kLog2e : 0.f;
            stats[C::kBlockM + r] = inside ? a.dsum[row0 + r] : 0.f;
        }
        mbarrier_arrive(bar.full(s));
    }
}

// ---- the steps of one consumer warpgroup ----------------------------------------------------

// S^T = K Q^T (or dP^T = V dO^T) of one pair, one wgmma group of head_dim / 16 k-steps; desc_a
// names the warpgroup's 64 rows of K (V), desc_b the slot's Q (dO) tile.
template <class C>
__device__ __forceinline__ void issue_sdp(float (&acc)[C::kBlockM / 2], u64 desc_a, u64 desc_b) {
    #pragma unroll
    for (int kk = 0; kk < C::kHeadDim / 16; ++kk) {
        const int panel = kk / C::kStepsPerPanel, step = kk % C::kStepsPerPanel;
        C::SdpGemm::mma(acc, desc_a + ((panel * C::kBlockN * C::kSwizzle + step * 32) >> 4),
                        desc_b + ((panel * C::kBlockM * C::kSwizzle + step * 32) >> 4), kk > 0);
    }
    wgmma_commit();
}

// dV += P^T dO (or dK += dS^T Q), one wgmma group of BLOCK_M / 16 k-steps of 16 query rows; the
// A fragments are read from registers while it runs and must not change until it is retired.
template <class C>
__device__ __forceinline__ void issue_dkv(float (&acc)[C::kHeadDim / 2],
                                          const u32 (&a)[C::kBlockM / 16][4], u64 desc_b) {
    #pragma unroll
    for (int kk = 0; kk < C::kBlockM / 16; ++kk)
        C::DkvGemm::mma(acc, a[kk], desc_b + ((kk * 16 * C::kSwizzle) >> 4));
    wgmma_commit();
}

// dQ (this warpgroup's part) = dS K over the tile's keys, one group of BLOCK_N / 16 k-steps.
template <class C>
__device__ __forceinline__ void issue_dq(float (&acc)[C::kDqN / 2], u64 desc_ds, u64 desc_k) {
    #pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk)
        C::DqGemm::mma(acc, desc_ds + ((kk * 16 * C::kDsSwizzle) >> 4),
                       desc_k + ((kk * 16 * C::kSwizzle) >> 4), kk > 0);
    wgmma_commit();
}

// One consumer warpgroup: keys kv0 + 64 * wg .. + 63 of the CTA's tile.
template <class C, class Mods>
__device__ __forceinline__ void bwd_consume(const BwdArgs<typename C::Elem>& a, unsigned char* tiles,
                                            u32 base, BwdSm90Barriers<C> bar, BwdWalk<C, Mods> walk,
                                            int wg) {
    const BwdWork& w = walk.w;
    using Elem = typename C::Elem;
    constexpr int kSw = C::kSwizzle;
    constexpr int kAccS = C::kBlockM / 2, kAccD = C::kHeadDim / 2, kAccQ = C::kDqN / 2;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int shift = a.seqlen_k - a.seqlen_q;  // causal: query i sees keys <= i + shift
    // This thread's accumulator elements (wgmma.cuh): rows (keys, in the tile) lane_key and
    // lane_key + 8, columns (queries, in the query tile) lane_col + 8 * i + {0, 1}.
    const int lane_key = 64 * wg + 16 * warp + lane / 4, lane_col = 2 * (lane % 4);
    const float scale_log2 = a.softmax_scale * kLog2e;

    // Descriptors of each operand's first k16 step; slots and steps add their byte offset >> 4.
    const u64 desc_k = desc_k_major<kSw>(base + C::kOffK + 64 * wg * kSw);
    const u64 desc_v = desc_k_major<kSw>(base + C::kOffV + 64 * wg * kSw);
    const u64 desc_q = desc_k_major<kSw>(base + C::kOffQ);
    const u64 desc_do = desc_k_major<kSw>(base + C::kOffDo);
    const u64 desc_q_mn = desc_mn_major<kSw>(base + C::kOffQ, C::kBlockM * kSw);
    const u64 desc_do_mn = desc_mn_major<kSw>(base + C::kOffDo, C::kBlockM * kSw);
    // dQ: dS^T (one panel of 64 queries) and this warpgroup's head_dim columns of K.
    const int dq_col0 = C::kDqHalves ? wg * C::kDqN : 0;
    const u64 desc_ds = desc_mn_major<C::kDsSwizzle>(base + C::kOffDs, C::kBlockN * C::kDsSwizzle);
    const u64 desc_k_mn = desc_mn_major<kSw>(
        base + C::kOffK + (dq_col0 / C::kPanel) * C::kBlockN * kSw, C::kBlockN * kSw);
    const float* stats_all = reinterpret_cast<const float*>(tiles + C::kOffStats);

    float acc_dk[kAccD], acc_dv[kAccD], acc_s[kAccS], acc_dp[kAccS], acc_dq[kAccQ];
    #pragma unroll
    for (int i = 0; i < kAccD; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    Packed<C::kBlockM> p16, ds16;

    mbarrier_wait(bar.full_kv(), 0);
    if constexpr (!kBwdSlotPairs<C, Mods>) walk.first();
    // One pair, step `it` of the walk; `hidden` (Bool) true where none of this warpgroup's 64
    // keys is seen by the pair's rows: then its dS^T rows are zeros and it runs no GEMM but its
    // part of dQ (bwd_hidden_last).
    const auto pair_step = [&](const int it, auto hidden) {
        constexpr bool kHidden = decltype(hidden)::value;
        const int s = it % C::kStages;
        BwdPair pair;
        if constexpr (!kBwdSlotPairs<C, Mods>) pair = walk.step(it);
        const u64 slot = (s * C::kTileQ) >> 4;
        const float* lse2 = stats_all + s * 2 * C::kBlockM;
        const float* dsum = lse2 + C::kBlockM;
        mbarrier_wait(bar.full(s), u32(it / C::kStages) & 1);
        if constexpr (kBwdSlotPairs<C, Mods>) {  // the producer's record of the slot's pair
            const BwdSlotPair found = slot_pairs<C>(tiles)[s];
            pair = BwdPair{found.head, found.m0, found.partial};
        }
        const int head = pair.head, m0 = pair.m0;
        if constexpr (kHidden) {
            unsigned char* ds_tile = tiles + C::kOffDs + (it % 2) * C::kTileDs;
            // dS^T = 0 in this warpgroup's rows, which dQ reads: P^T is 0 there.
            #pragma unroll
            for (int i = 0; i < C::kBlockM / 8; ++i)
                #pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<u32*>(ds_tile + panel_offset_bwd<C::kDsSwizzle>(
                        C::kBlockN, lane_key + 8 * h, lane_col + 8 * i)) = 0u;
            fence_proxy_async_shared();
        } else {
            // Zeroed here (the first k-step overwrites them anyway), so that nothing of the last
            // pair stays live across the loop: the wgmma's "+f" operands would read them.
            #pragma unroll
            for (int i = 0; i < kAccS; ++i) acc_s[i] = acc_dp[i] = 0.f;
            fence_operands(acc_s);
            fence_operands(acc_dp);
            wgmma_fence();
            issue_sdp<C>(acc_s, desc_k, desc_q + slot);
            issue_sdp<C>(acc_dp, desc_v, desc_do + slot);
            // This lane's LSE (times log2 e) of the pair's queries, read while the GEMMs run: read
            // after the wait, the first exp2 stalled on them (PERF_NOTES §89). Not everywhere:
            // LaneStats says where.
            LaneStats<C> lse;
            lse.load(lse2 + lane_col);

            // P^T in place of S^T. Keys past seqlen_k and, causal, keys past a query's diagonal get
            // 0; that also covers queries that see no key (LSE = -inf, P = inf before the select),
            // which only occur in tiles that straddle the diagonal. Only those tiles pay.
            const int key0 = w.kv0 + lane_key, query0 = m0 + lane_col;
            bool need_mask = w.kv0 + 64 * wg + 64 > a.seqlen_k;
            if constexpr (C::kCausal) need_mask |= w.kv0 + 64 * wg + 63 > m0 + shift;
            // The mask_mod per element: in a block mask's partial tiles, else unless the kv range
            // vouches for this warpgroup's 64 keys and the tile's rows. Found here, while the
            // GEMMs run: found by the stats warp beside its loads, it put the bounds' loads on the
            // slot's full barrier, and packed / varlen ran 4-6% slower (PERF_NOTES §92). Its
            // verdicts are taken while the GEMMs run too (kEarlyModBits).
            bool need_mod_mask = Mods::kMaskMod;
            u32 mod_hidden = 0;
            if constexpr (Mods::kMaskMod) {
                if constexpr (Mods::kBlockSparse)
                    need_mod_mask = pair.partial != 0;
                else if constexpr (Mods::kKvRange)
                    need_mod_mask = mod_mask_needed<64>(walk.mods, w.kv0 + 64 * wg, m0,
                                                        min(m0 + C::kBlockM, a.seqlen_q) - 1,
                                                        w.batch, head, a.seqlen_q, a.seqlen_k);
                if (kEarlyModBits<C> && need_mod_mask)
                    mod_hidden = bwd_mod_hidden_bits<C>(a, walk.mods, w.batch, head, key0, query0);
            }
            wgmma_wait<1>();
            fence_operands(acc_s);
            if constexpr (kHasMods<Mods>) {
                bwd_mod_probs<C>(acc_s, p16, a, walk.mods, w.batch, head, key0, query0, lse,
                                 need_mask, need_mod_mask, mod_hidden);
            } else {
                #pragma unroll
                for (int i = 0; i < C::kBlockM / 8; ++i)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc_s[4 * i + e] = exp2_approx(
                            fmaf(acc_s[4 * i + e], scale_log2, -(e & 1 ? lse[i].y : lse[i].x)));
                if (need_mask) {
                    #pragma unroll
                    for (int i = 0; i < C::kBlockM / 8; ++i)
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = key0 + 8 * (e / 2), query = query0 + 8 * i + (e & 1);
                            bool masked = key >= a.seqlen_k;
                            if constexpr (C::kCausal) masked |= key > query + shift;
                            if (masked) acc_s[4 * i + e] = 0.f;
                        }
                }
                pack_a<Elem>(p16, acc_s);
            }
            // dV += P^T dO runs while dS^T is computed (P^T lives in fp32 and packed meanwhile).
            fence_operands(acc_dv);
            fence_packed(p16);
            wgmma_fence();
            issue_dkv<C>(acc_dv, p16.r, desc_do_mn + slot);
            LaneStats<C> d;  // D of the pair's queries, likewise read before the wait
            d.load(dsum + lane_col);
            wgmma_wait<1>();  // dP^T is done; dV may still run
            fence_operands(acc_dp);
            #pragma unroll
            for (int i = 0; i < C::kBlockM / 8; ++i)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_dp[4 * i + e] =
                        acc_s[4 * i + e] * (acc_dp[4 * i + e] - (e & 1 ? d[i].y : d[i].x));
            pack_a<Elem>(ds16, acc_dp);

            // dS^T to this pair's buffer (for dQ), visible to the async proxy before the barrier.
            unsigned char* ds_tile = tiles + C::kOffDs + (it % 2) * C::kTileDs;
            #pragma unroll
            for (int i = 0; i < C::kBlockM / 8; ++i)
                #pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<u32*>(ds_tile + panel_offset_bwd<C::kDsSwizzle>(
                        C::kBlockN, lane_key + 8 * h, lane_col + 8 * i)) =
                        ds16.r[i / 2][(i % 2) * 2 + h];
            fence_proxy_async_shared();

            fence_operands(acc_dk);
            fence_packed(ds16);
            wgmma_fence();
            issue_dkv<C>(acc_dk, ds16.r, desc_q_mn + slot);
        }

        // Both warpgroups' dS^T rows are written before dQ reads them. With dQ taken in turns,
        // only the pair's dQ warpgroup waits; the other arrives (bar.arrive: its stores are
        // performed for the participants when the barrier completes) and goes on to its next
        // pair, where it is the one that waits (hd64 spent 9% of its stall samples here, one
        // warpgroup idle through the other's dQ every pair: PERF_NOTES §90). One barrier per
        // dS^T buffer, so that no warpgroup arrives twice at one before the other has waited;
        // its next write to this buffer follows its own wait at the next pair, which the dQ
        // warpgroup reaches only once this dQ has read the buffer.
        const bool dq_here = C::kDqHalves || it % 2 == wg;
        const u32 ds_bar = C::kDqHalves ? kBarDs : kBarDs + it % 2;
        if (dq_here) named_barrier_sync(ds_bar, 256);
        else named_barrier_arrive(ds_bar, 256);
        if (dq_here) {
            #pragma unroll
            for (int i = 0; i < kAccQ; ++i) acc_dq[i] = 0.f;
            fence_operands(acc_dq);
            wgmma_fence();
            issue_dq<C>(acc_dq, desc_ds + (((it % 2) * C::kTileDs) >> 4), desc_k_mn);
        }
        // dV and dK, the slot's last readers, are done; dQ may still run. (Not when dQ is taken
        // in turns: a wait count that differs between the branches serializes every wgmma, C7518.)
        if constexpr (kHidden) {
            if constexpr (!C::kDqHalves) wgmma_wait<0>();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(bar.empty(s));  // the slot was never read
        } else {
            if constexpr (C::kDqHalves) wgmma_wait<1>();
            else wgmma_wait<0>();
            fence_operands(acc_dv);
            fence_operands(acc_dk);
            __syncwarp();  // every lane's reads of the slot's LSE and D are done
            if (lane == 0) mbarrier_arrive(bar.empty(s));
        }

        // scale * dQ to this warpgroup's buffer, for the reducer's add into dq_accum[query,
        // head, dq_col0..] once the buffer's last add has read it (kDqTma; else added here).
        if (!dq_here) return;
        if constexpr (C::kDqHalves) wgmma_wait<0>();
        fence_operands(acc_dq);
        if constexpr (C::kDqTma)
            bwd_stage_dq<C>(tiles, bar, acc_dq, a.softmax_scale, wg, C::kDqHalves ? it : it / 2,
                            head, m0);
        else
            bwd_red_dq<C>(a, acc_dq, w.batch, head, m0 + 16 * warp + lane / 4, dq_col0 + lane_col);
    };
    // Causal: the walk's last pair is the first head's diagonal query tile (kBwdPeelDiagonal),
    // whose rows see none of the second warpgroup's keys in most KV tiles (in all where
    // seqlen_k - seqlen_q is a multiple of 64): ~5% of the pairs at 1k (PERF_NOTES §91), the
    // kernel 2.6% faster there, 1.4% at 4k (§92). Peeled after the loop, not a branch in it:
    // ptxas serialized or spilled every branch around the GEMMs there (§90). Both warpgroups
    // peel (the first runs the pair in full), so the loop's bound depends on the CTA alone: a
    // bound per warpgroup was one live register more, spilled.
    const bool peel = bwd_hidden_last<C, Mods>(a, w);
    int it = 0;
    for (const int n = w.n_iter - int(peel); it < n; ++it) pair_step(it, Bool<false>{});
    if (peel) {
        if (wg == 1) pair_step(it, Bool<true>{});
        else pair_step(it, Bool<false>{});
    }

    // Epilogue: dK * scale and dV to 16 bits, staged in this warp's own rows of the K and V tiles
    // (once both warpgroups are past their last dQ, which read all of K), then 16-byte stores.
    named_barrier_sync(kBarEpilogue, 256);
    #pragma unroll
    for (int i = 0; i < C::kHeadDim / 8; ++i)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 at = panel_offset_bwd<kSw>(C::kBlockN, lane_key + 8 * h, lane_col + 8 * i);
            *reinterpret_cast<u32*>(tiles + C::kOffK + at) =
                pack2<Elem>(acc_dk[4 * i + 2 * h] * a.softmax_scale,
                            acc_dk[4 * i + 2 * h + 1] * a.softmax_scale);
            *reinterpret_cast<u32*>(tiles + C::kOffV + at) =
                pack2<Elem>(acc_dv[4 * i + 2 * h], acc_dv[4 * i + 2 * h + 1]);
        }
    __syncwarp();
    const int kv_rows = a.seqlen_k - w.kv0;
    Elem* dk = a.dk + w.batch * a.dk_stride_b + w.kv_head * a.dk_stride_h + w.kv0 * a.dk_stride_s;
    Elem* dv = a.dv + w.batch * a.dv_stride_b + w.kv_head * a.dv_stride_h + w.kv0 * a.dv_stride_s;
    constexpr int kChunks = C::kHeadDim / 8;  // 16-byte chunks per row
    #pragma unroll
    for (int idx = lane; idx < 16 * kChunks; idx += 32) {
        const int r = 64 * wg + 16 * warp + idx / kChunks, c = (idx % kChunks) * 8;
        if (r < kv_rows) {
            const u32 at = panel_offset_bwd<kSw>(C::kBlockN, r, c);
            *reinterpret_cast<uint4*>(dk + r * a.dk_stride_s + c) =
                *reinterpret_cast<const uint4*>(tiles + C::kOffK + at);
            *reinterpret_cast<uint4*>(dv + r * a.dv_stride_s + c) =
                *reinterpret_cast<const uint4*>(tiles + C::kOffV + at);
        }
    }
}

// A KV tile no query sees (causal, seqlen_q < seqlen_k): dK = dV = 0.
template <class C>
__device__ __forceinline__ void write_empty_kv_tile(const BwdArgs<typename C::Elem>& a,
                                                    const BwdWork& w) {
    using Elem = typename C::Elem;
    const int rows = min(a.seqlen_k - w.kv0, C::kBlockN);
    Elem* dk = a.dk + w.batch * a.dk_stride_b + w.kv_head * a.dk_stride_h + w.kv0 * a.dk_stride_s;
    Elem* dv = a.dv + w.batch * a.dv_stride_b + w.kv_head * a.dv_stride_h + w.kv0 * a.dv_stride_s;
    for (int i = threadIdx.x; i < rows * C::kHeadDim; i += C::kThreads) {
        dk[(i / C::kHeadDim) * a.dk_stride_s + i % C::kHeadDim] = Elem{0};
        dv[(i / C::kHeadDim) * a.dv_stride_s + i % C::kHeadDim] = Elem{0};
    }
}

template <class C, class Mods = NoMods>
__device__ __forceinline__ void flash_bwd_sm90(const BwdArgs<typename C::Elem>& a,
                                               const TensorMap& map_q, const TensorMap& map_k,
                                               const TensorMap& map_v, const TensorMap& map_do,
                                               const TensorMap& map_dq, const Mods& mods = Mods{}) {
    extern __shared__ __align__(1024) unsigned char smem[];
    BwdWork w = bwd_tile<C>(a, mods);
    if constexpr (!kBwdEarlyKv<Mods>) {
        bwd_count<C>(a, mods, w);
        if (w.n_iter == 0) {  // no barriers, no loads
            write_empty_kv_tile<C>(a, w);
            return;
        }
    }

    // Swizzled tiles need 1024-byte alignment; the dynamic smem base is only guaranteed 16.
    const u32 raw = smem_addr(smem), base = (raw + 1023) & ~1023u;
    unsigned char* tiles = smem + (base - raw);
    const BwdSm90Barriers<C> bar{base + C::kOffBarriers};
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::kStages; ++s) {
            mbarrier_init(bar.full(s), 1 + C::kStatsArrivals);
            mbarrier_init(bar.empty(s), 4 * C::kConsumers);  // one arrival per consumer warp
        }
        mbarrier_init(bar.full_kv(), 1);
        if constexpr (kBwdSlotPairs<C, Mods>)
            for (int s = 0; s < C::kStages; ++s) mbarrier_init(bar.pair(s), 1);
        for (int wg = 0; C::kDqTma && wg < C::kConsumers; ++wg) {
            mbarrier_init(bar.dq_full(wg), 4);  // one arrival per warp of the consumer
            mbarrier_init(bar.dq_empty(wg), 1);
        }
        mbarrier_fence_init();
        if constexpr (kBwdEarlyKv<Mods>) bwd_load_kv<C>(base, bar, map_k, map_v, w);
    }
    if constexpr (kBwdEarlyKv<Mods>) {
        bwd_count<C>(a, mods, w);   // while K and V load
        if (w.n_iter == 0) {
            write_empty_kv_tile<C>(a, w);
            if (threadIdx.x == 0) mbarrier_wait(bar.full_kv(), 0);  // TMA done with this smem
            return;
        }
    }
    __syncthreads();  // the last CTA-wide barrier: the producer's idle warps exit below

    const BwdWalk<C, Mods> walk{a, mods, w};
    if (threadIdx.x < 128) {
        setmaxnreg_dec<C::kProducerRegs>();
        if (kBwdSkipPairs<Mods> ? threadIdx.x < 32 : threadIdx.x == 0)
            bwd_produce_tiles<C>(base, slot_pairs<C>(tiles), bar, map_q, map_k, map_v, map_do,
                                 walk);
        else if (threadIdx.x / 32 == 1)
            bwd_produce_stats<C>(a, tiles, bar, walk, threadIdx.x % 32);
        else if (C::kDqTma && threadIdx.x == 64)
            bwd_reduce_dq<C>(tiles, base, bar, map_dq, w);
        return;
    }
    setmaxnreg_inc<C::kConsumerRegs>();
    bwd_consume<C>(a, tiles, base, bar, walk, int(threadIdx.x / 128) - 1);
}

}  // namespace kg
