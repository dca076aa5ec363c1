"""Autotuning: search a spec's config space on the GPU in hand, remember the answer, look it up.

    tune(spec, problem, ...)       prune by constraints and device limits, compile in parallel,
                                   check each candidate against the reference, then time it;
                                   record every trial and the winner in the tuning DB
    lookup(spec, variant, problem) the config to launch: memo -> tuning DB -> shipped tuned
                                   defaults -> the spec's heuristic; tunes on a miss only with
                                   KERNELGEN_AUTOTUNE=1, and never during CUDA-graph capture

The search loop (search.py) sees candidates only through check() and run(), so its rules are
tested on the CPU with fakes; the GPU side of a candidate lives in measure.py, the command line in
tune_cli.py. torch is imported only where a GPU is used: a memoized lookup, `kernelgen tune
--export` and the shipped-defaults code do not need it.

The module is callable, so `kernelgen.tune(...)` runs tune() and `kernelgen.tune.lookup` works.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import sqlite3
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kernelgen import cache, env, tunedb
from kernelgen.compile_child import compile_isolated
from kernelgen.search import Trial, build, choose, prune, search
from kernelgen.spec import Config, KernelSpec, SpecError, Variant, load_named, load_spec
from kernelgen.tunedb import Identity

log = logging.getLogger("kernelgen.tune")

DEFAULTS_PATH = Path(__file__).resolve().parent / "data" / "tuned_defaults.json"
DEFAULTS_FORMAT = 1
_MAX_MEMO = 4096


class TuneError(RuntimeError):
    pass


# ---- problems and buckets -----------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Bucket:
    """Problems that share a tuned config: sequence lengths and batch*heads rounded up to powers
    of two (tile efficiency changes with the number of tiles, i.e. with these, stepwise)."""
    seqlen_q: int
    seqlen_k: int
    batch_heads: int

    @property
    def slug(self) -> str:
        return f"q{self.seqlen_q}_k{self.seqlen_k}_bh{self.batch_heads}"

    @classmethod
    def from_slug(cls, slug: str) -> Bucket:
        q, k, bh = slug.split("_")
        return cls(int(q.removeprefix("q")), int(k.removeprefix("k")), int(bh.removeprefix("bh")))

    def distance(self, other: Bucket) -> float:
        # In octaves; sequence lengths decide the tile shape more than the batch does.
        return (abs(math.log2(self.seqlen_q / other.seqlen_q)) + abs(math.log2(self.seqlen_k / other.seqlen_k))
                + 0.5 * abs(math.log2(self.batch_heads / other.batch_heads)))


@dataclass(frozen=True)
class Problem:
    batch: int
    heads: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int

    def bucket(self) -> Bucket:
        return Bucket(_pow2(self.seqlen_q), _pow2(self.seqlen_k), _pow2(self.batch * self.heads))

    def as_dict(self) -> dict:
        return {"batch": self.batch, "heads": self.heads, "heads_k": self.heads_k,
                "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k}


@dataclass(frozen=True)
class TuneResult:
    spec: str
    variant: Variant
    problem: Problem
    identity: Identity
    trials: tuple[Trial, ...]
    chosen: Trial | None
    default: Config

    def trial(self, config: Config) -> Trial | None:
        return next((t for t in self.trials if t.config == config), None)


def tune(spec, problem: Problem, *, variant: Variant | None = None, arch: str | None = None,
         device: int | None = None, jobs: int | None = None, rep_ms: float = 50.0,
         save: bool = True, progress: bool = False, mod_values: dict | None = None,
         configs: Sequence[Config | Mapping] | None = None, finalists: int | None = None,
         **params) -> TuneResult:
    """Tune one variant of `spec` (a name, a path or a KernelSpec) for `problem` on a GPU.

    The variant is `variant`, or built from `params` (missing ones take their defaults) on `arch`
    (default: the device's). Every trial is recorded in the tuning DB unless save=False, and the
    winner answers lookup() for the problem's bucket from then on. A spec with mods tunes on the
    values of its mod arguments, `mod_values` by name (measure_mods.py). `configs` (Configs, or
    mappings of the tune space's keys) narrows the search to those, as a Triton autotune list
    does; each must satisfy the spec's constraints, and may be one its tune.skip leaves out.
    With more candidates than `finalists` (default: all up to 128, else a tenth, at least 32),
    each is screened by a short timing and only that many fastest, and the default config, are
    timed in full (search.search), which is most of a candidate's time (PERF_NOTES §95).
    """
    import torch

    from kernelgen import api, measure

    spec = spec if isinstance(spec, KernelSpec) else load_spec(spec)
    device = _device(device)
    if _capturing():
        raise TuneError("kernelgen.tune: cannot tune during CUDA-graph capture; tune (or run the "
                        "op once) before capturing")
    if finalists is not None and (isinstance(finalists, bool) or not isinstance(finalists, int)
                                  or finalists < 1):
        raise TuneError(f"tune: finalists must be a whole number >= 1, not {finalists!r}")
    if variant is None:
        variant = spec.variant(arch or api.pick_arch(spec, device), **params)
    elif params or arch:
        raise TypeError("tune: give either a variant or its params and arch, not both")
    given = None if configs is None else _given_configs(spec, variant, configs)
    identity, limits = gpu_identity(device), measure.device_limits(device)
    configs, rejected = prune(spec, variant, limits, given)
    with torch.cuda.device(device):
        workload_class, candidate_class = _measurers(spec)
        extra = {} if mod_values is None else {"mod_values": mod_values}
        workload = workload_class(spec, variant, problem, device, **extra)
        candidates = [candidate_class(workload, spec, variant, c, rep_ms) for c in configs]
        kept = _finalists(len(candidates)) if finalists is None else finalists
        timings = len(candidates) + (min(kept + 1, len(candidates)) if kept < len(candidates) else 0)
        # NVRTC runs in a child process per config: a compiler crash fails its config, not
        # this process (compile_child.py).
        with _progress(progress, timings, variant) as on_trial, \
                ThreadPoolExecutor(max_workers=jobs or _default_jobs(len(candidates))) as pool:
            trials = search(candidates, functools.partial(build, spec, variant, limits,
                                                          compile=compile_isolated),
                            pool, on_trial, kept, spec.default_config(variant))
        del workload, candidates
    trials += rejected
    result = TuneResult(spec.name, variant, problem, identity, tuple(trials), choose(trials),
                        spec.default_config(variant))
    key = _key(spec, variant, problem.bucket(), identity)
    if save:
        _save(key, result)
    if result.chosen is not None:
        _remember(spec, variant, problem, device, Choice(result.chosen.config, "tuned"))
    return result


def _finalists(count: int) -> int:
    """How many candidates a search times in full: every one of a small space (the mma.sync
    forward's and its mods' 80 at most, the backward's 46), a tenth of a large one (the Hopper
    forward's 966 at hd64; its hd256 spaces, 80 configs, stay whole)."""
    return count if count <= 128 else max(32, count // 10)


def _given_configs(spec: KernelSpec, variant: Variant, configs) -> list[Config]:
    """tune()'s `configs`, each parsed and checked against the spec's constraints before anything
    compiles; an error names the entry."""
    if isinstance(configs, (str, bytes, Mapping, Config)) or not isinstance(configs, Iterable):
        raise TypeError(f"tune: configs must be a list of configs, not {type(configs).__name__}")
    parsed = []
    for i, config in enumerate(configs):
        try:
            config = config if isinstance(config, Config) else spec.parse_config(config)
        except (SpecError, TypeError, AttributeError) as exc:
            raise TuneError(f"tune: configs[{i}]: {exc}") from None
        failing = spec.violations(variant, config)
        if failing:
            raise TuneError(f"tune: configs[{i}] ({config.slug}) breaks {spec.name}'s constraints "
                            f"for {variant.slug}: " + "; ".join(failing))
        if config not in parsed:
            parsed.append(config)
    if not parsed:
        raise TuneError("tune: configs is empty; give at least one config, or None for the "
                        "spec's whole search")
    return parsed


def _measurers(spec: KernelSpec):
    """(workload class, candidate class) for `spec`: the backward's main kernel has inputs and a
    check of its own (measure_bwd.py), so do specs with mods (measure_mods.py); measure.py's
    serve the forward and refuse the rest."""
    from kernelgen import measure, measure_bwd

    if spec.mods.any or spec.mods.args:
        from kernelgen import measure_mods   # its workloads subclass measure's and measure_bwd's

        if measure_mods.feeds(spec):
            return measure_mods.measurers(spec)
    if measure_bwd.feeds(spec):
        return measure_bwd.Workload, measure_bwd.Candidate
    return measure.Workload, measure.AttentionCandidate


def _default_jobs(count: int) -> int:
    # One core stays free for the thread that launches and times.
    return max(1, min(count, (os.cpu_count() or 2) - 1))


@contextlib.contextmanager
def _progress(enabled: bool, total: int, variant: Variant):
    """on_trial for search(): a progress bar on stderr showing the best time so far."""
    try:
        from tqdm import tqdm
    except ImportError:   # a declared dependency; an environment without it still tunes
        enabled = False
    if not enabled:
        yield None
        return

    best = [math.inf]
    with tqdm(total=total, desc=variant.slug, unit="config", file=sys.stderr, leave=False) as bar:
        def on_trial(trial: Trial) -> None:
            bar.update(1)
            if trial.status == "ok" and trial.timing.median_ms < best[0]:
                best[0] = trial.timing.median_ms
                bar.set_postfix_str(f"best {trial.config.slug} {best[0]:.4f} ms")

        yield on_trial


def _save(key: tunedb.Key, result: TuneResult) -> None:
    rows = [tunedb.TrialRow(
        t.config, t.status,
        median_ms=t.timing.median_ms if t.timing else None, min_ms=t.timing.min_ms if t.timing else None,
        samples=t.timing.samples if t.timing else 0,
        registers=t.built.registers if t.built else None, smem=t.built.smem if t.built else None,
        max_error=t.check.max_error if t.check else None, note=t.note) for t in result.trials]
    chosen = result.chosen
    tunedb.TuneDB().record(key, result.problem.as_dict(), chosen.config if chosen else None,
                           chosen.timing.median_ms if chosen else None, rows)


# ---- lookup on the call path ------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    config: Config
    source: str   # "tuned" (this process), "db", "shipped", "heuristic"


_MEMO: dict[tuple, Config] = {}       # (spec hash, variant, problem, device) -> config
_BUCKETS: dict[tuple, Choice] = {}    # (spec hash, variant, bucket, device) -> choice
_RESOLVING = threading.RLock()        # reentrant: tuning on a miss remembers its own answer
_IDENTITIES: dict[int, Identity] = {}


def lookup(spec: KernelSpec, variant: Variant, problem: Problem, device: int | None = None) -> Config:
    """The config to launch `variant` with on `problem`. A repeated call is one dict lookup; pass
    `device` (the CUDA index) when the process uses GPUs of different kinds."""
    config = _MEMO.get((spec.content_hash, variant, problem, device))
    if config is None:
        config = resolve(spec, variant, problem, device).config
        if len(_MEMO) >= _MAX_MEMO:
            _MEMO.clear()
        _MEMO[(spec.content_hash, variant, problem, device)] = config
    return config


def resolve(spec: KernelSpec, variant: Variant, problem: Problem, device: int | None = None) -> Choice:
    """lookup()'s answer and where it came from, memoized per bucket."""
    device = _device(device)
    bucket_key = (spec.content_hash, variant, problem.bucket(), device)
    choice = _BUCKETS.get(bucket_key)
    if choice is None:
        with _RESOLVING:
            choice = _BUCKETS.get(bucket_key) or _resolve(spec, variant, problem, device)
            _BUCKETS[bucket_key] = choice
    return choice


def _remember(spec, variant, problem: Problem, device: int, choice: Choice) -> None:
    with _RESOLVING:
        _BUCKETS[(spec.content_hash, variant, problem.bucket(), device)] = choice
        _MEMO.clear()   # exact-problem entries of this bucket may hold the old answer


def clear_memo() -> None:
    """Forget every in-process answer (tests; or to see another process's new tunings)."""
    with _RESOLVING:
        _MEMO.clear()
        _BUCKETS.clear()
        _IDENTITIES.clear()
        _shipped_table.cache_clear()


def _resolve(spec: KernelSpec, variant: Variant, problem: Problem, device: int) -> Choice:
    key = _key(spec, variant, problem.bucket(), gpu_identity(device))
    config = _from_db(spec, variant, key)
    if config is not None:
        return Choice(config, "db")
    if env.settings().autotune:
        tuned = _autotune(spec, variant, problem, device, key)
        if tuned is not None:
            return tuned
    config = _from_shipped(spec, variant, key)
    if config is not None:
        return Choice(config, "shipped")
    return Choice(spec.default_config(variant), "heuristic")


def _autotune(spec, variant, problem: Problem, device: int, key: tunedb.Key) -> Choice | None:
    if _capturing():
        raise TuneError(
            f"kernelgen: no tuned config for {variant.slug} at {key.bucket} and KERNELGEN_AUTOTUNE=1 "
            "asks to tune it, but the current stream is capturing a CUDA graph: run the op once "
            "on this shape before capturing")
    # One process tunes a bucket; the others wait here, then read its answer from the DB.
    digest = hashlib.sha256(repr(sorted(key.columns().items())).encode()).hexdigest()[:32]
    lock = env.settings().cache_dir / "tune-locks" / f"{digest}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with cache.file_lock(lock):
        config = _from_db(spec, variant, key)
        if config is not None:
            return Choice(config, "db")
        log.warning("kernelgen: tuning %s %s on %s for bucket %s (KERNELGEN_AUTOTUNE=1); "
                    "this runs once per bucket", spec.name, variant.slug, key.identity.gpu, key.bucket)
        try:
            result = tune(spec, problem, variant=variant, device=device)
        except Exception:
            log.warning("kernelgen: tuning %s failed; using the untuned config", variant.slug,
                        exc_info=True)
            return None
    if result.chosen is None:
        log.warning("kernelgen: no config of %s passed the check; using the untuned config",
                    variant.slug)
        return None
    return Choice(result.chosen.config, "tuned")


def _usable(spec: KernelSpec, variant: Variant, config: Config | None, where: str) -> Config | None:
    if config is None:
        return None
    try:
        config = spec.parse_config(config.as_dict())
    except SpecError as exc:
        log.warning("kernelgen: ignoring a config from %s: %s", where, exc)
        return None
    problems = spec.violations(variant, config)
    if problems:
        log.warning("kernelgen: ignoring %s from %s: violates %s", config.slug, where, problems)
        return None
    return config


def _from_db(spec, variant, key: tunedb.Key) -> Config | None:
    try:
        config = tunedb.TuneDB().best(key)
    except (sqlite3.Error, OSError, tunedb.TuneDBError) as exc:   # never fail a call over it
        log.warning("kernelgen: tuning database unusable (%s); using defaults", exc)
        return None
    return _usable(spec, variant, config, "the tuning database")


@functools.cache
def _shipped_table() -> dict[tuple, list[tuple[Bucket, Config]]]:
    try:
        return _read_shipped(json.loads(DEFAULTS_PATH.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("kernelgen: shipped tuned defaults %s unusable (%s: %s); ignored", DEFAULTS_PATH,
                    type(exc).__name__, exc)
        return {}


def _read_shipped(doc: dict) -> dict[tuple, list[tuple[Bucket, Config]]]:
    if doc.get("format") != DEFAULTS_FORMAT:
        raise ValueError(f"format {doc.get('format')!r}, expected {DEFAULTS_FORMAT}")
    table: dict[tuple, list[tuple[Bucket, Config]]] = {}
    for entry in doc["entries"]:
        where = (entry["spec"], entry["variant"], entry["arch"], entry["gpu"], entry["capability"],
                 entry["sm_count"])
        config = Config(tuple((str(k), int(v)) for k, v in entry["config"].items()))
        table.setdefault(where, []).append((Bucket.from_slug(entry["bucket"]), config))
    return table


def _from_shipped(spec, variant, key: tunedb.Key) -> Config | None:
    # Matched by GPU, not toolchain: these are measurements of a GPU we had, shipped as data.
    # The nearest measured bucket stands in for one that was not measured.
    identity = key.identity
    table = _shipped_table()
    variants = [v for v in (variant, _dtype_sibling(spec, variant)) if v is not None]
    wheres = ((spec.name, v.slug, v.arch, gpu, identity.capability, identity.sm_count)
              for gpu in (identity.gpu, *_same_chip(table, identity)) for v in variants)
    entries = next((table[where] for where in wheres if table.get(where)), None)
    if not entries:
        return None
    wanted = Bucket.from_slug(key.bucket)
    _, config = min(entries, key=lambda entry: entry[0].distance(wanted))
    return _usable(spec, variant, config, str(DEFAULTS_PATH))


def _same_chip(table: dict, identity: tunedb.Identity) -> list[str]:
    """The other GPUs of the table with this one's capability and SM count, by name: a GPU we never
    measured borrows their tuning (H100 SXM and H200 are one chip, 132 SMs, with different memory;
    attention's forward is bound by the SMs, so their best tiles agree far more often than the
    untuned heuristic does). An exact name match always comes first."""
    return sorted({where[3] for where in table
                   if where[3] != identity.gpu and where[4:] == (identity.capability, identity.sm_count)})


_SIBLING_DTYPES = {"fp16": "bf16", "bf16": "fp16"}


def _dtype_sibling(spec, variant: Variant) -> Variant | None:
    """The variant with the other 16-bit dtype: fp16 and bf16 kernels issue the same instructions
    at the same rate, so where only one was measured its tuning stands in for the other's."""
    params = variant.as_dict()
    other = _SIBLING_DTYPES.get(params.get("dtype"))
    if other is None:
        return None
    try:
        return spec.variant(variant.arch, **{**params, "dtype": other})
    except SpecError:   # the spec offers only one of them
        return None


def export_defaults(path: Path, db: tunedb.TuneDB | None = None) -> int:
    """Write the latest chosen config per (spec, variant, bucket, GPU) of the DB in the shipped
    format (kernelgen/data/tuned_defaults.json). Rows of a spec that has changed are left out."""
    hashes: dict[str, str | None] = {}
    latest: dict[tuple, dict] = {}
    for run in (db or tunedb.TuneDB()).dump():   # oldest first: later runs replace earlier ones
        if run["config"] is None:
            continue
        if run["spec"] not in hashes:
            # `<spec>[_bm]__<base>`: a mods spec put onto another base (load_spec's onto=),
            # maybe on a block mask (block_mask=).
            try:
                hashes[run["spec"]] = load_named(run["spec"]).content_hash
            except SpecError:   # not a shipped spec
                hashes[run["spec"]] = None
        if run["spec_hash"] != hashes[run["spec"]]:
            continue
        where = tuple(run[name] for name in ("spec", "variant", "arch", "bucket", "gpu",
                                             "capability", "sm_count"))
        latest[where] = run
    names = ("spec", "spec_hash", "variant", "arch", "bucket", "gpu", "capability", "sm_count",
             "time_ms", "driver", "nvrtc", "kernelgen")
    entries = [{**{name: run[name] for name in names}, "problem": json.loads(run["problem"]),
                "config": json.loads(run["config"])} for _, run in sorted(latest.items())]
    Path(path).write_text(json.dumps({"format": DEFAULTS_FORMAT, "entries": entries}, indent=1) + "\n")
    return len(entries)


# ---- the GPU in hand ----------------------------------------------------------------------------

def gpu_identity(device: int) -> Identity:
    identity = _IDENTITIES.get(device)
    if identity is None:
        from kernelgen import measure

        identity = _IDENTITIES[device] = measure.gpu_identity(device)
    return identity


def _device(device: int | None) -> int:
    if device is not None:
        return device
    import torch

    return torch.cuda.current_device()


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _key(spec: KernelSpec, variant: Variant, bucket: Bucket, identity: Identity) -> tunedb.Key:
    return tunedb.Key(spec.name, spec.content_hash, variant.slug, variant.arch, bucket.slug, identity)


def main(argv: list[str]) -> int:
    from kernelgen import tune_cli

    return tune_cli.main(argv)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> TuneResult:
        return self.tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
