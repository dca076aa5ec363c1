"""tools/tile_bound.py on hand-counted cases: the forward's per-warpgroup skips (both ends), kv_align,
and the backward's whole 64 x 128 pairs."""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))

import tile_bound  # noqa: E402

DIAGONAL = [[(i, i + 1) for i in range(128)]]   # each row sees its own key only


def test_each_warpgroup_skips_the_blocks_its_rows_do_not_see():
    # One 128-row tile over keys [0, 128) in 64-key blocks: warpgroup 0 skips the last block
    # (past its rows), warpgroup 1 the first (before them): 64 x 64 each, 128 visible.
    assert tile_bound.forward_bound(DIAGONAL, 128, 64, False) == 128 / (2 * 64 * 64)
    # In one 128-key block neither can skip: 128 x 128 computed.
    assert tile_bound.forward_bound(DIAGONAL, 128, 128, False) == 128 / (128 * 128)


def test_kv_align_starts_the_blocks_at_the_first_key():
    rows = [[(100 + i, 100 + i + 64) for i in range(128)]]   # keys [100, 292) in all
    # From key 96 (a multiple of 32): 7 blocks [96, 320); from key 100: 6 blocks [100, 292).
    # Warpgroup 0 sees [100, 228): the last two blocks skipped. Warpgroup 1 sees [164, 292):
    # two blocks wholly before it, of which it skips stages - 1 = 1.
    unaligned = tile_bound.forward_bound(rows, 128, 32, False)
    aligned = tile_bound.forward_bound(rows, 128, 32, True)
    assert unaligned == 128 * 64 / (64 * 5 * 32 + 64 * 6 * 32)
    assert aligned == 128 * 64 / (64 * 4 * 32 + 64 * 5 * 32)


def test_the_backward_computes_every_pair_its_kv_tile_meets_whole():
    assert tile_bound.backward_bound(DIAGONAL) == 128 / (2 * 64 * 128)
    plain = tile_bound.row_ranges("plain", False)
    assert tile_bound.backward_bound(plain) == 1.0
    assert tile_bound.forward_bound(plain, 128, 128, False) == 1.0


def test_the_bench_rows_are_below_plain():
    for mod in ("window", "varlen_window", "document"):
        for causal in (False, True):
            sequences = tile_bound.row_ranges(mod, causal)
            assert 0.5 < tile_bound.backward_bound(sequences) < 1.0
