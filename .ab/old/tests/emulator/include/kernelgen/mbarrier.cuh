// CPU stand-in for templates/include/kernelgen/mbarrier.cuh (see ../../sm90_emu.h).
#pragma once
#include "sm90_emu.h"

namespace kg {

inline void mbarrier_init(u32 bar, u32 arrivals) { emu::mbar_init(bar, arrivals); }
inline void mbarrier_fence_init() {}
inline void mbarrier_arrive(u32 bar) { emu::mbar_arrive(bar, 0); }
inline void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) { emu::mbar_arrive(bar, bytes); }
inline bool mbarrier_try_wait(u32 bar, u32 parity) { return emu::mbar_try_wait(bar, parity); }
inline void mbarrier_wait(u32 bar, u32 parity) { emu::mbar_wait(bar, parity); }
// Clusters are not emulated (the tests run cluster 1 only): reaching one is a failure.
inline u32 cluster_rank() { emu::fail("clusters are not emulated", 0); }  // fail never returns
inline void cluster_sync() { emu::fail("clusters are not emulated", 0); }
inline void mbarrier_arrive_cluster(u32, u32) { emu::fail("clusters are not emulated", 0); }
inline void named_barrier_sync(u32 id, u32 threads) { emu::named_sync(id, threads); }
inline void named_barrier_arrive(u32 id, u32 threads) { emu::named_arrive(id, threads); }

}  // namespace kg
