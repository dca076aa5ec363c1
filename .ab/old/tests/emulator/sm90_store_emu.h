// TMA tensor stores for the emulator (an addition to sm90_emu.h, which holds the loads): one box
// of a tensor map from shared memory to global memory, or added into it (fp32 reduce-add),
// tracked by the issuing thread's bulk async-groups (cp.async.bulk.commit_group /
// wait_group.read).
//
// When a store reads its shared memory is chosen to expose the bug the other timing would hide:
//  * lazy TMA (loads land at their mbarrier wait): a store reads at issue, so one issued before
//    every thread's O is in shared memory stores stale data;
//  * eager TMA (loads land at issue): a store reads at the wait_group.read that retires it, so a
//    buffer handed back (and refilled by a TMA load) before that wait stores the new tile's data.
// Elements outside the tensor are not written. A store never retired by the CTA's end fails: its
// shared memory would be gone.
#pragma once
#include <map>

#include "sm90_emu.h"

namespace emu {

struct TmaStore {  // global <- smem (+= for a reduce-add)
    std::vector<std::pair<unsigned char*, unsigned>> writes;
    unsigned element_bytes = 2;
    bool add = false;
};

struct StoreState {
    // Per thread: committed bulk groups (oldest first), then the open one.
    std::map<unsigned, std::vector<std::vector<TmaStore>>> groups;
};
inline StoreState& stores() { static StoreState s; return s; }

inline void perform(const TmaStore& st) {
    for (const auto& [dst, src] : st.writes) {
        if (!st.add) {
            memcpy(dst, kg::smem + src, st.element_bytes);
            continue;
        }
        float sum, value;
        memcpy(&sum, dst, 4);
        memcpy(&value, kg::smem + src, 4);
        sum += value;
        memcpy(dst, &sum, 4);
    }
}

inline void tma_store(const void* map_bytes, unsigned src, const int (&coords)[5], bool add = false) {
    MapFields m;
    memcpy(&m, map_bytes, sizeof m);
    if (m.rank != 5) fail("tensor map rank", m.rank);
    if (add != (m.element_bytes == 4)) fail("reduce-adds of fp32, stores of 16-bit elements", add);
    const unsigned e = m.element_bytes;
    if (m.box[0] * e != m.swizzle) fail("box inner dimension is not the swizzle span", m.box[0]);
    if (src % 1024) fail("swizzled TMA store source not 1024-byte aligned", src);
    TmaStore st;
    st.element_bytes = e;
    st.add = add;
    unsigned offset = 0;
    for (unsigned i4 = 0; i4 < m.box[4]; ++i4)
    for (unsigned i3 = 0; i3 < m.box[3]; ++i3)
    for (unsigned i2 = 0; i2 < m.box[2]; ++i2)
    for (unsigned i1 = 0; i1 < m.box[1]; ++i1)
    for (unsigned i0 = 0; i0 < m.box[0]; ++i0, offset += e) {
        const long long at[5] = {coords[0] + i0, coords[1] + i1, coords[2] + i2, coords[3] + i3,
                                 coords[4] + i4};
        const unsigned from = swizzled(src + offset, m.swizzle);
        check_smem(from, e, e);
        bool inside = true;
        for (int d = 0; d < 5; ++d) inside &= at[d] >= 0 && at[d] < (long long)m.dims[d];
        if (!inside) continue;
        unsigned long long byte = at[0] * e;
        for (int d = 1; d < 5; ++d) byte += at[d] * m.strides[d - 1];
        auto* dst = reinterpret_cast<unsigned char*>(m.address + byte);
        check_global(dst, e);
        st.writes.push_back({dst, from});
    }
    auto& mine = stores().groups[threadIdx.x];
    if (mine.empty()) mine.emplace_back();
    if (sm90().lazy_tma) {
        perform(st);         // read now: the data it had to wait for must be there already
        st.writes.clear();
    }
    mine.back().push_back(std::move(st));
}

inline void bulk_commit() {
    auto& mine = stores().groups[threadIdx.x];
    if (mine.empty()) mine.emplace_back();
    mine.emplace_back();
}

inline void bulk_wait_read(int pending) {
    auto& mine = stores().groups[threadIdx.x];
    const int committed = mine.empty() ? 0 : int(mine.size()) - 1;
    for (int i = 0; i < committed - pending; ++i)
        for (const TmaStore& st : mine[i]) perform(st);   // eager: the read happens only now
    if (committed > pending) mine.erase(mine.begin(), mine.begin() + (committed - pending));
}

// Chained onto sm90_emu.h's hooks (defined after them in this translation unit, so they exist).
inline void (*const kSm90CtaStart)() = rt().cta_start;
inline void (*const kSm90CtaEnd)() = rt().cta_end;

inline void store_cta_start() {
    stores().groups.clear();
    if (kSm90CtaStart) kSm90CtaStart();
}

inline void store_cta_end() {
    for (auto& [thread, mine] : stores().groups)
        for (auto& group : mine)
            if (!group.empty()) fail("TMA stores never waited for (wait_group.read)", thread);
    if (kSm90CtaEnd) kSm90CtaEnd();
}

inline const bool kStoreHooks = (rt().cta_start = store_cta_start, rt().cta_end = store_cta_end, true);

}  // namespace emu
