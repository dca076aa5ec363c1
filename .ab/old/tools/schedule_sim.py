"""Simulate the Hopper forward's persistent schedules on the bench's documents or the plain
causal mask: each tile costs its KV blocks + `overhead`, and the balance is the ideal time (all
work / CTAs) over the makespan. Dynamic (greedy claims by the SMs' CTAs): the persistent causal
order of sections (tile_order.cuh) with the short ranks left in them (tail 0) and taken out.
--static: the static round robin (CTA c takes items c, c + CTAs, ...) against a zigzag (odd
rounds reversed), on the plain causal mask at 512-8k for each head dim.
--defer: non-causal documents on the dynamic schedule in claim order, with the claims that
defer tiles shorter than the claiming CTA's mean (TileQueue::claim_longer in
tools/wip/defer.patch), and longest first.

    python tools/schedule_sim.py [--ctas 132] [--overhead 1.0] [--head-dim 128] [--static|--defer]
"""
from __future__ import annotations

import argparse
import heapq
import math

from kernelgen import bench_mods

BLOCK = 128  # block_m = block_n: the packed spec's tuned causal tiles


def makespan(costs, ctas: int) -> float:
    free = [0.0] * ctas
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def document_work(seqlen: int, batch: int, causal: bool = True) -> list[list[int]]:
    """KV blocks of each query tile of the bench's documents (as its varlen/packed rows)."""
    work = []
    for row in bench_mods.document_lengths(batch, seqlen, max(2, seqlen // 1024), seed=seqlen):
        span, start = [], 0  # each token's document, [start, end)
        for length in row:
            span += [(start, start + length)] * length
            start += length
        tiles = []
        for m in range(math.ceil(seqlen / BLOCK)):
            first, last = m * BLOCK, min(seqlen, m * BLOCK + BLOCK) - 1
            lo, hi = span[first][0], min(span[last][1], last + 1) if causal else span[last][1]
            tiles.append(math.ceil(hi / BLOCK) - lo // BLOCK)
        work.append(tiles)
    return work


def causal_order(work, heads: int, section: int, tail: int) -> list[int]:
    """Tile costs in claim order: sections of `section` pairs, rank by rank (longest position
    first), the last `tail` ranks after all sections over every pair."""
    ranks = len(work[0])
    pairs = [b for b in range(len(work)) for _ in range(heads)]
    order = [work[b][ranks - 1 - r] for first in range(0, len(pairs), section)
             for r in range(ranks - tail) for b in pairs[first:first + section]]
    return order + [work[b][ranks - 1 - r] for r in range(ranks - tail, ranks) for b in pairs]


def static_makespan(costs, ctas: int, zigzag: bool = False) -> float:
    """Item i of round r goes to CTA i % ctas, or with zigzag in odd rounds to CTA ctas - 1 - (i %
    ctas): a short last round then falls to the CTAs that drew the previous round's short tiles.
    (Reversing only the round's own items, n - 1 - c, hands it to the first CTAs again and
    measured no better than straight round robin in this model.)"""
    sums = [0.0] * ctas
    for i, cost in enumerate(costs):
        rnd, c = divmod(i, ctas)
        sums[ctas - 1 - c if zigzag and rnd % 2 else c] += cost
    return max(sums)


def deferring_makespan(costs, ctas: int) -> float:
    """The dynamic schedule with claim_longer: CTA c's first tile is c; when a CTA is free it
    claims the next tiles in order, putting those below its own running mean (over its first
    tile and its claims) on a list, which the CTAs take from in order once the claims run out."""
    free = [(cost, c) for c, cost in enumerate(costs[:ctas])]
    heapq.heapify(free)
    mean = {c: [cost, 1] for c, cost in enumerate(costs[:ctas])}
    claims, deferred, end = iter(costs[ctas:]), [], 0.0
    while free:
        time, c = heapq.heappop(free)
        end = max(end, time)
        pick = None
        for cost in claims:
            mean[c][0] += cost
            mean[c][1] += 1
            if cost * mean[c][1] >= mean[c][0]:
                pick = cost
                break
            deferred.append(cost)
        if pick is None and deferred:
            pick = deferred.pop(0)
        if pick is not None:
            heapq.heappush(free, (time + pick, c))
    return end


def defer_table(ctas: int, overhead: float, head_dim: int) -> None:
    heads = 2048 // head_dim
    print(f"{'documents, non-causal':24} {'claims':>7} {'defer':>7} {'longest':>8}")
    for seqlen in (4096, 8192, 16384):
        batch = 16384 // seqlen
        work = document_work(seqlen, batch, causal=False)
        costs = [c + overhead for b in range(batch) for _ in range(heads) for c in work[b]]
        ideal = sum(costs) / ctas
        print(f"{seqlen:>5} x {batch:<2}                 {ideal / makespan(costs, ctas):7.3f} "
              f"{ideal / deferring_makespan(costs, ctas):7.3f} "
              f"{ideal / makespan(sorted(costs, reverse=True), ctas):8.3f}")


def static_table(ctas: int, overhead: float) -> None:
    print(f"{'plain causal':22} {'static':>7} {'zigzag':>7} {'dynamic':>8}")
    for head_dim in (64, 128, 256):
        for seqlen in (512, 1024, 2048, 4096, 8192):
            batch = 16384 // seqlen
            work = [[m + 1 for m in range(seqlen // BLOCK)]] * batch
            section = max(1, (12 << 20) // (4 * seqlen * head_dim))
            costs = [c + overhead for c in causal_order(work, 2048 // head_dim, section, 0)]
            ideal = sum(costs) / ctas
            print(f"hd{head_dim:<3} {seqlen:>5} x {batch:<2}        "
                  f"{ideal / static_makespan(costs, ctas):7.3f} "
                  f"{ideal / static_makespan(costs, ctas, zigzag=True):7.3f} "
                  f"{ideal / makespan(costs, ctas):8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--overhead", type=float, default=1.0)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--static", action="store_true")
    p.add_argument("--defer", action="store_true")
    opts = p.parse_args()
    if opts.static:
        return static_table(opts.ctas, opts.overhead)
    if opts.defer:
        return defer_table(opts.ctas, opts.overhead, opts.head_dim)
    heads = 2048 // opts.head_dim
    print(f"{'case':24} " + " ".join(f"tail m/{d}" if d else "tail 0  " for d in (0, 16, 8, 4)))
    for seqlen in (4096, 8192, 16384):
        batch = 16384 // seqlen
        plain = [[math.ceil(min(seqlen, m * BLOCK + BLOCK) / BLOCK) for m in range(seqlen // BLOCK)]] * batch
        for name, work in (("documents", document_work(seqlen, batch)), ("plain", plain)):
            section = max(1, (12 << 20) // (4 * seqlen * opts.head_dim))
            cells = []
            for div in (0, 16, 8, 4):
                costs = [c + opts.overhead for c in causal_order(work, heads, section,
                                                                 len(work[0]) // div if div else 0)]
                cells.append(f"{sum(costs) / opts.ctas / makespan(costs, opts.ctas):8.3f}")
            print(f"{name:9} {seqlen:>5} x {batch:<2}      " + " ".join(cells))


if __name__ == "__main__":
    main()
