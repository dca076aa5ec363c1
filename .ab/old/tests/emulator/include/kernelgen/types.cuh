// CPU stand-in for templates/include/kernelgen/types.cuh: the same names, computed in C++
// instead of single PTX instructions (see ../cuda_emu.h).
#pragma once
#include "cuda_emu.h"

namespace kg {

using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
using i64 = long long;

struct alignas(2) half_t { u16 bits; };
struct alignas(2) bf16_t { u16 bits; };

template <class Elem> inline u32 pack2(float lo, float hi);
template <> inline u32 pack2<bf16_t>(float lo, float hi) {
    return u32(emu::float_to_bf16(lo)) | (u32(emu::float_to_bf16(hi)) << 16);
}
template <> inline u32 pack2<half_t>(float lo, float hi) {
    return u32(emu::float_to_half(lo)) | (u32(emu::float_to_half(hi)) << 16);
}

inline float exp2_approx(float x) { return exp2f(x); }
inline float tanh_approx(float x) { return tanhf(x); }
inline float log2_approx(float x) { return log2f(x); }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline float neg_inf() { return -INFINITY; }

// Shared "addresses" are byte offsets into the CTA's dynamic shared memory.
inline u32 smem_addr(const void* p) {
    const auto* c = static_cast<const unsigned char*>(p);
    if (c < smem || c > smem + kEmuSmemBytes) emu::fail("smem_addr of a non-shared pointer");
    return static_cast<u32>(c - smem);
}

inline i64 opaque(i64 x) { return x; }

constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

template <bool V>
struct Bool {  // as the real types.cuh's
    static constexpr bool value = V;
};

}  // namespace kg
