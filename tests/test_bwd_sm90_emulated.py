"""The Hopper backward main kernel (flash_attn_bwd_sm90) on the CPU emulator (tests/emulator,
sm90_emu.h), launched by backward._run between the prep kernel and the dQ cast, with tensor maps
from backward_sm90.tensor_maps, against autograd through kernelgen.reference by FlashAttention's
rule. Seconds per case: small ragged shapes that reach every code path (every head dim: both
ways of splitting dQ, 128B and 64B swizzle; causal with seqlen_q > seqlen_k, rows that see no
key and KV tiles no query sees; GQA; a strided view and a transposed dout; 2 and 3 stages, every
ring wrapping), with TMA copies landing at issue (eager) or as late as allowed (lazy, where the
emulator also stalls a warpgroup now and then: with one dS^T buffer instead of two, the other
warpgroup overwrites it under a pending dQ wgmma, which fails the lazy hd128 cases)."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulator"))
import emulate  # noqa: E402

from kernelgen import backward, backward_sm90  # noqa: E402
from kernelgen.reference import attention_ref, max_error, rounding_allowance  # noqa: E402
from kernelgen.spec import load_spec  # noqa: E402

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
        self.spec = load_spec(name)
        arch = "sm_90a" if name == backward_sm90.SPEC else "sm_90"
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


def grads(q, k, v, dout, causal, scale, upcast):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, scale, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout)


def check(q, k, v, dout, causal, config=None, lazy=False):
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attention_ref(q, k, v, causal, scale)
    dtype = NAMES[q.dtype]
    kernels = backward._Kernels(Emulated(backward.PREP_SPEC, dtype=dtype),
                                Emulated(backward_sm90.SPEC, config, head_dim=head_dim,
                                         dtype=dtype, causal=causal),
                                None)
    # Poisoned outputs: every element the kernels should write starts as NaN.
    buffers = backward._Buffers(*(torch.full_like(t, float("nan")) for t in backward._buffers(
        q, k, deterministic=False).__dict__.values()))
    got = backward._run(kernels, launcher(lazy), dout, q, k, v, out, lse, scale, buffers=buffers)
    refs = grads(q, k, v, dout, causal, scale, True)
    pts = grads(q, k, v, dout, causal, scale, False)
    for name, g, ref, pt, like in zip(("dq", "dk", "dv"), got, refs, pts, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert not g.isnan().any(), f"{name} has NaN (unwritten or bad math)"
        err, err_pt = max_error(g, ref), max_error(pt, ref)
        # + 1e-4: with one visible key dS is exactly 0, and so is the reference.
        assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)
    empty = ~torch.isfinite(lse).transpose(1, 2)  # (batch, seqlen_q, heads): rows that see no key
    assert torch.all(got[0][empty] == 0)
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
    (96, torch.bfloat16, True, (140, 140), (1, 2, 1), 2, False),     # 64B swizzle, dQ N = 96
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
