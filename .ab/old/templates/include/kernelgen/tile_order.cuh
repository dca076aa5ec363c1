// Longest first, in sections that fit in L2: the order in which the Hopper forward's persistent
// causal schedule runs the tiles of many (batch, head) pairs. Longest first over every pair at
// once (all pairs' longest tile, then all their second longest, ...) puts a pair's tiles a whole
// round of pairs apart, so each one reads the pair's K and V from DRAM again once the pairs'
// bytes exceed L2: at 512 keys the forward moved 1.75x the compulsory bytes and was DRAM-bound
// (ncu: 82% of DRAM bandwidth). In sections, the pairs of one section run longest first among
// themselves, then the next section's: the imbalance of the tail is that of the last section,
// whose short tiles still come last. (The Hopper backward gets the same from its grid's order,
// one batch per section: flash_bwd_sm90.cuh.)
#pragma once
#include "kernelgen/types.cuh"

// The K and V bytes a section keeps in flight: a quarter of the H100/H200 L2 (50 MB in two
// partitions, whose data may be duplicated), so that the Q and O streaming through beside them
// leave them in place. A macro so that the emulated tests can cut shapes small enough to run
// into many sections.
#ifndef KG_L2_SECTION_BYTES
#define KG_L2_SECTION_BYTES (12ll << 20)
#endif
// The shortest ranks kept out of the sections (section_item's `tail`): m_blocks / this many
// (a quarter measured 1.5-5.6% faster than an eighth on packed and varlen causal, 0.7% slower on
// the window's, PERF_NOTES §46).
// A macro for the same reason as the section budget.
#ifndef KG_TAIL_RANKS_DIV
#define KG_TAIL_RANKS_DIV 4
#endif

// The fewest query tiles per (batch, head) for the static causal zigzag (TileSchedule::zigzag).
// A macro for the same reason as the section budget.
#ifndef KG_ZIGZAG_M_BLOCKS
#define KG_ZIGZAG_M_BLOCKS 16
#endif

namespace kg {

// This CTA's place in its grid's launch order: the GPU starts CTAs in blockIdx order, x fastest,
// as SMs free up (the sectioned causal grid and a block mask's bm_order map it to a tile).
__device__ __forceinline__ int launch_index() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// Pairs per section when each pair keeps `pair_bytes` in L2 (at least one).
__device__ __forceinline__ int section_pairs(i64 pair_bytes) {
    return int(max(i64(1), i64(KG_L2_SECTION_BYTES) / max(pair_bytes, i64(1))));
}

struct SectionItem {
    int rank;  // 0: the pair's longest tile, 1: the next, ...
    int pair;
};

// The t-th of the `pairs` x `ranks` (rank, pair) items, sections of `section` pairs in turn, each
// section's rank 0 of every pair first, then its rank 1, ... (the last section may be short).
__device__ __forceinline__ SectionItem section_item(int t, int pairs, int ranks, int section) {
    // A section of more than every pair is all of them; clamped, per_section stays within the
    // item count (few keys and a long query sequence would overflow it otherwise).
    section = min(section, pairs);
    const int per_section = section * ranks;
    const int first = t / per_section * section, u = t % per_section;
    const int in_section = min(section, pairs - first);
    return SectionItem{u / in_section, first + u % in_section};
}

// section_item with the last `tail` ranks (the shortest tiles) taken out of the sections and
// run after all of them, rank by rank over every pair. Where a tile's rank only bounds its work
// (documents: a tile's keys are its rows' documents, not every key up to its diagonal), the last
// section still holds long tiles, which CTAs claim while the others run out of work: the
// dynamic schedule simulated on the bench's documents (128-row tiles, 132 CTAs) reached 0.88 of
// a perfect balance at 16k tokens x 1 (one pair per section) and 0.96 at 4k x 4; with the
// last quarter of the ranks over every pair, 0.99 and 0.99 (tools/schedule_sim.py; measured:
// packed and varlen causal +1-6% at 4k and 16k over no tail, PERF_NOTES §46). Those short
// tiles read few K and V blocks, so leaving their sections costs little L2 traffic. The plain
// kernels' dynamic schedule has the same tail (its last section's long tiles claimed late):
// with it hd64 causal 2k/4k, hd192 512/1k and ALiBi hd128 causal 4k ran 1.5-3% faster, hd64
// causal 1k 1.3% slower (PERF_NOTES §49).
__device__ __forceinline__ SectionItem section_item(int t, int pairs, int ranks, int section,
                                                   int tail) {
    const int sectioned = pairs * (ranks - tail);
    if (t >= sectioned) return SectionItem{ranks - tail + (t - sectioned) / pairs,
                                           (t - sectioned) % pairs};
    return section_item(t, pairs, ranks - tail, section);
}

// The item of a static round robin's slot t (CTA t % ctas, its round t / ctas), in a zigzag: a
// CTA takes item c of the even rounds and ctas - 1 - c of the odd ones, so the CTA that drew a
// round's longest tile draws the next one's shortest, and a short last round (odd) falls to the
// CTAs that drew the previous round's short tiles: its slots whose item is >= count hold none
// (TileSchedule::valid). Straight round robin gives CTA 0 the longest tile of every round of a
// longest-first order: the simulated static schedule (tools/schedule_sim.py --static) reached
// 0.89 of a perfect balance at hd256 causal 4k and 0.95 at hd128 8k, this zigzag 0.97 and 0.97
// (reversing only a short round's own items hands it to the first CTAs again: no better).
// Measured against the straight order (PERF_NOTES §54, hd256 causal): +2-4% at 2k, +2-6% at 4k,
// but -3% at 1k, where the simulation saw no difference; so `zigzag` (odd rounds reversed) only
// from KG_ZIGZAG_M_BLOCKS query tiles per (batch, head): hd256 causal 512 +7%, 1k +3% with the
// straight order there (§61).
__device__ __forceinline__ int zigzag_item(int t, int ctas, bool zigzag = true) {
    const int round = t / ctas;
    return !zigzag || round % 2 == 0 ? t : round * ctas + ctas - 1 - t % ctas;
}

}  // namespace kg
