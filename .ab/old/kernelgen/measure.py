"""The GPU side of tuning an attention spec: identity and limits of the device, the tuning inputs,
the correctness check against the reference, and CUDA-event timing of one config.

The check runs a candidate on the full tuning inputs (outputs poisoned with NaN first, so an
element it never writes fails) and compares slices of the output with the float32 reference by
FlashAttention's rule, max|out - ref| <= 2 max|out_pt - ref| + rounding allowance. Slices, because
the reference on a 16k x 16k problem would cost more than the tuning: the first and last query
rows of the first and last batch, all heads. Dropping query rows from the end (or keys beyond the
last visible one) keeps the bottom-right causal alignment, so each slice is a problem of its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernelgen
from kernelgen import api, launch
from kernelgen import compile as compiler
from kernelgen.bench import time_samples
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.search import Check, DeviceLimits, Timing
from kernelgen.tune import Problem, TuneError
from kernelgen.tunedb import Identity

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_POINTERS = ("q", "k", "v", "o", "lse")
_SCALARS = ("q_stride_b", "q_stride_s", "q_stride_h", "k_stride_b", "k_stride_s", "k_stride_h",
            "v_stride_b", "v_stride_s", "v_stride_h", "o_stride_b", "o_stride_s", "o_stride_h",
            "batch", "heads", "heads_k", "seqlen_q", "seqlen_k", "softmax_scale")
# The Hopper family reads Q, K, V through tensor maps, and writes O through one (TMA stores);
# then comes its dynamic schedule's tile counter.
_MAPS = ("tmap_q", "tmap_k", "tmap_v", "tmap_o")
_HOPPER = (*_MAPS, "tile_counter")
_PARAMS = ("head_dim", "dtype", "causal")
CHECK_ROWS = 128
_LSE_TOLERANCE = 2e-3


def gpu_identity(device: int) -> Identity:
    props = torch.cuda.get_device_properties(device)
    driver = launch._driver()
    version = launch._check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
    return Identity(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, driver=int(version),
                    nvrtc="%d.%d" % compiler.nvrtc_version(), kernelgen=kernelgen.__version__)


def device_limits(device: int) -> DeviceLimits:
    driver = launch._driver()
    handle = launch._check(driver, driver.cuDeviceGet(device), "cuDeviceGet")
    attribute = driver.CUdevice_attribute

    def read(name: str) -> int:
        return int(launch._check(driver, driver.cuDeviceGetAttribute(getattr(attribute, name), handle),
                                 f"cuDeviceGetAttribute({name})"))

    return DeviceLimits(max_smem=read("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
                        max_threads=min(1024, read("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK")))


@dataclass(frozen=True)
class _Slice:
    batch: int
    start: int           # first query row
    rows: int
    out_ref: torch.Tensor
    lse_ref: torch.Tensor
    bound: float


class Workload:
    """The inputs of one tuning problem, output buffers, and the reference on slices of them."""

    def __init__(self, spec, variant, problem: Problem, device: int | str, seed: int = 0):
        # device: a CUDA index; "cpu" serves the CPU tests of the check, with launchers of their own.
        names = tuple(a.name for a in spec.args)
        self._check_spec(spec, names)
        if min(problem.as_dict().values()) < 1 or problem.heads % problem.heads_k:
            raise TuneError(f"cannot tune for {problem}: every size must be at least 1 and heads a "
                            "multiple of heads_k")
        self.device, self.names, self.causal = device, names, bool(variant["causal"])
        dtype, head_dim = _DTYPES[variant["dtype"]], variant["head_dim"]
        place = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        generator = torch.Generator(device=place).manual_seed(seed)

        def randn(seqlen, heads):
            return torch.randn(problem.batch, seqlen, heads, head_dim, device=place, dtype=dtype,
                               generator=generator)

        self.q, self.k, self.v = (randn(problem.seqlen_q, problem.heads),
                                  randn(problem.seqlen_k, problem.heads_k),
                                  randn(problem.seqlen_k, problem.heads_k))
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(problem.batch, problem.heads, problem.seqlen_q, device=self.q.device,
                               dtype=torch.float32)
        self.scale = 1.0 / math.sqrt(head_dim)
        tensors = {"q": self.q, "k": self.k, "v": self.v, "o": self.out}
        self.values = {
            **{f"{name}_stride_{axis}": t.stride(i) for name, t in tensors.items()
               for i, axis in enumerate("bsh")},
            **problem.as_dict(), "softmax_scale": self.scale,
            **{name: t.data_ptr() for name, t in tensors.items()}, "lse": self.lse.data_ptr(),
        }
        self.slices = self._reference_slices()

    def _check_spec(self, spec, names: tuple[str, ...]) -> None:
        known = sorted(_POINTERS + _SCALARS)
        if (sorted(names) not in (known, sorted(known + list(_HOPPER)))
                or {p.name for p in spec.params} != set(_PARAMS)):
            raise TuneError(f"kernelgen tune makes inputs for attention specs with the args and "
                            f"params of flash_attn_fwd ({', '.join(_PARAMS)}; tensor maps "
                            f"{', '.join(_HOPPER)} optional); {spec.name} has "
                            f"args {list(names)} and params {[p.name for p in spec.params]}")

    def _reference_slices(self) -> list[_Slice]:
        batch, seqlen_q = self.q.shape[:2]
        seqlen_k = self.k.shape[1]
        rows = min(CHECK_ROWS, seqlen_q)
        slices = []
        for b in sorted({0, batch - 1}):
            slices.append(self._reference(b, seqlen_q - rows, rows, seqlen_k))
            if rows < seqlen_q:
                # Query i sees keys j <= i + seqlen_k - seqlen_q: the first rows need only that many.
                keys = rows + seqlen_k - seqlen_q if self.causal else seqlen_k
                if keys > 0:
                    slices.append(self._reference(b, 0, rows, min(keys, seqlen_k)))
        return slices

    def _reference(self, b: int, start: int, rows: int, keys: int) -> _Slice:
        q = self.q[b:b + 1, start:start + rows]
        k, v = self.k[b:b + 1, :keys], self.v[b:b + 1, :keys]
        out_ref, lse_ref = attention_ref(q, k, v, self.causal, self.scale, upcast=True)
        out_pt, _ = attention_ref(q, k, v, self.causal, self.scale, upcast=False)
        bound = 2 * max_error(out_pt, out_ref) + rounding_allowance(out_ref)
        return _Slice(b, start, rows, out_ref, lse_ref, bound)

    def launcher(self, kernel: api.BoundKernel):
        """fn() that launches `kernel` on these inputs, with everything but the call worked out."""
        values = {**self.values, **self._maps(kernel), "tile_counter": 0}
        values = [values[name] for name in self.names]
        # Every value a grid may read: the sizes, and a mods spec's scalars (measure_mods.py).
        grid = kernel.grid({**self.values,
                            "sm_count": api.sm_count(self.device) if self.q.is_cuda else 4})
        stream, device = api._current_stream(self.device), self.device
        if "tile_counter" not in self.names or kernel.config["persistent"] != 2:
            values = tuple(values)
            return lambda: kernel.launch(values, grid, device, stream)
        from kernelgen import hopper

        at = self.names.index("tile_counter")

        def launch_dynamic():
            # What the library's call does: fresh zero words of the stream's pooled counters.
            values[at] = hopper.counter_address(kernel, self.q, stream)[0]
            kernel.launch(tuple(values), grid, device, stream)

        return launch_dynamic

    def _maps(self, kernel: api.BoundKernel) -> dict:
        """The tensor maps of a Hopper-family config: their boxes follow its tile shape."""
        if _MAPS[0] not in self.names:
            return {}
        from kernelgen import hopper

        layouts = hopper.tensor_maps(kernel, self.q, self.k, self.v)  # O: like q, contiguous
        return dict(zip(_MAPS, hopper.encode_maps(layouts, self.q, self.k, self.v, self.out)))

    def check(self, launch) -> Check:
        self.out.fill_(float("nan"))
        self.lse.fill_(float("nan"))
        launch()
        if self.q.is_cuda:
            torch.cuda.synchronize(self.device)
        worst, worst_bound = 0.0, 0.0
        for s in self.slices:
            out = self.out[s.batch:s.batch + 1, s.start:s.start + s.rows]
            lse = self.lse[s.batch:s.batch + 1, :, s.start:s.start + s.rows]
            where = f"batch {s.batch}, rows {s.start}..{s.start + s.rows - 1}"
            error = max_error(out, s.out_ref)
            if not error <= s.bound:   # NaN (an unwritten element) fails too
                return Check(False, error, s.bound, f"max error {error:.3g} > {s.bound:.3g} at {where}")
            problem = _lse_problem(lse, s.lse_ref)
            if problem:
                return Check(False, error, s.bound, f"{problem} at {where}")
            if error / max(s.bound, 1e-30) >= worst / max(worst_bound, 1e-30):
                worst, worst_bound = error, s.bound
        return Check(True, worst, worst_bound)


def _lse_problem(lse: torch.Tensor, lse_ref: torch.Tensor) -> str:
    finite = torch.isfinite(lse_ref)
    if not torch.equal(torch.isfinite(lse), finite):
        return "LSE is not -inf exactly where no key is visible (or is NaN)"
    if finite.any():
        error = (lse[finite] - lse_ref[finite]).abs().max().item()
        if not error <= _LSE_TOLERANCE:
            return f"LSE error {error:.3g} > {_LSE_TOLERANCE}"
    return ""


class AttentionCandidate:
    """One config on the workload: what the search loop checks and times."""

    def __init__(self, workload: Workload, spec, variant, config, rep_ms: float):
        self.workload, self.spec, self.variant, self.config = workload, spec, variant, config
        self.rep_ms = rep_ms
        self.launch = None

    def check(self) -> Check:
        # The compile pool has built this config already: this load is a memory hit.
        kernel = api.load(self.spec, arch=self.variant.arch, config=self.config.as_dict(),
                          **self.variant.as_dict())
        self.launch = self.workload.launcher(kernel)
        return self.workload.check(self.launch)

    def run(self) -> Timing:
        return Timing.of(time_samples(self.launch, rep_ms=self.rep_ms))

    def screen(self) -> Timing:
        # One round of a tenth of run()'s: ranks configs to about a percent (search.search).
        return Timing.of(time_samples(self.launch, warmup_ms=2.0, rep_ms=self.rep_ms / 10,
                                      min_repeats=5, rounds=1))
