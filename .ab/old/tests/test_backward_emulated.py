"""The backward kernels on the CPU emulator (tests/emulator): prep, main and dQ kernels launched
in flash_attn_backward's own order with its own argument lists (backward._run), compared with
autograd through kernelgen.reference by FlashAttention's rule. Seconds per case, so a few small
shapes that reach every code path: both DSPLIT layouts, 16- and 32-row warps, an odd number of
S^T tiles (BLOCK_M 16 with DSPLIT 2), causal with seqlen_q > seqlen_k (rows that see no key),
GQA, strided inputs and dout, and the deterministic path."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "emulator"))
import emulate  # noqa: E402
from gradients import assert_gradients, grads  # noqa: E402,F401  (grads: test_blockmask_emulated)

from kernelgen import backward  # noqa: E402
from kernelgen.reference import attention_ref  # noqa: E402
from kernelgen.spec import load_spec  # noqa: E402

pytestmark = pytest.mark.skipif(not emulate.available(), reason="the emulator needs g++")

NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class Emulated:
    """Stands in for an api.BoundKernel: what the emulator needs to run one variant and config."""

    def __init__(self, name, arch: str, config=None, **params):
        self.spec = load_spec(name) if isinstance(name, str) else name
        self.variant = self.spec.variant(arch, **params)
        self.config = (self.spec.default_config(self.variant) if config is None
                       else self.spec.parse_config(config))
        assert not self.spec.violations(self.variant, self.config)


def emulated_kernels(head_dim, dtype, causal, deterministic, arch, config=None, mods=None,
                     dq_config=None):
    """mods: a spec with mods (a name or path): its mods put onto the main and dQ specs."""
    variant = dict(head_dim=head_dim, dtype=NAMES[dtype], causal=causal)
    main, dq = backward.MAIN_SPEC, backward.DQ_SPEC
    if mods is not None:
        main, dq = load_spec(mods, onto=main), load_spec(mods, onto=dq)
    return backward._Kernels(Emulated(backward.PREP_SPEC, arch, dtype=NAMES[dtype]),
                             Emulated(main, arch, config, **variant),
                             Emulated(dq, arch, dq_config, **variant) if deterministic else None)


def launch(kernel, args, sizes):
    emulate.run(kernel.spec, kernel.variant, kernel.config,
                dict(zip((a.name for a in kernel.spec.args), args)))


def check(q, k, v, dout, causal, arch, config=None, deterministic=False, *, mods=None,
          mod_args=(), score_mod=None, mask_mod=None, dq_config=None):
    """mods: a spec with mods (test_mods_bwd_emulated.py), run with `mod_args` (kernel order);
    score_mod / mask_mod: the same modification for the reference."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attention_ref(q, k, v, causal, scale, score_mod=score_mod, mask_mod=mask_mod)
    kernels = emulated_kernels(head_dim, q.dtype, causal, deterministic, arch, config, mods,
                               dq_config)
    got = backward._run(kernels, launch, dout, q, k, v, out, lse, scale, mod_args=mod_args)
    assert_gradients(got, q, k, v, dout, lse, causal, scale, score_mod, mask_mod)
    return got


def make(batch, seqlen, heads, head_dim, dtype, seed):
    torch.manual_seed(seed)
    return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype)


CASES = [
    # head_dim, dtype, causal, (seqlen_q, seqlen_k), (batch, heads, heads_k), arch, config
    (64, torch.bfloat16, True, (130, 77), (1, 4, 2), "sm_80", None),
    (96, torch.float16, False, (70, 150), (2, 2, 2), "sm_86", None),
    (128, torch.bfloat16, True, (100, 100), (1, 2, 1), "sm_90",
     {"block_m": 64, "block_n": 128, "warps": 8, "dsplit": 2, "stages": 2, "grid_order": 0}),
    (256, torch.float16, True, (40, 90), (1, 2, 1), "sm_86", None),
]


@pytest.mark.parametrize("head_dim, dtype, causal, seqlens, layout, arch, config", CASES,
                         ids=[f"hd{c[0]}-{NAMES[c[1]]}-{'causal' if c[2] else 'full'}-{c[5]}" for c in CASES])
def test_gradients(head_dim, dtype, causal, seqlens, layout, arch, config):
    (seqlen_q, seqlen_k), (batch, heads, heads_k) = seqlens, layout
    q = make(batch, seqlen_q, heads, head_dim, dtype, 1)
    k, v = make(batch, seqlen_k, heads_k, head_dim, dtype, 2), make(batch, seqlen_k, heads_k, head_dim, dtype, 3)
    check(q, k, v, make(batch, seqlen_q, heads, head_dim, dtype, 4), causal, arch, config)


def test_deterministic_path():
    q, k, v = (make(1, n, 2, 192, torch.bfloat16, s) for n, s in ((90, 1), (60, 2), (60, 3)))
    dout = make(1, 90, 2, 192, torch.bfloat16, 4)
    check(q, k, v, dout, True, "sm_80", deterministic=True)


def test_strided_inputs_and_dout():
    torch.manual_seed(0)
    qkv = torch.randn(2, 80, 3, 2, 64, dtype=torch.bfloat16)
    q, k, v = qkv[:, 13:, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = torch.randn(2, 2, 67, 64, dtype=torch.bfloat16).transpose(1, 2)  # heads-major
    assert not q.is_contiguous() and not dout.is_contiguous()
    check(q, k, v, dout, True, "sm_80")
