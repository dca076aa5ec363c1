// The Hopper backward's compile-time configuration (one variant's tiles, ring and shared-memory
// layout) and its mbarriers (flash_bwd_sm90.cuh says how the pipeline uses them).
#pragma once
#include "kernelgen/types.cuh"
#include "kernelgen/wgmma_desc.cuh"  // swizzle

namespace kg {

// Whether a Mods struct changes anything (NoMods: the plain kernel, its code unchanged).
template <class Mods>
constexpr bool kHasMods = Mods::kScoreMod || Mods::kMaskMod || Mods::kKvRange || Mods::kBlockSparse;

// The consumers' named barriers (0 is __syncthreads): both warpgroups' dS^T rows written, one
// per dS^T buffer (kBarDs + pair parity), and the epilogue's, once both are past their last dQ.
constexpr u32 kBarDs = 1, kBarEpilogue = 3;

// SdpGemm::mma(float (&)[BLOCK_M / 2], u64 desc_a, u64 desc_b, int accumulate),
// DkvGemm::mma(float (&)[HEAD_DIM / 2], const u32 (&a)[4], u64 desc_b) and
// DqGemm::mma(float (&)[kDqN / 2], u64 desc_a, u64 desc_b, int accumulate): one k16 step each,
// rendered by the template for this variant's N.
template <class Elem_, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL,
          class SdpGemm_, class DkvGemm_, class DqGemm_>
struct BwdSm90Config {
    using Elem = Elem_;
    using SdpGemm = SdpGemm_;
    using DkvGemm = DkvGemm_;
    using DqGemm = DqGemm_;
    static constexpr int kHeadDim = HEAD_DIM, kBlockM = BLOCK_M, kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr bool kCausal = CAUSAL;
    static constexpr int kConsumers = BLOCK_N / 64;          // one warpgroup per 64 keys
    static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
    static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // FA3's backward budgets
    // Q, K, V, dO: bytes per panel row (64 or, for head dims not a multiple of 64, 32 columns);
    // dS^T: 128 (BLOCK_M = 64 queries, one panel).
    static constexpr int kSwizzle = HEAD_DIM % 64 == 0 ? 128 : 64, kDsSwizzle = 128;
    static constexpr int kPanel = kSwizzle / 2;              // head_dim columns per panel
    static constexpr int kStepsPerPanel = kPanel / 16;       // k16 steps inside a panel
    // dQ split between the consumers: halves of head_dim where each half is whole panels of K
    // (128), else the whole of dQ by one warpgroup, the two taking turns by pair parity (64).
    static constexpr bool kDqHalves = HEAD_DIM / 2 % kPanel == 0;
    static constexpr int kDqN = kDqHalves ? HEAD_DIM / 2 : HEAD_DIM;
    static constexpr u32 kTileKV = BLOCK_N * HEAD_DIM * 2, kTileQ = BLOCK_M * HEAD_DIM * 2;
    static constexpr u32 kTileDs = BLOCK_N * BLOCK_M * 2;
    static constexpr u32 kOffK = 0, kOffV = kTileKV, kOffQ = 2 * kTileKV;
    static constexpr u32 kOffDo = kOffQ + STAGES * kTileQ, kOffDs = kOffDo + STAGES * kTileQ;
    // dQ * scale of one consumer's pair in fp32 for the TMA reduce-add into dq_accum: panels of
    // 32 columns (128 bytes a row, 128B-swizzled, so the accumulator's float2 stores from 8 rows
    // a warp meet no bank twice), one buffer per consumer warpgroup.
    // Not at head dim 96, whose consumers keep red.global.add: ptxas spilled 24-72 bytes there
    // with the shared-memory stores, however their addresses were computed.
    static constexpr bool kDqTma = HEAD_DIM != 96;
    static constexpr int kDqSwizzle = 128, kDqPanel = kDqSwizzle / 4;
    static constexpr u32 kTileDq = kDqTma ? BLOCK_M * kDqN * 4 : 0;
    static constexpr u32 kOffDq = kOffDs + 2 * kTileDs;
    static constexpr u32 kOffStats = kOffDq + kConsumers * kTileDq;  // [STAGES][LSE * log2e, D][BLOCK_M]
    // [STAGES] int4: the slot's pair (head, m0, partial) where the walk reads memory (BwdSlotPair)
    static constexpr u32 kOffPairs = kOffStats + STAGES * 2 * BLOCK_M * 4;
    // [kConsumers] int4: the pair whose dQ a consumer's buffer holds (BwdSlotPair), for the
    // reducing thread
    static constexpr u32 kOffDqPairs = kOffPairs + STAGES * 16;
    static constexpr u32 kOffBarriers = kOffDqPairs + kConsumers * 16;
    // full[], empty[], full_kv, pair[], dq_full[], dq_empty[]
    static constexpr int kBarriers = 3 * STAGES + 1 + 2 * kConsumers;
    static constexpr u32 kSmemBytes = 1024 + kOffBarriers + 8 * kBarriers;  // + 1024: realignment
    static constexpr int kStatsArrivals = 32;                 // the stats warp's lanes

    static_assert(BLOCK_N == 128, "two consumer warpgroups of 64 keys");
    static_assert(BLOCK_M == 64, "dQ's M is one wgmma (and dS^T one 64-query panel)");
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "whole 64B panels; wgmma N <= 256");
    static_assert(kTileQ % 1024 == 0 && kTileKV % 1024 == 0 && kTileDq % 1024 == 0,
                  "every panel stays 1024-aligned");
    static_assert(!kDqTma || kDqN % kDqPanel == 0, "dQ's buffer is whole fp32 panels");
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");
    static_assert(STAGES >= 2, "a ring of one stage cannot overlap loads with math");
};

// Byte offset of element (row, col) of a tile of `rows` rows stored as panels of SWIZZLE bytes a
// row (SWIZZLE / ELEM columns: 16-bit Q, K, V, dO, dS^T; the fp32 dQ buffers, ELEM = 4).
template <int SWIZZLE, int ELEM = 2>
__device__ __forceinline__ u32 panel_offset_bwd(int rows, int row, int col) {
    return (col / (SWIZZLE / ELEM)) * rows * SWIZZLE +
           swizzle<SWIZZLE>(row * SWIZZLE + (col % (SWIZZLE / ELEM)) * ELEM);
}

template <class C>
struct BwdSm90Barriers {
    u32 base;
    __device__ __forceinline__ u32 full(int s) const { return base + 8 * s; }
    __device__ __forceinline__ u32 empty(int s) const { return base + 8 * (C::kStages + s); }
    __device__ __forceinline__ u32 full_kv() const { return base + 8 * (2 * C::kStages); }
    // The slot's pair is written (kBwdSlotPairs): the loads' warp to the stats warp.
    __device__ __forceinline__ u32 pair(int s) const { return base + 8 * (2 * C::kStages + 1 + s); }
    // A consumer's dQ buffer is written (its 4 warps), then read by the reduce-add (the reducer).
    __device__ __forceinline__ u32 dq_full(int wg) const { return base + 8 * (3 * C::kStages + 1 + wg); }
    __device__ __forceinline__ u32 dq_empty(int wg) const {
        return base + 8 * (3 * C::kStages + 1 + C::kConsumers + wg);
    }
};

}  // namespace kg
