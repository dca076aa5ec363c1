"""The gradient check both emulated backward suites use (test_backward_emulated.py for the
mma.sync kernel, test_bwd_sm90_emulated.py for the Hopper one): autograd through
kernelgen.reference, and FlashAttention's rule on dQ, dK, dV."""
from __future__ import annotations

import torch

from kernelgen.reference import attention_ref, max_error, rounding_allowance


def grads(q, k, v, dout, causal, scale, upcast, score_mod=None, mask_mod=None):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, scale, upcast=upcast, score_mod=score_mod,
                           mask_mod=mask_mod)
    return torch.autograd.grad(out, leaves, dout)


def assert_gradients(got, q, k, v, dout, lse, causal, scale, score_mod=None, mask_mod=None):
    """got: (dq, dk, dv) of a kernel; lse: the forward's (rows that see no key: -inf)."""
    refs = grads(q, k, v, dout, causal, scale, True, score_mod, mask_mod)
    pts = grads(q, k, v, dout, causal, scale, False, score_mod, mask_mod)
    for name, g, ref, pt, like in zip(("dq", "dk", "dv"), got, refs, pts, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert not g.isnan().any(), f"{name} has NaN (unwritten or bad math)"
        err, err_pt = max_error(g, ref), max_error(pt, ref)
        # + 1e-4: with one visible key dS is exactly 0, and so is the reference.
        assert err <= 2 * err_pt + rounding_allowance(ref) + 1e-4, (name, err, err_pt)
    empty = ~torch.isfinite(lse).transpose(1, 2)  # (batch, seqlen_q, heads): rows that see no key
    assert torch.all(got[0][empty] == 0)
