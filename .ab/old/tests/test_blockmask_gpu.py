"""Block masks on the GPU: flash_attn_document with random document boundaries, forward (both
forward families: mma.sync and, on compute capability 9.0, the Hopper one) and backward (atomic
and deterministic dQ), with a reused BlockMask and without one (each call builds its own), against
the float32 reference of the same mask by FlashAttention's rule; the GPU classify kernel against
its torch oracle; errors for a mask of another problem."""
import pytest
import torch

import kernelgen
from kernelgen import blockmask, ops
from kernelgen.reference import attention_ref, max_error, rounding_allowance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def packed(batch, seqlen_q, seqlen_k, documents, seed):
    """(doc_q, doc_k): one packed sequence per batch element of random document lengths, its
    last seqlen_q tokens the queries and last seqlen_k the keys."""
    generator = torch.Generator().manual_seed(seed)
    seqlen = max(seqlen_q, seqlen_k)
    ids = torch.zeros(batch, seqlen, dtype=torch.int32)
    for row in ids:
        cuts = torch.sort(torch.randperm(seqlen - 1, generator=generator)[:documents - 1] + 1).values
        for n, (a, b) in enumerate(zip([0, *cuts.tolist()], [*cuts.tolist(), seqlen])):
            row[a:b] = n
    return ids[:, -seqlen_q:].contiguous().cuda(), ids[:, -seqlen_k:].contiguous().cuda()


def same_document(doc_q, doc_k):
    return (doc_q[:, :, None] == doc_k[:, None, :])[:, None]


@pytest.fixture(params=["sm80", "sm90"])
def family(request, monkeypatch):
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward needs compute capability 9.0")
    monkeypatch.setattr(ops, "FORCED_FAMILY", request.param)
    return request.param


def check_forward(got, q, k, v, causal, visible):
    out, lse = got
    torch.cuda.synchronize()
    mask_mod = lambda *_: visible  # noqa: E731
    ref, lse_ref = attention_ref(q, k, v, causal, mask_mod=mask_mod)
    pt, _ = attention_ref(q, k, v, causal, upcast=False, mask_mod=mask_mod)
    assert not out.isnan().any()
    err, err_pt = max_error(out, ref), max_error(pt, ref)
    assert err <= 2 * err_pt + rounding_allowance(ref), (err, err_pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-3
    assert torch.all(out[(~finite).transpose(1, 2)] == 0)


# (batch, seqlen_q, seqlen_k, heads, heads_k, documents)
SHAPES = [(2, 1000, 1000, 4, 2, 7), (1, 700, 1300, 2, 2, 5), (3, 517, 517, 2, 1, 3)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_document_forward(family, head_dim, causal):
    kernel = kernelgen.load("flash_attn_document", head_dim=head_dim, dtype="bf16", causal=causal)
    for batch, seqlen_q, seqlen_k, heads, heads_k, documents in SHAPES:
        torch.manual_seed(seqlen_q + head_dim)
        doc_q, doc_k = packed(batch, seqlen_q, seqlen_k, documents, seed=seqlen_k)
        doc_q[0, 100:180] = 99   # a document no key has: those rows see nothing
        q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda",
                            dtype=torch.bfloat16) for _ in range(2))
        mask = kernel.create_block_mask(batch, heads, seqlen_q, seqlen_k, doc_q=doc_q, doc_k=doc_k)
        with_mask = kernel(q, k, v, doc_q=doc_q, doc_k=doc_k, block_mask=mask, return_lse=True)
        check_forward(with_mask, q, k, v, causal, same_document(doc_q, doc_k))
        without = kernel(q, k, v, doc_q=doc_q, doc_k=doc_k, return_lse=True)
        # Without a block_mask the call builds the same one: the same tiles, the same bits.
        assert torch.equal(with_mask[0], without[0]) and torch.equal(with_mask[1], without[1])
        again = kernel(q, k, v, doc_q=doc_q, doc_k=doc_k, block_mask=mask)   # reused
        assert torch.equal(again, with_mask[0])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True])
def test_document_backward(causal, deterministic):
    head_dim, batch, seqlen, heads, heads_k = 128, 2, 900, 4, 2
    kernel = kernelgen.load("flash_attn_document", head_dim=head_dim, dtype="bf16", causal=causal)
    torch.manual_seed(7)
    doc_q, doc_k = packed(batch, seqlen, seqlen, 6, seed=9)
    visible = same_document(doc_q, doc_k)
    q = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    mask = kernel.create_block_mask(batch, heads, seqlen, seqlen, doc_q=doc_q, doc_k=doc_k)

    def grads(call, upcast=None):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        if upcast is None:
            out = call(*leaves)
        else:
            out, _ = attention_ref(*leaves, causal, upcast=upcast, mask_mod=lambda *_: visible)
        return torch.autograd.grad(out, leaves, dout)

    refs = grads(None, upcast=True)
    pts = grads(None, upcast=False)
    for block_mask in (mask, None):
        got = grads(lambda q, k, v: kernel(q, k, v, doc_q=doc_q, doc_k=doc_k,
                                           block_mask=block_mask, deterministic=deterministic))
        torch.cuda.synchronize()
        for name, g, ref, pt in zip(("dq", "dk", "dv"), got, refs, pts):
            assert not g.isnan().any(), name
            err, err_pt = max_error(g, ref), max_error(pt, ref)
            assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)


@pytest.mark.parametrize("causal", [False, True])
def test_classify_kernel_matches_its_oracle(causal):
    kernel = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16", causal=causal)
    doc_q, doc_k = packed(2, 600, 1100, 9, seed=1)
    mask = kernel.create_block_mask(2, 8, 600, 1100, doc_q=doc_q, doc_k=doc_k)
    assert mask.heads is None and mask.batch == 2   # the mask reads batch, not head
    for block_m, block_n in ((128, 64), (64, 128), (128, 176), (16, 32)):
        state = blockmask.classify_dense(same_document(doc_q, doc_k), causal, block_m, block_n)
        lists = mask.lists(block_m, block_n)
        expected = blockmask.compact(state, block_m, block_n)
        for name in ("kv_num", "full_kv_num", "q_num", "full_q_num"):
            assert torch.equal(getattr(lists, name), getattr(expected, name)), name
        assert {0, 1, 2} <= set(state.unique().tolist())
    # wg_skip's grouped lists (from 64-row halves on the GPU) are those of the dense oracle
    dense = blockmask.from_dense(kernel.spec, same_document(doc_q, doc_k).cpu(), causal, batch=2)
    for block_n in (64, 128, 176):
        got, want = mask.lists(128, block_n, grouped=True), dense.lists(128, block_n, grouped=True)
        for name in ("kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "full_q_num"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (block_n, name)
        # skips of the leading warpgroup at every width, of the trailing one at 64 (the dense
        # oracle's counts for these documents: 12 / 7 / 4 leading, 2 / 3 trailing at 64 keys)
        assert (got.kv_idx[..., -2] & 0xffff).sum() > 0
        assert got.kv_idx[..., -1].sum() > 0 or block_n > 64


def test_a_mask_of_another_problem_is_refused_before_launch():
    kernel = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16")
    doc_q, doc_k = packed(2, 300, 300, 3, seed=2)
    mask = kernel.create_block_mask(2, 4, 300, 300, doc_q=doc_q, doc_k=doc_k)
    q = torch.randn(2, 301, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = v = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(2, 301, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="block_mask was built for seqlen_q=300"):
        kernel(q, k, v, doc_q=ids, doc_k=doc_k, block_mask=mask)
    with pytest.raises(TypeError, match="block_mask must be a kernelgen BlockMask"):
        kernel(q[:, :300], k, v, doc_q=doc_q, doc_k=doc_k, block_mask=mask.lists(64, 64))


def test_a_mask_built_on_cuda_serves_inputs_on_the_current_cuda_device():
    """"cuda" and "cuda:0" name one device when 0 is the current one (tools/config_ab.py met this)."""
    spec = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16").spec
    built = blockmask.BlockMask("flash_attn_document", False, 2, None, 40, 50, "cuda")
    current = torch.device("cuda", torch.cuda.current_device())
    built.check(spec, False, 2, 4, 40, 50, current)
    with pytest.raises(ValueError, match="block_mask is on cuda, but q is on cpu"):
        built.check(spec, False, 2, 4, 40, 50, torch.device("cpu"))
