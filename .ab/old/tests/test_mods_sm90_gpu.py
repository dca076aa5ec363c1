"""GPU numerics of the modifier specs on the Hopper forward (kernelgen.mods_sm90.forward_sm90):
softcap, sliding window, ALiBi, document masks and the tutorial's prefix LM against the float32
reference applying the same modification, with the tuned-or-default config and with persistent
ones. Needs compute capability 9.0 (H100/H200):
    python -m pytest -q -m gpu tests/test_mods_sm90_gpu.py"""
import pytest
import torch
from test_mods_gpu import SHAPES, check, rand   # the sm80 family's checks, same reference rule
from test_mods_sm90_emulated import documents

from kernelgen.packed import packed_ranges
from kernelgen.mods_sm90 import forward_sm90
from kernelgen.spec import REPO_ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU (H100/H200)")]

PERSISTENT = {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1}
DYNAMIC = {**PERSISTENT, "persistent": 2, "q_buffers": 2}   # tiles claimed from a counter
# kv ranges' blocks from each tile's first key, 144 keys each: off every multiple of 128.
ALIGNED = {**DYNAMIC, "block_n": 144, "kv_align": 1}


def run(spec, q, k, v, causal, values, config=None):
    """forward_sm90 as AttentionKernel calls it: the variant's params, the scale, the mod values."""
    params = {"head_dim": q.shape[-1], "dtype": "bf16" if q.dtype == torch.bfloat16 else "fp16",
              "causal": causal}
    return forward_sm90(spec, q, k, v, params, q.shape[-1] ** -0.5, values, config=config)


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC], ids=["default", "persistent", "dynamic"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(head_dim, causal, config):
    torch.manual_seed(head_dim)
    if config is not None and head_dim == 256:
        # fits head_dim 256's registers (and, with one Q buffer, its shared memory)
        config = {**config, "block_n": 64, "schedule": 1, "q_buffers": 1}
    for b, sq, sk, h, hk in SHAPES:
        q, k = rand(b, sq, h, head_dim, scale=3), rand(b, sk, hk, head_dim, scale=3)
        v = rand(b, sk, hk, head_dim)
        got = run("flash_attn_softcap", q, k, v, causal, (5.0,), config)
        check(got, q, k, v, causal, score_mod=lambda s, *_: 5.0 * torch.tanh(s / 5.0))


# bf16: 39 within the bound, 60 past it; fp16: 4 within, 5 past; a negative cap (the score_mod's
# factor, kept out of the exp2's scale: the online softmax).
@pytest.mark.parametrize("dtype, cap", [(torch.bfloat16, 39.0), (torch.bfloat16, 60.0),
                                        (torch.float16, 4.0), (torch.float16, 5.0),
                                        (torch.bfloat16, -3.0)])
def test_softcap_at_and_past_the_score_bound(dtype, cap):
    """The softmax subtracts the cap instead of a running max when exp(-2 cap) is a normal P
    (bf16: cap <= 39.8, fp16: <= 4.5), else runs online; large scores make both edges matter:
    at the bound a P of exp(-2 cap) must not flush to zero."""
    torch.manual_seed(int(cap))
    for b, sq, sk, h, hk in SHAPES:
        q, k = rand(b, sq, h, 128, scale=12, dtype=dtype), rand(b, sk, hk, 128, scale=12, dtype=dtype)
        v = rand(b, sk, hk, 128, dtype=dtype)
        for causal in (False, True):
            got = run("flash_attn_softcap", q, k, v, causal, (cap,), DYNAMIC)
            check(got, q, k, v, causal, score_mod=lambda s, *_: cap * torch.tanh(s / cap))


# Clusters of two CTAs (K and V multicast): allowed for score_mods, which leave every query tile
# the same KV blocks (non-causal); head dims 128 and 256.
CLUSTER = {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 0, "cluster": 2}


@pytest.mark.parametrize("head_dim", [128, 256])
def test_score_mods_in_clusters(head_dim):
    config = CLUSTER if head_dim == 128 else {**CLUSTER, "block_n": 80, "schedule": 1}
    torch.manual_seed(head_dim + 1)
    for b, sq, sk, h, hk in SHAPES:
        q, k = rand(b, sq, h, head_dim, scale=3), rand(b, sk, hk, head_dim, scale=3)
        v = rand(b, sk, hk, head_dim)
        got = run("flash_attn_softcap", q, k, v, False, (5.0,), config)
        check(got, q, k, v, False, score_mod=lambda s, *_: 5.0 * torch.tanh(s / 5.0))
        slopes = torch.rand(h, device="cuda") * 0.5
        got = run("flash_attn_alibi", q, k, v, False, (slopes.data_ptr(), 0), config)
        check(got, q, k, v, False, score_mod=lambda s, bb, hh, i, j:
              s - slopes.view(1, h, 1, 1) * (i + sk - sq - j).abs().float())


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC, ALIGNED],
                         ids=["default", "persistent", "dynamic", "aligned"])
@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(window, causal, config):
    left, right = window
    torch.manual_seed(left + 7 * right)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, 128), rand(b, sk, hk, 128), rand(b, sk, hk, 128)

        def visible(bb, hh, i, j, shift=sk - sq):
            return ((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0))

        got = run("flash_attn_window", q, k, v, causal, (left, right), config)
        check(got, q, k, v, causal, mask_mod=visible)


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC], ids=["default", "persistent", "dynamic"])
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch, config):
    torch.manual_seed(per_batch)
    for b, sq, sk, h, hk in SHAPES:
        q = rand(b, sq, h, 64, dtype=torch.float16)
        k, v = rand(b, sk, hk, 64, dtype=torch.float16), rand(b, sk, hk, 64, dtype=torch.float16)
        slopes = torch.rand((b, h) if per_batch else (h,), device="cuda") * 0.5
        s4 = slopes.view(b if per_batch else 1, h, 1, 1)
        for causal in (False, True):
            got = run("flash_attn_alibi", q, k, v, causal,
                      (slopes.data_ptr(), h if per_batch else 0), config)
            check(got, q, k, v, causal,
                  score_mod=lambda s, bb, hh, i, j: s - s4 * (i + sk - sq - j).abs().float())


# ALiBi's distance_slopes: blocks wholly before or after their rows' diagonal take a term per key
# column and shift their rows in the softmax (the LSE takes the shift back out); blocks across it
# run the score_mod. Long and unequal lengths put most blocks on one side, far from the diagonal
# (scores thousands of slopes below it), and slopes from 2^-8 to 1 span the heads of real models.
@pytest.mark.parametrize("config", [None, DYNAMIC], ids=["default", "dynamic"])
@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (128, torch.float16),
                                             (64, torch.bfloat16), (256, torch.float16)])
def test_alibi_far_from_the_diagonal(head_dim, dtype, config):
    torch.manual_seed(head_dim)
    if config is not None and head_dim == 256:
        config = {**config, "block_n": 64, "schedule": 1, "q_buffers": 1}
    heads = 4
    slopes = torch.tensor([1.0, 2 ** -2, 2 ** -5, 2 ** -8], device="cuda")
    for sq, sk in [(2048, 2048), (1000, 3000), (3000, 1000)]:
        q = rand(1, sq, heads, head_dim, dtype=dtype)
        k, v = rand(1, sk, heads, head_dim, dtype=dtype), rand(1, sk, heads, head_dim, dtype=dtype)
        for causal in (False, True):
            got = run("flash_attn_alibi", q, k, v, causal, (slopes.data_ptr(), 0), config)
            check(got, q, k, v, causal, score_mod=lambda s, bb, hh, i, j:
                  s - slopes.view(1, heads, 1, 1) * (i + sk - sq - j).abs().float())


# half_diag at hd128 (causal): the column terms then go in after the QK^T, as with carry_qk (put
# into S before it, the half block's -inf fill made ptxas serialize: no such config compiled).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_alibi_with_half_diagonal_blocks(dtype):
    torch.manual_seed(3)
    heads = 4
    slopes = torch.tensor([1.0, 2 ** -2, 2 ** -5, 2 ** -8], device="cuda")
    for sq, sk in [(1024, 1024), (333, 1517), (1000, 300)]:
        q = rand(1, sq, heads, 128, dtype=dtype)
        k, v = rand(1, sk, heads, 128, dtype=dtype), rand(1, sk, heads, 128, dtype=dtype)
        got = run("flash_attn_alibi", q, k, v, True, (slopes.data_ptr(), 0),
                  {**DYNAMIC, "half_diag": 1})
        check(got, q, k, v, True, score_mod=lambda s, bb, hh, i, j:
              s - slopes.view(1, heads, 1, 1) * (i + sk - sq - j).abs().float())


# wg_skip: the block mask's lists grouped so that each warpgroup skips the blocks its 64 rows
# do not see (built from 64-row halves by the classify kernel)
WG_SKIP = ({**DYNAMIC, "schedule": 1, "wg_skip": 1},
           {**PERSISTENT, "block_n": 64, "stages": 3, "wg_skip": 1})


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC, *WG_SKIP],
                         ids=["default", "persistent", "dynamic", "wg-skip-dynamic", "wg-skip-64"])
@pytest.mark.parametrize("causal", [False, True])
def test_document_mask(causal, config):
    torch.manual_seed(3)
    batch, seqlen_q, seqlen_k, heads = 2, 700, 530, 4
    doc_q, doc_k = documents(batch, seqlen_q, 5).cuda(), documents(batch, seqlen_k, 4).cuda()
    doc_q[1, 600:] = 99   # a document with no keys: those rows see nothing
    q = rand(batch, seqlen_q, heads, 64)
    k, v = rand(batch, seqlen_k, heads, 64), rand(batch, seqlen_k, heads, 64)
    got = run("flash_attn_document", q, k, v, causal, (doc_q.data_ptr(), doc_k.data_ptr()), config)
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]  # (batch, 1, seqlen_q, seqlen_k)
    check(got, q, k, v, causal, mask_mod=lambda *_: same)


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC, ALIGNED],
                         ids=["default", "persistent", "dynamic", "aligned"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents(causal, config):
    """flash_attn_packed: packed documents as per-token key ranges, an exact kv range that reads
    tensors (its padding rows clamped into the sequence); 700 queries against 530 keys, so the
    last tile has padding rows, and queries of a document with no keys see nothing."""
    torch.manual_seed(4)
    batch, seqlen_q, seqlen_k, heads = 2, 700, 530, 4
    doc_q, doc_k = documents(batch, seqlen_q, 5).cuda(), documents(batch, seqlen_k, 4).cuda()
    doc_q[1, 600:] = 99
    start, end = packed_ranges(doc_q, doc_k)
    q = rand(batch, seqlen_q, heads, 128)
    k, v = rand(batch, seqlen_k, heads, 128), rand(batch, seqlen_k, heads, 128)
    got = run("flash_attn_packed", q, k, v, causal, (start.data_ptr(), end.data_ptr()), config)
    same = (doc_q[:, :, None] == doc_k[:, None, :])
    keys = torch.arange(seqlen_k, device="cuda")
    visible = (keys >= start[:, :, None]) & (keys < end[:, :, None])
    assert torch.equal(visible, same)   # the ranges are the ids' mask
    check(got, q, k, v, causal, mask_mod=lambda *_: visible[:, None])


@pytest.mark.parametrize("config", [None, PERSISTENT, DYNAMIC], ids=["default", "persistent", "dynamic"])
def test_tutorial_prefix_lm(config):
    spec = str(REPO_ROOT / "examples" / "prefix_lm.yaml")
    torch.manual_seed(5)
    for prefix in (0, 37, 300, 1000):
        q, k, v = (rand(2, 333, 4, 64) for _ in range(3))
        got = run(spec, q, k, v, False, (prefix,), config)
        check(got, q, k, v, mask_mod=lambda bb, hh, i, j: (j <= i) | (j < prefix))
