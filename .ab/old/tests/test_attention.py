"""GPU numerics of the forward kernels against a float32 reference (FlashAttention's rule):
max|out - ref| <= 2 * max|out_pt - ref| + rounding allowance, where out_pt is the same math done
by PyTorch in the input dtype. Outputs are poisoned (NaN in the allocator's free blocks) before
each call so an unwritten element cannot pass."""
import math

import pytest
import torch

from kernelgen.reference import attention_ref, max_error, rounding_allowance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEAD_DIMS = [64, 96, 128, 192, 256]
DTYPES = [torch.float16, torch.bfloat16]
SEQLENS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (4096, 4096), (1, 1000), (17, 128),
           (1000, 17), (128, 4096), (4096, 128), (1000, 4096)]
# (batch, heads, heads_k): GQA ratios 1, 2 and 8, batch 1 and 3.
LAYOUTS = [(1, 8, 8), (3, 4, 2), (1, 8, 1), (3, 2, 2)]


def poison():
    """Fill free blocks of the caching allocator with NaN so outputs that land there start as NaN."""
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")
    del junk


def check(q, k, v, causal, softmax_scale=None):
    import kernelgen

    poison()
    out, lse = kernelgen.flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                         return_lse=True)
    torch.cuda.synchronize()
    out_ref, lse_ref = attention_ref(q, k, v, causal, softmax_scale, upcast=True)
    out_pt, _ = attention_ref(q, k, v, causal, softmax_scale, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "output has NaN (unwritten or bad math)"
    err, err_pt = max_error(out, out_ref), max_error(out_pt, out_ref)
    assert err <= 2 * err_pt + rounding_allowance(out_ref), (err, err_pt)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE is -inf exactly where no key is visible"
    assert torch.all(lse[~finite] == float("-inf"))
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 2e-3
    empty_rows = (~finite).transpose(1, 2)  # (batch, seqlen_q, heads)
    assert torch.all(out[empty_rows] == 0), "rows that see no key give 0"
    return err, err_pt


def make(batch, seqlen, heads, head_dim, dtype):
    return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward(head_dim, dtype, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    index = HEAD_DIMS.index(head_dim) + SEQLENS.index(seqlens) + (2 if causal else 0)
    batch, heads, heads_k = LAYOUTS[index % len(LAYOUTS)]
    if seqlen_q * seqlen_k >= 4096 * 1000:
        batch, heads, heads_k = (1, 4, 2) if index % 2 else (1, 4, 1)  # keep the reference small
    torch.manual_seed(index)
    q = make(batch, seqlen_q, heads, head_dim, dtype)
    k = make(batch, seqlen_k, heads_k, head_dim, dtype)
    v = make(batch, seqlen_k, heads_k, head_dim, dtype)
    check(q, k, v, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(head_dim, causal):
    """Sliced views: q, k, v out of one packed qkv tensor, and a window of a longer sequence."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(2, 300, 3, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 37:, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    check(q, k, v, causal)
    wide = torch.randn(2, 200, 8, head_dim, device="cuda", dtype=torch.float16)
    check(wide[:, :, 1::2], wide[:, :150, ::2], wide[:, 50:, 4:], causal)


def test_softmax_scale_and_large_values():
    torch.manual_seed(0)
    q = make(2, 257, 4, 128, torch.bfloat16) * 4
    k = make(2, 333, 4, 128, torch.bfloat16) * 4
    v = make(2, 333, 4, 128, torch.bfloat16)
    check(q, k, v, False, softmax_scale=0.3)
    check(q, k, v, True, softmax_scale=1.0 / math.sqrt(128) / 2)


def test_repeated_call_compiles_and_loads_nothing(monkeypatch):
    import kernelgen
    from kernelgen import cache, launch

    q = make(1, 64, 2, 64, torch.bfloat16)
    kernelgen.flash_attn_func(q, q, q)

    def fail(*args, **kwargs):
        raise AssertionError("a repeated call compiled or loaded")

    monkeypatch.setattr(cache, "compile_cached", fail)
    monkeypatch.setattr(launch.Kernel, "_load", fail)
    kernelgen.flash_attn_func(q, q, q)
    torch.cuda.synchronize()
