"""GPU numerics of the backward kernels against a float32 reference (FlashAttention's rule): for
each of dq, dk, dv, max|g - g_ref| <= 2 * max|g_pt - g_ref| + rounding allowance, where g_ref is
autograd through kernelgen.reference with float32 math and g_pt the same in the input dtype.
out and lse come from kernelgen's forward. Gradients are poisoned (NaN in the allocator's free
blocks) before each call so an unwritten element cannot pass. Kept small: long sequences run
with few heads, and the deterministic path has its own, smaller grid."""
import math

import pytest
import torch

from kernelgen.backward import flash_attn_backward
from kernelgen.reference import attention_ref, max_error, rounding_allowance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEAD_DIMS = [64, 96, 128, 192, 256]
DTYPES = [torch.float16, torch.bfloat16]
SEQLENS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (1, 1000), (17, 128), (1000, 17),
           (128, 1000)]
# (batch, heads, heads_k): GQA ratios 1, 2 and 8, batch 1 and 3.
LAYOUTS = [(1, 8, 8), (3, 4, 2), (1, 8, 1), (3, 2, 2)]


def poison():
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")
    del junk


def reference_grads(q, k, v, dout, causal, scale, upcast):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, scale, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout)


def forward(q, k, v, causal, softmax_scale=None):
    import kernelgen

    with torch.no_grad():
        return kernelgen.flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                         return_lse=True)


def check(q, k, v, causal, dout=None, deterministic=False, softmax_scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = forward(q, k, v, causal, scale)  # the LSE must come from the same scale
    if dout is None:
        dout = torch.randn_like(out)
    poison()
    got = flash_attn_backward(dout, q, k, v, out, lse, causal, scale, deterministic)
    torch.cuda.synchronize()
    refs = reference_grads(q, k, v, dout, causal, scale, upcast=True)
    pts = reference_grads(q, k, v, dout, causal, scale, upcast=False)
    for name, g, ref, pt, like in zip(("dq", "dk", "dv"), got, refs, pts, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype and g.device == like.device, name
        assert not g.isnan().any(), f"{name} has NaN (unwritten or bad math)"
        err, err_pt = max_error(g, ref), max_error(pt, ref)
        # + 1e-4: with a single visible key dS is exactly 0 in exact math, and the reference
        # gets exactly 0, while dP - D leaves rounding noise of ~1e-6.
        assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)
    empty = ~torch.isfinite(lse).transpose(1, 2)  # (batch, seqlen_q, heads): rows that see no key
    assert torch.all(got[0][empty] == 0), "rows that see no key get dq = 0"
    return got


def make(batch, seqlen, heads, head_dim, dtype):
    return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)


def inputs(head_dim, dtype, seqlens, index):
    seqlen_q, seqlen_k = seqlens
    batch, heads, heads_k = LAYOUTS[index % len(LAYOUTS)]
    if seqlen_q * seqlen_k >= 128 * 1000:
        batch, heads, heads_k = (1, 4, 2) if index % 2 else (1, 8, 1)  # keep the reference small
    torch.manual_seed(index)
    return (make(batch, seqlen_q, heads, head_dim, dtype), make(batch, seqlen_k, heads_k, head_dim, dtype),
            make(batch, seqlen_k, heads_k, head_dim, dtype))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward(head_dim, dtype, causal, seqlens):
    index = HEAD_DIMS.index(head_dim) + SEQLENS.index(seqlens) + (2 if causal else 0)
    check(*inputs(head_dim, dtype, seqlens, index), causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(17, 128), (1000, 17), (300, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_deterministic(head_dim, causal, seqlens):
    """Correct, and bitwise identical on a second run."""
    q, k, v = inputs(head_dim, torch.bfloat16, seqlens, HEAD_DIMS.index(head_dim) + 1)
    dout = torch.randn_like(q)
    first = check(q, k, v, causal, dout=dout, deterministic=True)
    second = check(q, k, v, causal, dout=dout, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs_and_dout(head_dim, causal):
    """q, k, v sliced out of a packed qkv tensor and out of a longer sequence; dout heads-major
    (last dim contiguous), and dout with a strided last dim (copied)."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(2, 300, 3, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 37:, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = torch.randn(2, 4, 263, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous() and not dout.is_contiguous()
    check(q, k, v, causal, dout=dout)
    wide = torch.randn(2, 200, 8, head_dim, device="cuda", dtype=torch.float16)
    q, k, v = wide[:, :, 1::2], wide[:, :150, ::2], wide[:, 50:, 4:]
    dout = torch.randn(2, 200, 4, 2 * head_dim, device="cuda", dtype=torch.float16)[..., ::2]
    check(q, k, v, causal, dout=dout)


def test_softmax_scale_and_large_values():
    torch.manual_seed(0)
    q = make(2, 257, 4, 128, torch.bfloat16) * 4
    k = make(2, 333, 2, 128, torch.bfloat16) * 4
    v = make(2, 333, 2, 128, torch.bfloat16)
    check(q, k, v, False, softmax_scale=0.3)
    check(q, k, v, True, softmax_scale=1.0 / math.sqrt(128) / 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_sequences(causal):
    """No queries: dk = dv = 0. No keys: dq = 0 (and empty dk, dv)."""
    q, k = make(2, 0, 4, 64, torch.bfloat16), make(2, 5, 2, 64, torch.bfloat16)
    out, lse = forward(q, k, k, causal)
    dq, dk, dv = flash_attn_backward(torch.zeros_like(out), q, k, k, out, lse, causal, 0.125)
    assert dq.shape == q.shape and torch.all(dk == 0) and torch.all(dv == 0)
    q, k = make(2, 7, 4, 64, torch.bfloat16), make(2, 0, 2, 64, torch.bfloat16)
    out, lse = forward(q, k, k, causal)
    dq, dk, dv = flash_attn_backward(torch.randn_like(out), q, k, k, out, lse, causal, 0.125)
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == k.shape


def test_bad_dout_on_gpu():
    q = make(1, 16, 2, 64, torch.float16)
    out, lse = forward(q, q, q, False)
    with pytest.raises(ValueError, match="dout is on cpu but out is on cuda"):
        flash_attn_backward(out.cpu(), q, q, q, out, lse, False, 0.125)
    with pytest.raises(TypeError, match="dout must have the dtype of out"):
        flash_attn_backward(out.bfloat16(), q, q, q, out, lse, False, 0.125)
    with pytest.raises(ValueError, match="dout must have the shape of out"):
        flash_attn_backward(out[:, :8], q, q, q, out, lse, False, 0.125)
