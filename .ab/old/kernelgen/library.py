"""kernelgen's attention as torch.library custom ops, with fake (meta) implementations and
autograd, so that torch.compile(fullgraph=True) traces models that use them and CUDA graphs can
capture them after warm-up.

    torch.ops.kernelgen.flash_attn_fwd(q, k, v, causal, softmax_scale, deterministic) -> (out, lse)
    torch.ops.kernelgen.flash_attn_bwd(dout, q, k, v, out, lse, causal, softmax_scale,
                                       deterministic) -> (dq, dk, dv)

Outputs are always freshly allocated and contiguous (what the fake implementations promise).
LSE is an output for inspection: gradients flow through `out` only (as in FlashAttention).
"""
from __future__ import annotations

import torch

from kernelgen import ops


@torch.library.custom_op("kernelgen::flash_attn_fwd", mutates_args=(), device_types="cuda")
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only matters to the backward; it is an argument so that autograd saves it.
    # checked_forward: a training step's repeated shapes reuse their launch plan (no re-checks).
    return ops.checked_forward(q, k, v, causal, softmax_scale)


@flash_attn_fwd.register_fake
def _(q, k, v, causal, softmax_scale, deterministic):
    ops._check_structure(q, k, v)
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32))


@torch.library.custom_op("kernelgen::flash_attn_bwd", mutates_args=(), device_types="cuda")
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernelgen.backward import flash_attn_backward

    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    if dout.shape != out.shape or dout.dtype != out.dtype:
        raise ValueError(f"dout must match out: got {tuple(dout.shape)} {dout.dtype}, "
                         f"expected {tuple(out.shape)} {out.dtype}")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.kernelgen.flash_attn_bwd(dout, q, k, v, out, lse, ctx.causal,
                                                    ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
