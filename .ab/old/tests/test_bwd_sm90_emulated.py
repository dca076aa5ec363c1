"""The Hopper backward main kernel (flash_attn_bwd_sm90) on the CPU emulator (tests/emulator,
sm90_emu.h), launched by backward._run between the prep kernel and the dQ cast, with tensor maps
from backward_sm90.tensor_maps, against autograd through kernelgen.reference by FlashAttention's
rule. Seconds per case: small ragged shapes that reach every code path (every head dim: both
ways of splitting dQ, 128B and 64B swizzle; causal with seqlen_q > seqlen_k, rows that see no
key and KV tiles no query sees; GQA; a strided view and a transposed dout; 2 and 3 stages, every
ring wrapping), with TMA copies landing at issue (eager) or as late as allowed (lazy, where the
emulator also stalls a warpgroup now and then: with one dS^T buffer instead of two, the other
warpgroup overwrites it under a pending dQ wgmma, which fails the lazy hd128 cases).

The mods cases put each shipped mods spec onto flash_attn_bwd_sm90 as backward.py does (softcap,
sliding windows with rows that see no key and query tiles the kv range skips, ALiBi, a document
block mask's transposed lists from blockmask.from_dense, the tutorial's prefix LM), against the
reference applying the same modification."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulator"))
import emulate  # noqa: E402
from gradients import assert_gradients  # noqa: E402

from kernelgen import backward, backward_sm90, blockmask  # noqa: E402
from kernelgen.bench_mods import document_ids, document_lengths  # noqa: E402
from kernelgen.reference import attention_ref  # noqa: E402
from kernelgen.spec import REPO_ROOT, load_spec  # noqa: E402

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

SPEC = load_spec(backward_sm90.SPEC)
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def emulated_wgmma(text: str) -> str:
    """The template's three inline-PTX wgmma wrappers, as calls into the emulator."""
    calls = {  # (d, ...) -> emu::wgmma(d, n, desc_a, a, desc_b, accumulate, trans_b, trans_a)
        "SdpGemm": "emu::wgmma<elem_t>(d, {n}, desc_a, nullptr, desc_b, scale_d != 0, false, false)",
        "DkvGemm": "emu::wgmma<elem_t>(d, {n}, 0, a, desc_b, true, true, false)",
        "DqGemm": "emu::wgmma<elem_t>(d, {n}, desc_a, nullptr, desc_b, scale_d != 0, true, true)",
    }

    def replace(match):
        name, n, rest = match.group(1), int(match.group(2)) * 2, match.group(3)
        call = calls[name].format(n=n)
        return f"struct {name} {{\n    static void mma(float (&d)[{n // 2}], {rest}) {{ {call}; }}\n}};"

    pattern = r"struct (SdpGemm|DkvGemm|DqGemm) \{\n.*?mma\(float \(&d\)\[(\d+)\], (.*?)\) \{.*?\n\};"
    text, count = re.subn(pattern, replace, text, flags=re.S)
    assert count == 3, "the template's wgmma wrappers changed shape"
    return text


class Emulated:
    """Stands in for an api.BoundKernel: what the emulator needs to run one variant and config."""

    def __init__(self, name, config=None, **params):
        self.spec = load_spec(name) if isinstance(name, str) else name
        arch = "sm_90a" if backward_sm90.is_sm90(self) else "sm_90"
        self.variant = self.spec.variant(arch, **params)
        self.config = (self.spec.default_config(self.variant) if config is None
                       else self.spec.parse_config(config))
        assert not self.spec.violations(self.variant, self.config)


def launcher(lazy: bool):
    def launch(kernel, args, sizes):
        sm90 = backward_sm90.is_sm90(kernel)
        emulate.run(kernel.spec, kernel.variant, kernel.config,
                    dict(zip((a.name for a in kernel.spec.args), args)), defer=lazy and sm90,
                    transform=emulated_wgmma if sm90 else None)
    return launch


def check(q, k, v, dout, causal, config=None, lazy=False, *, mods=None, mod_values=(),
          block_mask=None, score_mod=None, mask_mod=None, on_mask=False):
    """mods: a spec with mods (name or path) put onto the kernel, run with `mod_values` (its
    mod arguments in order; a block-sparse spec's lists come from `block_mask`, as
    backward._mod_arguments hands them; on_mask: the spec's mods put on a block mask, as a kv
    range's backward runs them, load_spec's block_mask=); score_mod / mask_mod: the same
    modification for the reference."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attention_ref(q, k, v, causal, scale, score_mod=score_mod, mask_mod=mask_mod)
    dtype = NAMES[q.dtype]
    main = (backward_sm90.SPEC if mods is None
            else load_spec(mods, onto=backward_sm90.SPEC, block_mask=on_mask))
    kernels = backward._Kernels(Emulated(backward.PREP_SPEC, dtype=dtype),
                                Emulated(main, config, head_dim=head_dim,
                                         dtype=dtype, causal=causal),
                                None)
    mod_args = ()
    if mods is not None:
        args = backward.ModArgs(load_spec(mods, block_mask=on_mask), kernels.main.variant.params,
                                tuple(mod_values), block_mask)
        mod_args, _ = backward._mod_arguments(args, kernels, q, k)
    # Poisoned outputs: every element the kernels should write starts as NaN.
    buffers = backward._Buffers(*(torch.full_like(t, float("nan")) for t in backward._buffers(
        q, k, deterministic=False).__dict__.values()))
    got = backward._run(kernels, launcher(lazy), dout, q, k, v, out, lse, scale, buffers=buffers,
                        mod_args=mod_args)
    assert_gradients(got, q, k, v, dout, lse, causal, scale, score_mod, mask_mod)
    return got


def make(batch, seqlen, heads, head_dim, dtype, seed):
    torch.manual_seed(seed)
    return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype)


CASES = [
    # head_dim, dtype, causal, (seqlen_q, seqlen_k), (batch, heads, heads_k), stages, lazy
    (128, torch.bfloat16, False, (150, 200), (1, 2, 1), 2, True),    # GQA 2:1, ragged tails
    (128, torch.float16, True, (200, 77), (1, 2, 2), 3, False),      # rows that see no key
    (64, torch.bfloat16, True, (70, 300), (2, 3, 1), 2, True),       # MQA, a KV tile no query sees
    (64, torch.float16, False, (90, 130), (1, 1, 1), 3, False),
    # eleven pairs a CTA, dQ in turns: the warpgroup not taking dQ arrives at the dS^T barrier and
    # runs a pair ahead (lazy stalls); with one barrier for both buffers instead of one each, it
    # arrives twice at it and the emulator deadlocks here
    (64, torch.bfloat16, False, (650, 150), (1, 2, 1), 2, True),
    (96, torch.bfloat16, True, (140, 140), (1, 2, 1), 2, False),     # 64B swizzle, dQ N = 96
    # GQA 2:1, each KV tile's first query tile walked last (kBwdPeelDiagonal): in KV tiles 1 and
    # 2 the second warpgroup sees none of it and takes only its turn of dQ; in tile 0 (the
    # diagonal 32 keys off the tile's) it sees keys 64..95 and runs the pair in full
    (64, torch.bfloat16, True, (288, 320), (1, 4, 2), 2, True),
]


@pytest.mark.parametrize("head_dim, dtype, causal, seqlens, layout, stages, lazy", CASES,
                         ids=[f"hd{c[0]}-{NAMES[c[1]]}-{'causal' if c[2] else 'full'}-"
                              f"{c[3][0]}x{c[3][1]}" for c in CASES])
def test_gradients(head_dim, dtype, causal, seqlens, layout, stages, lazy):
    (seqlen_q, seqlen_k), (batch, heads, heads_k) = seqlens, layout
    q = make(batch, seqlen_q, heads, head_dim, dtype, 1)
    k = make(batch, seqlen_k, heads_k, head_dim, dtype, 2)
    v = make(batch, seqlen_k, heads_k, head_dim, dtype, 3)
    dout = make(batch, seqlen_q, heads, head_dim, dtype, 4)
    check(q, k, v, dout, causal, {"block_m": 64, "block_n": 128, "stages": stages}, lazy)


def test_strided_inputs_and_dout():
    """q, k, v views into one packed qkv tensor, dout heads-major."""
    torch.manual_seed(0)
    qkv = torch.randn(1, 140, 3, 2, 128, dtype=torch.bfloat16)
    q, k, v = qkv[:, 9:, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = torch.randn(1, 2, 131, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous() and not dout.is_contiguous()
    check(q, k, v, dout, True, lazy=True)


# ---- mods -----------------------------------------------------------------------------------

PREFIX_LM = str(REPO_ROOT / "examples" / "prefix_lm.yaml")


def qkv_dout(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, scale=1.0):
    return (make(batch, seqlen_q, heads, head_dim, dtype, 1) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype, 2) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype, 3),
            make(batch, seqlen_q, heads, head_dim, dtype, 4))


def test_softcap_causal_gqa():
    """Scores well into the cap, so that score_mod_grad (1 - tanh^2) is far from 1."""
    q, k, v, dout = qkv_dout(1, 130, 200, 4, 2, 64, torch.bfloat16, scale=3.0)
    cap = 2.0
    check(q, k, v, dout, True, lazy=True, mods="flash_attn_softcap", mod_values=(cap,),
          score_mod=lambda s, *_: cap * torch.tanh(s / cap))


def window_mask(left, right, seqlen_q, seqlen_k):
    shift = seqlen_k - seqlen_q

    def visible(b, h, i, j):
        return ((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0))
    return visible


def test_window_rows_that_see_no_key():
    """seqlen_q > seqlen_k aligns the window bottom-right: the first 150 queries see no key, and
    each KV tile meets only some of the query tiles (the kv range skips the others)."""
    q, k, v, dout = qkv_dout(1, 300, 150, 2, 1, 128, torch.float16)
    mask_mod = window_mask(8, 0, 300, 150)
    _, lse = attention_ref(q, k, v, mask_mod=mask_mod)
    assert (~torch.isfinite(lse)).sum() == 2 * 150   # what check() asserts dq = 0 for
    check(q, k, v, dout, False, lazy=True, mods="flash_attn_window", mod_values=(8, 0),
          mask_mod=mask_mod)


@pytest.mark.parametrize("window, head_dim", [((40, 24), 128), ((-1, 5), 128), ((40, 24), 64)])
def test_window_causal_gqa(window, head_dim):
    """Three KV tiles, four query tiles: skipped pairs, pairs without the mask_mod (the kv range
    vouches for them) and pairs with it; 3 stages so the skips meet a wrapping ring. Head dim 64
    causal runs here since the consumers stopped walking the pairs (PERF_NOTES §87)."""
    q, k, v, dout = qkv_dout(1, 200, 330, 2, 1, head_dim, torch.bfloat16)
    check(q, k, v, dout, True, {"block_m": 64, "block_n": 128, "stages": 3}, lazy=window[0] > 0,
          mods="flash_attn_window", mod_values=window, mask_mod=window_mask(*window, 200, 330))


@pytest.mark.parametrize("per_batch, causal", [(False, True), (True, False)],
                         ids=["per_head-causal", "per_batch-full"])
def test_alibi(per_batch, causal):
    batch, heads, seqlen_q, seqlen_k = 2, 2, 90, 150
    q, k, v, dout = qkv_dout(batch, seqlen_q, seqlen_k, heads, 2, 96, torch.float16)
    torch.manual_seed(7)
    slopes = torch.rand((batch, heads) if per_batch else (heads,)) * 0.5
    s4 = slopes.view(batch if per_batch else 1, heads, 1, 1)
    check(q, k, v, dout, causal, mods="flash_attn_alibi",
          mod_values=(slopes, heads if per_batch else 0),
          score_mod=lambda s, b, h, i, j: s - s4 * (i + seqlen_k - seqlen_q - j).abs().float())


@pytest.mark.parametrize("causal, head_dim", [(False, 128), (True, 64)])
def test_document_block_mask(causal, head_dim):
    """The transposed lists of a BlockMask at the kernel's tile (64 x 128): per KV block the query
    blocks of each head of the GQA group, partial ones with the mask_mod; rows of a document no
    key has see nothing."""
    batch, seqlen_q, seqlen_k = 2, 200, 300
    q, k, v, dout = qkv_dout(batch, seqlen_q, seqlen_k, 2, 1, head_dim, torch.bfloat16)
    ids = document_ids(document_lengths(batch, seqlen_k, 4, seed=5))
    doc_q, doc_k = ids[:, -seqlen_q:].contiguous(), ids[:, -seqlen_k:].contiguous()
    doc_q[1, 120:140] = 99
    visible = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    mask = blockmask.from_dense(load_spec("flash_attn_document"), visible, causal, batch=batch)
    states = mask.classify(64, 128)
    assert {1, 2} <= set(states.unique().tolist())   # partial and full blocks
    check(q, k, v, dout, causal, lazy=causal, mods="flash_attn_document", mod_values=(doc_q, doc_k),
          block_mask=mask, mask_mod=lambda *_: visible)


@pytest.mark.parametrize("order", ["mask", "shuffled"])
def test_document_tiles_in_launch_order(order, monkeypatch):
    """Full attention: CTA i takes KV tile bm_order[i] (BlockMask.tile_order: the shortest eighth
    last), decoding its block, kv head and batch from it; 'shuffled': any permutation. A tile
    decoded wrong leaves another's dK / dV unwritten (NaN-poisoned) or adds its dQ twice."""
    batch, heads, heads_k, seqlen_q, seqlen_k = 2, 4, 2, 130, 520
    q, k, v, dout = qkv_dout(batch, seqlen_q, seqlen_k, heads, heads_k, 64, torch.bfloat16)
    ids = document_ids(document_lengths(batch, seqlen_k, 5, seed=11))
    doc_q, doc_k = ids[:, -seqlen_q:].contiguous(), ids[:, -seqlen_k:].contiguous()
    visible = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    mask = blockmask.from_dense(load_spec("flash_attn_document"), visible, False, batch=batch)
    tiles = batch * heads_k * 5   # 520 keys: five KV tiles of 128
    natural = list(range(tiles))
    if order == "shuffled":
        shuffled = torch.randperm(tiles, generator=torch.Generator().manual_seed(3)).to(torch.int32)
        monkeypatch.setattr(blockmask.BlockMask, "tile_order", lambda self, *_, **__: shuffled)
    launched = mask.tile_order(64, 128, batch, heads, heads_k).tolist()
    assert sorted(launched) == natural and launched != natural
    check(q, k, v, dout, False, mods="flash_attn_document", mod_values=(doc_q, doc_k),
          block_mask=mask, mask_mod=lambda *_: visible)


@pytest.mark.parametrize("causal, stages, lazy", [(False, 3, True), (True, 2, False)])
def test_packed_varlen_ranges(causal, stages, lazy):
    """flash_attn_packed's per-token key ranges (the stats warp hands each slot's pair to the
    consumers, kBwdSlotPairs): varlen sequences of unequal query and key lengths in one flattened
    batch, GQA 2:1, so each KV tile meets a run of the query tiles with gaps before and after it
    (the walk's first pair is not pair 0, and nothing follows its last); causal folded into the
    ranges, so rows of a sequence with fewer keys than queries see none; 3 stages wrap the ring."""
    from kernelgen.packed import varlen_ranges
    cu_q = torch.tensor([0, 70, 75, 210, 330, 400], dtype=torch.int32)
    cu_k = torch.tensor([0, 50, 130, 260, 270, 420], dtype=torch.int32)
    start, end = varlen_ranges(cu_q, cu_k, causal=causal)
    q, k, v, dout = qkv_dout(1, 400, 420, 2, 1, 128, torch.bfloat16)
    keys = torch.arange(420)
    visible = ((keys >= start[0, :, None]) & (keys < end[0, :, None]))[None, None]
    if causal:
        assert (start[0] == end[0]).any()   # rows that see no key
    check(q, k, v, dout, False, {"block_m": 64, "block_n": 128, "stages": stages}, lazy,
          mods="flash_attn_packed", mod_values=(start, end), mask_mod=lambda *_: visible)


def test_packed_long_walk():
    """A KV tile's count of pairs in steps of 128 (bwd_count_seen: four rounds of 32 at a time,
    indices clamped): 8,450 queries in one flattened batch, 133 query tiles, so the count takes a
    second, partial step, and the KV tiles near the end first meet a query tile past 128."""
    from kernelgen.packed import varlen_ranges
    lengths = [410, 395, 610, 280, 505, 700, 350, 460, 530, 300, 640, 420, 380, 590, 480, 350,
               600, 450]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    assert total > 128 * 64 and total % 64 != 0
    start, end = varlen_ranges(cu, cu)
    q, k, v, dout = qkv_dout(1, total, total, 1, 1, 64, torch.bfloat16)
    keys = torch.arange(total)
    visible = ((keys >= start[0, :, None]) & (keys < end[0, :, None]))[None, None]
    check(q, k, v, dout, False, {"block_m": 64, "block_n": 128, "stages": 2}, True,
          mods="flash_attn_packed", mod_values=(start, end), mask_mod=lambda *_: visible)


def classified_ranges(start, end, causal, seqlen_k, tile):
    """The classify kernel of flash_attn_packed (its exact range: each row's bounds, not the
    mask_mod per element) on the emulator, at tile (block_m, block_n)."""
    spec = load_spec("flash_attn_packed", onto=str(blockmask.CLASSIFY_SPEC))
    variant = spec.variant(head_dim=64, dtype="bf16", causal=causal)
    batch, seqlen_q = start.shape
    state = torch.full((batch, 1, -(-seqlen_q // tile[0]), -(-seqlen_k // tile[1])), 9,
                       dtype=torch.uint8)
    emulate.run(spec, variant, spec.default_config(variant),
                dict(state=state, seqlen_q=seqlen_q, seqlen_k=seqlen_k, tile_m=tile[0],
                     tile_n=tile[1], mask_batch=batch, mask_heads=1, doc_start=start,
                     doc_end=end))
    return state


@pytest.mark.parametrize("causal", [False, True])
def test_packed_on_block_mask(causal):
    """flash_attn_packed's backward as AttentionKernel.range_spec runs it (PERF_NOTES §109): its
    mods on a block mask classified from the ranges. Varlen sequences with a sliding window
    (left 45, and right 30 when full), GQA 2:1. Full: unequal query and key lengths, causal
    folded into nothing, the grid in the mask's launch order; causal: equal offsets, the
    kernel's own causal mask, the window's left side in the ranges. The classify kernel's
    per-row path matches the dense oracle at the backward's tile and a small one (empty, partial
    and full tiles all occur), then the gradients match the reference."""
    from kernelgen.packed import _varlen
    cu_q = torch.tensor([0, 70, 75, 210, 330, 400], dtype=torch.int32)
    cu_k = cu_q if causal else torch.tensor([0, 50, 130, 260, 270, 420], dtype=torch.int32)
    start, end, *_, kernel_causal = _varlen(cu_q, cu_k, causal, True, (45, -1 if causal else 30))
    assert kernel_causal == causal
    seqlen_q, seqlen_k = int(cu_q[-1]), int(cu_k[-1])
    keys = torch.arange(seqlen_k)
    visible = ((keys >= start[0, :, None]) & (keys < end[0, :, None]))[None, None]
    for tile in ((64, 128), (16, 32)):
        state = classified_ranges(start, end, causal, seqlen_k, tile)
        assert torch.equal(state, blockmask.classify_dense(visible, causal, *tile))
        assert {0, 1, 2} <= set(state.unique().tolist())
    twin = load_spec("flash_attn_packed", block_mask=True)
    mask = blockmask.BlockMask(twin.name, causal, 1, None, seqlen_q, seqlen_k, torch.device("cpu"),
                               lambda m, n: classified_ranges(start, end, causal, seqlen_k, (m, n)))
    q, k, v, dout = qkv_dout(1, seqlen_q, seqlen_k, 2, 1, 128, torch.bfloat16)
    check(q, k, v, dout, causal, {"block_m": 64, "block_n": 128, "stages": 2}, not causal,
          mods="flash_attn_packed", mod_values=(start, end), block_mask=mask,
          mask_mod=lambda *_: visible, on_mask=True)


@pytest.mark.parametrize("prefix", [0, 150])
def test_tutorial_prefix_lm(prefix):
    q, k, v, dout = qkv_dout(1, 260, 260, 2, 2, 64, torch.bfloat16)
    check(q, k, v, dout, False, mods=PREFIX_LM, mod_values=(prefix,),
          mask_mod=lambda b, h, i, j: (j <= i) | (j < prefix))
