// Ampere tensor-core and async-copy primitives (sm_80+; they run on Hopper too).
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 (4 regs): a0 row g, k 2t..2t+1 | a1 row g+8 | a2 row g, k 2t+8.. | a3 row g+8, k 2t+8..
//   B 16x8  (2 regs): b0 k 2t..2t+1, col g | b1 k 2t+8..2t+9, col g
//   C 16x8  (4 f32) : c0,c1 row g, cols 2t,2t+1 | c2,c3 row g+8
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                          bf16_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                          half_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Transposed: each lane receives two elements of one column (the B layout from row-major V).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Two 8x8 b16 matrices; lanes 0..15 give the row addresses (one n8 tile of B, both k halves).
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// 16-byte global->shared copy through L2 only (.cg: a CTA never re-reads an address).
// valid == false copies nothing and zero-fills the 16 bytes: that pads tiles past the end.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

// 4-byte copy for rows of fp32 statistics (LSE, D): such a row need not be 16-byte aligned.
// .ca is the only cache mode below 16 bytes. valid == false zero-fills.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Wait until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// p[0] += a, p[1] += b in global memory, performed at L2 (red: no old value comes back). p must
// be 8-byte aligned. Hopper adds both in one instruction.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p + 1), "f"(b) : "memory");
#endif
}

}  // namespace kg
