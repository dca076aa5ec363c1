// Tensor Memory Accelerator loads (sm_90). The tensor map is encoded on the host
// (kernelgen/tma.py, cuTensorMapEncodeTiled) and passed by value as a `const __grid_constant__`
// kernel parameter; NVRTC has no <cuda.h>, so CUtensorMap's 128 opaque, 64-byte aligned bytes are
// declared here. Coordinates are in elements, innermost dimension first; boxes that reach past the
// tensor's extent are zero-filled, which pads sequence tails for free.
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

struct alignas(64) TensorMap {
    u64 opaque[16];
};

// L2 eviction hints (the createpolicy encodings CUTLASS uses): Q is read by one CTA, K and V by
// every query tile of a head.
constexpr u64 kEvictFirst = 0x12F0000000000000ull;
constexpr u64 kEvictLast = 0x14F0000000000000ull;

__device__ __forceinline__ void tma_prefetch(const TensorMap& map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}

// One box of a rank-5 map into shared memory at `dst`; completes `bytes of the box` on `bar`.
__device__ __forceinline__ void tma_load_5d(u32 dst, const TensorMap& map, u32 bar, int c0, int c1,
                                            int c2, int c3, int c4, u64 hint) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;"
        :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar),
           "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "l"(hint)
        : "memory");
}

// The box at these coordinates into L2 only (no shared memory, no barrier): a later load of it
// then reads L2.
__device__ __forceinline__ void tma_prefetch_5d(const TensorMap& map, int c0, int c1, int c2, int c3,
                                                int c4) {
    asm volatile("cp.async.bulk.prefetch.tensor.5d.L2.global.tile [%0, {%1, %2, %3, %4, %5}];"
                 :: "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
                 : "memory");
}

// The same box, landing at `dst` in every CTA of the cluster that `cta_mask` names (bit r: rank
// r), and counted on `bar` at the same offset in each: one L2 read for several CTAs' tiles.
__device__ __forceinline__ void tma_load_5d_multicast(u32 dst, const TensorMap& map, u32 bar, int c0,
                                                      int c1, int c2, int c3, int c4, u16 cta_mask,
                                                      u64 hint) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster.L2::cache_hint [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8, %9;"
        :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar),
           "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "h"(cta_mask), "l"(hint)
        : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (a TMA
// load into the same bytes, once an mbarrier hands them over).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace kg
