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

// Named barriers 1..15 (0 is __syncthreads): `threads` (a multiple of 32) must arrive; sync waits
// for the others, arrive does not.
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

}  // namespace kg
