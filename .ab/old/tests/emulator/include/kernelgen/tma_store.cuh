// CPU stand-in for templates/include/kernelgen/tma_store.cuh (see ../../sm90_store_emu.h).
#pragma once
#include "kernelgen/tma.cuh"
#include "sm90_store_emu.h"

namespace kg {

inline void tma_store_5d(const TensorMap& map, u32 src, int c0, int c1, int c2, int c3, int c4) {
    emu::tma_store(&map, src, {c0, c1, c2, c3, c4});
}

inline void tma_reduce_add_5d(const TensorMap& map, u32 src, int c0, int c1, int c2, int c3,
                              int c4) {
    emu::tma_store(&map, src, {c0, c1, c2, c3, c4}, /*add=*/true);
}

inline void bulk_commit_group() { emu::bulk_commit(); }

template <int N>
inline void bulk_wait_group_read() { emu::bulk_wait_read(N); }

}  // namespace kg
