// CPU stand-in for templates/include/kernelgen/tma.cuh: the map's 128 bytes hold emu::MapFields.
#pragma once
#include "sm90_emu.h"

namespace kg {

struct alignas(64) TensorMap { u64 opaque[16]; };
static_assert(sizeof(emu::MapFields) <= sizeof(TensorMap), "the emulator's map fits");

constexpr u64 kEvictFirst = 0x12F0000000000000ull;
constexpr u64 kEvictLast = 0x14F0000000000000ull;

inline void tma_prefetch(const TensorMap&) {}

inline void tma_load_5d(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2, int c3,
                        int c4, u64 hint) {
    if (hint != kEvictFirst && hint != kEvictLast) emu::fail("unknown L2 cache hint", hint);
    emu::tma_load(dst, &map, bar, {c0, c1, c2, c3, c4});
}

// L2 only: nothing to copy here, but the box must start inside the tensor's panels, heads and
// batches (its rows may lie past the sequence, as a ragged last tile's second warpgroup's do).
inline void tma_prefetch_5d(const TensorMap& map, int c0, int c1, int c2, int c3, int c4) {
    emu::check_prefetch(&map, {c0, c1, c2, c3, c4});
}

inline void tma_load_5d_multicast(u32, const TensorMap&, u32, int, int, int, int, int, u16, u64) {
    emu::fail("clusters are not emulated", 0);
}

inline void fence_proxy_async_shared() {}  // one proxy here: program order suffices

}  // namespace kg
