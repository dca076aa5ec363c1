"""The tuner's core loop: candidates in, trials out. Knows nothing of torch or of the GPU.

A candidate is anything with a config and three hooks, check() (run once, compare with the
reference), run() (timed repeats) and screen() (a short timing, for ranking); its build (render +
compile) goes to a pool first. The rules live here, so a CPU test with fake candidates proves
them: compile failures, spills and configs beyond the device never run; a candidate that fails
its check is never timed, however fast; with more candidates than `finalists`, every checked one
is screened and only the fastest of those (and the default config) are timed in full, and only
they can win; every trial is kept, not only the winner.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Protocol

from kernelgen import cache
from kernelgen.render import render
from kernelgen.spec import Config, KernelSpec, Variant


@dataclass(frozen=True)
class DeviceLimits:
    max_smem: int      # dynamic + static shared memory one block may opt in to
    max_threads: int   # per block


@dataclass(frozen=True)
class Built:
    registers: int
    spill_stores: int
    stack_bytes: int
    smem: int          # dynamic (the spec's launch formula) + static

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.stack_bytes)


@dataclass(frozen=True)
class Check:
    ok: bool
    max_error: float
    bound: float
    note: str = ""


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    samples: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        ordered = sorted(samples)
        middle = len(ordered) // 2
        median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        return cls(median, ordered[0], len(ordered))


# "screened": passed the check, timed only by screen() and not among the finalists.
STATUSES = ("ok", "screened", "wrong", "spills", "device_limit", "compile_error", "run_error")


@dataclass(frozen=True)
class Trial:
    config: Config
    status: str                      # one of STATUSES; only "ok" trials were timed in full
    timing: Timing | None = None
    built: Built | None = None
    check: Check | None = None
    note: str = ""


class Candidate(Protocol):
    config: Config

    def check(self) -> Check: ...   # run once on the tuning inputs, compare with the reference

    def run(self) -> Timing: ...    # timed repeats

    def screen(self) -> Timing: ... # a few timed repeats: enough to rank, not to choose


class DeviceLimit(Exception):
    pass


def prune(spec: KernelSpec, variant: Variant, limits: DeviceLimits,
          configs: Sequence[Config] | None = None) -> tuple[list[Config], list[Trial]]:
    """`configs` (default: the spec's valid configs less its tune.skip ones) that fit the device,
    and a trial for each one that does not."""
    kept, rejected = [], []
    for config in spec.tuned_configs(variant) if configs is None else configs:
        values = spec.environment(variant, config)
        threads = math.prod(int(e(values)) for e in spec.block)
        smem = int(spec.smem(values))
        if threads > limits.max_threads:
            rejected.append(Trial(config, "device_limit",
                                  note=f"{threads} threads per block > {limits.max_threads}"))
        elif smem > limits.max_smem:
            rejected.append(Trial(config, "device_limit",
                                  note=f"{smem} B shared memory > {limits.max_smem}"))
        else:
            kept.append(config)
    return kept, rejected


def build(spec: KernelSpec, variant: Variant, limits: DeviceLimits, config: Config,
          compile=None) -> Built:
    """Render and compile one config (runs on the build threads; `compile`, tune()'s
    compile_child.compile_isolated, puts NVRTC in a child process)."""
    smem = int(spec.smem(spec.environment(variant, config)))
    binary = cache.compile_cached(render(spec, variant, config), variant.arch, compile=compile)
    built = Built(binary.registers, binary.spill_stores, binary.stack_bytes, smem + binary.static_smem)
    if built.smem > limits.max_smem:   # static shared memory is known only now
        raise DeviceLimit(f"{built.smem} B shared memory (with static) > {limits.max_smem}")
    return built


def search(candidates: Sequence[Candidate], build: Callable[[Config], Built], pool: Executor,
           on_trial: Callable[[Trial], None] | None = None, finalists: int | None = None,
           default: Config | None = None) -> list[Trial]:
    """Every candidate's build goes to `pool` at once; candidates are then checked and timed in
    order as their builds finish, so candidate i is timed while later ones still compile.

    With more candidates than `finalists`, a checked candidate is screened (a short timing)
    instead, and then the `finalists` fastest by screening, with `default` among them if it
    passed its check (so the winner is measured against it), are timed in full: the full timing
    is most of a candidate's cost (warmup and rounds until two agree), and a screening misranks
    only configs within its noise of each other, which the finalists' margin covers."""
    screening = finalists is not None and finalists < len(candidates)
    futures = [pool.submit(build, candidate.config) for candidate in candidates]
    trials = []
    try:
        for candidate, future in zip(candidates, futures):
            trials.append(_evaluate(candidate, future, screening))
            if on_trial is not None:
                on_trial(trials[-1])
    finally:
        for future in futures:
            future.cancel()
    if screening:
        ranked = sorted((t for t in trials if t.status == "screened"), key=lambda t: t.timing.median_ms)
        final = {t.config for t in ranked[:finalists]} | ({default} & {t.config for t in ranked})
        for i, candidate in enumerate(candidates):
            if trials[i].config in final:
                trials[i] = _time(candidate, trials[i])
                if on_trial is not None:
                    on_trial(trials[i])
    return trials


def _time(candidate: Candidate, screened: Trial) -> Trial:
    """A finalist's full timing; its build and check stay those of its screening."""
    try:
        return Trial(screened.config, "ok", timing=candidate.run(), built=screened.built,
                     check=screened.check)
    except Exception as exc:
        return Trial(screened.config, "run_error", built=screened.built, check=screened.check,
                     note=_first_line(exc))


def _evaluate(candidate: Candidate, future: Future, screening: bool = False) -> Trial:
    config = candidate.config
    try:
        built = future.result()
    except DeviceLimit as exc:
        return Trial(config, "device_limit", note=str(exc))
    except Exception as exc:
        return Trial(config, "compile_error", note=_first_line(exc))
    if built.spills:
        return Trial(config, "spills", built=built,
                     note=f"{built.spill_stores} B spill stores, {built.stack_bytes} B stack")
    try:
        check = candidate.check()
        if not check.ok:   # correctness gates speed: a wrong candidate is never timed
            return Trial(config, "wrong", built=built, check=check, note=check.note)
        if screening:
            return Trial(config, "screened", timing=candidate.screen(), built=built, check=check)
        return Trial(config, "ok", timing=candidate.run(), built=built, check=check)
    except Exception as exc:
        return Trial(config, "run_error", built=built, note=_first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def choose(trials: Sequence[Trial]) -> Trial | None:
    passed = [t for t in trials if t.status == "ok"]
    return min(passed, key=lambda t: t.timing.median_ms, default=None)
