"""The Hopper backward main kernel (spec flash_attn_bwd_sm90: TMA, mbarriers, wgmma) for
kernelgen.backward: when it applies, and the tensor maps its launch takes.

It computes what flash_attn_bwd's main kernel computes, with the same arguments plus five tensor
maps (Q and dO in boxes of block_m rows, K and V of block_n, the fp32 dQ accumulator in boxes of
block_m rows and one consumer's dq_n columns), so backward._run keeps the prep kernel and the dQ
cast around it. Only the non-deterministic path runs here (the kernel adds dQ with TMA
reduce-adds, in no fixed order). A spec's mods run here too (the spec put onto this one, `<spec>__flash_attn_bwd_sm90`,
its mod arguments after the tensor maps), unless the spec's `onto: {flash_attn_bwd_sm90: ...}`
section leaves the variant no config: its live values do not fit the consumers' 240 registers
there. KERNELGEN_BACKWARD=sm80 forces the mma.sync kernel everywhere (SHORT_SEQLEN_K, below, once
kept it for short sequences).
"""
from __future__ import annotations

import functools

from kernelgen import env, tma
from kernelgen.spec import KernelSpec, SpecError

SPEC = "flash_attn_bwd_sm90"
# Sequences of at most this many keys keep flash_attn_bwd. At seqlen 512 (H200, hd128 bf16, batch
# 32, 16 heads) this kernel once lost (causal 75 vs 134 TFLOP/s, full 202 vs 214, PERF_NOTES §15):
# its causal grid ran every pair's KV tile 0, then every tile 1, ..., so no resident CTAs shared
# a head's Q, dO or dQ in L2. With the grid in per-batch order (flash_bwd_sm90.cuh) it measured
# full 277 vs 217 and causal 145 vs 148 (PERF_NOTES §16): no sequence is short enough any more.
SHORT_SEQLEN_K = 0
_EMPTY_MAP = bytes(tma.MAP_BYTES)  # for empty Q or K/V
_DQ_SWIZZLE = 128  # bytes a row of the fp32 dQ buffers' panels


@functools.cache
def head_dims() -> tuple[int, ...]:
    """The spec's head_dim values (64, 96, 128)."""
    from kernelgen.spec import load_spec

    return next(p.values for p in load_spec(SPEC).params if p.name == "head_dim")


def main_spec(mods: KernelSpec | None = None) -> KernelSpec:
    """This spec, or a spec with mods put onto it."""
    from kernelgen.spec import load_spec

    if mods is None:
        return load_spec(SPEC)
    return load_spec(mods.path, onto=SPEC, block_mask=mods.mods.block_sparse)


def applies(head_dim: int, device: int, deterministic: bool, seqlen_k: int,
            mods: KernelSpec | None = None, params: dict | None = None) -> bool:
    """Whether backward runs this kernel as its main kernel on `device` (compute capability 9.0)
    for a problem of seqlen_k keys; `mods`: the spec with mods the forward ran, `params` its
    variant's (head_dim, dtype, causal, ...)."""
    if deterministic or head_dim not in head_dims() or seqlen_k <= SHORT_SEQLEN_K:
        return False
    if env.settings().backward == "sm80":
        return False
    # The arch api.load would compile this spec for (backward calls this once per problem, so
    # asking again is cheap): sm_90a on compute capability 9.0, none elsewhere.
    from kernelgen import api

    spec = main_spec(mods)
    try:
        arch = api.pick_arch(spec, device)
    except RuntimeError:  # no variant for this GPU
        return False
    if arch != "sm_90a":
        return False
    if mods is not None:
        try:  # the spec's onto section may leave this variant no config (registers)
            spec.default_config(spec.variant(arch=arch, **(params or {})))
        except SpecError:
            return False
    return True


def is_sm90(kernel) -> bool:
    """Whether a main kernel (an api.BoundKernel, or what stands in for one) is this spec's, or a
    spec with mods put onto it (`<spec>__flash_attn_bwd_sm90`)."""
    name = kernel.spec.name
    return name == SPEC or name.endswith("__" + SPEC)


# Map layouts per (variant, config, shapes, strides): a repeated training-step shape builds none.
_LAYOUTS: dict[tuple, tuple] = {}
_MAX_LAYOUTS = 4096


def tensor_maps(kernel, q, k, v, dout, dq_accum) -> tuple:
    """(tma.TiledMap, tensor) for Q, K, V, dO and dq_accum (fp32, shaped as q), in the kernel's
    argument order; all-zero maps when Q or K/V are empty. A pair is what the emulator takes;
    `encode` makes the launch's bytes."""
    tensors = (q, k, v, dout, dq_accum)
    key = (kernel.variant, kernel.config, *(t.shape for t in tensors),
           *(t.stride() for t in tensors))
    layouts = _LAYOUTS.get(key)
    if layouts is None:
        layouts = _layouts(kernel, tensors)
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layouts
    return tuple(zip(layouts, tensors))


def _layouts(kernel, tensors) -> tuple:
    q, k = tensors[0], tensors[1]
    if not q.numel() or not k.numel():  # no CTA loads anything (maybe not even a valid address)
        return (_EMPTY_MAP,) * 5
    config = kernel.config
    dtype = kernel.variant["dtype"]
    env = kernel.spec.environment(kernel.variant, config)
    rows = (config["block_m"], config["block_n"], config["block_n"], config["block_m"])
    maps = tuple(tma.attention_map(t.shape, t.stride(), dtype, r, env["swizzle"])
                 for t, r in zip(tensors, rows))
    if not env["dq_tma"]:  # dQ by atomics: the map is not read
        return maps + (_EMPTY_MAP,)
    dq = tensors[4]  # fp32 panels of 128 bytes a row (bwd_sm90_config.cuh kDqSwizzle, kDqPanel)
    panel = _DQ_SWIZZLE // tma.ELEMENT_BYTES["fp32"]
    return maps + (tma.attention_map(dq.shape, dq.stride(), "fp32", config["block_m"],
                                     _DQ_SWIZZLE, panels=env["dq_n"] // panel),)


def encode(pair) -> bytes:
    """A tensor_maps pair as the 128 bytes the kernel parameter takes (needs a driver)."""
    tiled, tensor = pair
    return tiled if isinstance(tiled, bytes) else tma.encode(tiled, tensor.data_ptr())
