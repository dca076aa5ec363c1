"""`kernelgen tune`: tune a spec for given shapes, or a preset grid, and print a table per run.

    kernelgen tune SPEC [--set head_dim=128 ...] --shape batch=4,seqlen=8192,heads=16 [--shape ...]
    kernelgen tune --preset fwd-grid [--head-dims 128] [--seqlens 4096 8192] [--causal true]
    kernelgen tune --preset fwd-sm90-grid ...   (the Hopper family, on an sm_90 GPU)
    kernelgen tune --preset bwd-grid ...        (the backward's main kernel, flash_attn_bwd)
    kernelgen tune --preset bwd-sm90-grid ...   (its Hopper kernel, flash_attn_bwd_sm90)
    kernelgen tune --export FILE          (also after a tuning run: the DB in the shipped format)
    kernelgen tune flash_attn_softcap --arg softcap=30 [--onto flash_attn_fwd_sm90] --shape ...
                                          (a mods spec: its scalar arguments' values, and the base
                                           its mods run on: the Hopper forward, the backward)
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

from kernelgen import tune as tuning
from kernelgen.search import STATUSES
from kernelgen.cli import _assignments, _param_value   # the --set parsing of `kernelgen render`
from kernelgen.spec import load_spec
from kernelgen.tune import Problem, TuneError, TuneResult

SHAPE_KEYS = ("batch", "heads", "heads_k", "seqlen", "seqlen_q", "seqlen_k")
GRID_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
_STATUS_ORDER = {status: i for i, status in enumerate(STATUSES)}


@dataclass(frozen=True)
class Job:
    spec: str
    params: tuple[tuple[str, object], ...]
    problem: Problem
    onto: str | None = None                            # load_spec(spec, onto=): a mods spec's base
    mod_values: tuple[tuple[str, object], ...] = ()    # a mods spec's scalar arguments


def fwd_grid(head_dims=(64, 128, 256), seqlens=GRID_SEQLENS, causals=(False, True),
             spec: str = "flash_attn_fwd") -> list[Job]:
    """The benchmark grid of the FlashAttention papers: batch x seqlen = 16k tokens, hidden 2048."""
    jobs = []
    for head_dim in head_dims:
        heads = 2048 // head_dim
        for causal in causals:
            for seqlen in seqlens:
                params = (("head_dim", head_dim), ("dtype", "bf16"), ("causal", causal))
                problem = Problem(max(1, 16384 // seqlen), heads, heads, seqlen, seqlen)
                jobs.append(Job(spec, params, problem))
    return jobs


PRESETS = {"fwd-grid": fwd_grid,                      # the mma.sync family (sm_80 and later)
           "fwd-sm90-grid": functools.partial(fwd_grid, spec="flash_attn_fwd_sm90"),
           "bwd-grid": functools.partial(fwd_grid, spec="flash_attn_bwd"),   # the backward's main kernel
           "bwd-sm90-grid": functools.partial(fwd_grid, head_dims=(64, 128),  # its Hopper kernel
                                              spec="flash_attn_bwd_sm90")}
# FLOPs of a spec's run per forward FLOP: the backward's five products to the forward's two (the
# FlashAttention papers' convention; its prep and dQ cast are in the time but count nothing).
FLOPS_PER_FORWARD = {"flash_attn_bwd": 2.5, "flash_attn_bwd_sm90": 2.5}


def parse_shape(text: str) -> Problem:
    values = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SHAPE_KEYS:
            raise TuneError(f"--shape {text!r}: {item!r} is not KEY=VALUE with a key of "
                            f"{', '.join(SHAPE_KEYS)}")
        try:
            values[name] = int(value)
        except ValueError:
            raise TuneError(f"--shape {text!r}: {name}={value} is not an integer") from None
    seqlen = values.pop("seqlen", None)
    values.setdefault("seqlen_q", seqlen)
    values.setdefault("seqlen_k", seqlen)
    values.setdefault("heads_k", values.get("heads"))
    missing = [name for name in ("batch", "heads", "seqlen_q", "seqlen_k") if values.get(name) is None]
    if missing:
        raise TuneError(f"--shape {text!r}: missing {', '.join(missing)} (seqlen sets both seqlens)")
    if min(values.values()) < 1:
        raise TuneError(f"--shape {text!r}: every size must be at least 1")
    return Problem(**values)


def _flops(result: TuneResult) -> float | None:
    params = result.variant.as_dict()
    if "head_dim" not in params:
        return None
    from kernelgen.bench import attention_flops

    p = result.problem
    base = result.spec.rpartition("__")[2]   # a mods spec put onto a base counts like the base
    return FLOPS_PER_FORWARD.get(base, 1.0) * attention_flops(
        p.batch, p.heads, p.seqlen_q, p.seqlen_k, params["head_dim"], bool(params.get("causal", False)))


def format_table(result: TuneResult, top: int = 0) -> str:
    p, flops = result.problem, _flops(result)
    lines = [f"== {result.spec} {result.variant.slug} {result.variant.arch} | batch {p.batch}, "
             f"heads {p.heads}/{p.heads_k}, seqlen {p.seqlen_q}x{p.seqlen_k} (bucket "
             f"{p.bucket().slug}) | {result.identity.gpu}",
             f"{'config':<40} {'regs':>4} {'smem KiB':>8} {'median ms':>10} {'min ms':>8} "
             f"{'n':>4} {'TFLOP/s':>8}  status"]
    trials = sorted(result.trials, key=lambda t: (_STATUS_ORDER[t.status],
                                                  t.timing.median_ms if t.timing else 0.0))
    shown = [t for t in trials if t.status == "ok"][:top] if top else trials
    for trial in shown + [t for t in trials if t.config == result.default and t not in shown]:
        built, timing = trial.built, trial.timing
        marks = ("  <- chosen" if result.chosen is trial else "") + \
                ("  (default)" if trial.config == result.default else "")
        cells = [f"{trial.config.slug:<40}",
                 f"{built.registers:>4}" if built else f"{'':>4}",
                 f"{built.smem / 1024:>8.1f}" if built else f"{'':>8}"]
        if timing:
            rate = f"{flops / timing.median_ms / 1e9:>8.1f}" if flops else f"{'':>8}"
            cells += [f"{timing.median_ms:>10.4f}", f"{timing.min_ms:>8.4f}", f"{timing.samples:>4}", rate]
        else:
            cells += [f"{'':>10}", f"{'':>8}", f"{'':>4}", f"{'':>8}"]
        status = trial.status + (f": {trial.note}" if trial.note and trial.status != "ok" else "")
        lines.append(" ".join(cells) + f"  {status}{marks}")
    lines.append(summary(result))
    return "\n".join(lines)


def summary(result: TuneResult) -> str:
    chosen = result.chosen
    if chosen is None:
        return f"{result.variant.slug} {result.problem.bucket().slug}: no config passed the check"
    flops, default = _flops(result), result.trial(result.default)
    rate = f" {flops / chosen.timing.median_ms / 1e9:.1f} TFLOP/s," if flops else ""
    versus = (f" {default.timing.median_ms / chosen.timing.median_ms:.2f}x the default"
              if default is not None and default.status == "ok" else " (the default was not timed)")
    return (f"{result.variant.slug} {result.problem.bucket().slug}: chosen {chosen.config.slug}:"
            f"{rate} {chosen.timing.median_ms:.4f} ms,{versus}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelgen tune", description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", help="shipped spec name or path to a .yaml file")
    parser.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE")
    parser.add_argument("--arch", help="default: the GPU's")
    parser.add_argument("--shape", action="append", default=[], metavar="batch=4,seqlen=8192,heads=16",
                        help=f"repeatable; keys: {', '.join(SHAPE_KEYS)}")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--head-dims", type=int, nargs="+", help="with --preset: a subset")
    parser.add_argument("--seqlens", type=int, nargs="+", help="with --preset: a subset")
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("-j", "--jobs", type=int, metavar="N", help="parallel compiles")
    parser.add_argument("--rep-ms", type=float, default=50.0, help="timing per round and config")
    parser.add_argument("--finalists", type=int, metavar="N",
                        help="time N configs in full, the fastest of a short screening of all "
                             "(default: all up to 128, else a tenth, at least 32)")
    parser.add_argument("--top", type=int, default=0, metavar="N", help="show the N fastest only")
    parser.add_argument("--no-save", action="store_true", help="do not record in the tuning DB")
    parser.add_argument("--onto", choices=["flash_attn_fwd_sm90", "flash_attn_bwd"],
                        help="tune a mods spec put onto this base (the Hopper forward, the backward)")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                        help="a mods spec's scalar argument (tensors: tune from Python)")
    parser.add_argument("--export", metavar="FILE",
                        help="write the DB's tuned configs in the shipped-defaults format")
    return parser


def _jobs(opts) -> list[Job]:
    if opts.preset:
        if opts.set or opts.shape or opts.arg or opts.onto:
            raise TuneError("--preset takes no --set, --shape, --arg or --onto")
        causals = {"both": (False, True), "true": (True,), "false": (False,)}[opts.causal]
        return PRESETS[opts.preset](**{k: v for k, v in (("head_dims", opts.head_dims),
                                                          ("seqlens", opts.seqlens)) if v},
                                    causals=causals)
    if opts.head_dims or opts.seqlens or opts.causal != "both":
        raise TuneError("--head-dims, --seqlens and --causal go with --preset; use --set and --shape")
    if not opts.shape:
        raise TuneError("give at least one --shape, e.g. --shape batch=4,seqlen=8192,heads=16")
    spec = load_spec(opts.spec, onto=opts.onto)
    params = tuple((name, _param_value(spec, name, text))
                   for name, text in _assignments(opts.set, "--set").items())
    spec.variant(opts.arch, **dict(params))   # a bad param is an error now, not after a GPU check
    mod_values = _mod_values(spec, _assignments(opts.arg, "--arg"))
    return [Job(opts.spec, params, parse_shape(text), opts.onto, mod_values) for text in opts.shape]


def _mod_values(spec, given: dict[str, str]) -> tuple[tuple[str, object], ...]:
    """--arg values by the type the spec declares; tensors cannot come from a command line."""
    args = {a.name: a for a in spec.mods.args}
    values = []
    for name, text in given.items():
        arg = args.get(name)
        if arg is None:
            raise TuneError(f"--arg {name}: {spec.name} has no mod argument {name!r}; it has "
                            f"{sorted(args)}")
        if arg.type == "ptr":
            raise TuneError(f"--arg {name}: a tensor ({arg.ctype}); tune from Python with the "
                            "tensors it will run on: kernelgen.load(...).tune(q, k, v, **mod_args)")
        try:
            values.append((name, float(text) if arg.type == "f32" else int(text)))
        except ValueError:
            raise TuneError(f"--arg {name}={text!r}: not a number of type {arg.type}") from None
    missing = [name for name in args if name not in given]
    if missing:
        raise TuneError(f"{spec.name} tunes on its mod arguments' values: give --arg "
                        + " ".join(f"{name}=..." for name in missing))
    return tuple(values)


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    try:
        return _run(opts)
    except TuneError as exc:
        print(f"kernelgen: error: {exc}", file=sys.stderr)
        return 1


def _run(opts) -> int:
    if opts.spec and opts.preset:
        raise TuneError("give a SPEC or --preset, not both")
    if not opts.spec and not opts.preset:
        if not opts.export:
            raise TuneError("give a SPEC with --shape, --preset NAME, or --export FILE")
        return _export(opts.export)
    jobs = _jobs(opts)
    import torch

    if not torch.cuda.is_available():
        print("kernelgen tune: no CUDA GPU here; nothing to tune")
        return 1
    results = []
    for number, job in enumerate(jobs, 1):
        print(f"[{number}/{len(jobs)}] tuning {job.spec} {dict(job.params)} {job.problem}", flush=True)
        spec = load_spec(job.spec, onto=job.onto) if job.onto else job.spec
        extra = {"mod_values": dict(job.mod_values)} if job.mod_values else {}
        if opts.finalists is not None:
            extra["finalists"] = opts.finalists
        result = tuning.tune(spec, job.problem, arch=opts.arch, jobs=opts.jobs,
                             rep_ms=opts.rep_ms, save=not opts.no_save, progress=True,
                             **extra, **dict(job.params))
        print(format_table(result, opts.top), flush=True)
        results.append(result)
    if len(results) > 1:
        print("== summary")
        print("\n".join(summary(result) for result in results))
    if opts.export:
        _export(opts.export)
    return 0 if all(result.chosen for result in results) else 1


def _export(path: str) -> int:
    count = tuning.export_defaults(path)
    print(f"wrote {count} tuned configs to {path}")
    return 0
