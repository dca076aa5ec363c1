"""The Hopper forward family (spec flash_attn_fwd_sm90: TMA, mbarriers, wgmma).

`flash_attn_func` runs it on compute capability 9.0 (kernelgen.ops.forward_family); this module
holds what only this family needs, the tensor maps, and an explicit entry point that takes a
config. The kernel takes the sm80 family's arguments plus three tensor maps (kernelgen/tma.py)
whose layouts a launch plan keeps; per call only the addresses change (tma.encode).
"""
from __future__ import annotations

from kernelgen import ops, tma

SPEC = ops.FAMILIES["sm90"]
_EMPTY_MAP = bytes(tma.MAP_BYTES)  # for an empty K/V: no CTA loads from it


def tensor_maps(kernel, q, k, v) -> tuple:
    """The map layouts of Q, K, V for `kernel`'s tiles; all-zero maps when K/V are empty."""
    if not k.shape[1]:
        return (_EMPTY_MAP,) * 3
    env = kernel.spec.environment(kernel.variant, kernel.config)
    dtype = kernel.variant["dtype"]
    return tuple(tma.attention_map(t.shape, t.stride(), dtype, rows, env["swizzle"])
                 for t, rows in ((q, env["block_m"]), (k, env["block_n"]), (v, env["block_n"])))


def encode_maps(layouts: tuple, q, k, v) -> tuple:
    """The 128-byte maps of `tensor_maps`' layouts at q, k and v's addresses (per call: only the
    address changes, which tma.encode patches in)."""
    return tuple(m if isinstance(m, bytes) else tma.encode(m, t.data_ptr())
                 for m, t in zip(layouts, (q, k, v)))


def flash_attn_forward_sm90(q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                            config=None):
    """Exact attention on the Hopper kernels; same contract as `flash_attn_func(..., return_lse=
    True)` without autograd: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
    heads_k, head_dim), causal aligned bottom-right. Returns (out like q, lse (batch, heads,
    seqlen_q) float32 in natural log; -inf and a zero output row where a query sees no key).
    `config`: a mapping of the spec's tune keys (block_m, block_n, stages, schedule) instead of
    the tuned or default one."""
    ops._check_inputs(q, k, v)
    return ops.flash_attn_forward(q, k, v, bool(causal), ops._scale(q, softmax_scale),
                                  family="sm90", config=None if config is None else dict(config))
