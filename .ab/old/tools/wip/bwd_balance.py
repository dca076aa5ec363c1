"""Two CPU estimates for the masked Hopper backward on the modifier bench's documents (hd128 4k:
batch 4, 16 heads; PERF_NOTES §90):
  * tile bound: visible work over the work of every (block_m x block_n) tile that has any visible
    element, for the documents against plain (varlen: each sequence tiled on its own);
  * balance: the ideal time (all work / 132 SMs) over the makespan of the launch-order grid, CTA
    cost = its pairs + a per-CTA overhead in pairs, against longest first.

    PYTHONPATH=. python tools/wip/bwd_balance.py
"""
import heapq
import math

import torch

from kernelgen.bench_mods import document_ids, document_lengths

SEQLEN, BATCH, HEADS, SMS = 4096, 4, 16, 132


def computed(vis, bm, bn):
    batch, seqlen, _ = vis.shape
    tiles = vis.reshape(batch, seqlen // bm, bm, seqlen // bn, bn).any(dim=(2, 4))
    return tiles.sum().item() * bm * bn


def varlen_computed(rows, bm, bn, causal):
    total = 0
    for row in rows:
        for length in row:
            m_tiles, n_tiles = -(-length // bm), -(-length // bn)
            if not causal:
                total += m_tiles * bm * n_tiles * bn
            else:
                total += sum(bm * bn * ((min(length, (i + 1) * bm) - 1) // bn + 1) for i in range(m_tiles))
    return total


def makespan(costs):
    free = [0.0] * SMS
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def packed_pairs(lengths, causal, bm=64, bn=128):
    span, start = [], 0
    for length in lengths:
        span += [(start, start + length)] * length
        start += length
    out = []
    for n in range(math.ceil(SEQLEN / bn)):
        k0, k1, count = n * bn, min(SEQLEN, (n + 1) * bn), 0
        for m in range(math.ceil(SEQLEN / bm)):
            q0, q1 = m * bm, min(SEQLEN, (m + 1) * bm) - 1
            lo, hi = span[q0][0], span[q1][1]
            if causal:
                hi = min(hi, q1 + 1)
            count += lo < hi and k0 < hi and lo < k1
        out.append(count)
    return out


def main():
    rows = document_lengths(BATCH, SEQLEN, max(2, SEQLEN // 1024), seed=SEQLEN)
    ids = document_ids(rows)
    token = torch.arange(SEQLEN)
    lower = token[:, None] >= token[None, :]
    for causal in (False, True):
        vis = ids[:, :, None] == ids[:, None, :]
        plain = lower.expand(BATCH, -1, -1) if causal else torch.ones(BATCH, SEQLEN, SEQLEN, dtype=torch.bool)
        if causal:
            vis = vis & lower
        seen, every = vis.sum().item(), plain.sum().item()
        cells = []
        for bm, bn in ((64, 128), (128, 128), (64, 64)):
            bound = (seen / computed(vis, bm, bn)) / (every / computed(plain, bm, bn))
            cells.append(f"{bm}x{bn} {bound:.3f}")
        bound = (seen / varlen_computed(rows, 64, 128, causal)) / (every / computed(plain, 64, 128))
        cells.append(f"varlen 64x128 {bound:.3f}")
        print(f"tile bound, {'causal' if causal else 'full'}: " + ", ".join(cells))
    for causal in (False, True):
        for overhead in (0.0, 1.5, 3.0):
            costs = []
            for row in rows:
                pairs = packed_pairs(row, causal)
                costs += [c + overhead if c else 0.2 for c in pairs] * HEADS
            ideal = sum(costs) / SMS
            print(f"balance, packed {'causal' if causal else 'full'}, overhead {overhead}: launch order "
                  f"{ideal / makespan(costs):.3f}, longest first {ideal / makespan(sorted(costs, reverse=True)):.3f}")


if __name__ == "__main__":
    main()
