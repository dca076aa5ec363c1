"""GPU numerics of the modifier specs (softcap, sliding window, ALiBi, document masks, the
tutorial's prefix LM) against the float32 reference applying the same modification."""
import pytest
import torch

import kernelgen
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import REPO_ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=dtype) * scale


def check(got, q, k, v, causal=False, score_mod=None, mask_mod=None):
    out, lse = got
    torch.cuda.synchronize()
    ref, lse_ref = attention_ref(q, k, v, causal, score_mod=score_mod, mask_mod=mask_mod)
    pt, _ = attention_ref(q, k, v, causal, upcast=False, score_mod=score_mod, mask_mod=mask_mod)
    assert not out.isnan().any()
    err, err_pt = max_error(out, ref), max_error(pt, ref)
    assert err <= 2 * err_pt + rounding_allowance(ref), (err, err_pt)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-3
    assert torch.all(out[(~finite).transpose(1, 2)] == 0)


SHAPES = [(1, 300, 300, 4, 2), (2, 200, 513, 4, 4), (2, 513, 200, 2, 1)]  # b, sq, sk, h, hk


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(head_dim, causal):
    torch.manual_seed(head_dim)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, head_dim, scale=3), rand(b, sk, hk, head_dim, scale=3), rand(b, sk, hk, head_dim)
        got = kernelgen.flash_attn_func(q, k, v, causal=causal, softcap=5.0, return_lse=True)
        check(got, q, k, v, causal, score_mod=lambda s, *_: 5.0 * torch.tanh(s / 5.0))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(window, causal):
    left, right = window
    torch.manual_seed(left + 7 * right)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, 128), rand(b, sk, hk, 128), rand(b, sk, hk, 128)

        def visible(bb, hh, i, j, shift=sk - sq):
            return (((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0)))

        got = kernelgen.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
        check(got, q, k, v, causal, mask_mod=visible)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch):
    torch.manual_seed(per_batch)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, 64, dtype=torch.float16), rand(b, sk, hk, 64, dtype=torch.float16), rand(b, sk, hk, 64, dtype=torch.float16)
        slopes = torch.rand((b, h) if per_batch else (h,), device="cuda") * 0.5
        s4 = slopes.view(b if per_batch else 1, h, 1, 1)
        for causal in (False, True):
            got = kernelgen.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_lse=True)
            check(got, q, k, v, causal,
                  score_mod=lambda s, bb, hh, i, j: s - s4 * (i + sk - sq - j).abs().float())


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask(causal):
    torch.manual_seed(3)
    batch, seqlen, heads = 2, 700, 4
    kernel = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16", causal=causal)
    # Random document lengths per sequence, packed back to back.
    docs = torch.zeros(batch, seqlen, dtype=torch.int32, device="cuda")
    for row in docs:
        cuts = torch.sort(torch.randperm(seqlen - 1)[:5] + 1).values.tolist()
        for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, seqlen])):
            row[a:b] = n
    q, k, v = (rand(batch, seqlen, heads, 64) for _ in range(3))
    got = kernel(q, k, v, doc_q=docs, doc_k=docs, return_lse=True)
    same = (docs[:, :, None] == docs[:, None, :])[:, None]  # (batch, 1, seqlen_q, seqlen_k)
    check(got, q, k, v, causal, mask_mod=lambda *_: same)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ordered", [True, False])
def test_document_block_mask_as_ranges(monkeypatch, causal, ordered):
    """flash_attn_document's create_block_mask keeps ids packed in order as key ranges, and the
    Hopper forward then runs flash_attn_packed's kernel on them; the same runs numbered
    backwards keep the block mask's kernel. Queries and keys of other lengths, GQA, a query
    document without keys (document_ids')."""
    from kernelgen import mods_sm90

    (doc_q, doc_k), (q, k, v), same = document_ids(128)
    if not ordered:
        doc_q, doc_k = 9 - doc_q, 9 - doc_k
    kernel = kernelgen.load("flash_attn_document", head_dim=128, dtype="bf16", causal=causal)
    (batch, seqlen_q), seqlen_k = doc_q.shape, doc_k.shape[1]
    mask = kernel.create_block_mask(batch, q.shape[2], seqlen_q, seqlen_k, doc_q=doc_q, doc_k=doc_k)
    assert (mask.ranges is not None) == ordered
    ran, forward_sm90 = [], mods_sm90.forward_sm90

    def spy(spec, *args, **kwargs):
        ran.append(getattr(spec, "name", spec))
        return forward_sm90(spec, *args, **kwargs)

    monkeypatch.setattr(mods_sm90, "forward_sm90", spy)
    got = kernel(q, k, v, doc_q=doc_q, doc_k=doc_k, block_mask=mask, return_lse=True)
    check(got, q, k, v, causal, mask_mod=lambda *_: same)
    if torch.cuda.get_device_capability() == (9, 0):
        assert ran == ["flash_attn_packed" if ordered else "flash_attn_document"]


def document_ids(head_dim):
    """Sorted ids of 700 queries and 530 keys (ragged tiles), 2 sequences, GQA 4/2, query
    document 5 with no keys (rows that see nothing); returns (doc_q, doc_k), (q, k, v) and the
    ids' mask (batch, 1, seqlen_q, seqlen_k)."""
    torch.manual_seed(6)
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 700, 530, 4, 2
    doc_q = torch.sort(torch.randint(0, 6, (batch, seqlen_q), device="cuda"), dim=1).values
    doc_k = torch.sort(torch.randint(0, 5, (batch, seqlen_k), device="cuda"), dim=1).values
    q = rand(batch, seqlen_q, heads, head_dim)
    k, v = rand(batch, seqlen_k, heads_k, head_dim), rand(batch, seqlen_k, heads_k, head_dim)
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    assert not same.any(dim=-1).all()   # some rows see nothing
    return (doc_q.to(torch.int32), doc_k.to(torch.int32)), (q, k, v), same


def packed_documents(head_dim):
    """flash_attn_packed's inputs: document_ids' as kernelgen.packed_ranges; returns (start,
    end), (q, k, v) and the ids' mask (batch, 1, seqlen_q, seqlen_k)."""
    (doc_q, doc_k), (q, k, v), same = document_ids(head_dim)
    return kernelgen.packed_ranges(doc_q, doc_k), (q, k, v), same


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_documents(causal, head_dim):
    (start, end), (q, k, v), same = packed_documents(head_dim)
    kernel = kernelgen.load("flash_attn_packed", head_dim=head_dim, dtype="bf16", causal=causal)
    got = kernel(q, k, v, doc_start=start, doc_end=end, return_lse=True)
    check(got, q, k, v, causal, mask_mod=lambda *_: same)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sequences_as_ranges(causal):
    """FlashAttention's varlen layout (sequences packed into one, cu_seqlens offsets) through
    kernelgen.varlen_ranges and flash_attn_packed: each sequence attends to itself only, causal
    within it; lengths that are not tile multiples, one of a single token."""
    torch.manual_seed(7)
    cu = torch.tensor([0, 130, 131, 400, 777], device="cuda", dtype=torch.int32)
    start, end = kernelgen.varlen_ranges(cu)
    q, k, v = rand(1, 777, 4, 128), rand(1, 777, 2, 128), rand(1, 777, 2, 128)
    kernel = kernelgen.load("flash_attn_packed", head_dim=128, dtype="bf16", causal=causal)
    got = kernel(q, k, v, doc_start=start, doc_end=end, return_lse=True)
    same = varlen_mask(cu, cu, causal=False)   # the kernel's causal masks the packed sequence
    check(got, q, k, v, causal, mask_mod=lambda *_: same)


def varlen_mask(cu_q, cu_k, causal, window=(-1, -1)):
    """(1, 1, total_q, total_k): query i sees key j when both are in sequence d and, causal, j's
    position in d is at most i's plus len_k - len_q (bottom-right); a window (left, right)
    bounds j's position on either side of that diagonal too."""
    tq, tk = (torch.arange(int(cu[-1]), device="cuda") for cu in (cu_q, cu_k))
    seq_q = torch.searchsorted(cu_q[1:], tq, right=True)
    seq_k = torch.searchsorted(cu_k[1:], tk, right=True)
    visible = seq_q[:, None] == seq_k[None, :]
    diagonal = (tq - cu_q[seq_q] + (cu_k.diff() - cu_q.diff())[seq_q])[:, None]
    key = (tk - cu_k[seq_k])[None, :]
    left, right = window
    if causal:
        visible &= key <= diagonal
    if left >= 0:
        visible &= key >= diagonal - left
    if right >= 0:
        visible &= key <= diagonal + right
    return visible[None, None]


def varlen_problem(head_dim, causal):
    """flash_attn_varlen_func's inputs: 5 sequences packed along one token axis with queries and
    keys of other lengths each (more of either), one sequence with no queries, one with a single
    query and no keys, GQA 4/2; returns (cu_q, cu_k), (q, k, v) (3-D) and varlen_mask."""
    torch.manual_seed(11 + causal)
    cu_q = torch.tensor([0, 130, 131, 131, 400, 777], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 200, 260, 300, 690], device="cuda", dtype=torch.int32)
    q, k, v = rand(777, 4, head_dim), rand(690, 2, head_dim), rand(690, 2, head_dim)
    visible = varlen_mask(cu_q, cu_k, causal)
    assert not visible.any(dim=-1).all()   # some rows see nothing (sequence 1; 4 when causal)
    return (cu_q, cu_k), (q, k, v), visible


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_func(causal, head_dim):
    """kernelgen.flash_attn_varlen_func (FlashAttention's varlen call): each sequence attends to
    itself only, causal aligned bottom-right within each."""
    (cu_q, cu_k), (q, k, v), visible = varlen_problem(head_dim, causal)
    out, lse = kernelgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=377,
                                                max_seqlen_k=390, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 777) and lse.dtype == torch.float32
    check((out[None], lse[None]), q[None], k[None], v[None], mask_mod=lambda *_: visible)


@pytest.mark.parametrize("causal, window", [(False, (40, 9)), (True, (70, -1)), (False, (-1, 0)),
                                            (True, (0, 0))])
def test_varlen_func_window(causal, window):
    """flash_attn_varlen_func's window_size, folded into each sequence's range (test_packed
    checks the ranges; here the kernel on them, rows that see nothing included)."""
    (cu_q, cu_k), (q, k, v), _ = varlen_problem(128, causal)
    visible = varlen_mask(cu_q, cu_k, causal, window)
    out, lse = kernelgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=causal,
                                                window_size=window, return_lse=True)
    check((out[None], lse[None]), q[None], k[None], v[None], mask_mod=lambda *_: visible)


def test_varlen_func_window_on_its_own_causal_kernel():
    """Equal offsets, causal, a window: the kernel's causal variant with the left side folded."""
    cu, (q, k, v), _ = same_offsets_problem(128)
    visible = varlen_mask(cu, cu, True, (50, -1))
    out, lse = kernelgen.flash_attn_varlen_func(q, k, v, cu, causal=True, window_size=(50, -1),
                                                return_lse=True)
    check((out[None], lse[None]), q[None], k[None], v[None], mask_mod=lambda *_: visible)


def same_offsets_problem(head_dim):
    """Causal varlen with the same offsets for queries and keys (training's case: the kernel's
    own causal mask, ranges unfolded): 777 tokens in 5 sequences, one empty, one of one token."""
    torch.manual_seed(13)
    cu = torch.tensor([0, 130, 131, 131, 400, 777], device="cuda", dtype=torch.int32)
    q, k, v = rand(777, 4, head_dim), rand(777, 2, head_dim), rand(777, 2, head_dim)
    return cu, (q, k, v), varlen_mask(cu, cu, True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_func_causal_same_offsets(head_dim):
    cu, (q, k, v), visible = same_offsets_problem(head_dim)
    out, lse = kernelgen.flash_attn_varlen_func(q, k, v, cu, causal=True, return_lse=True)
    check((out[None], lse[None]), q[None], k[None], v[None], mask_mod=lambda *_: visible)


def test_varlen_func_remembers_its_offsets():
    """The second call with the same offsets tensors syncs nothing (so it can be captured in a
    CUDA graph), and an in-place change of them is seen."""
    (cu_q, cu_k), (q, k, v), visible = varlen_problem(64, True)
    cu_q, cu_k = cu_q.clone(), cu_k.clone()
    kernelgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, q_in = torch.cuda.CUDAGraph(), q.clone()   # the graph's static input
        with torch.cuda.graph(graph):
            out, lse = kernelgen.flash_attn_varlen_func(q_in, k, v, cu_q, cu_k, causal=True,
                                                        return_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out.fill_(float("nan"))
    q_in.copy_(q)
    graph.replay()
    check((out[None], lse[None]), q[None], k[None], v[None], mask_mod=lambda *_: visible)
    # Sequence 0 (130 queries, 200 keys) split in place into 100 + 30 queries, 150 + 50 keys.
    cu_q.copy_(torch.tensor([0, 100, 130, 131, 400, 777]))
    cu_k.copy_(torch.tensor([0, 150, 200, 260, 300, 690]))
    split = varlen_mask(cu_q, cu_k, True)
    assert not torch.equal(split, visible)
    got = kernelgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    check((got[0][None], got[1][None]), q[None], k[None], v[None], mask_mod=lambda *_: split)


def test_tutorial_prefix_lm():
    kernel = kernelgen.load(str(REPO_ROOT / "examples" / "prefix_lm.yaml"), head_dim=64, dtype="bf16")
    torch.manual_seed(5)
    for prefix in (0, 37, 300, 1000):
        q, k, v = (rand(2, 333, 4, 64) for _ in range(3))
        got = kernel(q, k, v, prefix_len=prefix, return_lse=True)
        check(got, q, k, v, mask_mod=lambda bb, hh, i, j: (j <= i) | (j < prefix))


def test_mods_refuse_bad_arguments():
    # (gradients: tests/test_mods_bwd_gpu.py)
    x = rand(1, 64, 2, 64)
    with pytest.raises(NotImplementedError, match="combining"):
        kernelgen.flash_attn_func(x, x, x, softcap=3.0, window_size=(4, 4))
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        kernelgen.flash_attn_func(x, x, x, alibi_slopes=torch.ones(3, device="cuda"))
    kernel = kernelgen.load("flash_attn_softcap", head_dim=64, dtype="bf16")
    with pytest.raises(TypeError, match="missing mod arguments \\['softcap'\\]"):
        kernel(x, x, x)
    # Tensors are checked against the spec's ctype and shape before anything launches.
    packed = kernelgen.load("flash_attn_packed", head_dim=64, dtype="bf16")
    start = torch.zeros(1, 64, dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="doc_start must be torch.int32"):
        packed(x, x, x, doc_start=start.long(), doc_end=start)
    with pytest.raises(ValueError, match=r"doc_end must have shape \(batch, seqlen_q\) = \(1, 64\)"):
        packed(x, x, x, doc_start=start, doc_end=start[:, :63].contiguous())
