// Shared-memory layouts wgmma and TMA agree on, and the wgmma matrix descriptors that name them
// (sm_90). Plain integer code: no instructions, so it is the same on every target.
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

// Swizzled layouts: a tile is stored as panels of SWIZZLE bytes per row (128 B = 64 bf16 or 64 B
// = 32 bf16), rows back to back, every panel 1024-byte aligned. Inside each group of 8 rows the
// 16-byte chunks are permuted: chunk ^= (byte address >> 7) & mask, CuTe's Swizzle<3,4,3> (128 B)
// or Swizzle<2,4,3> (64 B). TMA with CU_TENSOR_MAP_SWIZZLE_{128B,64B} writes exactly this.
template <int SWIZZLE> __device__ __forceinline__ u32 swizzle(u32 offset) {
    static_assert(SWIZZLE == 128 || SWIZZLE == 64, "128B or 64B swizzle");
    constexpr u32 kMask = SWIZZLE == 128 ? 7 : 3;
    return offset ^ (((offset >> 7) & kMask) << 4);
}

// Shared-memory matrix descriptor (sm_90): start address >> 4 in bits 0-13, leading byte offset
// >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0 (tiles are 1024-aligned), layout
// in 62-63 (1 = 128B swizzle, 2 = 64B). Offsets below 2^18 bytes never carry out of the address
// field, so stepping a descriptor is adding (bytes >> 4) to it.
template <int SWIZZLE>
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
    constexpr u64 kLayout = SWIZZLE == 128 ? 1 : 2;
    return u64((addr & 0x3FFFF) >> 4) | u64(leading_bytes >> 4) << 16 |
           u64(stride_bytes >> 4) << 32 | kLayout << 62;
}

// K-major operand (rows of the M or N dimension, K contiguous): 8-row core groups sit
// 8 * SWIZZLE bytes apart (SBO); the leading offset is unused with swizzling (CuTe sets 1).
template <int SWIZZLE> __device__ __forceinline__ u64 desc_k_major(u32 addr) {
    return smem_desc<SWIZZLE>(addr, 16, 8 * SWIZZLE);
}

// MN-major operand (rows of the K dimension, N contiguous) stored as N-panels of `panel_bytes`
// each: the next SWIZZLE/2 columns of N are one panel further (LBO), the next 8 rows of K are
// 8 * SWIZZLE bytes further (SBO).
template <int SWIZZLE> __device__ __forceinline__ u64 desc_mn_major(u32 addr, u32 panel_bytes) {
    return smem_desc<SWIZZLE>(addr, panel_bytes, 8 * SWIZZLE);
}

}  // namespace kg
