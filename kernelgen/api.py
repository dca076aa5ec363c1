"""The top level that chains the stages: spec -> variant/config -> render -> compile (cached) ->
load -> a callable. `kernelgen.load(spec, **params)` works for any spec, shipped or a user's file.
"""
from __future__ import annotations

import threading

from kernelgen import launch, render
from kernelgen.cache import compile_cached
from kernelgen.spec import KernelSpec, SpecError, load_spec

_TORCH_RAW_STREAM = None


def _current_stream(device: int) -> int:
    global _TORCH_RAW_STREAM
    if _TORCH_RAW_STREAM is None:
        import torch

        # The raw-stream getter is what torch's own generated code calls: ~10x cheaper than
        # torch.cuda.current_stream(device).cuda_stream.
        _TORCH_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream
        )
    return _TORCH_RAW_STREAM(device)


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: int) -> int:
    """Multiprocessors of a CUDA device (a grid expression's `sm_count`), read once per device."""
    count = _SM_COUNTS.get(device)
    if count is None:
        import torch

        count = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def device_arch(device: int | None = None) -> str:
    """sm_XY of a CUDA device (the current one by default), through torch."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("kernelgen: no CUDA GPU is available to run kernels on")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def pick_arch(spec: KernelSpec, device: int | None = None) -> str:
    arch = device_arch(device)
    if arch in spec.archs:
        return arch
    if arch + "a" in spec.archs:   # sm_90a code runs on exactly sm_90: a spec for it fits
        return arch + "a"
    raise RuntimeError(
        f"kernelgen: spec {spec.name!r} has no variant for this GPU ({arch}); it supports {list(spec.archs)}"
    )


class BoundKernel:
    """A compiled variant with one config, callable with the spec's runtime arguments by name."""

    def __init__(self, spec: KernelSpec, variant, config):
        self.spec, self.variant, self.config = spec, variant, config
        self.source = render.render(spec, variant, config)
        self.binary = compile_cached(self.source, variant.arch)
        self.kernel = launch.Kernel(self.binary, tuple(a.type for a in spec.args))
        self.arg_names = tuple(a.name for a in spec.args)
        self._env = spec.environment(variant, config)
        self._grid, self._block, self._smem = spec.grid, spec.block, spec.smem
        # Block and smem depend only on params and config: evaluate them once.
        self.block = tuple(int(e(self._env)) for e in self._block)
        self.smem = int(self._smem(self._env))
        self._scalars = [a.name for a in spec.args if a.type != "ptr"]
        self._grids: dict[tuple, tuple[int, int, int]] = {}   # grid() by its scalars

    def __repr__(self) -> str:
        return f"BoundKernel({self.source.name})"

    def grid(self, scalars: dict) -> tuple[int, int, int]:
        """The grid for these runtime scalars (and `sm_count`, where the spec's grid uses it).
        Kept per scalars: evaluating the expressions is ~4 us a launch, a dict hit under 1."""
        key = tuple(scalars.items())
        try:
            grid = self._grids.get(key)
        except TypeError:   # an unhashable value: evaluate, keep nothing
            key, grid = None, None
        if grid is None:
            env = dict(self._env)
            env.update(scalars)
            grid = tuple(int(e(env)) for e in self._grid)
            if key is not None:
                if len(self._grids) >= 1024:
                    self._grids.clear()
                self._grids[key] = grid
        return grid

    def __call__(self, *, stream: int | None = None, device: int | None = None, **args):
        missing = [n for n in self.arg_names if n not in args]
        extra = [n for n in args if n not in self.arg_names]
        if missing or extra:
            raise TypeError(
                f"{self.spec.name}: missing arguments {missing}, unexpected {extra}; "
                f"takes {list(self.arg_names)}"
            )
        values = []
        for name in self.arg_names:
            value = args[name]
            if hasattr(value, "data_ptr"):  # a tensor: its device also picks the launch device
                if device is None and getattr(value, "is_cuda", False):
                    device = value.device.index
                value = value.data_ptr()
            values.append(value)
        if device is None:
            import torch

            device = torch.cuda.current_device()
        scalars = {n: args[n] for n in self._scalars}
        scalars["sm_count"] = sm_count(device)
        self.launch(tuple(values), self.grid(scalars), device,
                    _current_stream(device) if stream is None else stream)

    def launch(self, values: tuple, grid, device: int, stream: int) -> None:
        """Hot path for callers that already ordered the arguments and computed the grid."""
        if grid[0] == 0 or grid[1] == 0 or grid[2] == 0:
            return
        self.kernel.launch(grid, self.block, self.smem, values, stream, device)


def refuse_during_capture(what: str) -> None:
    """Compiling, loading modules and tuning must not happen while a CUDA graph is captured."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"kernelgen: cannot {what} during CUDA-graph capture; run the same call once before "
            "capturing (warm-up) so that everything is compiled and loaded"
        )


_MEMO: dict[tuple, BoundKernel] = {}
_MEMO_LOCK = threading.Lock()


def load(spec, *, arch: str | None = None, config=None, **params) -> BoundKernel:
    """Compile (or fetch from the cache) one variant of `spec` and return it ready to call.

    `spec`: a shipped spec name, a path to a YAML file, or a KernelSpec. `params`: the spec's
    compile-time parameters (missing ones take their defaults). `arch`: defaults to the current
    GPU's. `config`: a mapping of tune values; defaults to the spec's default for the variant.
    """
    spec = spec if isinstance(spec, KernelSpec) else load_spec(spec)
    if arch is None:
        arch = pick_arch(spec)
    variant = spec.variant(arch=arch, **params)
    config = spec.default_config(variant) if config is None else spec.parse_config(dict(config))
    problems = spec.violations(variant, config)
    if problems:
        raise SpecError(f"{spec.path}: config {config.slug} is invalid for {variant.slug} on {arch}: "
                        + "; ".join(problems))
    key = (spec.content_hash, variant, config)
    bound = _MEMO.get(key)
    if bound is None:
        refuse_during_capture(f"compile or load {spec.name} {variant.slug}")
        with _MEMO_LOCK:
            bound = _MEMO.get(key)
            if bound is None:
                bound = _MEMO[key] = BoundKernel(spec, variant, config)
    return bound
