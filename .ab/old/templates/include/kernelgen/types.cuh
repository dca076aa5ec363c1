// Scalar types and conversions for NVRTC-compiled kernels. NVRTC has no host headers, and
// cuda_fp16.h / cuda_bf16.h cost compile time and break between toolkit versions, so the
// 16-bit element types are opaque 2-byte values here: the kernels only move their bits and
// convert with single PTX instructions.
#pragma once

namespace kg {

using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
using i64 = long long;

struct alignas(2) half_t { u16 bits; };
struct alignas(2) bf16_t { u16 bits; };

// Two fp32 values -> one register of two 16-bit values, `lo` in the low half (the lower address).
template <class Elem> __device__ __forceinline__ u32 pack2(float lo, float hi);

template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <> __device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// One MUFU.EX2 per call whatever the compile flags (exp2f may expand to more).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One MUFU.TANH (sm_75+; max relative error 2^-10.99, PTX ISA), for score mods such as softcap:
// tanhf is the libm sequence (an exp, a reciprocal and a dozen FMAs) on every score.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// A value the compiler cannot see through, so what is computed from it stays where it is written.
__device__ __forceinline__ i64 opaque(i64 x) {
    i64 y;
    asm volatile("mov.b64 %0, %1;" : "=l"(y) : "l"(x));
    return y;
}

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// A compile-time bool as a value: a generic lambda's way to take one (C++17; no std headers
// under NVRTC).
template <bool V>
struct Bool {
    static constexpr bool value = V;
};

}  // namespace kg
