"""The attention backward on top of the generated kernels: `flash_attn_backward`.

Launches on torch's current stream, without host synchronization:
  1. flash_attn_bwd_prep: D = rowsum(dO * O) in fp32, and zeroing of the fp32 dQ accumulator;
  2. flash_attn_bwd: dK and dV per KV tile (the query heads of a GQA group summed in registers),
     and dQ * scale added into the accumulator with fp32 atomics; dQ is the accumulator cast to
     the input dtype. On compute capability 9.0 (head dims 64, 96, 128; not deterministic)
     flash_attn_bwd_sm90 does the same with wgmma, adding dQ by TMA reduce-adds
     (backward_sm90, with or without mods; KERNELGEN_BACKWARD=sm80 keeps flash_attn_bwd).
With deterministic=True, step 2 runs without atomics and flash_attn_bwd_dq computes dQ per query
tile (recomputing P and dP), so that the gradients are bitwise identical from run to run.
The main kernel's config comes from the tuner (tune.lookup per problem: `kernelgen tune
flash_attn_bwd ...` measures it, measure_bwd.py is its workload); prep and dQ take their defaults.

With `mods` (ModArgs: a spec with mods, as kernelgen.load runs it) the main and dQ kernels are
that spec put onto flash_attn_bwd (or flash_attn_bwd_sm90) and flash_attn_bwd_dq
(load_spec(onto=)), its mod arguments appended to theirs (after the Hopper kernel's tensor maps); a score_mod without a score_mod_grad has no backward (NotImplementedError).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelgen import api, backward_sm90, ops, tune
from kernelgen.spec import KernelSpec, load_spec

PREP_SPEC, MAIN_SPEC, DQ_SPEC = "flash_attn_bwd_prep", "flash_attn_bwd", "flash_attn_bwd_dq"


@dataclass(frozen=True)
class _Kernels:
    prep: api.BoundKernel
    main: api.BoundKernel
    dq: api.BoundKernel | None  # the deterministic path only


@dataclass(frozen=True)
class ModArgs:
    """The mods of a spec that extends flash_attn_fwd, for its backward: the spec, the params of
    the variant that ran the forward, and the mod arguments' values in the order of
    spec.mods.args (tensors, or numbers for scalars); block_mask: the forward's
    blockmask.BlockMask for a spec with mods.block_sparse (None: one is built here)."""
    spec: KernelSpec
    params: tuple[tuple[str, object], ...]
    values: tuple
    block_mask: object = None


def check_differentiable(spec: KernelSpec) -> None:
    """A score_mod needs its derivative for the backward; masks need none."""
    if spec.mods.score_mod is not None and spec.mods.score_mod_grad is None:
        raise NotImplementedError(
            f"{spec.name} ({spec.path}) is forward-only: its mods.score_mod has no "
            "mods.score_mod_grad (d score_mod / d score), so there is no gradient; add one to "
            "the spec, or call it under torch.no_grad() or on tensors that do not require grad")


def _backward_spec(name: str, mods: ModArgs | None) -> KernelSpec:
    if mods is None:
        return load_spec(name)
    check_differentiable(mods.spec)
    # A spec's mods on a block mask (load_spec's block_mask=) stay on it.
    return load_spec(mods.spec.path, onto=name, block_mask=mods.spec.mods.block_sparse)


# Per (variant, device, deterministic, problem): a repeated call is one dict lookup, as ops' plans.
# Like those, an entry keeps the config it was made with when a later tune() in this process
# finds a better one; tune.clear_memo() and a new process see it.
_KERNELS: dict[tuple, _Kernels] = {}
_MAX_KERNELS = 4096


def _load(spec: KernelSpec | str, device: int, config=None, **params) -> api.BoundKernel:
    spec = load_spec(spec) if isinstance(spec, str) else spec
    return api.load(spec, arch=api.pick_arch(spec, device), config=config, **params)


def prep_kernel(device: int, dtype: str) -> api.BoundKernel:
    """The prep kernel (D = rowsum(dO * O), dQ accumulator zeroed) for this GPU: its own arch,
    which is not the main kernel's (the Hopper main kernel is sm_90a, the prep plain sm_90)."""
    return _load(PREP_SPEC, device, dtype=dtype)


def _main_config(device: int, problem: tune.Problem, spec: KernelSpec | None = None, **params):
    """The main kernel's config: the tuner's lookup (memo, tuning DB, shipped tuned defaults, then
    the spec's heuristic). The deterministic path takes the same one, tuned with dQ atomics: its
    main kernel does that work minus the dQ product."""
    spec = load_spec(MAIN_SPEC) if spec is None else spec
    variant = spec.variant(arch=api.pick_arch(spec, device), **params)
    return tune.lookup(spec, variant, problem, device).as_dict()


def main_spec_name(head_dim: int, device: int, deterministic: bool, seqlen_k: int,
                   mods: KernelSpec | None = None, params: dict | None = None) -> str:
    """The base of the main kernel a backward runs (what AttentionKernel.tune tunes too): on
    compute capability 9.0, with atomics allowed (and more than SHORT_SEQLEN_K keys), the
    Hopper kernel (backward_sm90.applies), else flash_attn_bwd."""
    return (backward_sm90.SPEC if backward_sm90.applies(head_dim, device, deterministic,
                                                        seqlen_k, mods, params) else MAIN_SPEC)


def _kernels(head_dim: int, dtype: str, causal: bool, device: int, deterministic: bool,
             sizes: tuple[int, int, int, int, int], mods: ModArgs | None = None) -> _Kernels:
    """sizes: (batch, heads, heads_k, seqlen_q, seqlen_k), a tune.Problem's fields; a plain tuple
    so that a hit builds no dataclass. With mods, its params (those of the forward's variant)
    choose the main and dQ variants."""
    key = (head_dim, dtype, causal, device, deterministic, sizes)
    if mods is not None:
        key += (mods.spec.path, mods.spec.content_hash, mods.params)
    kernels = _KERNELS.get(key)
    if kernels is None:
        variant = dict(head_dim=head_dim, dtype=dtype, causal=causal)
        if mods is not None:
            variant = dict(mods.params)
        main_name = main_spec_name(head_dim, device, deterministic, sizes[4],
                                   None if mods is None else mods.spec, variant)
        main, dq = _backward_spec(main_name, mods), _backward_spec(DQ_SPEC, mods)
        problem = tune.Problem(*sizes)
        kernels = _Kernels(prep_kernel(device, dtype),
                           _load(main, device, _main_config(device, problem, main, **variant), **variant),
                           _load(dq, device, **variant) if deterministic else None)
        if len(_KERNELS) >= _MAX_KERNELS:
            _KERNELS.clear()
        _KERNELS[key] = kernels
    for kernel in (kernels.prep, kernels.main, kernels.dq):
        if kernel is not None and not kernel.kernel.loaded_on(device):
            api.refuse_during_capture(f"load {kernel.source.name} on device {device}")
    return kernels


def _check_dout(dout, out) -> None:
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout must be a torch.Tensor, got {type(dout).__name__}")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if dout.shape != out.shape:
        raise ValueError(f"dout must have the shape of out {tuple(out.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != out.dtype:
        raise TypeError(f"dout must have the dtype of out ({out.dtype}), got {dout.dtype}")
    if dout.device != out.device:
        raise ValueError(f"dout is on {dout.device} but out is on {out.device}")


def _check_saved(q, k, v, out, lse) -> None:
    """What the forward saved: structure first (testable anywhere), then the GPU and devices."""
    ops._check_structure(q, k, v)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    batch, seqlen_q, heads, _ = q.shape
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.shape != (batch, heads, seqlen_q):
        shown = f"{tuple(lse.shape)}, {lse.dtype}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse must be float32 of shape {(batch, heads, seqlen_q)}, got {shown}")
    if not ops._gpu_available():
        raise RuntimeError("kernelgen.flash_attn_backward needs a CUDA GPU; none is available here")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride()[:3]


def flash_attn_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float,
                        deterministic: bool = False, mods: ModArgs | None = None):
    """Gradients of flash_attn_func's `out` with respect to q, k and v: (dq, dk, dv), dq like q,
    dk and dv like k and v (contiguous, input dtype). `out` and `lse` are the forward's outputs;
    dout must match out (any strides: a last dim that is not contiguous is copied). `mods`: the
    forward was that spec's kernel (kernelgen.load); its mod arguments get no gradient."""
    if mods is not None:
        check_differentiable(mods.spec)
    _check_dout(dout, out)
    _check_saved(q, k, v, out, lse)
    return _backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, mods)


def saved_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float,
                   deterministic: bool = False, mods: ModArgs | None = None):
    """flash_attn_backward on what a kernelgen forward saved for autograd: q, k, v, out and lse
    were checked when that forward ran (and the spec's differentiability before it), so only
    dout, the caller's, is checked here; ~10 us of host time a call less (PERF_NOTES §119)."""
    _check_dout(dout, out)
    return _backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, mods)


def _backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, deterministic: bool,
              mods: ModArgs | None):
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:
        dout = dout.contiguous()
    q, k, v, out, dout = (ops._aligned(t) for t in (q, k, v, out, dout))
    device = q.device.index
    batch, seqlen_q, heads, head_dim = q.shape
    kernels = _kernels(head_dim, ops._DTYPES[q.dtype], bool(causal), device, bool(deterministic),
                       (batch, heads, k.shape[2], seqlen_q, k.shape[1]), mods)
    mod_args, dq_mod_args = _mod_arguments(mods, kernels, q, k)
    return _run(kernels, _launcher(device), dout, q, k, v, out, lse.contiguous(), float(softmax_scale),
                mod_args=mod_args, dq_mod_args=dq_mod_args)


def _mod_arguments(mods: ModArgs | None, kernels: _Kernels, q, k) -> tuple[tuple, tuple | None]:
    """The main and dQ kernels' mod arguments: the values, then for a block-sparse spec the
    block mask's lists for each kernel's tile (the main kernel's transposed, per KV block)."""
    if mods is None:
        return (), None
    if not mods.spec.mods.block_sparse:
        return mods.values, None
    from kernelgen import blockmask

    batch, seqlen_q, heads, _ = q.shape
    params = dict(mods.params)
    mask = mods.block_mask
    if mask is None:
        mask = blockmask.create_block_mask(
            mods.spec, params, batch, heads, seqlen_q, k.shape[1],
            dict(zip((a.name for a in mods.spec.mods.args), mods.values)), q.device)
    mask.check(mods.spec, params.get("causal", False), batch, heads, seqlen_q, k.shape[1], q.device)
    main = mods.values + main_block_args(mask, kernels.main, q, k)
    dq = None if kernels.dq is None else mods.values + mask.kernel_args(
        kernels.dq.config["block_m"], kernels.dq.config["block_n"])
    return main, dq


def main_block_args(mask, kernel, q, k) -> tuple:
    """A block mask's arguments for the main kernel `kernel`: its tile's transposed lists and,
    for the Hopper kernel's full-attention grid, its KV tiles' launch order (shortest last,
    BlockMask.tile_order; the sm80 kernel and causal grids keep their own)."""
    ordered = backward_sm90.is_sm90(kernel) and not kernel.variant["causal"]
    return mask.kernel_args(kernel.config["block_m"], kernel.config["block_n"], transposed=True,
                            order=(q.shape[0], q.shape[2], k.shape[2]) if ordered else None)


def _launcher(device: int):
    """launch(kernel, args, sizes) on torch's current stream; args hold tensors, None for null,
    and (layout, tensor) pairs for tensor maps (backward_sm90.tensor_maps)."""
    stream = api._current_stream(device)
    tensor, encode = torch.Tensor, backward_sm90.encode

    def value(a):
        if isinstance(a, tensor):
            return a.data_ptr()
        return 0 if a is None else encode(a) if isinstance(a, tuple) else a

    def launch(kernel: api.BoundKernel, args: tuple, sizes: dict) -> None:
        # Numbers pass as they are (most of a launch's ~60 arguments): one type test each.
        values = tuple(a if type(a) is int or type(a) is float else value(a) for a in args)
        kernel.launch(values, kernel.grid(sizes), device, stream)

    return launch


@dataclass(frozen=True)
class _Buffers:
    """What one backward writes: D, the fp32 dQ accumulator (None on the deterministic path), and
    the gradients. The tuner passes its own, to poison them before a candidate runs."""
    dsum: torch.Tensor
    dq_accum: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def _buffers(q, k, deterministic: bool) -> _Buffers:
    batch, seqlen_q, heads, _ = q.shape
    return _Buffers(
        torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device),
        None if deterministic else torch.empty(q.shape, dtype=torch.float32, device=q.device),
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device))


def _run(kernels: _Kernels, launch, dout, q, k, v, out, lse, scale: float,
         buffers: _Buffers | None = None, mod_args: tuple = (), dq_mod_args: tuple | None = None):
    """The launches, with tensors (None for a null pointer) in each kernel's argument order, the
    main and dQ kernels' ending with `mod_args` (a spec's mods, after the Hopper main kernel's
    tensor maps; the dQ kernel's with `dq_mod_args` when given: a block mask's lists differ per
    tile); returns (dq, dk, dv), the tensors of `buffers` when given."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    sizes = {"batch": batch, "heads": heads, "heads_k": heads_k, "seqlen_q": seqlen_q,
             "seqlen_k": seqlen_k, "head_dim": head_dim}
    b = _buffers(q, k, kernels.dq is not None) if buffers is None else buffers
    launch(kernels.prep, (out, dout, b.dsum, b.dq_accum, *_strides(out), *_strides(dout),
                          batch, heads, seqlen_q, head_dim), sizes)
    main_args = (q, k, v, dout, lse, b.dsum, b.dq_accum, b.dk, b.dv,
                 *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
                 *_strides(b.dk), *_strides(b.dv),
                 batch, heads, heads_k, seqlen_q, seqlen_k, scale)
    if backward_sm90.is_sm90(kernels.main):  # + its tensor maps, before the mod arguments
        main_args += backward_sm90.tensor_maps(kernels.main, q, k, v, dout, b.dq_accum)
    launch(kernels.main, main_args + tuple(mod_args), sizes)
    if b.dq_accum is not None:  # already scaled by the kernel
        b.dq.copy_(b.dq_accum)
    else:
        launch(kernels.dq, (q, k, v, dout, lse, b.dsum, b.dq,
                            *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
                            *_strides(b.dq), batch, heads, heads_k, seqlen_q, seqlen_k, scale,
                            *(mod_args if dq_mod_args is None else dq_mod_args)), sizes)
    return b.dq, b.dk, b.dv
