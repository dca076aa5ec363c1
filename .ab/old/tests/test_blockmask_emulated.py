"""Block masks on the CPU emulator (tests/emulator): the classify kernel against its torch oracle
(blockmask.classify_dense), and flash_attn_document's block-sparse kernels (sm80 forward, Hopper
forward, backward main and dQ kernels) run with the lists of a BlockMask, against the float32
reference of the same document mask by FlashAttention's rule. Document boundaries fall inside
tiles, some query rows see no key (a document id no key has), and small tiles give many blocks:
empty (skipped), partial (mask_mod per element) and full (no mask_mod) all occur."""
from __future__ import annotations

import math

import pytest
import torch
from test_backward_emulated import emulate, emulated_kernels, grads, launch
from test_sm90_emulated import check as check_sm90

from kernelgen import backward, blockmask
from kernelgen.bench_mods import document_ids, document_lengths
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import load_spec

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

SPEC = "flash_attn_document"
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def packed(batch, seqlen_q, seqlen_k, cuts, seed):
    """(doc_q, doc_k) of one packed sequence: its last seqlen_q tokens are the queries and its
    last seqlen_k the keys (bottom-right, like the causal mask)."""
    ids = document_ids(document_lengths(batch, max(seqlen_q, seqlen_k), cuts + 1, seed))
    return ids[:, -seqlen_q:].contiguous(), ids[:, -seqlen_k:].contiguous()


def same_document(doc_q, doc_k):
    return (doc_q[:, :, None] == doc_k[:, None, :])[:, None]  # (batch, 1, seqlen_q, seqlen_k)


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, h, head_dim, generator=generator).to(dtype)
                 for n, h in ((seqlen_q, heads), (seqlen_k, heads_k), (seqlen_k, heads_k)))


def dense_mask(doc_q, doc_k, causal):
    """The BlockMask the GPU would build, from the dense mask (torch on the CPU)."""
    return blockmask.from_dense(load_spec(SPEC), same_document(doc_q, doc_k), causal,
                                batch=doc_q.shape[0])


def block_args(mask, config, transposed=False):
    return dict(zip((a.name for a in load_spec(SPEC).mods.block_args),
                    mask.kernel_args(config["block_m"], config["block_n"], transposed)))


# ---- the classify kernel ----------------------------------------------------------------------

@pytest.mark.parametrize("causal, shape, tile", [
    (False, (2, 70, 90), (32, 16)),
    (True, (1, 100, 60), (16, 32)),    # seqlen_q > seqlen_k: causal hides whole tiles
], ids=["full", "causal-tall"])
def test_classify_kernel_matches_its_oracle(causal, shape, tile):
    batch, seqlen_q, seqlen_k = shape
    # One packed sequence, its last seqlen_q tokens the queries and last seqlen_k the keys.
    ids = document_ids(document_lengths(batch, max(seqlen_q, seqlen_k), 5, seed=1))
    doc_q, doc_k = ids[:, -seqlen_q:].contiguous(), ids[:, -seqlen_k:].contiguous()
    doc_q[0, -7:] = 77  # rows that see no key
    spec = load_spec(SPEC, onto=str(blockmask.CLASSIFY_SPEC))
    variant = spec.variant(head_dim=64, dtype="bf16", causal=causal)
    config = spec.default_config(variant)
    block_m, block_n = tile
    state = torch.full((batch, 1, -(-seqlen_q // block_m), -(-seqlen_k // block_n)), 9,
                       dtype=torch.uint8)
    emulate.run(spec, variant, config,
                dict(state=state, seqlen_q=seqlen_q, seqlen_k=seqlen_k, tile_m=block_m,
                     tile_n=block_n, mask_batch=batch, mask_heads=1,
                     doc_q=doc_q.contiguous(), doc_k=doc_k.contiguous()))
    expected = blockmask.classify_dense(same_document(doc_q, doc_k), causal, block_m, block_n)
    assert torch.equal(state, expected)
    assert {0, 1, 2} <= set(state.unique().tolist())


# ---- the sm80 forward ---------------------------------------------------------------------------

def forward_sm80(q, k, v, causal, config, doc_q, doc_k, mask):
    spec = load_spec(SPEC)
    variant = spec.variant("sm_80", head_dim=q.shape[-1], dtype=NAMES[q.dtype], causal=causal)
    config = spec.parse_config(config)
    assert not spec.violations(variant, config)
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, seqlen_q), float("nan"))
    strides = {f"{name}_stride_{dim}": t.stride(i)
               for name, t in (("q", q), ("k", k), ("v", v), ("o", out))
               for i, dim in enumerate("bsh")}
    args = dict(q=q, k=k, v=v, o=out, lse=lse, batch=batch, heads=heads, heads_k=k.shape[2],
                seqlen_q=seqlen_q, seqlen_k=k.shape[1], softmax_scale=1 / math.sqrt(head_dim),
                doc_q=doc_q, doc_k=doc_k, **strides, **block_args(mask, config.as_dict()))
    emulate.run(spec, variant, config, args, seed=seqlen_q)
    return out, lse


def check_forward(out, lse, q, k, v, causal, visible):
    mask_mod = lambda *_: visible  # noqa: E731
    out_ref, lse_ref = attention_ref(q, k, v, causal, upcast=True, mask_mod=mask_mod)
    out_pt, _ = attention_ref(q, k, v, causal, upcast=False, mask_mod=mask_mod)
    assert not out.isnan().any(), "output has NaN (unwritten or bad math)"
    assert max_error(out, out_ref) <= 2 * max_error(out_pt, out_ref) + rounding_allowance(out_ref)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE is -inf exactly where no key is visible"
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-3
    assert torch.all(out[(~finite).transpose(1, 2)] == 0), "rows that see no key give 0"
    return finite


@pytest.mark.parametrize("causal, shape, config", [
    (False, (2, 150, 170, 2, 1), {"block_m": 64, "block_n": 32, "warps": 4, "stages": 2,
                                  "grid_order": 0}),
    (True, (1, 200, 160, 2, 2), {"block_m": 64, "block_n": 48, "warps": 4, "stages": 3,
                                 "grid_order": 1}),
], ids=["full-gqa", "causal-3stages"])
def test_sm80_forward_with_block_mask(causal, shape, config):
    batch, seqlen_q, seqlen_k, heads, heads_k = shape
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 64, seed=seqlen_q)
    doc_q, doc_k = packed(batch, seqlen_q, seqlen_k, 2, seed=3)
    doc_q[-1, 120:140] = 99  # a document no key has: those rows see nothing
    mask = dense_mask(doc_q, doc_k, causal)
    state = mask.classify(config["block_m"], config["block_n"])
    assert {0, 1, 2} <= set(state.unique().tolist())
    out, lse = forward_sm80(q, k, v, causal, config, doc_q, doc_k, mask)
    finite = check_forward(out, lse, q, k, v, causal, same_document(doc_q, doc_k))
    assert not finite.all()


# ---- the Hopper forward -------------------------------------------------------------------------

@pytest.mark.parametrize("causal, cfg", [
    (False, {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1}),
    (True, {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 0}),
    (True, {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2,
            "q_buffers": 2}),
], ids=["full-pingpong-persistent", "causal-overlap", "causal-pingpong-dynamic"])
def test_sm90_forward_with_block_mask(causal, cfg):
    batch, seqlen_q, seqlen_k, heads = 2, 230, 310, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads, 64, seed=5)
    doc_q, doc_k = packed(batch, seqlen_q, seqlen_k, 3, seed=11)
    doc_q[1, 200:] = 99   # a document with no keys: those rows see nothing
    mask = dense_mask(doc_q, doc_k, causal)
    spec = load_spec(SPEC, onto="flash_attn_fwd_sm90")
    lse = check_sm90(q, k, v, causal, config=cfg, seed=3, lazy=causal, spec=spec,
                     mod_args={"doc_q": doc_q, "doc_k": doc_k, **block_args(mask, cfg)},
                     mask_mod=lambda *_: same_document(doc_q, doc_k))
    assert torch.all(lse[1, :, 200:] == float("-inf"))


@pytest.mark.parametrize("order", ["mask", "shuffled"])
def test_sm90_forward_takes_tiles_in_launch_order(order, monkeypatch):
    """A CTA per tile, full attention: CTA i computes query tile bm_order[i] (BlockMask.tile_order:
    the shortest eighth last; 'shuffled': any permutation) and stores it where it belongs."""
    batch, seqlen_q, seqlen_k, heads = 2, 400, 310, 3
    cfg = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 0}
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads, 64, seed=6)
    doc_q, doc_k = packed(batch, seqlen_q, seqlen_k, 4, seed=12)
    mask = dense_mask(doc_q, doc_k, False)
    tiles = batch * heads * 4   # 400 rows: four query tiles of 128
    if order == "shuffled":
        shuffled = torch.randperm(tiles, generator=torch.Generator().manual_seed(4)).to(torch.int32)
        monkeypatch.setattr(blockmask.BlockMask, "tile_order", lambda self, *_, **__: shuffled)
    spec = load_spec(SPEC, onto="flash_attn_fwd_sm90")
    args = dict(zip((a.name for a in spec.mods.block_args), mask.forward_args(cfg, batch, heads)))
    launched = args["bm_order"].tolist()
    assert sorted(launched) == list(range(tiles)) and launched != list(range(tiles))
    assert mask.forward_args({**cfg, "persistent": 1}, batch, heads)[-1] == 0   # its own order
    check_sm90(q, k, v, False, config=cfg, seed=3, spec=spec,
               mod_args={"doc_q": doc_q, "doc_k": doc_k, **args},
               mask_mod=lambda *_: same_document(doc_q, doc_k))


# ---- the backward -------------------------------------------------------------------------------

MAIN = {"block_m": 32, "block_n": 32, "warps": 4, "dsplit": 2, "stages": 2, "grid_order": 0}
DQ = {"block_m": 64, "block_n": 16, "warps": 4, "stages": 2}


@pytest.mark.parametrize("deterministic, causal", [(False, False), (True, True)],
                         ids=["atomic", "deterministic-causal"])
def test_backward_with_block_mask(deterministic, causal):
    q, k, v = qkv(2, 96, 112, 2, 1, 64, seed=7)
    doc_q, doc_k = packed(2, 96, 112, 3, seed=8)
    doc_q[0, 40:50] = 99  # rows that see no key: their gradients are 0
    states = check_backward(q, k, v, doc_q, doc_k, causal, deterministic)
    assert {0, 1, 2} <= set(states.unique().tolist())


def check_backward(q, k, v, doc_q, doc_k, causal, deterministic, main=MAIN, dq=DQ):
    """The emulated backward (main kernel, and dQ kernel when deterministic) of a document mask
    with its BlockMask's lists, against autograd through the reference; returns the main
    kernel's tile states (transposed lists come from them)."""
    visible = same_document(doc_q, doc_k)
    mask = dense_mask(doc_q, doc_k, causal)
    head_dim, scale = q.shape[-1], 1.0 / math.sqrt(q.shape[-1])
    mask_mod = lambda *_: visible  # noqa: E731
    out, lse = attention_ref(q, k, v, causal, scale, mask_mod=mask_mod)
    kernels = emulated_kernels(head_dim, q.dtype, causal, deterministic, "sm_80", main, SPEC,
                               dq if deterministic else None)
    values = (doc_q, doc_k)
    mods = backward.ModArgs(load_spec(SPEC), kernels.main.variant.params, values, mask)
    mod_args, dq_mod_args = backward._mod_arguments(mods, kernels, q, k)
    torch.manual_seed(99)
    dout = torch.randn_like(q)
    got = backward._run(kernels, launch, dout, q, k, v, out, lse, scale, mod_args=mod_args,
                        dq_mod_args=dq_mod_args)
    refs = grads(q, k, v, dout, causal, scale, True, mask_mod=mask_mod)
    pts = grads(q, k, v, dout, causal, scale, False, mask_mod=mask_mod)
    for name, g, ref, pt in zip(("dq", "dk", "dv"), got, refs, pts):
        assert not g.isnan().any(), name
        err, err_pt = max_error(g, ref), max_error(pt, ref)
        assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)
    return mask.classify(main["block_m"], main["block_n"])
