"""GPU gradients of the modifier specs (softcap, sliding window, ALiBi, document masks, the
tutorial's prefix LM) through autograd (flash_attn_func's options and kernelgen.load), against
autograd through the float32 reference applying the same modification, by FlashAttention's rule
as in tests/test_backward.py: max|g - g_ref| <= 2 * max|g_pt - g_ref| + rounding allowance, g_pt
the same reference in the input dtype. Ragged sequence lengths (partial tiles, seqlen_q above and
below seqlen_k) and GQA; gradients poisoned first so that an unwritten element cannot pass.

Every test runs twice (the `main_kernel` fixture): on compute capability 9.0 with the Hopper main
kernel (flash_attn_bwd_sm90, where backward_sm90.applies takes the variant; these shapes are
short, so its seqlen rule is lifted), and with KERNELGEN_BACKWARD=sm80 (the mma.sync kernel)."""
import textwrap

import pytest
import torch
from test_mods_gpu import (document_ids, packed_documents, same_offsets_problem, varlen_mask,
                           varlen_problem)

import kernelgen
from kernelgen import backward, backward_sm90, env
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import REPO_ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(1, 300, 300, 4, 2), (2, 200, 513, 4, 4), (2, 513, 200, 2, 1), (1, 77, 1000, 8, 1)]  # b, sq, sk, h, hk


@pytest.fixture(autouse=True, params=["sm90", "sm80"])
def main_kernel(request, monkeypatch):
    if request.param == "sm90":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Hopper backward runs on compute capability 9.0 only")
        monkeypatch.setattr(backward_sm90, "SHORT_SEQLEN_K", 0)
    else:
        monkeypatch.setenv("KERNELGEN_BACKWARD", "sm80")
    env.reload_settings()
    backward._KERNELS.clear()   # its key does not hold the switch
    yield request.param
    backward._KERNELS.clear()
    monkeypatch.undo()
    env.reload_settings()


def main_kernels() -> set[str]:
    """The main kernels of the backwards run since the fixture cleared backward's memo."""
    return {kernels.main.spec.name for kernels in backward._KERNELS.values()}


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=dtype) * scale


def poison():
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")
    del junk


def reference_grads(q, k, v, dout, causal, upcast, score_mod, mask_mod):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, upcast=upcast, score_mod=score_mod, mask_mod=mask_mod)
    return torch.autograd.grad(out, leaves, dout)


def check(run, q, k, v, causal=False, score_mod=None, mask_mod=None):
    """run(q, k, v) -> (out, lse) with autograd; returns the gradients."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = run(q, k, v)
    dout = torch.randn_like(out)
    poison()
    got = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    refs = reference_grads(q, k, v, dout, causal, True, score_mod, mask_mod)
    pts = reference_grads(q, k, v, dout, causal, False, score_mod, mask_mod)
    for name, g, ref, pt, like in zip(("dq", "dk", "dv"), got, refs, pts, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert not g.isnan().any(), f"{name} has NaN (unwritten or bad math)"
        err, err_pt = max_error(g, ref), max_error(pt, ref)
        assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)
    empty = ~torch.isfinite(lse).transpose(1, 2)
    assert torch.all(got[0][empty] == 0), "rows that see no key get dq = 0"
    return got


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(head_dim, causal):
    torch.manual_seed(head_dim)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, head_dim, scale=3), rand(b, sk, hk, head_dim, scale=3), rand(b, sk, hk, head_dim)
        check(lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal, softcap=5.0, return_lse=True),
              q, k, v, causal, score_mod=lambda s, *_: 5.0 * torch.tanh(s / 5.0))


@pytest.mark.parametrize("window", [(16, 0), (64, 64), (-1, 32), (100, -1), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sliding_window(window, causal, head_dim):
    left, right = window
    torch.manual_seed(left + 7 * right)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = rand(b, sq, h, head_dim), rand(b, sk, hk, head_dim), rand(b, sk, hk, head_dim)

        def visible(bb, hh, i, j, shift=sk - sq):
            return (((j >= i + shift - left) | (left < 0)) & ((j <= i + shift + right) | (right < 0)))

        check(lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                        return_lse=True),
              q, k, v, causal, mask_mod=visible)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 192])
def test_alibi(per_batch, head_dim):
    torch.manual_seed(per_batch + head_dim)
    for b, sq, sk, h, hk in SHAPES:
        q, k, v = (rand(b, n, heads, head_dim, dtype=torch.float16) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
        slopes = torch.rand((b, h) if per_batch else (h,), device="cuda") * 0.5
        s4 = slopes.view(b if per_batch else 1, h, 1, 1)
        for causal in (False, True):
            check(lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                                            return_lse=True),
                  q, k, v, causal,
                  score_mod=lambda s, bb, hh, i, j: s - s4 * (i + sk - sq - j).abs().float())


def documents(batch, seqlen):
    docs = torch.zeros(batch, seqlen, dtype=torch.int32, device="cuda")
    for row in docs:
        cuts = torch.sort(torch.randperm(seqlen - 1)[:5] + 1).values.tolist()
        for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, seqlen])):
            row[a:b] = n
    return docs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_document_mask(causal, head_dim):
    torch.manual_seed(3)
    batch, seqlen, heads, heads_k = 2, 700, 4, 2
    kernel = kernelgen.load("flash_attn_document", head_dim=head_dim, dtype="bf16", causal=causal)
    docs = documents(batch, seqlen)
    q = rand(batch, seqlen, heads, head_dim)
    k, v = rand(batch, seqlen, heads_k, head_dim), rand(batch, seqlen, heads_k, head_dim)
    same = (docs[:, :, None] == docs[:, None, :])[:, None]
    check(lambda q, k, v: kernel(q, k, v, doc_q=docs, doc_k=docs, return_lse=True),
          q, k, v, causal, mask_mod=lambda *_: same)


@pytest.mark.parametrize("causal", [False, True])
def test_document_block_mask_as_ranges(causal):
    """Gradients of flash_attn_document with a block mask that keeps its ids (packed in order)
    as key ranges: the forward runs flash_attn_packed's kernel on them (on the Hopper family),
    the backward the block mask's (test_mods_gpu's document_ids: other lengths, GQA, rows that
    see nothing)."""
    (doc_q, doc_k), (q, k, v), same = document_ids(128)
    kernel = kernelgen.load("flash_attn_document", head_dim=128, dtype="bf16", causal=causal)
    (batch, seqlen_q), seqlen_k = doc_q.shape, doc_k.shape[1]
    mask = kernel.create_block_mask(batch, q.shape[2], seqlen_q, seqlen_k, doc_q=doc_q, doc_k=doc_k)
    assert mask.ranges is not None
    check(lambda q, k, v: kernel(q, k, v, doc_q=doc_q, doc_k=doc_k, block_mask=mask,
                                 return_lse=True), q, k, v, causal, mask_mod=lambda *_: same)


@pytest.mark.parametrize("range_backward", ["blockmask", "ranges"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_documents(main_kernel, causal, head_dim, range_backward, monkeypatch):
    """flash_attn_packed's gradients (test_mods_gpu's inputs: seqlen_q != seqlen_k, GQA, a query
    document with no keys), on the Hopper family by either backward (KERNELGEN_RANGE_BACKWARD):
    on a block mask classified from the ranges (AttentionKernel.range_spec), or on the ranges."""
    monkeypatch.setenv("KERNELGEN_RANGE_BACKWARD", range_backward)
    env.reload_settings()
    (start, end), (q, k, v), same = packed_documents(head_dim)
    kernel = kernelgen.load("flash_attn_packed", head_dim=head_dim, dtype="bf16", causal=causal)
    check(lambda q, k, v: kernel(q, k, v, doc_start=start, doc_end=end, return_lse=True),
          q, k, v, causal, mask_mod=lambda *_: same)
    on_mask = "_bm" if range_backward == "blockmask" else ""
    expected = (f"flash_attn_packed{on_mask}__{backward_sm90.SPEC}" if main_kernel == "sm90"
                else f"flash_attn_packed__{backward.MAIN_SPEC}")
    assert main_kernels() == {expected}


def test_packed_range_mask_is_kept(main_kernel, monkeypatch):
    """The block mask of a kv range's backward is built once per ranges (the same tensors, not
    changed in place) and problem; an in-place change of the ranges builds another."""
    if main_kernel != "sm90":
        pytest.skip("the block mask is the Hopper backward's")
    monkeypatch.setenv("KERNELGEN_RANGE_BACKWARD", "blockmask")
    env.reload_settings()
    (start, end), (q, k, v), same = packed_documents(128)
    kernel = kernelgen.load("flash_attn_packed", head_dim=128, dtype="bf16", causal=False)
    run = lambda q, k, v: kernel(q, k, v, doc_start=start, doc_end=end, return_lse=True)  # noqa: E731
    check(run, q, k, v, mask_mod=lambda *_: same)
    check(run, q, k, v, mask_mod=lambda *_: same)
    assert len(kernel._range_masks) == 1
    end.add_(0)   # the same values, a new version: not trusted to be the same
    check(run, q, k, v, mask_mod=lambda *_: same)
    assert len(kernel._range_masks) == 2


@pytest.mark.parametrize("case, causal, window", [
    ("full", False, (-1, -1)), ("causal_same_offsets", True, (-1, -1)), ("causal", True, (-1, -1)),
    ("window", False, (40, 9)), ("causal_window", True, (70, -1))])
def test_varlen_func(main_kernel, case, causal, window):
    """kernelgen.flash_attn_varlen_func's gradients (test_mods_gpu's sequences: other lengths
    for queries and keys, GQA, rows that see nothing; or the same offsets, causal: the packed
    kernel's causal variant), and which backward ran them (packed._document_route): on the
    Hopper family flash_attn_document's over the sequences (its block mask kept with the
    offsets) for full attention and causal at the same offsets; causal at other offsets (folded
    into the ranges) and a window's folded ranges flash_attn_packed's on a block mask of its
    ranges (AttentionKernel.range_spec); the mma.sync family the kv-range kernel's."""
    from kernelgen import packed

    if case == "causal_same_offsets":
        cu, (q, k, v), visible = same_offsets_problem(128)
        cu_q, cu_k = cu.clone(), cu.clone()
    else:
        (cu_q, cu_k), (q, k, v), _ = varlen_problem(128, causal)
        cu_q, cu_k = cu_q.clone(), cu_k.clone()
        visible = varlen_mask(cu_q, cu_k, causal, window)

    def run(q, k, v):
        out, lse = kernelgen.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, causal=causal,
                                                    window_size=window, return_lse=True)
        return out[None], lse[None]

    check(run, q[None], k[None], v[None], mask_mod=lambda *_: visible)
    kept = [entry[4] for entry in packed._REMEMBERED.values() if entry[0] is cu_q]
    assert len(kept) == 1
    routes = [route for route in kept[0].values() if route is not None]
    routed = main_kernel == "sm90" and case in ("full", "causal_same_offsets")
    assert bool(routes) == routed, (case, main_kernel, kept[0])
    if routed:
        (route,) = routes
        assert route.kernel.spec.name == "flash_attn_document" and route.mask.causal == causal
        assert route.mask.ranges is not None   # so its forward runs flash_attn_packed's kernel
        assert main_kernels() == {f"flash_attn_document__{backward_sm90.SPEC}"}
    elif main_kernel == "sm90":   # the ranges on a block mask (AttentionKernel.range_spec)
        on_mask = "_bm" if env.settings().range_backward == "blockmask" else ""
        assert main_kernels() == {f"flash_attn_packed{on_mask}__{backward_sm90.SPEC}"}
    else:
        assert main_kernels() == {f"flash_attn_packed__{backward.MAIN_SPEC}"}


def test_tutorial_prefix_lm():
    kernel = kernelgen.load(str(REPO_ROOT / "examples" / "prefix_lm.yaml"), head_dim=64, dtype="bf16")
    torch.manual_seed(5)
    for prefix in (0, 37, 300, 1000):
        q, k, v = rand(2, 333, 4, 64), rand(2, 333, 2, 64), rand(2, 333, 2, 64)
        check(lambda q, k, v: kernel(q, k, v, prefix_len=prefix, return_lse=True),
              q, k, v, mask_mod=lambda bb, hh, i, j: (j <= i) | (j < prefix))


def _window(left, right, sq, sk):
    return lambda b, h, i, j: (j >= i + sk - sq - left) & (j <= i + sk - sq + right)


@pytest.mark.parametrize("name, mod_args, mods", [
    ("flash_attn_window", {"window_left": 50, "window_right": 10},
     {"mask_mod": _window(50, 10, 400, 333)}),
    ("flash_attn_softcap", {"softcap": 4.0},
     {"score_mod": lambda s, *_: 4.0 * torch.tanh(s / 4.0)}),
])
def test_deterministic(name, mod_args, mods):
    """Correct, and bitwise identical on a second run."""
    kernel = kernelgen.load(name, head_dim=128, dtype="bf16", causal=True)
    torch.manual_seed(11)
    q, k, v = rand(2, 400, 8, 128), rand(2, 333, 2, 128), rand(2, 333, 2, 128)
    run = lambda q, k, v: kernel(q, k, v, deterministic=True, return_lse=True, **mod_args)  # noqa: E731
    check(run, q, k, v, True, **mods)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, _ = run(*leaves)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for label, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{label} differs between two deterministic runs"


def test_a_forward_only_spec_refuses_gradients(tmp_path):
    path = tmp_path / "my_temperature.yaml"
    path.write_text(textwrap.dedent("""
        name: my_temperature
        extends: flash_attn_fwd
        mods:
          args: [{name: temperature, type: f32}]
          score_mod: "score / temperature"
        """))
    kernel = kernelgen.load(str(path), head_dim=64, dtype="bf16")
    q = rand(1, 64, 2, 64)
    with torch.no_grad():
        kernel(q, q, q, temperature=2.0)   # the forward runs
    with pytest.raises(NotImplementedError, match="my_temperature .* forward-only: .*score_mod_grad"):
        kernel(q.requires_grad_(), q.detach(), q.detach(), temperature=2.0)


@pytest.mark.parametrize("name, mod_args, head_dim, causal, sm90", [
    ("flash_attn_softcap", {"softcap": 4.0}, 128, True, True),
    ("flash_attn_window", {"window_left": 50, "window_right": 10}, 128, False, True),
    ("flash_attn_window", {"window_left": 50, "window_right": 10}, 96, False, False),  # spills there
])
def test_which_main_kernel_runs(main_kernel, name, mod_args, head_dim, causal, sm90):
    kernel = kernelgen.load(name, head_dim=head_dim, dtype="bf16", causal=causal)
    q = rand(1, 200, 2, head_dim, scale=1.0).requires_grad_()
    out = kernel(q, q.detach(), q.detach(), **mod_args)
    torch.autograd.grad(out, q, torch.randn_like(out))
    base = backward_sm90.SPEC if main_kernel == "sm90" and sm90 else backward.MAIN_SPEC
    assert main_kernels() == {f"{name}__{base}"}
