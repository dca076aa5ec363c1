"""The tile bound of a masked row of the modifier bench: the share of the (query, key) pairs a
Hopper kernel computes that are visible, divided by plain's own share on the same shape (causal:
plain's diagonal tiles compute some masked pairs too). A kernel cannot beat plain's rate per
visible pair by more than this, before any cost of the mask itself (PERF_NOTES §115, §117).

Forward: a tile of block_m rows computes, for each of its two consumer warpgroups (64 rows
each), the tile's KV blocks (the union of its rows' key ranges, from the first key with kv_align
or else from the multiple of block_n below it) less those wholly past or before that
warpgroup's own keys (fwd_sm90_tiles.cuh skipped_blocks: at least one block kept, at most
stages - 1 skipped before). Backward: a KV tile of block_n keys walks the 64-row query pairs
whose rows' range union meets it (bwd_sm90_pairs.cuh bwd_pair_seen) and computes each whole.

    python tools/tile_bound.py [--mods window varlen_window document] [--block-n 64 128]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernelgen.bench_mods import VARLEN_WINDOW, WINDOW, document_lengths  # noqa: E402

SEQLEN, TOKENS = 4096, 16384


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_ranges(mod: str, causal: bool) -> list[list[tuple[int, int]]]:
    """Per sequence of the kernel's batch, each query row's visible keys [lo, hi)."""
    batch = TOKENS // SEQLEN

    def window(n: int, left: int, right: int, offset: int = 0, end: int | None = None):
        end = offset + n if end is None else end
        rows = []
        for i in range(n):
            lo = offset + max(0, i - left) if left >= 0 else offset
            hi = offset + i + 1 if causal else (min(end, offset + i + right + 1) if right >= 0 else end)
            rows.append((lo, hi))
        return rows

    if mod == "plain":
        return [window(SEQLEN, -1, -1) for _ in range(batch)]
    if mod == "window":
        return [window(SEQLEN, *WINDOW[causal]) for _ in range(batch)]
    lengths = document_lengths(batch, SEQLEN, max(2, SEQLEN // 1024), seed=SEQLEN)
    left, right = VARLEN_WINDOW[causal] if mod == "varlen_window" else (-1, -1)
    sequences = []
    for row in lengths:
        rows, offset = [], 0
        for n in row:
            rows += window(n, left, right, offset)
            offset += n
        sequences.append(rows)
    if mod == "varlen_window":   # one flattened sequence (flash_attn_varlen_func's batch of one)
        flat, offset = [], 0
        for rows in sequences:
            flat += [(lo + offset, hi + offset) for lo, hi in rows]
            offset += len(rows)
        return [flat]
    return sequences


def forward_bound(sequences, block_m: int, block_n: int, kv_align: bool, stages: int = 2):
    visible = computed = 0
    for rows in sequences:
        for row0 in range(0, len(rows), block_m):
            tile = [r for r in rows[row0:row0 + block_m] if r[1] > r[0]]
            visible += sum(hi - lo for lo, hi in tile)
            if not tile:
                continue
            lo, hi = min(r[0] for r in tile), max(r[1] for r in tile)
            first = lo if kv_align else lo // block_n * block_n
            blocks = _cdiv(hi - first, block_n)
            for w in range(row0, min(len(rows), row0 + block_m), 64):
                own = [r for r in rows[w:w + 64] if r[1] > r[0]]
                n = len(rows[w:w + 64])
                if not own:
                    computed += n * block_n   # one block kept
                    continue
                olo, ohi = min(r[0] for r in own), max(r[1] for r in own)
                lead = min(max(0, blocks - _cdiv(ohi - first, block_n)), blocks - 1)
                trail = min(max(0, (olo - first) // block_n), blocks - 1 - lead, stages - 1)
                computed += n * (blocks - lead - trail) * block_n
    return visible / computed


def backward_bound(sequences, block_m: int = 64, block_n: int = 128):
    visible = computed = 0
    for rows in sequences:
        visible += sum(max(0, hi - lo) for lo, hi in rows)
        pairs = [(min(r[0] for r in rows[m:m + block_m]), max(r[1] for r in rows[m:m + block_m]))
                 for m in range(0, len(rows), block_m)]
        keys = max(hi for _, hi in pairs)
        for kv0 in range(0, keys, block_n):
            computed += sum(block_m * block_n for lo, hi in pairs if lo < hi and kv0 < hi and lo < kv0 + block_n)
    return visible / computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mods", nargs="+", default=["window", "varlen_window", "document"])
    parser.add_argument("--block-n", nargs="+", type=int, default=[64, 96, 128, 144, 160])
    args = parser.parse_args()
    for causal in (False, True):
        plain = row_ranges("plain", causal)
        plain_fwd = forward_bound(plain, 128, 128, False)
        plain_bwd = backward_bound(plain)
        print(f"causal={causal}: plain's own share fwd 128x128 {plain_fwd:.3f}, bwd 64x128 {plain_bwd:.3f}")
        for mod in args.mods:
            sequences = row_ranges(mod, causal)
            cells = [f"{bn}{'a' if align else ''} {forward_bound(sequences, 128, bn, align) / plain_fwd:.3f}"
                     for bn in args.block_n for align in ((False, True) if mod != "window" else (False,))]
            print(f"  {mod:14} fwd 128 x " + ", ".join(cells)
                  + f" | bwd 64 x 128 {backward_bound(sequences) / plain_bwd:.3f}")
    print("(a: kv_align; each figure divided by plain's own share)")


if __name__ == "__main__":
    main()
