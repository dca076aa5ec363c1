"""The Hopper forward (flash_attn_fwd_sm90) with a spec's mods: the launch AttentionKernel makes on
compute capability 9.0.

A mods spec extends flash_attn_fwd; `load_spec(spec, onto="flash_attn_fwd_sm90")` puts the same
mods onto the Hopper kernel (its args, tune space, defaults and template; the mod args come after
the three tensor maps). This module plans and launches that kernel like ops does for the plain
forward: the config from tune.lookup (tuning DB, else the Hopper spec's defaults: shipped tuned
defaults are for the plain spec only), the tensor-map layouts and the grid (persistent configs
need the SM count) kept per call signature, the map addresses patched in per call.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kernelgen import api, hopper, ops, tune
from kernelgen.spec import KernelSpec, load_spec

BASE = hopper.SPEC  # "flash_attn_fwd_sm90"


def sm90_spec(spec: str | KernelSpec) -> KernelSpec:
    """The mods spec (a shipped name, a YAML path, or its KernelSpec) put onto the Hopper forward,
    named `<spec>__flash_attn_fwd_sm90`. A KernelSpec's is remembered: load_spec checks the files
    on disk each time (a path resolve and stats, ~70-200 us), which an AttentionKernel, holding
    one parsed spec for its life, has no use for on every call."""
    if not isinstance(spec, KernelSpec):
        return load_spec(spec, onto=BASE)
    key = (spec.path, spec.content_hash)
    onto = _ONTO.get(key)
    if onto is None:
        onto = _ONTO[key] = load_spec(spec.path, onto=BASE)
    return onto


_ONTO: dict[tuple, KernelSpec] = {}


@dataclass(frozen=True)
class _Plan:
    kernel: api.BoundKernel
    grid: tuple
    maps: tuple  # the Q, K, V map layouts (tma.TiledMap), or all-zero bytes when K/V are empty


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def forward_sm90(spec: str | KernelSpec, q, k, v, params: Mapping, softmax_scale: float,
                 mod_values: tuple, config: Mapping | None = None, block_mask=None):
    """Attention with `spec`'s mods on the Hopper kernels; returns (out, lse) like
    `flash_attn_func(..., return_lse=True)` without autograd.

    spec: a spec that extends flash_attn_fwd (an AttentionKernel's `spec`: a KernelSpec, a shipped
      name or a YAML path); its mods run on flash_attn_fwd_sm90. flash_attn_fwd itself is not
      one (SpecError): the plain forward is ops.flash_attn_forward(..., family="sm90").
    q (batch, seqlen_q, heads, head_dim), k, v (batch, seqlen_k, heads_k, head_dim): validated as
      AttentionKernel does (ops._check_inputs) on one sm_90 device; misaligned views are copied.
    params: the variant's compile-time params (AttentionKernel.params: head_dim, dtype, causal
      and any the spec adds); they must name a variant of the Hopper spec.
    softmax_scale: the scale itself (ops._scale resolves None).
    mod_values: the values of `spec.mods.args` in order, as AttentionKernel._mod_values makes them
      (a data pointer for a `ptr`, a float for `f32`, an int otherwise); a tensor is taken for a
      `ptr` too.
    config: the Hopper spec's tune keys (block_m, block_n, stages, schedule, persistent) instead
      of tune.lookup's answer.
    block_mask: for a spec with mods.block_sparse, the blockmask.BlockMask of this problem (its
      lists for the config's tile follow the mod values); None builds one (a classify launch).
    Rows that see no key give 0 and LSE -inf."""
    q, k, v = ops._aligned(q), ops._aligned(k), ops._aligned(v)
    onto = sm90_spec(spec)
    mod_args = onto.mods.args
    if len(mod_values) != len(mod_args):
        raise TypeError(f"{onto.name}: {len(mod_values)} mod values for the mod arguments "
                        f"{[a.name for a in mod_args]}")
    values = tuple(_value(onto, arg, x, q.device) for arg, x in zip(mod_args, mod_values))
    scalars = tuple((a.name, x) for a, x in zip(mod_args, values) if a.type != "ptr")
    signature = (onto.content_hash, tuple(sorted(params.items())), q.shape, k.shape, v.shape,
                 q.stride(), k.stride(), v.stride(), q.dtype, q.device,
                 None if config is None else tuple(sorted(config.items())), scalars)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _plan(onto, q, k, v, params, config, dict(scalars))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[signature] = plan
    if onto.mods.block_sparse:
        from kernelgen import blockmask

        batch, seqlen_q, heads, _ = q.shape
        if block_mask is None:
            block_mask = blockmask.create_block_mask(
                onto, params, batch, heads, seqlen_q, k.shape[1],
                dict(zip((a.name for a in mod_args), mod_values)), q.device)
        block_mask.check(onto, params.get("causal", False), batch, heads, seqlen_q, k.shape[1],
                         q.device)
        lists = block_mask.forward_args(plan.kernel.config.as_dict(), batch, heads)
        values += tuple(_value(onto, arg, x, q.device) for arg, x in zip(onto.mods.block_args, lists))
    elif block_mask is not None:
        raise TypeError(f"{onto.name} takes no block_mask: its spec has no mods.block_sparse")
    return _launch(plan, q, k, v, softmax_scale, values)


def _value(onto: KernelSpec, arg, value, device):
    if not isinstance(value, torch.Tensor):
        return value
    if arg.type != "ptr" or value.device != device or not value.is_contiguous():
        raise ValueError(f"{onto.name}: a tensor for {arg.name} ({arg.type}) must be a contiguous "
                         f"tensor on {device} for a ptr argument")
    return value.data_ptr()


def _plan(onto: KernelSpec, q, k, v, params: Mapping, config: Mapping | None,
          scalars: dict) -> _Plan:
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    device = q.device.index
    ops.forward_family(device, "sm90")  # a clear error off compute capability 9.0
    variant = onto.variant(arch=ops._SM90_ARCH, **params)
    if config is not None:
        chosen = onto.parse_config(dict(config))
    else:
        chosen = tune.lookup(onto, variant, tune.Problem(batch, heads, heads_k, seqlen_q, seqlen_k),
                             device)
    kernel = api.load(onto, arch=variant.arch, config=chosen.as_dict(), **variant.as_dict())
    if not kernel.kernel.loaded_on(device):
        api.refuse_during_capture(f"load {kernel.source.name} on device {device}")
    grid = kernel.grid({"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads": heads,
                        "heads_k": heads_k, "batch": batch, "sm_count": api.sm_count(device),
                        **scalars})
    return _Plan(kernel, grid, hopper.tensor_maps(kernel, q, k, v))


def _launch(plan: _Plan, q, k, v, softmax_scale: float, mod_values: tuple):
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    maps = hopper.encode_maps(plan.maps, q, k, v, out)
    device = q.device.index
    stream = api._current_stream(device)
    counter, alive = hopper.counter_address(plan.kernel, q, stream)  # alive: past the launch
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            batch, heads, k.shape[2], seqlen_q, k.shape[1], float(softmax_scale),
            *maps, counter, *mod_values)
    plan.kernel.launch(args, plan.grid, device, stream)
    return out, lse
