// The Hopper part of the emulator (cuda_emu.h): warpgroup collectives, named barriers, mbarriers,
// TMA tensor loads and wgmma, enough to run the sm_90a forward (flash_fwd_sm90.cuh) and the
// backward main kernel (flash_bwd_sm90.cuh: wgmma with A read transposed from shared memory) on
// the CPU.
//
// Asynchrony is modelled where a missing wait would otherwise pass by luck:
//  * wgmma records its operands at issue; the math runs at the wgmma.wait_group that retires its
//    group, reading shared memory and the A registers then and writing the accumulators then.
//    Operands are decoded from the descriptors by CuTe's canonical GMMA layouts, independently of
//    how the kernel built them, with the swizzle applied to byte addresses. The shared-memory
//    operands are also read at issue, and a change by the time the op runs is an error (a store
//    or a TMA refill into bytes an in-flight wgmma reads). In lazy mode a warpgroup sometimes
//    stalls at a wait while the others run on, so a race between warpgroups gets its chance.
//  * TMA: in eager mode a box lands at issue (refilling a slot that a pending wgmma still reads
//    corrupts it); in lazy mode it lands only when a thread waits on its mbarrier (reading a tile
//    without waiting sees NaN). Elements outside the tensor are zero-filled.
//  * An mbarrier completes a phase when its pending arrivals and transaction bytes reach zero;
//    try_wait.parity(P) succeeds once the phase of parity P has completed.
// wgmma.wait_group is a warpgroup-wide collective here, stronger than the hardware's per-warp one.
#pragma once
#include <map>
#include <type_traits>

#include "cuda_emu.h"
#include "kernelgen/types.cuh"  // the CPU stand-in (include/): kg::bf16_t, kg::smem

namespace emu {

struct WgmmaOp {            // one wgmma instruction of one warpgroup
    int n = 0;              // N of m64nNk16
    bool bf16 = true, trans_b = false, accumulate = true, trans_a = false;
    uint64_t desc_a = 0, desc_b = 0;  // desc_a unused when A comes from registers
    float* d[128];          // each thread's accumulators (n / 2 floats)
    const uint32_t* a[128]; // each thread's A fragment, or null (A from shared memory)
    std::vector<uint16_t> snapshot;  // its shared-memory operands at issue
};

struct Warpgroup {
    std::vector<std::vector<WgmmaOp>> groups{1};  // committed groups, then the open one
    WgmmaOp pending;
    int arrived = 0, op = 0;
    unsigned generation = 0;
};

struct Mbarrier { int count = 0, pending = 0; long tx = 0; unsigned phase = 0; };
struct NamedBarrier { int arrived = 0, expected = 0; unsigned generation = 0; };
struct TmaCopy { unsigned bar; long bytes; std::vector<std::pair<unsigned, uint16_t>> writes; };

// The emulator's encoding of a tensor map (the 128 bytes emulate.py writes from a tma.TiledMap):
// what cuTensorMapEncodeTiled receives (the address made absolute by harness.h).
struct MapFields {
    uint64_t address, dims[5], strides[4];
    uint32_t box[5], swizzle, rank, element_bytes;  // 2 (fp16, bf16) or 4 (fp32)
};

struct Sm90State {
    std::vector<Warpgroup> warpgroups;
    std::vector<unsigned> waits;  // wgmma.wait_group calls per thread (lazy mode's stalls)
    NamedBarrier named[16];
    std::map<unsigned, Mbarrier> barriers;
    std::vector<TmaCopy> in_flight;
    bool lazy_tma = false;  // the launch's `defer`: copies land as late as the program allows
};
inline Sm90State& sm90() { static Sm90State s; return s; }

constexpr long kSpinLimit = 200000;  // failed waits of one thread before it is called a deadlock

inline void sm90_cta_start() {
    Sm90State& s = sm90();
    s.lazy_tma = rt().defer_copies;
    s.warpgroups.assign((rt().threads + 127) / 128, Warpgroup{});
    s.waits.assign(rt().threads, 0);
    for (auto& b : s.named) b = NamedBarrier{};
    s.barriers.clear();
}

inline void sm90_cta_end() {
    Sm90State& s = sm90();
    for (auto& wg : s.warpgroups)
        if (wg.groups.size() != 1 || !wg.groups[0].empty()) fail("wgmma groups never waited for");
    if (!s.in_flight.empty()) fail("TMA copies never waited for");
    for (auto& b : s.named) if (b.arrived) fail("a named barrier was left half-arrived", b.arrived);
}

inline const bool kSm90Hooks = (rt().cta_start = sm90_cta_start, rt().cta_end = sm90_cta_end, true);

// ---- warpgroups and named barriers ------------------------------------------------------------

enum { kWgMma = 1, kWgCommit, kWgWait, kWgFence, kWgSetmaxnreg };

// All 128 threads of the calling warpgroup; the last to arrive runs `compute`.
template <class Compute> inline void warpgroup_collective(int op, Compute&& compute) {
    Warpgroup& wg = sm90().warpgroups[threadIdx.x / 128];
    if (wg.arrived == 0) wg.op = op;
    else if (wg.op != op) fail("threads of a warpgroup reached different collectives", op);
    const unsigned generation = wg.generation;
    if (++wg.arrived == 128) {
        compute(wg);
        wg.arrived = 0;
        ++wg.generation;
        return;
    }
    while (wg.generation == generation) yield();
}

inline NamedBarrier& named(unsigned id, unsigned count) {
    if (id == 0 || id >= 16 || count % 32) fail("named barrier id or thread count", id);
    NamedBarrier& b = sm90().named[id];
    if (b.arrived == 0) b.expected = int(count);
    else if (b.expected != int(count)) fail("named barrier thread counts differ", count);
    return b;
}

inline void named_arrive(unsigned id, unsigned count) {  // bar.arrive: counted, no wait
    NamedBarrier& b = named(id, count);
    if (++b.arrived == b.expected) { b.arrived = 0; ++b.generation; }
}

inline void named_sync(unsigned id, unsigned count) {
    NamedBarrier& b = named(id, count);
    const unsigned generation = b.generation;
    if (++b.arrived == b.expected) { b.arrived = 0; ++b.generation; return; }
    for (long spins = 0; b.generation == generation; ++spins) {
        if (spins > kSpinLimit) fail("deadlock at a named barrier", id);
        yield();
    }
}

// ---- mbarriers -------------------------------------------------------------------------------

inline Mbarrier& barrier(unsigned addr) {
    check_smem(addr, 8, 8);
    auto found = sm90().barriers.find(addr);
    if (found == sm90().barriers.end()) fail("mbarrier used before mbarrier.init", addr);
    return found->second;
}

inline void complete_if_done(Mbarrier& b) {
    if (b.pending == 0 && b.tx == 0) { ++b.phase; b.pending = b.count; }
}

inline void mbar_init(unsigned addr, unsigned count) {
    check_smem(addr, 8, 8);
    sm90().barriers[addr] = Mbarrier{int(count), int(count), 0, 0};
}

inline void mbar_arrive(unsigned addr, unsigned expect_bytes) {
    Mbarrier& b = barrier(addr);
    if (b.pending <= 0) fail("more arrivals than the mbarrier expects", addr);
    b.tx += expect_bytes;
    --b.pending;
    complete_if_done(b);
}

inline void land(const TmaCopy& c) {
    for (const auto& [addr, value] : c.writes) memcpy(kg::smem + addr, &value, 2);
    Mbarrier& b = barrier(c.bar);
    b.tx -= c.bytes;
    if (b.tx < 0) fail("TMA bytes beyond the mbarrier's expect_tx", c.bar);
    complete_if_done(b);
}

inline bool mbar_try_wait(unsigned addr, unsigned parity) {
    Sm90State& s = sm90();
    for (size_t i = 0; i < s.in_flight.size();) {  // lazy mode: what this barrier counts lands now
        if (s.in_flight[i].bar == addr) {
            land(s.in_flight[i]);
            s.in_flight.erase(s.in_flight.begin() + i);
        } else {
            ++i;
        }
    }
    return (barrier(addr).phase & 1) != parity;
}

inline void mbar_wait(unsigned addr, unsigned parity) {
    for (long spins = 0; !mbar_try_wait(addr, parity); ++spins) {
        if (spins > kSpinLimit) fail("deadlock waiting on an mbarrier", addr);
        yield();
    }
}

// ---- TMA -------------------------------------------------------------------------------------

inline unsigned swizzled(unsigned addr, unsigned swizzle_bytes) {  // CuTe Swizzle<B,4,3>
    const unsigned mask = swizzle_bytes == 128 ? 7 : swizzle_bytes == 64 ? 3 : 0;
    return addr ^ (((addr >> 7) & mask) << 4);
}

inline void check_prefetch(const void* map_bytes, const int (&coords)[5]) {
    MapFields m;
    memcpy(&m, map_bytes, sizeof m);
    if (m.rank != 5) fail("tensor map rank", m.rank);
    if (coords[0] != 0 || coords[1] < 0) fail("prefetch box origin", coords[1]);
    for (int d = 2; d < 5; ++d)
        if (coords[d] < 0 || coords[d] >= (long long)m.dims[d]) fail("prefetch box outside", d);
}

inline void tma_load(unsigned dst, const void* map_bytes, unsigned bar, const int (&coords)[5]) {
    MapFields m;
    memcpy(&m, map_bytes, sizeof m);
    if (m.rank != 5) fail("tensor map rank", m.rank);
    if (m.element_bytes != 2) fail("TMA loads of 16-bit elements only", m.element_bytes);
    if (m.box[0] * 2 != m.swizzle) fail("box inner dimension is not the swizzle span", m.box[0]);
    if (dst % 1024) fail("swizzled TMA destination not 1024-byte aligned", dst);
    TmaCopy c{bar, 0, {}};
    unsigned offset = 0;
    for (unsigned i4 = 0; i4 < m.box[4]; ++i4)
    for (unsigned i3 = 0; i3 < m.box[3]; ++i3)
    for (unsigned i2 = 0; i2 < m.box[2]; ++i2)
    for (unsigned i1 = 0; i1 < m.box[1]; ++i1)
    for (unsigned i0 = 0; i0 < m.box[0]; ++i0, offset += 2) {
        const long long at[5] = {coords[0] + i0, coords[1] + i1, coords[2] + i2, coords[3] + i3,
                                 coords[4] + i4};
        bool inside = true;
        for (int d = 0; d < 5; ++d) inside &= at[d] >= 0 && at[d] < (long long)m.dims[d];
        uint16_t value = 0;
        if (inside) {
            unsigned long long byte = at[0] * 2;
            for (int d = 1; d < 5; ++d) byte += at[d] * m.strides[d - 1];
            const auto* src = reinterpret_cast<const unsigned char*>(m.address + byte);
            check_global(src, 2);
            memcpy(&value, src, 2);
        }
        const unsigned target = swizzled(dst + offset, m.swizzle);
        check_smem(target, 2, 2);
        c.writes.push_back({target, value});
    }
    c.bytes = offset;
    if (sm90().lazy_tma) sm90().in_flight.push_back(std::move(c));
    else land(c);
}

// ---- wgmma -----------------------------------------------------------------------------------

struct Desc { unsigned start, lbo, sbo, layout; };

inline Desc decode(uint64_t d) {
    if ((d >> 49) & 7) fail("descriptor base offset is not 0", d);
    return {unsigned(d & 0x3fff) << 4, unsigned((d >> 16) & 0x3fff) << 4,
            unsigned((d >> 32) & 0x3fff) << 4, unsigned(d >> 62)};
}

// Element (mn, k) of the k16 slab a descriptor names, by CuTe's canonical GMMA layouts
// (make_gmma_desc; u = 16 bytes, T = 8 elements per u, W = 8 for 128B swizzle, 4 for 64B):
//   K-major : ((8, m), (T, 2)) : ((W u, SBO), (1 element, 1 u))
//   MN-major: ((T, W, m), (8, k)) : ((1 element, 1 u, LBO), (W u, SBO))
// with Swizzle<3,4,3> (128B) or <2,4,3> (64B) on the byte address.
inline uint16_t operand_bits(const Desc& d, bool mn_major, int mn, int k) {
    const unsigned w = d.layout == 1 ? 8 : d.layout == 2 ? 4 : 0;
    if (!w) fail("descriptor layout is not a 128B or 64B swizzle", d.layout);
    const unsigned addr = mn_major
        ? d.start + (mn % 8) * 2 + ((mn / 8) % w) * 16 + (mn / (8 * w)) * d.lbo +
              (k % 8) * w * 16 + (k / 8) * d.sbo
        : d.start + (mn % 8) * w * 16 + (mn / 8) * d.sbo + (k / 8) * 16 + (k % 8) * 2;
    const unsigned at = swizzled(addr, w * 16);
    check_smem(at, 2, 2);
    uint16_t h;
    memcpy(&h, kg::smem + at, 2);
    return h;
}

inline float operand(const Desc& d, bool mn_major, int mn, int k, bool bf16) {
    const uint16_t h = operand_bits(d, mn_major, mn, k);
    return bf16 ? bf16_to_float(h) : half_to_float(h);
}

// The shared-memory operands of an op, as bits: taken at issue and compared when the op runs, so
// that a store (or a TMA refill) into bytes an in-flight wgmma reads fails however it was timed.
inline std::vector<uint16_t> smem_operands(const WgmmaOp& op) {
    std::vector<uint16_t> bits;
    if (!op.a[0]) {
        const Desc da = decode(op.desc_a);
        for (int m = 0; m < 64; ++m)
            for (int k = 0; k < 16; ++k) bits.push_back(operand_bits(da, op.trans_a, m, k));
    }
    const Desc db = decode(op.desc_b);
    for (int k = 0; k < 16; ++k)
        for (int n = 0; n < op.n; ++n) bits.push_back(operand_bits(db, op.trans_b, n, k));
    return bits;
}

inline float half_bits(uint32_t packed, int high, bool bf16) {
    const auto h = static_cast<unsigned short>(high ? packed >> 16 : packed & 0xffff);
    return bf16 ? bf16_to_float(h) : half_to_float(h);
}

inline void execute(const WgmmaOp& op) {
    if (smem_operands(op) != op.snapshot)
        fail("shared memory read by an in-flight wgmma changed before the wait that retires it",
             op.desc_b);
    float a[64][16];
    std::vector<float> b(16 * op.n);
    if (op.a[0]) {
        // A fragment (CuTe ALayout_64x16): thread 32w + l holds rows 16w + l/4 (+8 in registers
        // 1, 3) and columns 2(l%4), +1 (+8 in registers 2, 3), low half first.
        for (int t = 0; t < 128; ++t)
            for (int r = 0; r < 4; ++r) {
                const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * (r % 2);
                const int col = 2 * (t % 4) + 8 * (r / 2);
                a[row][col] = half_bits(op.a[t][r], 0, op.bf16);
                a[row][col + 1] = half_bits(op.a[t][r], 1, op.bf16);
            }
    } else {
        const Desc da = decode(op.desc_a);
        for (int m = 0; m < 64; ++m)
            for (int k = 0; k < 16; ++k) a[m][k] = operand(da, op.trans_a, m, k, op.bf16);
    }
    const Desc db = decode(op.desc_b);
    for (int k = 0; k < 16; ++k)
        for (int n = 0; n < op.n; ++n) b[k * op.n + n] = operand(db, op.trans_b, n, k, op.bf16);
    // D fragment (CuTe CLayout_64xN): d[4i + e] of thread 32w + l is row 16w + l/4 + 8(e/2),
    // column 8i + 2(l%4) + e%2.
    for (int t = 0; t < 128; ++t)
        for (int i = 0; i < op.n / 8; ++i)
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * (e / 2);
                const int col = 8 * i + 2 * (t % 4) + e % 2;
                float acc = op.accumulate ? op.d[t][4 * i + e] : 0.f;
                for (int k = 0; k < 16; ++k) acc += a[row][k] * b[k * op.n + col];
                op.d[t][4 * i + e] = acc;
            }
}

// One m64nNk16 wgmma of the calling thread's warpgroup: A from `desc_a` (K-major, MN-major when
// trans_a: 16-bit types only, as in the ISA) or, when `a` is given, from registers (never
// transposed); B from `desc_b`, MN-major when trans_b.
template <class Elem>
inline void wgmma(float* d, int n, uint64_t desc_a, const uint32_t* a, uint64_t desc_b,
                  bool accumulate, bool trans_b, bool trans_a = false) {
    if (a && trans_a) fail("wgmma with A from registers has no transpose", 0);
    Warpgroup& wg = sm90().warpgroups[threadIdx.x / 128];
    const int t = threadIdx.x % 128;
    if (wg.arrived == 0) {
        wg.pending = WgmmaOp{n, std::is_same_v<Elem, kg::bf16_t>, trans_b, accumulate, trans_a,
                             desc_a, desc_b};
    } else if (wg.pending.desc_a != desc_a || wg.pending.desc_b != desc_b || wg.pending.n != n ||
               wg.pending.accumulate != accumulate || wg.pending.trans_a != trans_a ||
               wg.pending.trans_b != trans_b) {
        fail("threads of a warpgroup issued different wgmma operands", desc_b);
    }
    wg.pending.d[t] = d;
    wg.pending.a[t] = a;
    warpgroup_collective(kWgMma, [](Warpgroup& g) {
        g.pending.snapshot = smem_operands(g.pending);
        g.groups.back().push_back(g.pending);
    });
}

inline void wgmma_commit() {
    warpgroup_collective(kWgCommit, [](Warpgroup& g) { g.groups.emplace_back(); });
}

// In lazy mode one wait in four (by a hash of the warpgroup and its wait count, the same for its
// 128 threads) first stalls the warpgroup for 64 scheduling rounds while the others run on, as
// slow wgmmas would: a warpgroup that overwrites what another's in-flight wgmma reads gets there.
inline void wgmma_wait(int pending) {
    Sm90State& s = sm90();
    if (s.lazy_tma) {
        unsigned hash = s.waits[threadIdx.x]++ * 0x9E3779B9u + threadIdx.x / 128 * 0x85EBCA6Bu;
        hash = (hash ^ (hash >> 16)) * 0x7FEB352Du;
        if ((hash ^ (hash >> 15)) % 4 == 0)
            for (int i = 0; i < 64; ++i) yield();
    }
    warpgroup_collective(kWgWait, [pending](Warpgroup& g) {
        const int committed = int(g.groups.size()) - 1;
        for (int i = 0; i < committed - pending; ++i)
            for (const WgmmaOp& op : g.groups[i]) execute(op);
        if (committed > pending) g.groups.erase(g.groups.begin(), g.groups.begin() + (committed - pending));
    });
}

}  // namespace emu
