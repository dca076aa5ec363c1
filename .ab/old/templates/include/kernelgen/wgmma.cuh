// Warpgroup tensor-core primitives (sm_90a): wgmma ordering and setmaxnreg (the descriptors are in
// wgmma_desc.cuh). The wgmma instructions themselves depend on N (every accumulator register is an
// asm operand), so the template renders the shapes a variant uses.
//
// Accumulator layout of m64nNk16 (warp w of the warpgroup, lane l, g = l / 4, t = l % 4):
// d[4i + 0..1] = row 16w + g, cols 8i + 2t, +1;  d[4i + 2..3] = row 16w + g + 8, same cols.
// That is N/8 copies of the mma.sync m16n8 C layout, so columns 16j..16j+15 packed to 16-bit pairs
// ({d[8j],d[8j+1]}, {d[8j+2],d[8j+3]}, {d[8j+4],d[8j+5]}, {d[8j+6],d[8j+7]}) are exactly the
// register A operand of k-step j: P feeds P.V without leaving registers.
#pragma once
#include "kernelgen/wgmma_desc.cuh"

namespace kg {

// Orders earlier register writes (accumulators, A fragments) before the wgmmas that follow.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Wait until at most N committed wgmma groups of this warp are still running.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Pins registers at this point of the program: the compiler may not move their reads or writes
// across it, so nothing touches an accumulator while a wgmma owns it (ptxas would serialize, C7515).
template <int N> __device__ __forceinline__ void fence_operands(float (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

template <int N> __device__ __forceinline__ void fence_operands(u32 (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

// Register budgets per warpgroup (the whole warpgroup executes them; ptxas honours them only
// with __launch_bounds__(threads, 1), otherwise C7508).
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}

template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}

}  // namespace kg
