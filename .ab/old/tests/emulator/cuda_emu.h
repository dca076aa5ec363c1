// A CPU emulator for kernelgen's mma.sync kernels: just enough CUDA to run a rendered template
// with g++ and compare its output with PyTorch, on a machine without a GPU.
//
// One CTA runs at a time; each of its CUDA threads is a fiber (ucontext) on one OS thread. A
// fiber runs until it reaches a collective (__syncthreads, a warp shuffle, ldmatrix, mma); the
// last lane to arrive at a warp collective computes every lane's result from all lanes' inputs,
// exactly as the PTX ISA defines the fragment layouts. The order in which fibers resume is
// shuffled (seeded), so a missing barrier shows up as wrong numbers rather than passing by luck.
// cp.async copies can be deferred to the latest moment the program allows (the wait_group
// that must cover them), so a read of a tile before its wait sees stale data.
//
// Device pointers are plain host pointers into one arena; cp.async, ldmatrix and the global
// reductions check their addresses (arena allocations, dynamic shared memory bounds).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct float4 { float x, y, z, w; };

inline emu_dim3 threadIdx, blockIdx, gridDim, blockDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }

namespace kg {
// The dynamic shared memory of the running CTA (kernels declare `extern __shared__ smem[]`
// inside namespace kg, which names this array).
constexpr unsigned kEmuSmemBytes = 256 * 1024;
alignas(128) inline unsigned char smem[kEmuSmemBytes];
}  // namespace kg

namespace emu {

[[noreturn]] inline void fail(const char* what, unsigned long long value = 0) {
    fprintf(stderr, "emulator: %s (0x%llx) in block (%u,%u,%u) thread %u\n", what, value,
            blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
    exit(3);
}

struct Copy { unsigned dst; const unsigned char* src; int bytes; bool valid; };

struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    bool done = false;
    std::vector<std::vector<Copy>> groups{1};  // cp.async groups; the last one is still open
};

enum Op { kNone, kShfl, kLdm, kMma, kSyncWarp };

struct WarpSlots {
    int arrived = 0;
    unsigned generation = 0;
    int op[32];
    unsigned in[32][8];
    float fin[32][4];
    unsigned out[32][4];
    float fout[32][4];
};

struct Runtime {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    int current = 0, threads = 0;
    void (*body)() = nullptr;
    int cta_arrived = 0;
    unsigned cta_generation = 0;
    std::vector<WarpSlots> warps;
    std::mt19937 rng{1};
    bool defer_copies = true;
    unsigned smem_bytes = 0;
    // Arena allocations [begin, end) that global accesses must fall in.
    std::vector<std::pair<const unsigned char*, const unsigned char*>> allocations;
    // Extensions with per-CTA state (sm90_emu.h) reset and check it here.
    void (*cta_start)() = nullptr;
    void (*cta_end)() = nullptr;
};

inline Runtime& rt() { static Runtime r; return r; }

inline void check_global(const void* p, size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (auto& [begin, end] : rt().allocations)
        if (c >= begin && c + bytes <= end) return;
    fail("global access outside every tensor", reinterpret_cast<unsigned long long>(p));
}

inline void check_smem(unsigned addr, unsigned bytes, unsigned align) {
    if (addr % align) fail("misaligned shared-memory address", addr);
    if (addr + bytes > rt().smem_bytes) fail("shared-memory access past the dynamic size", addr);
}

inline void yield() {
    Runtime& r = rt();
    swapcontext(&r.fibers[r.current].context, &r.scheduler);
}

inline void syncthreads() {
    Runtime& r = rt();
    const unsigned generation = r.cta_generation;
    if (++r.cta_arrived == r.threads) {
        r.cta_arrived = 0;
        ++r.cta_generation;
        return;
    }
    while (r.cta_generation == generation) yield();
}

inline int lane_id() { return threadIdx.x % 32; }
inline WarpSlots& my_warp() { return rt().warps[threadIdx.x / 32]; }

// Every lane has written its inputs; the last to arrive runs `compute` for all 32.
template <class Compute>
inline void warp_collective(Op op, Compute&& compute) {
    WarpSlots& w = my_warp();
    w.op[lane_id()] = op;
    const unsigned generation = w.generation;
    if (++w.arrived == 32) {
        for (int l = 0; l < 32; ++l)
            if (w.op[l] != op) fail("lanes of a warp reached different collectives", l);
        compute(w);
        w.arrived = 0;
        ++w.generation;
        return;
    }
    while (w.generation == generation) yield();
}

// ---- 16-bit floats --------------------------------------------------------------------------

inline float bf16_to_float(unsigned short h) {
    unsigned bits = unsigned(h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline unsigned short float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
    unsigned bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<unsigned short>(bits >> 16);
}

inline float half_to_float(unsigned short h) {
    const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) value = ldexpf(float(mantissa), -24);
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = ldexpf(float(mantissa | 0x400), exponent - 25);
    return sign ? -value : value;
}

inline unsigned short float_to_half(float f) {  // round to nearest even, with subnormals
    const unsigned short sign = signbit(f) ? 0x8000 : 0;
    float a = fabsf(f);
    if (isnan(f)) return 0x7e00;
    if (a >= 65520.f) return sign | 0x7c00;  // rounds to infinity
    if (a < ldexpf(1.f, -14)) {               // subnormal: multiples of 2^-24
        return sign | static_cast<unsigned short>(nearbyintf(a * ldexpf(1.f, 24)));
    }
    int exponent;
    const float m = frexpf(a, &exponent);      // a = m * 2^exponent, m in [0.5, 1)
    unsigned mantissa = static_cast<unsigned>(nearbyintf(ldexpf(m, 11)));  // 11 bits, in [1024, 2048]
    if (mantissa == 2048) { mantissa = 1024; ++exponent; }
    if (exponent + 14 > 30) return sign | 0x7c00;
    return sign | static_cast<unsigned short>(((exponent + 14) << 10) | (mantissa & 0x3ff));
}

// ---- cp.async ---------------------------------------------------------------------------------

inline void do_copy(const Copy& c) {
    if (c.valid) memcpy(kg::smem + c.dst, c.src, c.bytes);
    else memset(kg::smem + c.dst, 0, c.bytes);
}

inline void cp_async(unsigned dst, const void* src, int bytes, bool valid) {
    check_smem(dst, bytes, bytes);
    if (valid) check_global(src, bytes);
    const Copy c{dst, static_cast<const unsigned char*>(src), bytes, valid};
    if (rt().defer_copies) rt().fibers[rt().current].groups.back().push_back(c);
    else do_copy(c);
}

inline void cp_async_commit() { rt().fibers[rt().current].groups.emplace_back(); }

inline void cp_async_wait(int pending) {
    auto& groups = rt().fibers[rt().current].groups;
    // groups.back() is the open group; the committed ones are before it.
    const int committed = int(groups.size()) - 1;
    for (int g = 0; g < committed - pending; ++g) {
        for (const Copy& c : groups[g]) do_copy(c);
        groups[g].clear();
    }
    // Forget completed groups, keeping the order of the rest.
    if (committed > pending) groups.erase(groups.begin(), groups.begin() + (committed - pending));
}

// ---- the grid ---------------------------------------------------------------------------------

inline void trampoline() {
    Runtime& r = rt();
    r.body();
    for (auto& group : r.fibers[r.current].groups)
        if (!group.empty()) fail("cp.async copies never waited for");
    r.fibers[r.current].done = true;
    swapcontext(&r.fibers[r.current].context, &r.scheduler);
}

inline void run_cta(int threads) {
    Runtime& r = rt();
    r.threads = threads;
    r.fibers.assign(threads, Fiber{});
    r.warps.assign((threads + 31) / 32, WarpSlots{});
    r.cta_arrived = 0;
    memset(kg::smem, 0xff, sizeof(kg::smem));  // NaN everywhere: unwritten smem poisons results
    if (r.cta_start) r.cta_start();
    for (int t = 0; t < threads; ++t) {
        Fiber& f = r.fibers[t];
        f.stack.resize(512 * 1024);
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = nullptr;
        makecontext(&f.context, trampoline, 0);
    }
    std::vector<int> order(threads);
    for (int t = 0; t < threads; ++t) order[t] = t;
    for (int live = threads; live > 0;) {
        std::shuffle(order.begin(), order.end(), r.rng);
        live = 0;
        for (int t : order) {
            if (r.fibers[t].done) continue;
            r.current = t;
            threadIdx.x = t;
            swapcontext(&r.scheduler, &r.fibers[t].context);
            live += !r.fibers[t].done;
        }
    }
    if (r.cta_end) r.cta_end();
}

inline void run_grid(void (*body)(), emu_dim3 grid, int threads, unsigned smem_bytes) {
    Runtime& r = rt();
    if (smem_bytes > kg::kEmuSmemBytes) fail("dynamic shared memory too large", smem_bytes);
    r.body = body;
    r.smem_bytes = smem_bytes;
    gridDim = grid;
    blockDim = {unsigned(threads), 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                run_cta(threads);
            }
}

}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }

inline void __syncwarp(unsigned = 0xffffffffu) {
    emu::warp_collective(emu::kSyncWarp, [](emu::WarpSlots&) {});
}

inline unsigned emu_shfl_xor(unsigned value, int mask) {
    emu::WarpSlots& w = emu::my_warp();
    const int lane = emu::lane_id();
    w.in[lane][0] = value;
    w.in[lane][1] = mask;
    emu::warp_collective(emu::kShfl, [](emu::WarpSlots& s) {
        for (int l = 0; l < 32; ++l) s.out[l][0] = s.in[l ^ s.in[l][1]][0];
    });
    return w.out[lane][0];
}

inline float __shfl_xor_sync(unsigned, float value, int mask) {
    return __int_as_float(int(emu_shfl_xor(unsigned(__float_as_int(value)), mask)));
}
inline int __shfl_xor_sync(unsigned, int value, int mask) {
    return int(emu_shfl_xor(unsigned(value), mask));
}

// Lane `src`'s value in every lane (a whole-warp collective); the exchange goes through the
// shuffle slots.
inline int __shfl_sync(unsigned, int value, int src) {
    emu::WarpSlots& w = emu::my_warp();
    const int lane = emu::lane_id();
    w.in[lane][0] = unsigned(value);
    w.in[lane][1] = unsigned(src);
    emu::warp_collective(emu::kShfl, [](emu::WarpSlots& s) {
        for (int l = 0; l < 32; ++l) s.out[l][0] = s.in[s.in[l][1] % 32][0];
    });
    return int(w.out[lane][0]);
}

// Every lane's predicate as one bit (a whole-warp collective, as the kernels use it); the
// exchange goes through the shuffle slots.
inline unsigned __ballot_sync(unsigned, int predicate) {
    emu::WarpSlots& w = emu::my_warp();
    w.in[emu::lane_id()][0] = predicate ? 1u : 0u;
    emu::warp_collective(emu::kShfl, [](emu::WarpSlots& s) {
        unsigned bits = 0;
        for (int l = 0; l < 32; ++l) bits |= s.in[l][0] << l;
        for (int l = 0; l < 32; ++l) s.out[l][0] = bits;
    });
    return w.out[emu::lane_id()][0];
}
inline int __popc(unsigned value) { return __builtin_popcount(value); }
inline int __ffs(unsigned value) { return __builtin_ffs(int(value)); }
// One CTA at a time: global memory is ordered already, and a wait on another CTA never ends.
inline void __threadfence() {}
inline void __nanosleep(unsigned) { emu::fail("a wait on another CTA (__nanosleep)", 0); }
// Fibers switch only at collectives and barriers, so a plain read-modify-write is atomic here.
inline int atomicAdd(int* address, int value) {
    emu::check_global(address, sizeof(int));
    const int old = *address;
    *address = old + value;
    return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
    emu::check_global(address, sizeof(unsigned long long));
    const unsigned long long old = *address;
    *address = old + value;
    return old;
}
inline int atomicExch(int* address, int value) {
    emu::check_global(address, sizeof(int));
    const int old = *address;
    *address = value;
    return old;
}
