"""The attention API on top of the generated kernels: `flash_attn_func`.

Validates everything before anything launches (errors name the argument), picks the variant for
the input, and launches on torch's current stream without host synchronization.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral

import torch

from kernelgen import api, tune
from kernelgen.spec import load_spec

FWD_SPEC = "flash_attn_fwd"
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _check_inputs(q, k, v):
    # Structure first (testable anywhere), then the GPU, then devices.
    _check_structure(q, k, v)
    if not _gpu_available():
        raise RuntimeError("kernelgen.flash_attn_func needs a CUDA GPU; none is available here")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _check_structure(q, k, v):
    """Types, ranks, dtypes, shapes, strides: everything a fake tensor can answer too."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: all inputs need one dtype")
    batch, _, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"head_dim differs: q {head_dim}, k {k.shape[3]}, v {v.shape[3]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v need the same seqlen, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need the same number of heads, got {k.shape[2]} and {v.shape[2]}")
    heads_k = k.shape[2]
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({heads_k})")
    allowed = _head_dims()
    if head_dim not in allowed:
        raise ValueError(f"head_dim {head_dim} is not supported; the {FWD_SPEC} spec allows {list(allowed)}")


_GPU = False


def _gpu_available() -> bool:
    global _GPU  # once true, stays true: torch.cuda.is_available() costs microseconds per call
    _GPU = _GPU or torch.cuda.is_available()
    return _GPU


_HEAD_DIMS: tuple | None = None


def _head_dims() -> tuple:
    global _HEAD_DIMS  # read once per process: a stat of the spec file per call costs microseconds
    if _HEAD_DIMS is None:
        _HEAD_DIMS = next(p.values for p in load_spec(FWD_SPEC).params if p.name == "head_dim")
    return _HEAD_DIMS


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """cp.async moves 16-byte chunks: base address and row strides must be 16-byte aligned."""
    s_b, s_s, s_h, _ = t.stride()
    if (t.data_ptr() | s_b * 2 | s_s * 2 | s_h * 2) % 16 == 0:
        return t
    # A copy into fresh storage: .contiguous() would return a contiguous view that starts
    # misaligned (e.g. x.view(-1)[4:].view(...)) unchanged.
    return t.clone(memory_format=torch.contiguous_format)


# ---- the two forward families ------------------------------------------------------------------
# sm80: the mma.sync kernels (spec flash_attn_fwd), for every GPU from sm_80 on. sm90: the Hopper
# kernels (flash_attn_fwd_sm90: TMA, wgmma, warp specialization), chosen on compute capability 9.0
# where they run about twice as fast. KERNELGEN_FORWARD=sm80|sm90 (read at import) forces one.
FAMILIES = {"sm80": FWD_SPEC, "sm90": "flash_attn_fwd_sm90"}
FORCED_FAMILY = os.environ.get("KERNELGEN_FORWARD") or None
_SM90_ARCH = "sm_90a"


_FAMILY_OF_DEVICE: dict[int, str] = {}


def forward_family(device: int, family: str | None = None) -> str:
    """The family a forward on `device` runs: `family`, else $KERNELGEN_FORWARD, else by GPU."""
    family = family or FORCED_FAMILY
    if family is None:
        found = _FAMILY_OF_DEVICE.get(device)
        if found is None:   # a device's capability does not change: ask torch once
            found = _FAMILY_OF_DEVICE[device] = (
                "sm90" if torch.cuda.get_device_capability(device) == (9, 0) else "sm80")
        return found
    if family not in FAMILIES:
        raise ValueError(f"forward family must be one of {sorted(FAMILIES)} (family= or "
                         f"KERNELGEN_FORWARD), got {family!r}")
    if family == "sm90" and torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"the sm90 forward family needs an sm_90 GPU (H100/H200); device "
                           f"{device} is sm_{major}{minor}")
    return family


_KERNELS: dict[tuple, api.BoundKernel] = {}


def _forward_kernel(head_dim: int, dtype: str, causal: bool, device: int, problem,
                    family: str = "sm80", config: dict | None = None) -> api.BoundKernel:
    """The forward kernel for a problem: its config is `config`, else the tuner's lookup
    (in-process memo, tuning DB, shipped tuned defaults, then the spec's heuristic default)."""
    spec = load_spec(FAMILIES[family])
    arch = _SM90_ARCH if family == "sm90" else api.pick_arch(spec, device)
    variant = spec.variant(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal)
    config = spec.parse_config(config) if config is not None else tune.lookup(spec, variant,
                                                                               problem, device)
    key = (variant, config, device)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = api.load(spec, arch=variant.arch, config=config.as_dict(),
                                          **variant.as_dict())
    if not kernel.kernel.loaded_on(device):
        api.refuse_during_capture(f"load {kernel.source.name} on device {device}")
    return kernel


@dataclass(frozen=True)
class _Plan:
    """Everything about a call that depends only on shapes, strides, dtypes and devices."""
    kernel: api.BoundKernel
    device: int
    grid: tuple
    scalars: tuple  # the kernel's arguments after the five pointers
    maps: tuple     # sm90: the Q, K, V, O tensor-map layouts (tma.TiledMap, or bytes for none)
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _plan(q, k, v, causal: bool, softmax_scale: float, family: str | None = None,
          config: dict | None = None) -> _Plan:
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    device = q.device.index
    family = forward_family(device, family)
    kernel = _forward_kernel(head_dim, _DTYPES[q.dtype], causal, device,
                             tune.Problem(batch, heads, heads_k, seqlen_q, seqlen_k), family, config)
    maps = ()
    if family == "sm90":
        from kernelgen import hopper

        maps = hopper.tensor_maps(kernel, q, k, v)
    out_strides = (seqlen_q * heads * head_dim, heads * head_dim, head_dim)  # torch.empty's layout
    grid = kernel.grid({"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads": heads,
                        "heads_k": heads_k, "batch": batch, "sm_count": api.sm_count(device)})
    return _Plan(kernel, device, grid,
                 (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out_strides,
                  batch, heads, heads_k, seqlen_q, seqlen_k, softmax_scale),
                 maps, tuple(q.shape), (batch, heads, seqlen_q), q.dtype)


def flash_attn_forward(q, k, v, causal: bool, softmax_scale: float, family: str | None = None,
                       config: dict | None = None):
    """Launch the forward kernel on validated inputs; returns (out, lse). `family` ("sm80" or
    "sm90") and `config` (the family's tune keys) override the automatic choices."""
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    return _launch(_plan(q, k, v, causal, softmax_scale, family, config), q, k, v)


def _launch(plan: _Plan, q, k, v):
    out = torch.empty(plan.out_shape, dtype=plan.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    stream = api._current_stream(plan.device)
    args, counter = _arguments(plan, q, k, v, out, lse, stream)  # counter: alive past the launch
    plan.kernel.launch(args, plan.grid, plan.device, stream)
    return out, lse


def _arguments(plan: _Plan, q, k, v, out, lse, stream: int) -> tuple:
    """(the kernel's arguments in order, a tensor to keep alive until the launch or None: the
    dynamic schedule's counter while a graph is captured)."""
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), *plan.scalars)
    counter = None
    if plan.maps:
        from kernelgen import hopper

        address, counter = hopper.counter_address(plan.kernel, q, stream)
        args += (*hopper.encode_maps(plan.maps, q, k, v, out), address)
    return args, counter


def _scale(q, softmax_scale) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if not (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return float(softmax_scale)


def flash_attn_func(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                    return_lse: bool = False, deterministic: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None):
    """Exact attention, FlashAttention layout: q (batch, seqlen_q, heads, head_dim), k and v
    (batch, seqlen_k, heads_k, head_dim) with heads_k dividing heads (GQA/MQA). Causal masks are
    aligned bottom-right. Returns out (like q) and, with return_lse, lse (batch, heads, seqlen_q)
    in float32 (natural log). Differentiable in q, k, v (through `out`); `deterministic=True`
    makes the backward bitwise reproducible. Traceable by torch.compile (a torch.library op).
    Modifiers (differentiable too): window_size=(left, right) sliding window (-1: unbounded
    side), softcap=c (c * tanh(s / c) on the scaled scores), alibi_slopes (float32, (heads,) or
    (batch, heads)): one at a time."""
    if not (type(window_size) is tuple and window_size == (-1, -1)):  # the default: no checks
        window_size = window_bounds(window_size)                     # on the hot path (~1 us)
    if window_size != (-1, -1) or softcap or alibi_slopes is not None:
        from kernelgen.attention import builtin_forward

        return builtin_forward(q, k, v, causal, softmax_scale, return_lse, window_size, softcap,
                               alibi_slopes, deterministic=bool(deterministic))
    needs_op = torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor) and (q.requires_grad or k.requires_grad or v.requires_grad))
    if needs_op:
        from kernelgen import library  # noqa: F401  (registers torch.ops.kernelgen)

        _check_structure(q, k, v)
        out, lse = torch.ops.kernelgen.flash_attn_fwd(q, k, v, bool(causal), _scale(q, softmax_scale),
                                                      bool(deterministic))
        return (out, lse) if return_lse else out
    out, lse = checked_forward(q, k, v, causal, softmax_scale)
    return (out, lse) if return_lse else out


def window_bounds(window_size) -> tuple[int, int]:
    """(left, right) of a window_size=(left, right) (flash_attn_func's, flash_attn_varlen_func's):
    ints, -1 for an unbounded side. A TypeError or ValueError names the side."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError("window_size must be a pair (left, right) of ints, "
                        f"got {window_size!r}") from None
    if type(left) is int and type(right) is int and left >= -1 and right >= -1:
        return left, right   # the common case, without the abc checks below (~1 us each)
    for side, bound in (("left", left), ("right", right)):
        if isinstance(bound, bool) or not isinstance(bound, Integral):
            raise TypeError(f"window_size {side} must be an int (-1: unbounded), got {bound!r}")
        if bound < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1: unbounded), got {bound!r}")
    return int(left), int(right)


def checked_forward(q, k, v, causal, softmax_scale):
    """Validate, plan and launch the forward; (out, lse). The path of every call outside
    torch.compile (flash_attn_func, and the library op autograd runs). A call whose shapes,
    strides, dtypes and devices were validated before reuses that plan: only the pointers
    (alignment) are checked again."""
    try:
        signature = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                     k.dtype, v.dtype, q.device, k.device, v.device, causal, softmax_scale)
        plan = _PLANS.get(signature)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scale: the full checks say why
        signature = plan = None
    if plan is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0:
        return _launch(plan, q, k, v)
    _check_inputs(q, k, v)
    causal, scale = bool(causal), _scale(q, softmax_scale)
    aligned = _aligned(q), _aligned(k), _aligned(v)
    plan = _plan(*aligned, causal, scale)
    if signature is not None and all(a is b for a, b in zip(aligned, (q, k, v))):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[signature] = plan
    return _launch(plan, *aligned)
