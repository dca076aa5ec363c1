// Tensor Memory Accelerator stores (sm_90): one box of a tensor map from shared memory to global
// memory, the inverse of tma_load_5d (kernelgen/tma.cuh), or added into it (tma_reduce_add_5d).
// Elements of the box outside the tensor's extent are not written, so a tile's padding rows never
// reach memory.
//
// A store is tracked by bulk async-groups of the issuing thread, not by an mbarrier: commit the
// stores issued so far as one group, and wait (`.read`) until the groups older than the newest N
// have read their shared memory, after which those bytes may be overwritten. Their global writes
// complete on their own (visible to later kernels; nothing in this kernel reads them back).
// The bytes a store reads must have been written before it is issued and be visible to the async
// proxy: every writing thread runs fence.proxy.async.shared::cta, then a barrier orders the writers
// before the issuing thread.
#pragma once
#include "kernelgen/tma.cuh"

namespace kg {

__device__ __forceinline__ void tma_store_5d(const TensorMap& map, u32 src, int c0, int c1, int c2,
                                             int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];"
        :: "l"(reinterpret_cast<u64>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}

// The same box added into global memory element by element (the map's type: fp32 for the
// backward's dQ), as atomic adds in L2: CTAs that add into the same rows need no ordering.
__device__ __forceinline__ void tma_reduce_add_5d(const TensorMap& map, u32 src, int c0, int c1,
                                                  int c2, int c3, int c4) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group"
        " [%0, {%2, %3, %4, %5, %6}], [%1];"
        :: "l"(reinterpret_cast<u64>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}

__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most `N` of this thread's committed bulk groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

}  // namespace kg
