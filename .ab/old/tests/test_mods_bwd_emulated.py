"""The backward with each shipped modifier on the CPU emulator (tests/emulator): softcap, sliding
window (with rows that see no key), ALiBi, document masks and the tutorial's prefix LM, each spec
put onto flash_attn_bwd (and flash_attn_bwd_dq: the deterministic path) as backward.py does, and
launched by backward._run with the mod arguments appended. Gradients are compared with autograd
through kernelgen.reference applying the same score_mod / mask_mod, by FlashAttention's rule
(test_backward_emulated.py's check). Small tiles, so that a few hundred rows give several query
and KV tiles: the kv range's skipped tiles and its tiles without per-element masking both occur."""
from __future__ import annotations

import pytest
import torch
from test_backward_emulated import check, emulate, make

from kernelgen.bench_mods import document_ids, document_lengths
from kernelgen.reference import attention_ref
from kernelgen.spec import REPO_ROOT

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

PREFIX_LM = str(REPO_ROOT / "examples" / "prefix_lm.yaml")
# Small main-kernel tiles (DSPLIT 2 and 1) and a small dQ tile, valid for every head dim used here.
SPLIT = {"block_m": 32, "block_n": 32, "warps": 4, "dsplit": 2, "stages": 2, "grid_order": 0}
WHOLE = {"block_m": 32, "block_n": 64, "warps": 4, "dsplit": 1, "stages": 2, "grid_order": 0}
DQ = {"block_m": 64, "block_n": 16, "warps": 4, "stages": 2}


def check_mods(mods, mod_args, q, k, v, causal, arch, config, *, score_mod=None, mask_mod=None,
               deterministic=False):
    """The emulated backward of spec `mods` with mod arguments `mod_args` (kernel order)."""
    torch.manual_seed(99)
    check(q, k, v, torch.randn_like(q), causal, arch, config, deterministic, mods=mods,
          mod_args=mod_args, score_mod=score_mod, mask_mod=mask_mod,
          dq_config=DQ if deterministic else None)


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, scale=1.0):
    return (make(batch, seqlen_q, heads, head_dim, dtype, 1) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype, 2) * scale,
            make(batch, seqlen_k, heads_k, head_dim, dtype, 3))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_softcap(deterministic):
    q, k, v = qkv(1, 130, 77, 4, 2, 64, torch.bfloat16, scale=3.0)   # scores well into the cap
    cap = 2.0
    check_mods("flash_attn_softcap", (cap,), q, k, v, True, "sm_80", SPLIT,
               score_mod=lambda s, *_: cap * torch.tanh(s / cap), deterministic=deterministic)


def window_mask(left, right, seqlen_q, seqlen_k):
    shift = seqlen_k - seqlen_q

    def visible(b, h, i, j):
        return ((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0))
    return visible


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_window_with_rows_that_see_no_key(deterministic):
    """seqlen_q > seqlen_k aligns the window bottom-right: the first 50 queries see no key."""
    q, k, v = qkv(1, 150, 100, 2, 1, 64, torch.float16)
    mask_mod = window_mask(8, 0, 150, 100)
    _, lse = attention_ref(q, k, v, mask_mod=mask_mod)
    assert (~torch.isfinite(lse)).sum() == 2 * 50   # what check() then asserts dq = 0 for
    check_mods("flash_attn_window", (8, 0), q, k, v, False, "sm_86", SPLIT, mask_mod=mask_mod,
               deterministic=deterministic)


@pytest.mark.parametrize("window", [(40, 24), (-1, 5), (30, -1)])
def test_window_causal_gqa(window):
    q, k, v = qkv(2, 100, 160, 4, 2, 128, torch.bfloat16)
    check_mods("flash_attn_window", window, q, k, v, True, "sm_90", SPLIT,
               mask_mod=window_mask(*window, 100, 160))


@pytest.mark.parametrize("per_batch, causal", [(False, True), (True, False)],
                         ids=["per_head-causal", "per_batch-full"])
def test_alibi(per_batch, causal):
    batch, heads, seqlen_q, seqlen_k = 2, 2, 70, 90
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, 2, 96, torch.float16)
    torch.manual_seed(7)
    slopes = torch.rand((batch, heads) if per_batch else (heads,)) * 0.5
    s4 = slopes.view(batch if per_batch else 1, heads, 1, 1)
    check_mods("flash_attn_alibi", (slopes, heads if per_batch else 0), q, k, v, causal, "sm_86",
               WHOLE, score_mod=lambda s, b, h, i, j: s - s4 * (i + seqlen_k - seqlen_q - j).abs().float())


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_document_mask(deterministic):
    # flash_attn_document is block-sparse: its kernels take a block mask's lists besides the ids
    # (test_blockmask_emulated.py runs the backward with them).
    from test_blockmask_emulated import check_backward

    q, k, v = qkv(2, 96, 96, 2, 1, 64, torch.bfloat16)
    docs = document_ids(document_lengths(2, 96, 5, seed=3))
    check_backward(q, k, v, docs, docs, False, deterministic, WHOLE, DQ)


@pytest.mark.parametrize("prefix", [0, 37, 200])
def test_tutorial_prefix_lm(prefix):
    q, k, v = qkv(1, 120, 120, 2, 2, 64, torch.bfloat16)
    check_mods(PREFIX_LM, (prefix,), q, k, v, False, "sm_80", SPLIT,
               mask_mod=lambda b, h, i, j: (j <= i) | (j < prefix), deterministic=prefix == 37)


def test_default_configs_of_the_mod_specs():
    """The main and dQ kernels with mods at their untuned defaults (what backward.py launches
    without a tuning), on one modest shape each."""
    q, k, v = qkv(1, 140, 140, 2, 1, 64, torch.bfloat16, scale=2.0)
    check_mods("flash_attn_softcap", (3.0,), q, k, v, True, "sm_80", None,
               score_mod=lambda s, *_: 3.0 * torch.tanh(s / 3.0))
    check_mods("flash_attn_window", (20, 20), q, k, v, False, "sm_90", None,
               mask_mod=window_mask(20, 20, 140, 140))
