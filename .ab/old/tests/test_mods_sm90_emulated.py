"""The Hopper forward with each shipped modifier on the CPU emulator (tests/emulator): softcap,
sliding window, ALiBi, document masks and the tutorial's prefix LM, each spec put onto
flash_attn_fwd_sm90 (load_spec(..., onto=...), as kernelgen.mods_sm90 does) and run with its mod
arguments after the tensor maps. Compared with the float32 reference applying the same score_mod /
mask_mod by FlashAttention's rule (test_sm90_emulated.check). Small KV tiles, so that a few hundred
keys give many blocks: the kv range's skipped blocks, its blocks without per-element masking and
tiles with no block at all (rows that see no key) all occur, in both tile modes (persistent 0/1:
the ring position then runs on across tiles whose block counts the kv range decides)."""
from __future__ import annotations

import pytest
import torch
from test_packed import mask_of
from test_sm90_emulated import check, emulate, make

from kernelgen import blockmask, hopper
from kernelgen.packed import packed_ranges, varlen_ranges
from kernelgen.spec import REPO_ROOT, load_spec

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

BASE = "flash_attn_fwd_sm90"
PREFIX_LM = str(REPO_ROOT / "examples" / "prefix_lm.yaml")


def onto(name):
    return load_spec(name, onto=BASE)


def config(block_m=128, block_n=64, schedule=2, persistent=0, stages=2, kv_align=0, half_diag=0,
           **extra):
    return {"block_m": block_m, "block_n": block_n, "stages": stages, "schedule": schedule,
            "persistent": persistent, "kv_align": kv_align, "half_diag": half_diag, **extra}


CARRY = {"q_buffers": 2, "carry_qk": 1}  # each tile's first QK^T in the previous tile's last turn


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype=torch.bfloat16, scale=1.0):
    torch.manual_seed(seqlen_q * 7 + seqlen_k + head_dim)
    return (make(batch, seqlen_q, heads, head_dim, dtype) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype))


# Caps within the score bound's limit (bf16 39.8, fp16 4.5: the softmax subtracts the cap, no
# running max) and past it (the online softmax); a negative cap bounds the scores by its size.
@pytest.mark.parametrize("head_dim, dtype, causal, shape, cfg, cap", [
    (128, torch.bfloat16, True, (1, 200, 333, 4, 2), config(persistent=0), 2.0),
    (64, torch.float16, False, (2, 250, 200, 2, 1), config(192, 96, persistent=1), 2.0),  # 3 consumers
    (96, torch.bfloat16, False, (1, 130, 300, 2, 2), config(128, 128, schedule=0, persistent=1), -2.0),
    (128, torch.bfloat16, False, (1, 200, 333, 4, 2), config(128, 128, schedule=1, persistent=1), 45.0),
    # a negative cap at hd128: the cap is the score_mod's factor (Mods::kScoreFactor), folded into
    # the exp2's scale only where positive; here the scores take it before the causal mask
    (128, torch.bfloat16, True, (1, 200, 333, 4, 2), config(128, 128, schedule=1, persistent=1), -2.0),
    (64, torch.float16, True, (2, 250, 200, 2, 1), config(persistent=0), 6.0),
    # half_diag: the diagonal block's upper S is -inf before the score_mod sees it.
    (128, torch.bfloat16, True, (1, 300, 300, 2, 1), config(128, 128, 1, 2, half_diag=1), 45.0),
    # carry_qk: the score_mod on an S issued in the previous tile's last turn.
    (128, torch.bfloat16, False, (2, 200, 333, 2, 1), config(128, 128, 1, 1, **CARRY), 45.0),
    (64, torch.float16, True, (1, 300, 200, 2, 2), config(128, 128, 2, 2, **CARRY), 6.0),
], ids=["hd128-causal-gqa", "hd64-fp16-3wg-persistent", "hd96-plain-schedule-persistent-negative",
        "hd128-past-bound", "hd128-causal-negative", "hd64-fp16-past-bound", "hd128-causal-half-diag", "hd128-carry",
        "hd64-fp16-causal-carry-dynamic"])
def test_softcap(head_dim, dtype, causal, shape, cfg, cap):
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    # scores of q, k ~ N(0, 9) are far into a cap of 2; scale 12 puts some past 45
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype,
                  scale=3.0 if abs(cap) < 40 else 12.0)
    check(q, k, v, causal, config=cfg, seed=seqlen_k, lazy=causal, spec=onto("flash_attn_softcap"),
          mod_args={"softcap": cap}, score_mod=lambda s, *_: cap * torch.tanh(s / cap))


def window_mask(left, right, seqlen_q, seqlen_k):
    shift = seqlen_k - seqlen_q

    def visible(b, h, i, j):
        return ((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0))
    return visible


@pytest.mark.parametrize("window, causal, shape, cfg, empty_rows", [
    # Many blocks left of the window and right of it are skipped, the middle ones unmasked.
    ((40, 30), False, (2, 150, 400, 2, 1), config(persistent=1), False),
    ((70, 0), True, (1, 300, 430, 2, 2), config(persistent=0), False),
    # seqlen_q > seqlen_k: rows below the shifted diagonal see no key; whole tiles have no block.
    ((0, 0), False, (1, 300, 130, 2, 2), config(persistent=1), True),
    ((5, 3), True, (1, 260, 100, 1, 1), config(schedule=1, persistent=0), True),
    ((-1, 16), False, (1, 140, 270, 2, 1), config(128, 64, schedule=0, persistent=1), False),
    ((0, 0), False, (1, 300, 130, 2, 2), config(persistent=2), True),
    # No right bound: the exact range's top is the sequence end (and the diagonal, causal).
    ((24, -1), False, (1, 200, 330, 2, 1), config(persistent=1), False),
    ((24, -1), True, (1, 200, 330, 2, 1), config(persistent=2), False),
    # kv_align 1: each tile's blocks start at its first key (row0 - left), off the multiples of
    # 64, so the diagonal and the window's right edge cross blocks at other columns.
    ((40, 30), False, (2, 150, 400, 2, 1), config(persistent=1, kv_align=1), False),
    ((70, 0), True, (1, 300, 430, 2, 2), config(persistent=2, kv_align=1), False),
    ((5, 3), True, (1, 260, 100, 1, 1), config(schedule=1, persistent=0, kv_align=1), True),
    ((70, 0), True, (1, 300, 300, 2, 2), config(128, 128, persistent=1, half_diag=1), False),
], ids=["40-30-persistent", "70-0-causal", "0-0-empty-persistent", "5-3-causal-empty",
        "left-unbounded-schedule0", "0-0-empty-dynamic", "right-unbounded",
        "right-unbounded-causal-dynamic", "40-30-aligned", "70-0-causal-dynamic-aligned",
        "5-3-causal-empty-aligned", "70-0-causal-half-diag"])
def test_sliding_window(window, causal, shape, cfg, empty_rows):
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    left, right = window
    head_dim = 96 if left < 0 else 64   # 96: 64B swizzle
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim)
    lse = check(q, k, v, causal, config=cfg, seed=left + right, lazy=not causal,
                spec=onto("flash_attn_window"),
                mod_args={"window_left": left, "window_right": right},
                mask_mod=window_mask(left, right, seqlen_q, seqlen_k))
    assert bool((~torch.isfinite(lse)).any()) == empty_rows


# hd64 adds the column terms after the QK^T, hd128 puts them in S before it (kBiasBeforeQk).
@pytest.mark.parametrize("per_batch, causal, cfg, head_dim", [
    (False, True, config(persistent=1), 64),
    (True, False, config(192, 96, persistent=0), 64),
    (True, True, config(128, 128, schedule=1, persistent=1, stages=3), 128),
    # half_diag and carry_qk: hd128 then adds the column terms after the QK^T, as hd64 does
    # (with them before, half_diag's -inf fill of the upper half made ptxas serialize, C7511).
    (False, True, config(128, 128, schedule=2, persistent=2, half_diag=1), 128),
    (False, True, config(128, 128, schedule=2, persistent=2, **CARRY), 128),
    (True, False, config(128, 128, schedule=1, persistent=1, **CARRY), 64),
], ids=["per-head-causal-persistent", "per-batch-3wg", "per-batch-causal-overlap-persistent-hd128",
        "per-head-causal-half-diag-hd128", "per-head-causal-carry-hd128", "per-batch-carry-hd64"])
def test_alibi(per_batch, causal, cfg, head_dim):
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 170, 290, 4, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.float16)
    slopes = torch.rand((batch, heads) if per_batch else (heads,)) * 0.5
    s4 = slopes.view(batch if per_batch else 1, heads, 1, 1)
    shift = seqlen_k - seqlen_q
    check(q, k, v, causal, config=cfg, seed=heads, lazy=per_batch, spec=onto("flash_attn_alibi"),
          mod_args={"alibi_slopes": slopes, "alibi_stride_b": heads if per_batch else 0},
          score_mod=lambda s, b, h, i, j: s - s4 * (i + shift - j).abs().float())


@pytest.mark.parametrize("persistent, extra", [(1, {}), (2, {}), (0, {"grid_order": 1})],
                         ids=["static", "dynamic", "grid-in-the-dynamic-order"])
def test_packed_causal_tail_after_the_sections(persistent, extra):
    """A kv range's persistent causal order: sections of pairs, longest rank first, and the
    shortest ranks (m_blocks / KG_TAIL_RANKS_DIV, here 2 of 5) after every section, over all
    pairs (TileSchedule), and a CTA per tile taking that order (grid_order 1): each tile once,
    whatever the order (a tile left out stays NaN)."""
    batch, seqlen, heads = 2, 600, 3
    q, k, v = qkv(batch, seqlen, seqlen, heads, heads, 64)
    torch.manual_seed(13)
    start, end = packed_ranges(documents(batch, seqlen, 4))
    visible = mask_of(start, end, seqlen)[:, None]
    check(q, k, v, True, config={**config(persistent=persistent), **extra}, seed=3, lazy=True,
          spec=onto("flash_attn_packed"), mod_args={"doc_start": start, "doc_end": end},
          mask_mod=lambda *_: visible, l2_bytes=2 * 4 * seqlen * 64, tail_div=2)


@pytest.mark.parametrize("causal, window, cfg", [
    (False, (40, 9), config(persistent=1)),
    (True, (70, -1), config(persistent=2, kv_align=1)),
    (False, (-1, 0), config(192, 96, persistent=0, kv_align=1)),
], ids=["40-9-persistent", "causal-70-dynamic-aligned", "right-0-3wg-aligned"])
def test_varlen_window_as_ranges(causal, window, cfg):
    """flash_attn_varlen_func's window: each sequence's sliding window folded into the ranges
    (kernelgen.varlen_ranges), sequences of more queries than keys (rows that see nothing) and
    more keys than queries, run as flash_attn_packed over the packed tokens (a batch of one)."""
    cu_q = torch.tensor([0, 130, 131, 131, 400, 520])
    cu_k = torch.tensor([0, 200, 200, 260, 300, 450])
    q, k, v = qkv(1, 520, 450, 2, 1, 64)
    start, end = varlen_ranges(cu_q, cu_k, causal=causal, window_size=window)
    visible = mask_of(start, end, 450)[:, None]
    assert not visible.any(dim=-1).all()
    check(q, k, v, False, config=cfg, seed=9, lazy=causal, spec=onto("flash_attn_packed"),
          mod_args={"doc_start": start, "doc_end": end}, mask_mod=lambda *_: visible)


@pytest.mark.parametrize("head_dim, cfg", [
    (64, config(128, 64, schedule=2, persistent=2)),
    (64, config(192, 64, schedule=1, persistent=2)),
    (64, config(128, 64, schedule=2, persistent=2, kv_align=1)),
], ids=["pingpong", "3wg-overlap", "pingpong-aligned"])
def test_packed_full_defers_short_tiles(head_dim, cfg):
    """Non-causal kv ranges on the dynamic schedule (TileSchedule::kDefer): a scheduler thread
    claims the tiles, puts those shorter than its CTA's mean on a global list and takes them back
    after the claims run out; the producer thread takes every publication as the consumers do.
    Every tile once (a tile left out stays NaN, one run twice would still pass, so the list is
    checked too: each deferred tile once, all taken back)."""
    batch, seqlen, heads = 2, 700, 3
    q, k, v = qkv(batch, seqlen, seqlen, heads, heads, head_dim)
    torch.manual_seed(17)
    ids = documents(batch, seqlen, 5)
    ids[0, :40] = -1          # a short first document: its tile sees few blocks
    start, end = packed_ranges(ids)
    visible = mask_of(start, end, seqlen)[:, None]
    counter = torch.zeros(hopper.counter_words(cfg, q.shape), dtype=torch.int32)
    tiles = len(counter) - 4
    check(q, k, v, False, config=cfg, seed=7, lazy=True, spec=onto("flash_attn_packed"),
          mod_args={"doc_start": start, "doc_end": end}, mask_mod=lambda *_: visible,
          counter=counter)
    undecided, deferred, tickets = counter[1].item(), counter[2].item(), counter[3].item()
    listed = sorted(counter[4:4 + deferred].tolist())
    # Every CTA draws one ticket past the list's end, its last: the ones before it all taken.
    assert undecided == 0 and 0 < deferred and tickets == deferred + min(emulate.EMULATED_SMS, tiles)
    assert len(set(listed)) == deferred and min(listed) >= 1 and max(listed) <= tiles
    assert not counter[4 + deferred:].any()


def documents(batch, seqlen, cuts_per_row, first_id=0):
    """(batch, seqlen) int32 document ids: runs of equal ids, cut at random points."""
    ids = torch.zeros(batch, seqlen, dtype=torch.int32)
    for row in ids:
        cuts = torch.sort(torch.randperm(seqlen - 1)[:cuts_per_row] + 1).values.tolist()
        for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, seqlen])):
            row[a:b] = first_id + n
    return ids


@pytest.mark.parametrize("causal, cfg", [
    (False, config(persistent=1)),
    (True, config(128, 64, schedule=1, persistent=0)),
    (False, config(persistent=2)),   # block lists on the deferring claims (TileSchedule::kDefer)
], ids=["full-persistent", "causal-overlap", "full-dynamic"])
def test_document_mask(causal, cfg):
    batch, seqlen_q, seqlen_k, heads = 2, 230, 310, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads, 128)
    torch.manual_seed(11)
    doc_q, doc_k = documents(batch, seqlen_q, 3), documents(batch, seqlen_k, 4)
    doc_q[1, 200:] = 99   # a document with no keys: those rows see nothing
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]   # (batch, 1, seqlen_q, seqlen_k)
    # flash_attn_document is block-sparse: its kernel also takes a block mask's lists.
    spec = onto("flash_attn_document")
    lists = blockmask.from_dense(spec, same, causal, batch=batch).kernel_args(
        cfg["block_m"], cfg["block_n"])
    lse = check(q, k, v, causal, config=cfg, seed=3, lazy=causal, spec=spec,
                mod_args={"doc_q": doc_q, "doc_k": doc_k,
                          **dict(zip((a.name for a in spec.mods.block_args), lists))},
                mask_mod=lambda *_: same)
    assert torch.all(lse[1, :, 200:] == float("-inf"))


@pytest.mark.parametrize("causal, cfg", [
    (False, config(128, 64, schedule=1, persistent=2, wg_skip=1)),
    (True, config(128, 64, schedule=2, persistent=0, wg_skip=1)),
    (False, config(128, 64, schedule=2, persistent=1, stages=3, wg_skip=1)),
    (True, config(128, 64, schedule=1, persistent=2, wg_skip=1)),
], ids=["full-dynamic", "causal-pingpong", "full-pingpong-3-stages", "causal-dynamic"])
def test_document_mask_warpgroup_skips(causal, cfg):
    """wg_skip: grouped lists, each warpgroup skipping the blocks its own 64 rows do not see.
    Query rows 0-60 are document 0, 61-191 document 1, 192-299 document 3; keys 0-127 document
    0, 128-159 document 1, 160-199 document 2 (no query's), 200-309 document 3. Tile 0:
    warpgroup 1's rows (64-127) see neither of the first two 64-key blocks (it leads, skipping
    both), causal, warpgroup 0's see no key of block 2 (it trails). Tile 1: warpgroup 0's rows
    see blocks 3 and 4 not at all (it leads), warpgroup 1's block 2 not at all (it trails),
    which warpgroup 0 sees in part: masked per element. Rows 280-299 of the second batch see
    no key."""
    batch, seqlen_q, seqlen_k, heads = 2, 300, 310, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads, 128)

    def runs(*pairs):   # (document, tokens) in turn, for every batch element
        ids = torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in pairs])
        return ids.expand(batch, -1).contiguous()

    doc_q, doc_k = runs((0, 61), (1, 131), (3, 108)), runs((0, 128), (1, 32), (2, 40), (3, 110))
    doc_q[1, 280:] = 99
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    spec = onto("flash_attn_document")
    mask = blockmask.from_dense(spec, same, causal, batch=batch)
    lists = mask.kernel_args(cfg["block_m"], cfg["block_n"], grouped=True)
    info = mask.lists(cfg["block_m"], cfg["block_n"], grouped=True).kv_idx[..., -2:]
    lead, lead_wg, trail = info[..., 0] & 0xffff, info[..., 0] >> 16, info[..., 1]
    assert lead[:, 0, 0].min() >= 2 and lead_wg[:, 0, 0].eq(1).all()
    assert lead[:, 0, 1].min() >= 2 and lead_wg[:, 0, 1].eq(0).all() and trail[:, 0, 1].min() >= 1
    lse = check(q, k, v, causal, config=cfg, seed=5, lazy=causal, spec=spec,
                mod_args={"doc_q": doc_q, "doc_k": doc_k,
                          **dict(zip((a.name for a in spec.mods.block_args), lists))},
                mask_mod=lambda *_: same)
    assert torch.all(lse[1, :, 280:] == float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 33), (130, 77), (77, 130)])
def test_document_mask_warpgroup_skips_ragged(causal, seqlen_q, seqlen_k):
    """wg_skip on shapes that end inside a warpgroup's rows or a block (tools/ragged.py
    --wg-skip's, which compute-sanitizer runs on the GPU): documents of 29 tokens."""
    batch, heads = 2, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads, 64)
    doc_k = (torch.arange(seqlen_k, dtype=torch.int32) // 29).expand(batch, -1).contiguous()
    doc_q = (torch.arange(seqlen_q, dtype=torch.int32) // 29).expand(batch, -1).contiguous()
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    spec, cfg = onto("flash_attn_document"), config(128, 64, schedule=1, persistent=2, wg_skip=1)
    lists = blockmask.from_dense(spec, same, causal, batch=batch).kernel_args(128, 64, grouped=True)
    check(q, k, v, causal, config=cfg, seed=seqlen_q, lazy=causal, spec=spec,
          mod_args={"doc_q": doc_q, "doc_k": doc_k,
                    **dict(zip((a.name for a in spec.mods.block_args), lists))},
          mask_mod=lambda *_: same)


@pytest.mark.parametrize("prefix, cfg", [
    (0, config(persistent=0)),
    (37, config(persistent=1)),
    (150, config(192, 96, persistent=1)),
    (1000, config(schedule=0, persistent=0)),
], ids=["prefix0", "prefix37-persistent", "prefix150-3wg-persistent", "prefix-past-end"])
def test_tutorial_prefix_lm(prefix, cfg):
    q, k, v = qkv(2, 333, 333, 2, 1, 64)
    check(q, k, v, False, config=cfg, seed=prefix, lazy=prefix % 2 == 1, spec=onto(PREFIX_LM),
          mod_args={"prefix_len": prefix}, mask_mod=lambda b, h, i, j: (j <= i) | (j < prefix))


@pytest.mark.parametrize("head_dim, causal, cfg", [
    (128, False, config(persistent=1)),
    (128, True, config(128, 64, schedule=1, persistent=0)),
    (64, False, config(192, 96, persistent=0)),
    (128, False, config(128, 64, schedule=2, persistent=2)),
    # kv_align 1: blocks from each tile's first key; the warpgroups' skips counted from there.
    (128, False, config(persistent=1, kv_align=1)),
    (128, True, config(128, 64, schedule=1, persistent=0, kv_align=1)),
    (64, False, config(192, 96, persistent=2, kv_align=1)),
    (128, True, config(128, 128, schedule=2, persistent=2, kv_align=1, half_diag=1)),
], ids=["full-persistent", "causal-overlap", "hd64-3wg", "full-pingpong-dynamic-64",
        "full-persistent-aligned", "causal-overlap-aligned", "hd64-3wg-dynamic-aligned",
        "causal-aligned-half-diag"])
def test_packed_documents_as_an_exact_kv_range(head_dim, causal, cfg):
    """flash_attn_packed: packed documents as per-token key ranges read by an exact kv range: 230
    queries, so the last tile's padding rows evaluate the range (clamped into the sequence:
    kRangeReadsMemory), and a document of a single token."""
    batch, seqlen, heads = 2, 230, 2
    q, k, v = qkv(batch, seqlen, seqlen, heads, heads, head_dim)
    torch.manual_seed(12)
    ids = documents(batch, seqlen, 3)
    ids[1, 150:] += 1
    ids[1, 151:] += 1   # token 150 a document of its own
    start, end = packed_ranges(ids)
    assert start[1, 150].item() == 150 and end[1, 150].item() == 151
    visible = mask_of(start, end, seqlen)[:, None]
    spec = onto("flash_attn_packed")
    assert spec.mods.exact_range and spec.mods.range_reads_memory
    check(q, k, v, causal, config=cfg, seed=5, lazy=causal, spec=spec,
          mod_args={"doc_start": start, "doc_end": end}, mask_mod=lambda *_: visible)
