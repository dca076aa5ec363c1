"""The Hopper forward (flash_attn_fwd_sm90) on the CPU emulator (tests/emulator, sm90_emu.h): TMA
with swizzled boxes and zero-filled tails, mbarrier rings, wgmma reading shared memory through its
descriptors, the three schedules, compared with the float32 reference by FlashAttention's rule.
The tensor maps come from kernelgen.tma.attention_map, as on the GPU. Seconds per case: a few small
shapes that reach every code path (each schedule, 64B and 128B swizzle, two and three consumer
warpgroups, 2 and 3 stages, ragged tails, rows that see no key, GQA, a strided view), with TMA
copies landing at issue (eager) or as late as allowed (lazy)."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulator"))
import emulate  # noqa: E402

from kernelgen import hopper, tma  # noqa: E402
from kernelgen.reference import attention_ref, max_error, rounding_allowance  # noqa: E402
from kernelgen.spec import load_spec  # noqa: E402

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

SPEC = load_spec("flash_attn_fwd_sm90")
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def emulated_wgmma(text: str) -> str:
    """The template's three inline-PTX wgmma wrappers, as calls into the emulator."""
    def replace(match):
        name, n, rest = match.group(1), int(match.group(2)) * 2, match.group(3)
        if name != "PvGemm":  # (d, desc_q, desc_k, scale_d): SS, both K-major (Half: N / 2)
            call = f"emu::wgmma<elem_t>(d, {n}, desc_q, nullptr, desc_k, scale_d != 0, false)"
        else:                 # (d, p, desc_v): RS, V MN-major
            call = f"emu::wgmma<elem_t>(d, {n}, 0, p, desc_v, true, true)"
        return f"struct {name} {{\n    static void mma(float (&d)[{n // 2}], {rest}) {{ {call}; }}\n}};"

    pattern = r"struct (QkGemm|QkGemmHalf|PvGemm) \{\n.*?mma\(float \(&d\)\[(\d+)\], (.*?)\) \{.*?\n\};"
    text, count = re.subn(pattern, replace, text, flags=re.S)
    assert count == 3, "the template's wgmma wrappers changed shape"
    return text


def forward(q, k, v, causal, config=None, seed=0, lazy=False, spec=SPEC, mod_args=None, out=None,
            l2_bytes=None, tail_div=None, zigzag_m_blocks=None, counter=None):
    """The emulated kernel of `spec` (this family, or a mods spec put onto it), with the mod
    arguments `mod_args` by name (tensors for `ptr`); returns (out, lse). `out`: where O goes
    (default: a fresh NaN-filled tensor like q). `l2_bytes`: the persistent causal schedule's
    section budget (KG_L2_SECTION_BYTES), small enough to give these shapes several sections;
    `tail_div`: KG_TAIL_RANKS_DIV, small enough that the short ranks leave them (tile_order.cuh);
    `zigzag_m_blocks`: KG_ZIGZAG_M_BLOCKS, small enough for these shapes to take the zigzag;
    `counter`: the dynamic schedule's buffer (default: a fresh zero one, as hopper.tile_counter
    makes), for tests that read it afterwards."""
    head_dim = q.shape[-1]
    variant = spec.variant(head_dim=head_dim, dtype=NAMES[q.dtype], causal=causal)
    config = spec.default_config(variant) if config is None else spec.parse_config(config)
    assert not spec.violations(variant, config)
    env = spec.environment(variant, config)
    batch, seqlen_q, heads, _ = q.shape
    out = torch.full_like(q, float("nan")).contiguous() if out is None else out
    lse = torch.full((batch, heads, seqlen_q), float("nan"))
    maps = {f"tmap_{name}": (tma.attention_map(t.shape, t.stride(), NAMES[q.dtype], rows,
                                               env["swizzle"], panels), t)
            for name, t, rows, panels in (("q", q, *hopper.q_box(env)),
                                          ("k", k, env["block_n"], None),
                                          ("v", v, env["block_n"], None),
                                          ("o", out, 64, 1))}   # O: read by q_buffers 2 only
    strides = {f"{name}_stride_{dim}": t.stride(i)
               for name, t in (("q", q), ("k", k), ("v", v), ("o", out))
               for i, dim in enumerate("bsh")}
    # The dynamic schedule's counter (persistent 2), zero like the library's per launch.
    if counter is None and config["persistent"] == 2:
        counter = torch.zeros(hopper.counter_words(config, q.shape), dtype=torch.int32)
    args = dict(q=q, k=k, v=v, o=out, lse=lse, batch=batch, heads=heads, heads_k=k.shape[2],
                seqlen_q=seqlen_q, seqlen_k=k.shape[1], softmax_scale=1 / math.sqrt(head_dim),
                tile_counter=counter, **strides, **maps, **(mod_args or {}))
    define = "" if l2_bytes is None else f"#define KG_L2_SECTION_BYTES {l2_bytes}\n"
    define += "" if tail_div is None else f"#define KG_TAIL_RANKS_DIV {tail_div}\n"
    define += "" if zigzag_m_blocks is None else f"#define KG_ZIGZAG_M_BLOCKS {zigzag_m_blocks}\n"
    emulate.run(spec, variant, config, args, seed=seed, defer=lazy,
                transform=lambda text: define + emulated_wgmma(text))
    return out, lse


def check(q, k, v, causal, score_mod=None, mask_mod=None, **kwargs):
    """forward() against the float32 reference applying the same score_mod / mask_mod."""
    out, lse = forward(q, k, v, causal, **kwargs)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod)
    out_ref, lse_ref = attention_ref(q, k, v, causal, upcast=True, **mods)
    out_pt, _ = attention_ref(q, k, v, causal, upcast=False, **mods)
    assert not out.isnan().any(), "output has NaN (unwritten or bad math)"
    err, err_pt = max_error(out, out_ref), max_error(out_pt, out_ref)
    assert err <= 2 * err_pt + rounding_allowance(out_ref), (err, err_pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE is -inf exactly where no key is visible"
    assert torch.all(lse[~finite] == float("-inf"))
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-3
    assert torch.all(out[(~finite).transpose(1, 2)] == 0), "rows that see no key give 0"
    return lse


def make(batch, seqlen, heads, head_dim, dtype=torch.bfloat16):
    return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype)


# (head_dim, dtype, causal, (batch, seqlen_q, seqlen_k, heads, heads_k), config or None, lazy).
# Every ring wraps (more KV blocks than stages), so a slot released too early gets refilled.
CASES = [
    (128, torch.bfloat16, False, (2, 77, 600, 2, 1), None, True),    # 128x176, overlap + pingpong
    (128, torch.float16, True, (1, 300, 430, 2, 2), None, False),
    (128, torch.bfloat16, True, (1, 300, 130, 1, 1), None, True),    # rows that see no key
    (192, torch.float16, False, (1, 130, 377, 2, 1), None, True),    # overlap only
    (256, torch.bfloat16, True, (1, 1, 300, 1, 1), None, False),     # one query row
    (64, torch.bfloat16, False, (1, 200, 517, 2, 1),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 0, "persistent": 0}, True),
    (64, torch.bfloat16, True, (1, 250, 400, 1, 1),
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 0}, False),  # three consumers
    # A warpgroup skips the tile's last KV blocks that none of its rows sees (skipped_blocks):
    # with 64-key blocks warpgroup 0 the diagonal's last one, its slots released and (pingpong)
    # its turn passed on empty; seqlen_k > seqlen_q moves the diagonal; three consumers skip 2,
    # 1 and 0 blocks; a dynamic schedule's tiles run on across the skips.
    (128, torch.bfloat16, True, (1, 300, 300, 2, 1),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1}, False),
    (256, torch.bfloat16, True, (1, 257, 390, 1, 1),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2}, True),
    (64, torch.float16, True, (2, 200, 200, 1, 1),
     {"block_m": 192, "block_n": 64, "stages": 3, "schedule": 0, "persistent": 0}, False),
    # Persistent: emulate.EMULATED_SMS (3) CTAs loop over more tiles than that, the rings and
    # barrier phases running on across tiles (and across empty tiles, which only write zeros).
    (128, torch.bfloat16, False, (2, 200, 600, 2, 1),
     {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 1}, True),
    (128, torch.float16, True, (1, 300, 130, 2, 2),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 1}, False),
    (64, torch.bfloat16, True, (1, 250, 400, 2, 1),
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1}, True),
    (96, torch.bfloat16, False, (2, 130, 300, 1, 1),
     {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 0, "persistent": 1}, False),
    # A CTA whose every tile sees no key (the third of three: query tiles 0..2 are empty), with
    # pingpong: it must not hand out a first turn no warpgroup takes.
    (128, torch.bfloat16, True, (1, 600, 130, 1, 1),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1}, True),
    # Two Q buffers, O stored by TMA (q_buffers 2): each CTA runs 3-4 tiles, so a buffer comes
    # back to a third tile; ragged last query tiles (the store clips rows past seqlen_q: a
    # warpgroup's box may lie wholly outside), GQA, causal with empty tiles in between, 64B
    # swizzle (three panels, three stores per warpgroup), and both TMA timings: eager (a buffer
    # handed back before its store read it is stored refilled) and lazy (a store issued before
    # every thread's O is in place reads stale data), sm90_store_emu.h.
    (128, torch.bfloat16, False, (2, 300, 200, 2, 1),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2}, False),
    (128, torch.bfloat16, False, (2, 290, 200, 2, 2),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2}, True),
    (128, torch.float16, True, (1, 300, 330, 4, 2),
     {"block_m": 128, "block_n": 160, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2}, False),
    (64, torch.bfloat16, True, (1, 250, 400, 3, 1),
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2}, True),
    (96, torch.bfloat16, True, (1, 600, 130, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 1, "persistent": 1, "q_buffers": 2}, False),
    # Dynamic (persistent 2): after its first tile a CTA claims the next from the counter. The
    # emulator runs one CTA at a time, so the first CTA claims every tile past the grid's first
    # three, the others none: publications of tiles, of empty tiles (which still take their
    # pingpong turn) and of the end, through both queue slots many times over.
    (128, torch.bfloat16, True, (2, 300, 430, 2, 1),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}, True),
    (128, torch.float16, False, (2, 290, 200, 2, 2),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2}, False),
    (64, torch.bfloat16, False, (1, 600, 130, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 0, "persistent": 2}, True),
    (128, torch.bfloat16, True, (1, 600, 130, 2, 1),   # empty tiles first, then the last two
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2}, False),
    (96, torch.bfloat16, True, (1, 600, 130, 2, 2),    # three consumers
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}, True),
    # sum_mma: the row sums from the P V wgmma (N = 72, its last 8 columns the panel of ones,
    # reached through each stage's own leading offset): every schedule, 2 and 3 stages, rows
    # that see no key (l = 0), persistent with the TMA store, and fp16's ones.
    (64, torch.bfloat16, False, (2, 200, 517, 2, 1),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 0, "persistent": 0, "sum_mma": 1}, True),
    (64, torch.float16, True, (1, 300, 130, 2, 2),
     {"block_m": 128, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2,
      "sum_mma": 1}, False),
    (64, torch.bfloat16, True, (1, 250, 400, 3, 1),
     {"block_m": 192, "block_n": 112, "stages": 3, "schedule": 1, "persistent": 2, "q_buffers": 2,
      "sum_mma": 1}, True),
    # Three Q buffers: tile t+2's Q in tile t-1's buffer. Causal tiles of 1-5 blocks (the
    # producer runs up to two tiles ahead in Q), both persistent loops, two and three consumers,
    # 64B swizzle, GQA, ragged last tiles, half_diag; eager timing catches a buffer reloaded
    # before its store read it, lazy a Q read before it landed.
    (64, torch.bfloat16, True, (2, 520, 520, 2, 1),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 3,
      "half_diag": 1}, False),
    (128, torch.float16, True, (1, 600, 600, 3, 1),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 3},
     True),
    (96, torch.bfloat16, False, (2, 290, 200, 2, 2),
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 3},
     True),
    (128, torch.bfloat16, False, (2, 300, 200, 2, 1),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 2, "persistent": 1, "q_buffers": 3},
     False),
    # q_split: each consumer warpgroup's rows of Q on their own barriers, a box per panel:
    # persistent (the rows go back after each tile), 2 and 3 consumers, 64B swizzle (three
    # panels), the plain schedule, a CTA per tile, and the dynamic schedule.
    (128, torch.bfloat16, True, (2, 300, 430, 2, 1),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_split": 1}, True),
    (96, torch.float16, False, (1, 600, 130, 2, 2),
     {"block_m": 192, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 1, "q_split": 1}, False),
    (64, torch.bfloat16, True, (1, 250, 400, 3, 1),
     {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 0, "persistent": 0, "q_split": 1}, True),
    (256, torch.bfloat16, False, (2, 290, 200, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 2, "q_split": 1,
      "rescale": 1}, False),
    # ... with empty tiles first (seqlen_q > seqlen_k, causal) and a last tile of 38 rows, whose
    # second warpgroup's rows are not loaded at all.
    (64, torch.bfloat16, True, (1, 550, 130, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1, "q_split": 1}, True),
    # q_prefetch: each tile's Q boxes prefetched (checked against the map) before the wait for
    # the one Q buffer: split (a box per warpgroup and panel, 64B swizzle) and whole, dynamic.
    (96, torch.bfloat16, True, (1, 550, 130, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 1, "q_split": 1,
      "q_prefetch": 1}, False),
    (128, torch.float16, False, (2, 290, 200, 2, 2),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_prefetch": 1},
     True),
    # pv_wait: each block's V waited for at the end of its softmax (block 0's in the first
    # block's step, none after the loop): both overlapped schedules, a CTA per tile with the
    # early rescale, dynamic with causal skips and two Q buffers, 3 stages and 3 consumers, and
    # with carry_qk and half_diag (the first S carried from the previous tile).
    (64, torch.float16, False, (1, 600, 130, 2, 2),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 0, "rescale": 1,
      "pv_wait": 1}, False),
    (128, torch.bfloat16, True, (2, 300, 430, 2, 1),
     {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2,
      "pv_wait": 1}, True),
    (96, torch.bfloat16, True, (1, 250, 400, 3, 1),
     {"block_m": 192, "block_n": 96, "stages": 3, "schedule": 2, "persistent": 1, "pv_wait": 1},
     False),
    (128, torch.bfloat16, True, (2, 300, 430, 2, 2),
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2,
      "carry_qk": 1, "half_diag": 1, "pv_wait": 1}, True),
]


@pytest.mark.parametrize("head_dim, dtype, causal, shape, config, lazy", CASES,
                         ids=[f"hd{c[0]}-{NAMES[c[1]]}-{'causal' if c[2] else 'full'}"
                              f"-{'x'.join(map(str, c[3]))}" for c in CASES])
def test_forward(head_dim, dtype, causal, shape, config, lazy):
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    torch.manual_seed(head_dim + seqlen_q)
    q = make(batch, seqlen_q, heads, head_dim, dtype)
    k, v = (make(batch, seqlen_k, heads_k, head_dim, dtype) for _ in range(2))
    check(q, k, v, causal, config=config, seed=seqlen_k, lazy=lazy)


@pytest.mark.parametrize("q_buffers, persistent", [(1, 1), (2, 1), (2, 2)])
def test_persistent_causal_sections(q_buffers, persistent):
    """The persistent causal schedule in sections of pairs (TileSchedule), each longest first,
    across 3 emulated CTAs: a budget of one K/V head's bytes with GQA 2 makes 6 sections of 2
    pairs; of two K/V heads' bytes without GQA, 5 pairs in sections of 2, 2 and a short one of 1."""
    for batch, heads, heads_k, budget_heads in ((2, 6, 3, 1), (1, 5, 5, 2)):
        torch.manual_seed(heads)
        q = make(batch, 300, heads, 64)
        k, v = (make(batch, 270, heads_k, 64) for _ in range(2))
        check(q, k, v, True, config={"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2,
                                     "persistent": persistent, "q_buffers": q_buffers},
              seed=heads, lazy=q_buffers == 2, l2_bytes=budget_heads * 4 * 270 * 64)


@pytest.mark.parametrize("head_dim, shape, config, lazy", [
    # Square tiles: warpgroup 0's diagonal block is half seen; ragged last tile, GQA, dynamic.
    (128, (1, 300, 300, 2, 1), {"block_m": 128, "block_n": 128, "schedule": 1, "persistent": 2,
                                "q_buffers": 2}, False),
    (64, (2, 260, 260, 2, 2), {"block_m": 128, "block_n": 128, "schedule": 2, "persistent": 1,
                               "q_buffers": 2}, True),
    # More keys than queries (warpgroup 0's first block wholly past its rows: square tiles do
    # not skip it, so half of it runs) and fewer (warpgroup 1's half too).
    (64, (1, 200, 264, 1, 1), {"block_m": 128, "block_n": 128, "schedule": 1, "persistent": 0,
                               "rescale": 1}, False),
    (64, (1, 300, 236, 2, 1), {"block_m": 128, "block_n": 128, "schedule": 2, "persistent": 0},
     True),
    # Three consumers, 112-key blocks (N = 56); 64-key blocks with the warpgroups' skips; a tile
    # of one block (its P V the tail's).
    (64, (1, 250, 250, 2, 1), {"block_m": 192, "block_n": 112, "schedule": 2, "persistent": 2,
                               "q_buffers": 2, "sum_mma": 1}, False),
    (128, (1, 257, 257, 1, 1), {"block_m": 128, "block_n": 64, "schedule": 2, "persistent": 1},
     True),
    (96, (1, 100, 100, 2, 2), {"block_m": 128, "block_n": 128, "schedule": 1, "persistent": 0},
     False),
    # Each warpgroup's rows of Q on their own barriers; a CTA per tile in the dynamic order.
    (128, (2, 300, 300, 2, 1), {"block_m": 128, "block_n": 128, "schedule": 2, "persistent": 0,
                                "q_split": 1, "grid_order": 1}, True),
], ids=["square-dynamic", "square-pingpong-fp", "more-keys", "fewer-keys", "3wg-112",
        "skips-64", "one-block-64b-swizzle", "q-split-grid-order"])
def test_half_diagonal_blocks(head_dim, shape, config, lazy):
    """half_diag 1: a warpgroup's diagonal block whose upper half none of its rows sees runs S
    (an m64n{N/2} wgmma, the rest of S -inf) and P V over its lower half."""
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    dtype = torch.float16 if lazy else torch.bfloat16
    torch.manual_seed(seqlen_q + seqlen_k)
    q = make(batch, seqlen_q, heads, head_dim, dtype)
    k, v = (make(batch, seqlen_k, heads_k, head_dim, dtype) for _ in range(2))
    check(q, k, v, True, config={"stages": 2, **config, "half_diag": 1}, seed=seqlen_q,
          lazy=lazy)


@pytest.mark.parametrize("head_dim, causal, shape, config, lazy", [
    # Static, both schedules, ragged last tiles, GQA: each CTA's tiles carry their successor's S
    # from the Q buffer the producer fills next; the CTA's last tile carries a dummy.
    (64, False, (2, 300, 517, 2, 1), {"block_n": 128, "schedule": 1, "persistent": 1}, False),
    (128, False, (2, 290, 200, 2, 2), {"block_n": 160, "schedule": 2, "persistent": 1}, True),
    # Empty tiles (600 queries, 130 keys: the first three query tiles see no key), static and
    # dynamic: a tile without work waits for its dummy S and carries the next tile's in a turn.
    (128, True, (1, 600, 130, 2, 1), {"block_n": 128, "schedule": 2, "persistent": 1}, False),
    (64, True, (2, 600, 130, 1, 1), {"block_n": 128, "schedule": 1, "persistent": 2}, True),
    # Dynamic: tiles claimed from the counter, each carrying the S of the one it learns next.
    (128, True, (2, 300, 430, 2, 1), {"block_n": 128, "schedule": 2, "persistent": 2}, True),
    (128, False, (2, 290, 200, 2, 2), {"block_n": 144, "schedule": 1, "persistent": 2}, False),
    # Three consumers (a hand-off round of three; causal needs blocks as long as the tile,
    # which three consumers' registers do not hold), 64B swizzle; sum_mma's row sums.
    (96, False, (1, 600, 130, 2, 2), {"block_m": 192, "block_n": 64, "schedule": 2,
                                      "persistent": 2}, True),
    (64, False, (1, 250, 400, 3, 1), {"block_m": 192, "block_n": 64, "schedule": 2,
                                      "persistent": 1, "sum_mma": 1}, False),
    # half_diag: the carried S is the whole diagonal block's; the half's softmax and P V read
    # its lower half (warpgroup 0 of square tiles), static pingpong and dynamic overlap.
    (64, True, (2, 260, 260, 2, 2), {"block_n": 128, "schedule": 2, "persistent": 1,
                                     "half_diag": 1}, True),
    (128, True, (1, 300, 300, 2, 1), {"block_n": 128, "schedule": 1, "persistent": 2,
                                      "half_diag": 1}, False),
], ids=["static-overlap", "static-pingpong-gqa", "static-empty-tiles", "dynamic-empty-tiles",
        "dynamic-pingpong", "dynamic-overlap", "3wg-64b-swizzle", "3wg-sum-mma",
        "half-diag-static-pingpong", "half-diag-dynamic"])
def test_carried_first_qk(head_dim, causal, shape, config, lazy):
    """carry_qk 1: a tile's first QK^T issued in the previous tile's last turn (or before the
    CTA's first tile), a dummy where no tile with work follows."""
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    dtype = torch.float16 if lazy else torch.bfloat16
    torch.manual_seed(seqlen_q + seqlen_k + head_dim)
    q = make(batch, seqlen_q, heads, head_dim, dtype)
    k, v = (make(batch, seqlen_k, heads_k, head_dim, dtype) for _ in range(2))
    check(q, k, v, causal, config={"block_m": 128, "stages": 2, "q_buffers": 2, **config,
                                   "carry_qk": 1}, seed=seqlen_q, lazy=lazy)


@pytest.mark.parametrize("block_n, schedule, tail_div", [(64, 2, 2), (128, 1, 4), (96, 0, 64)],
                         ids=["skips-pingpong-tail2", "overlap", "plain-no-tail"])
def test_causal_grid_in_the_dynamic_order(block_n, schedule, tail_div):
    """grid_order 1: a CTA per causal tile, its blockIdx taken in launch order through the
    dynamic schedule's order (sections of pairs longest first, then the short ranks over every
    pair): every tile once (a tile left out stays NaN), with GQA 2, 3 query tiles per pair with a
    ragged last one, 6 pairs in sections of 4 and 2 (a budget of two K/V heads' bytes)."""
    torch.manual_seed(block_n)
    q = make(1, 300, 6, 64)
    k, v = (make(1, 270, 3, 64) for _ in range(2))
    check(q, k, v, True, config={"block_m": 128, "block_n": block_n, "stages": 2,
                                 "schedule": schedule, "persistent": 0, "grid_order": 1},
          seed=block_n, lazy=schedule == 1, l2_bytes=2 * 4 * 270 * 64, tail_div=tail_div)


def test_causal_grid_in_the_dynamic_order_with_empty_tiles():
    """grid_order 1 with 600 queries against 130 keys: the first three query tiles of each pair
    see no key, and their CTAs (wherever the order puts them) write zeros and -inf only."""
    torch.manual_seed(600)
    q = make(2, 600, 2, 64)
    k, v = (make(2, 130, 1, 64) for _ in range(2))
    lse = check(q, k, v, True, config={"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2,
                                       "persistent": 0, "grid_order": 1, "half_diag": 1},
                seed=600, l2_bytes=4 * 130 * 64, tail_div=2)
    assert torch.all(lse[:, :, :384] == float("-inf"))


def test_section_order_is_a_permutation(tmp_path):
    """tile_order.cuh's section_item, compiled with g++ as the kernels include it: for pair,
    rank, section and tail counts the schedules meet (one section, sections with a short last
    one, no tail, every rank a tail), the items t < pairs * ranks are every (rank, pair) once;
    each section's pairs are its own until the tail, and the tail runs its ranks in order. And
    zigzag_item's valid slots hold each tile once, within its round, a prefix of each CTA's walk."""
    source = tmp_path / "order.cpp"
    source.write_text(r"""
#include "cuda_emu.h"
#include "kernelgen/tile_order.cuh"
int main() {
    for (int pairs = 1; pairs <= 13; ++pairs)
    for (int ranks = 1; ranks <= 9; ++ranks)
    for (int section = 1; section <= pairs + 1; ++section)
    for (int tail = 0; tail <= ranks; ++tail) {
        std::vector<int> seen(pairs * ranks, 0);
        int last_tail_rank = -1;
        for (int t = 0; t < pairs * ranks; ++t) {
            const kg::SectionItem it = tail ? kg::section_item(t, pairs, ranks, section, tail)
                                            : kg::section_item(t, pairs, ranks, section);
            if (it.rank < 0 || it.rank >= ranks || it.pair < 0 || it.pair >= pairs) return 1;
            if (seen[it.rank * pairs + it.pair]++) return 2;
            const bool in_tail = t >= pairs * (ranks - tail);
            if (in_tail != (it.rank >= ranks - tail)) return 3;
            if (in_tail && it.rank < last_tail_rank) return 4;
            if (in_tail) last_tail_rank = it.rank;
            if (!in_tail && it.pair / section != t / (section * (ranks - tail))) return 5;
        }
    }
    for (int ctas = 1; ctas <= 7; ++ctas)
    for (int count = 0; count <= 40; ++count) {
        // TileSchedule::valid's slots: rounds up to cdiv(count, ctas), items < count.
        std::vector<int> seen(count, 0);
        for (int c = 0; c < ctas; ++c) {
            bool ended = false;
            for (int t = c; t < (count + ctas - 1) / ctas * ctas; t += ctas) {
                const int item = kg::zigzag_item(t, ctas);
                if (item / ctas != t / ctas) return 7;  // within its round
                if (item >= count) { ended = true; continue; }
                if (ended) return 8;                    // a CTA's valid slots are a prefix
                if (item < 0 || seen[item]++) return 6;
            }
        }
        for (int n : seen) if (n != 1) return 9;
    }
    return 0;
}
""")
    binary = tmp_path / "order"
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{emulate.HERE}",
                    f"-I{emulate.HERE / 'include'}", f"-I{emulate.INCLUDE}", str(source), "-o",
                    str(binary)], check=True, capture_output=True)
    assert subprocess.run([str(binary)]).returncode == 0


@pytest.mark.parametrize("q_buffers, zigzag_m_blocks", [(1, 1), (2, 1), (2, None)],
                         ids=["zigzag", "zigzag-2q", "straight-2q"])
def test_static_causal_zigzag_with_a_short_last_round(q_buffers, zigzag_m_blocks):
    """The static causal schedule's zigzag over 3 emulated CTAs: 16 tiles (2 pairs' 4 query
    tiles, twice) make five full rounds and a sixth, odd, of one tile, which falls to the last
    CTA; every tile computed once (a tile left out stays NaN). With the shipped threshold (16
    query tiles per pair) these 4 run in the straight order."""
    torch.manual_seed(16)
    q = make(2, 500, 2, 64)
    k, v = (make(2, 460, 2, 64) for _ in range(2))
    check(q, k, v, True, config={"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2,
                                 "persistent": 1, "q_buffers": q_buffers},
          seed=16, lazy=q_buffers == 2, zigzag_m_blocks=zigzag_m_blocks)


def test_strided_view_with_64b_swizzle():
    """head_dim 96 (three 32-column panels) read out of one packed qkv tensor."""
    torch.manual_seed(96)
    qkv = make(2, 150, 3 * 2, 96).view(2, 150, 3, 2, 96)
    q, k, v = qkv[:, 20:, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    check(q, k, v, True, seed=5, lazy=True)


def test_tma_store_leaves_rows_past_seqlen_alone():
    """q_buffers 2 with O a view into a NaN-filled buffer whose rows past seqlen_q are guards: the
    last query tile's store (one warpgroup's box partly, the other's wholly past seqlen_q) clips
    at O's extent, so no guard row is written (emulate.py also fails a write outside tensors)."""
    torch.manual_seed(7)
    q = make(2, 150, 2, 64)
    k, v = (make(2, 200, 1, 64) for _ in range(2))
    big = torch.full((2, 192, 2, 64), float("nan"), dtype=torch.bfloat16)
    config = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 1,
              "q_buffers": 2}
    check(q, k, v, False, config=config, seed=7, lazy=False, out=big[:, :150])
    assert big[:, 150:].isnan().all(), "a padding row reached memory past seqlen_q"


@pytest.mark.parametrize("window, shape, lazy", [
    ((40, 30), (2, 300, 400, 2, 1), True),    # blocks left and right of the window skipped
    ((0, 0), (1, 600, 130, 2, 2), False),     # seqlen_q > seqlen_k: tiles with no block between
], ids=["40-30", "0-0-empty-tiles"])
def test_q_buffers_with_a_kv_range(window, shape, lazy):
    """q_buffers 2 under a mods spec's kv_range (the window): tiles with no block are skipped by
    producer and consumers alike, so the Q buffers still alternate over the tiles with work."""
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    left, right = window
    torch.manual_seed(left + seqlen_q)
    q = make(batch, seqlen_q, heads, 64)
    k, v = (make(batch, seqlen_k, heads_k, 64) for _ in range(2))
    shift = seqlen_k - seqlen_q

    def visible(b, h, i, j):
        return (j >= i + shift - left) & (j <= i + shift + right)

    config = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1,
              "q_buffers": 2}
    check(q, k, v, False, config=config, seed=left, lazy=lazy,
          spec=load_spec("flash_attn_window", onto="flash_attn_fwd_sm90"),
          mod_args={"window_left": left, "window_right": right}, mask_mod=visible)


@pytest.mark.parametrize("schedule, rescale", [(0, 0), (2, 0), (1, 1), (2, 1)])
def test_rescale_when_the_max_grows(schedule, rescale):
    """Keys that grow toward the sequence start, which the kernel visits last: each KV block's
    max exceeds the running one by several log2 units, so O and the row sums are rescaled by a
    small alpha at nearly every block, in both the plain and the overlapped steps, next to rows
    whose max hardly moves (alpha near 1). rescale 1 rescales in the next QK^T's shadow, and
    the last block's alpha in the tail."""
    torch.manual_seed(schedule + 4 * rescale)
    seqlen_q, seqlen_k = 130, 400
    q = make(1, seqlen_q, 2, 64)
    k, v = (make(1, seqlen_k, 1, 64) for _ in range(2))
    growth = torch.linspace(12.0, 0.5, seqlen_k).view(1, seqlen_k, 1, 1)
    k = (k.float() * growth).to(k.dtype)
    q[:, ::2] = q[:, ::2] * 0.01   # rows whose max hardly moves, next to ones that jump
    config = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": schedule, "persistent": 0,
              "rescale": rescale}
    check(q, k, v, False, config=config, seed=schedule, lazy=True)
