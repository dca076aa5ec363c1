// CPU stand-in for templates/include/kernelgen/wgmma.cuh (see ../../sm90_emu.h); the descriptors
// and swizzle are the real ones (wgmma_desc.cuh).
#pragma once
#include "kernelgen/wgmma_desc.cuh"
#include "sm90_emu.h"

namespace kg {

inline void wgmma_fence() { emu::warpgroup_collective(emu::kWgFence, [](emu::Warpgroup&) {}); }
inline void wgmma_commit() { emu::wgmma_commit(); }
template <int N> inline void wgmma_wait() { emu::wgmma_wait(N); }
template <int N> inline void fence_operands(float (&)[N]) {}
template <int N> inline void fence_operands(u32 (&)[N]) {}
template <int N> inline void setmaxnreg_inc() {
    emu::warpgroup_collective(emu::kWgSetmaxnreg, [](emu::Warpgroup&) {});
}
template <int N> inline void setmaxnreg_dec() {
    emu::warpgroup_collective(emu::kWgSetmaxnreg, [](emu::Warpgroup&) {});
}

}  // namespace kg
