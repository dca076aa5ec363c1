"""The Hopper forward (spec flash_attn_fwd_sm90: TMA, mbarriers, wgmma), called explicitly.

Opt-in until its GPU tests have passed on an H200: `flash_attn_func` does not route here yet.
Inputs are validated exactly like `flash_attn_func`'s; the launch goes on torch's current stream.
The kernel takes the sm80 family's arguments plus three tensor maps (kernelgen/tma.py), which are
cached per layout and address, so a repeated call with the same tensors encodes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelgen import api, ops, tma

SPEC = "flash_attn_fwd_sm90"
ARCH = "sm_90a"
_EMPTY_MAP = bytes(tma.MAP_BYTES)  # for an empty K/V: no CTA loads from it


@dataclass(frozen=True)
class _Plan:
    kernel: api.BoundKernel
    device: int
    grid: tuple
    scalars: tuple  # the kernel's arguments between the five pointers and the three maps
    maps: tuple[tma.TiledMap, tma.TiledMap, tma.TiledMap] | None  # None: seqlen_k == 0
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A TMA source needs a 16-byte aligned start and strides: ops._aligned copies a tensor whose
    strides are not, but contiguous() keeps a contiguous view's misaligned start, so clone that."""
    t = ops._aligned(t)
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _kernel(head_dim: int, dtype: str, causal: bool, device: int, config) -> api.BoundKernel:
    major_minor = torch.cuda.get_device_capability(device)
    if major_minor != (9, 0):
        raise RuntimeError(f"kernelgen.hopper needs an sm_90 GPU (H100/H200); device {device} is "
                           f"sm_{major_minor[0]}{major_minor[1]}")
    kernel = api.load(SPEC, arch=ARCH, config=config, head_dim=head_dim, dtype=dtype, causal=causal)
    if not kernel.kernel.loaded_on(device):
        api.refuse_during_capture(f"load {kernel.source.name} on device {device}")
    return kernel


def _plan(q, k, v, causal: bool, softmax_scale: float, config) -> _Plan:
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    device = q.device.index
    dtype = ops._DTYPES[q.dtype]
    kernel = _kernel(head_dim, dtype, causal, device, config)
    env = kernel.spec.environment(kernel.variant, kernel.config)
    maps = None
    if seqlen_k:
        maps = tuple(tma.attention_map(t.shape, t.stride(), dtype, rows, env["swizzle"])
                     for t, rows in ((q, env["block_m"]), (k, env["block_n"]), (v, env["block_n"])))
    out_strides = (seqlen_q * heads * head_dim, heads * head_dim, head_dim)  # torch.empty's layout
    grid = kernel.grid({"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads": heads,
                        "heads_k": heads_k, "batch": batch})
    return _Plan(kernel, device, grid,
                 (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out_strides,
                  batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale),
                 maps, tuple(q.shape), (batch, heads, seqlen_q), q.dtype)


def flash_attn_forward_sm90(q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                            config=None):
    """Exact attention on the Hopper kernels; same contract as `flash_attn_func(..., return_lse=
    True)` without autograd: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
    heads_k, head_dim), causal aligned bottom-right. Returns (out like q, lse (batch, heads,
    seqlen_q) float32 in natural log; -inf and a zero output row where a query sees no key).
    `config`: a mapping of the spec's tune keys (block_m, block_n, stages, schedule) instead of
    the variant's default."""
    config = None if config is None else tuple(sorted(dict(config).items()))
    try:
        signature = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                     k.dtype, v.dtype, q.device, k.device, v.device, causal, softmax_scale, config)
        plan = _PLANS.get(signature)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scale: the checks say why
        signature = plan = None
    if plan is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        ops._check_inputs(q, k, v)
        causal, scale = bool(causal), ops._scale(q, softmax_scale)
        aligned = _aligned(q), _aligned(k), _aligned(v)
        plan = _plan(*aligned, causal, scale, None if config is None else dict(config))
        if signature is not None and all(a is b for a, b in zip(aligned, (q, k, v))):
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[signature] = plan
        q, k, v = aligned
    return _launch(plan, q, k, v)


def _launch(plan: _Plan, q, k, v):
    out = torch.empty(plan.out_shape, dtype=plan.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if plan.maps is None:
        maps = (_EMPTY_MAP,) * 3
    else:
        maps = tuple(tma.encode(m, t.data_ptr()) for m, t in zip(plan.maps, (q, k, v)))
    plan.kernel.launch((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                        *plan.scalars, *maps), plan.grid, plan.device,
                       api._current_stream(plan.device))
    return out, lse
