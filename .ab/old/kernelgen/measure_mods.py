"""The GPU side of tuning a spec with mods (score_mod, mask_mod: docs/writing-specs.md), forward
(the spec itself on the mma.sync family, or put onto flash_attn_fwd_sm90) and backward (put onto
flash_attn_bwd or flash_attn_bwd_sm90, the main kernels a gradient runs).

A mods spec has runtime arguments of its own (a cap, per-head slopes, document ids), and what they
are changes what a config does (a document mask skips tiles), so tuning takes their values from
the caller: `kernelgen.tune(spec, problem, mod_values={...})`, or AttentionKernel.tune with the
tensors it will run on. The sizes are the problem's; q, k, v and dO are fresh random tensors.

The check has no float32 reference to compare with (the mods are C expressions), so a candidate is
compared with the spec's default config on the same inputs, which the GPU tests hold to a float32
reference applying the same modification (tests/test_mods*_gpu.py). Two configs differ only in
their order of accumulation; each obeys FlashAttention's rule (error <= 2 e_pt + allowance, e_pt
the error of PyTorch's computation in the input dtype), so they differ by at most twice that
bound, which is the bound here, with e_pt measured on the plain attention of the same inputs (the
mods change which scores count, not the size of the rounding). Every element must be finite: an
element a candidate never writes stays NaN.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kernelgen import api, backward, measure, measure_bwd
from kernelgen.search import Check
from kernelgen.spec import KernelSpec, load_spec
from kernelgen.tune import Problem, TuneError

# The bases a mods spec's forward runs on (the Hopper one adds its tensor maps).
_FORWARD_ARGS = tuple(tuple(sorted(a.name for a in load_spec(name).args))
                      for name in ("flash_attn_fwd", "flash_attn_fwd_sm90"))
# The backward main kernel's: flash_attn_bwd's, or the Hopper one's (the same plus four tensor
# maps, which backward._run appends before the mod arguments).
_BACKWARD_ARGS = tuple(a.name for a in load_spec(backward.MAIN_SPEC).args)
_BACKWARD_BASES = (_BACKWARD_ARGS, _BACKWARD_ARGS + measure_bwd._SM90_MAPS)
_PARAMS = {"head_dim", "dtype", "causal"}


def has_mods(spec: KernelSpec) -> bool:
    return bool(spec.mods.any or spec.mods.args)


def feeds(spec: KernelSpec) -> str | None:
    """'forward' or 'backward' for a mods spec this module makes inputs for, else None."""
    if not has_mods(spec) or not _PARAMS <= {p.name for p in spec.params}:
        return None
    names = tuple(a.name for a in spec.args)
    base = names[:len(names) - len(spec.mods.members)]   # mod args, then a block mask's lists
    if base in _BACKWARD_BASES:
        return "backward"
    if tuple(sorted(base)) in _FORWARD_ARGS:
        return "forward"
    return None


def mod_launch_values(spec: KernelSpec, given: Mapping | None, device: torch.device) -> tuple:
    """The mod arguments' launch values in the spec's order (data pointers for tensors), checked:
    a TuneError names what is missing or wrong."""
    names = [a.name for a in spec.mods.args]
    given = dict(given or {})
    missing = [n for n in names if n not in given]
    extra = [n for n in given if n not in names]
    if missing or extra:
        raise TuneError(f"tuning {spec.name} needs the values of its mod arguments {names} "
                        f"(missing {missing}, unexpected {extra}): pass mod_values={{...}} to "
                        "kernelgen.tune, call kernel.tune(q, k, v, **mod_args) on what it will "
                        "run, or give scalars with `kernelgen tune --arg NAME=VALUE`")
    values = []
    for arg in spec.mods.args:
        value = given[arg.name]
        if arg.type == "ptr":
            if not isinstance(value, torch.Tensor) or value.device != device or not value.is_contiguous():
                raise TuneError(f"{spec.name}: mod argument {arg.name} must be a contiguous tensor "
                                f"on {device}, got {_describe(value)}")
            values.append(value.data_ptr())
        elif isinstance(value, torch.Tensor) or isinstance(value, bool):
            raise TuneError(f"{spec.name}: mod argument {arg.name} ({arg.type}) must be a number, "
                            f"got {_describe(value)}")
        else:
            values.append(float(value) if arg.type == "f32" else int(value))
    return tuple(values)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {'contiguous' if value.is_contiguous() else 'strided'} tensor on {value.device}"
    return repr(value)


def _block_mask(spec: KernelSpec, variant, problem: Problem, mod_values: Mapping, device):
    """A block-sparse spec's BlockMask of these inputs (built once; each config's tile gets its
    lists from it), or None."""
    if not spec.mods.block_sparse:
        return None
    from kernelgen import blockmask

    return blockmask.create_block_mask(spec, variant.as_dict(), problem.batch, problem.heads,
                                       problem.seqlen_q, problem.seqlen_k, dict(mod_values), device)


def _pointers(values) -> tuple:
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)


def _finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class ForwardWorkload(measure.Workload):
    """measure.Workload's inputs plus the mod arguments; the reference is the default config."""

    def __init__(self, spec, variant, problem: Problem, device: int, seed: int = 0,
                 mod_values: Mapping | None = None):
        super().__init__(spec, variant, problem, device, seed)
        mods = mod_launch_values(spec, mod_values, self.q.device)
        self.values.update(zip((a.name for a in spec.mods.args), mods))
        self.block_args = spec.mods.block_args
        self.block_mask = _block_mask(spec, variant, problem, mod_values, self.q.device)
        default = api.load(spec, arch=variant.arch, config=spec.default_config(variant).as_dict(),
                           **variant.as_dict())
        self.out.fill_(float("nan"))
        self.launcher(default)()
        torch.cuda.synchronize(device)
        self.out_default, self.lse_default = self.out.clone(), self.lse.clone()
        if not _finite(self.out_default):
            raise TuneError(f"{spec.name}: the default config {spec.default_config(variant).slug} "
                            "leaves non-finite outputs on these inputs; nothing to compare with")

    def launcher(self, kernel: api.BoundKernel):
        if self.block_mask is not None:   # the lists at this config's tile
            lists = self.block_mask.forward_args(kernel.config.as_dict(), self.q.shape[0],
                                                 self.q.shape[2])
            self.values.update(zip((a.name for a in self.block_args), _pointers(lists)))
        return super().launcher(kernel)

    def _check_spec(self, spec, names) -> None:
        if feeds(spec) != "forward":
            raise TuneError(f"{spec.name}: not a forward spec with mods (measure_mods.py)")

    def _reference_slices(self) -> list:
        # The rounding scale for the bound (module docstring): plain attention on the last rows
        # of the first batch, which see every key (causal included).
        rows = min(measure.CHECK_ROWS, self.q.shape[1])
        q, k, v = self.q[:1, -rows:], self.k[:1], self.v[:1]
        ref, _ = measure.attention_ref(q, k, v, self.causal, self.scale, upcast=True)
        low, _ = measure.attention_ref(q, k, v, self.causal, self.scale, upcast=False)
        self.bound = 2 * (2 * measure.max_error(low, ref) + measure.rounding_allowance(ref))
        return []

    def check(self, launch) -> Check:
        self.out.fill_(float("nan"))
        self.lse.fill_(float("nan"))
        launch()
        if self.out.is_cuda:
            torch.cuda.synchronize(self.device)
        if not _finite(self.out):
            return Check(False, math.nan, self.bound, "out is not finite everywhere (NaN: an "
                                                      "element left unwritten)")
        error = measure.max_error(self.out, self.out_default)
        if not error <= self.bound:
            return Check(False, error, self.bound, f"max difference {error:.3g} from the default "
                                                   f"config > {self.bound:.3g}")
        finite = torch.isfinite(self.lse_default)
        if not torch.equal(torch.isfinite(self.lse), finite):
            return Check(False, error, self.bound, "LSE is not -inf exactly where the default "
                                                   "config's is")
        if finite.any():
            lse_error = (self.lse[finite] - self.lse_default[finite]).abs().max().item()
            if not lse_error <= 2 * measure._LSE_TOLERANCE:
                return Check(False, error, self.bound, f"LSE differs by {lse_error:.3g} from the "
                                                       "default config's")
        return Check(True, error, self.bound)


class BackwardWorkload(measure_bwd.Workload):
    """measure_bwd.Workload's inputs, with out and lse from the spec's forward and the mod
    arguments on the main kernel; the reference is the default config's gradients."""

    def __init__(self, spec, variant, problem: Problem, device: int, seed: int = 0,
                 mod_values: Mapping | None = None):
        super().__init__(spec, variant, problem, device, seed)
        from kernelgen.attention import AttentionKernel

        forward_spec = load_spec(spec.path)   # the mods spec this one was put onto the backward from
        params = {p.name: variant[p.name] for p in forward_spec.params if p.name in variant.as_dict()}
        self.mods = mod_launch_values(spec, mod_values, self.q.device)
        tensors = {a.name: mod_values[a.name] for a in spec.mods.args if a.type == "ptr"}
        forward_values = tuple(tensors.get(a.name, x) for a, x in zip(spec.mods.args, self.mods))
        self.block_mask = _block_mask(spec, variant, problem, mod_values, self.q.device)
        self.out, self.lse = AttentionKernel(forward_spec, **params).forward(
            self.q, self.k, self.v, self.scale, forward_values,
            *(() if self.block_mask is None else (self.block_mask,)))
        # The plain reference's bounds (measure_bwd) give the rounding scale; twice that is the
        # bound between two configs (module docstring).
        self.bounds = tuple(2 * max(s.bounds[i] for s in self.slices) for i in range(3))
        self.slices = []
        default = api.load(spec, arch=variant.arch, config=spec.default_config(variant).as_dict(),
                           **variant.as_dict())
        self._run_once(self.launcher(default))
        self.default_grads = tuple(g.clone() for g in (self.buffers.dq, self.buffers.dk,
                                                       self.buffers.dv))
        if not _finite(*self.default_grads):
            raise TuneError(f"{spec.name}: the default config {spec.default_config(variant).slug} "
                            "leaves non-finite gradients on these inputs; nothing to compare with")

    def _check_spec(self, spec) -> None:
        if feeds(spec) != "backward":
            raise TuneError(f"{spec.name}: not a backward spec with mods (measure_mods.py)")

    def launcher(self, kernel: api.BoundKernel):
        prep = backward.prep_kernel(self.device, kernel.variant["dtype"])
        kernels = backward._Kernels(prep, kernel, None)
        launch = backward._launcher(self.device)
        args = (self.dout, self.q, self.k, self.v, self.out, self.lse, self.scale)
        mods = self.mods
        if self.block_mask is not None:   # the transposed lists at this config's tile
            mods += _pointers(backward.main_block_args(self.block_mask, kernel, self.q, self.k))
        return lambda: backward._run(kernels, launch, *args, buffers=self.buffers, mod_args=mods)

    def _run_once(self, launch) -> None:
        b = self.buffers
        for t in (b.dsum, b.dq_accum, b.dq, b.dk, b.dv):
            t.fill_(float("nan"))
        launch()
        if b.dq.is_cuda:
            torch.cuda.synchronize(self.device)

    def check(self, launch) -> Check:
        self._run_once(launch)
        b = self.buffers
        worst, worst_bound = 0.0, 0.0
        for name, grad, default, bound in zip(("dq", "dk", "dv"), (b.dq, b.dk, b.dv),
                                              self.default_grads, self.bounds):
            if not _finite(grad):
                return Check(False, math.nan, bound, f"{name} is not finite everywhere (NaN: an "
                                                     "element left unwritten)")
            error = measure.max_error(grad, default)
            if not error <= bound:
                return Check(False, error, bound, f"{name} differs by {error:.3g} from the "
                                                  f"default config's (> {bound:.3g})")
            if error / max(bound, 1e-30) >= worst / max(worst_bound, 1e-30):
                worst, worst_bound = error, bound
        return Check(True, worst, worst_bound)


def measurers(spec: KernelSpec):
    """(workload class, candidate class) for a mods spec, or None if it is not one."""
    kind = feeds(spec)
    if kind is None:
        return None
    return (ForwardWorkload if kind == "forward" else BackwardWorkload), measure.AttentionCandidate
