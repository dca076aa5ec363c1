// Shared-memory mbarriers and named barriers (sm_90): the producer/consumer handshakes of the
// warp-specialized kernels. An mbarrier completes a phase when its pending arrivals reach zero and,
// for TMA, when the transaction bytes announced with expect_tx have landed; waiters name the parity
// of the phase they wait for, so a fresh barrier (phase 0 in progress) already satisfies parity 1.
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals) : "memory");
}

// Makes the inits visible to the async proxy (TMA's complete_tx); a CTA barrier must follow.
__device__ __forceinline__ void mbarrier_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// One arrival plus `bytes` more transaction bytes the phase must wait for (the TMA copies that
// name this barrier count them down).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n .reg .pred p;\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.b32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// Spin until the phase of parity `parity` has completed (try_wait itself suspends a while).
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    while (!mbarrier_try_wait(bar, parity)) {
    }
}

// Thread-block clusters: this CTA's rank in its cluster, and a barrier over every thread of the
// cluster (threads that have exited count as arrived) whose release / acquire order each CTA's
// shared-memory writes and mbarrier inits before the others' use of them.
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
}

// One arrival on the barrier at `bar`'s offset in the shared memory of the cluster's CTA `rank`
// (this one's included).
__device__ __forceinline__ void mbarrier_arrive_cluster(u32 bar, u32 rank) {
    asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
                 " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}"
                 :: "r"(bar), "r"(rank) : "memory");
}

// Named barriers 1..15 (0 is __syncthreads): `threads` (a multiple of 32) must arrive; sync waits
// for the others, arrive does not.
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

}  // namespace kg
