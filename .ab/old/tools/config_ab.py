"""A/B of one tune key of the Hopper forward on the bench's shapes: each shape's shipped (or
default) config as it is and with KEY set to each of VALUES, timed in interleaved rounds in one
process, every output checked against the float32 reference (FlashAttention's rule).

    python tools/config_ab.py [--key schedule --values 1 2] [--head-dims 64 128]
                              [--seqlens 1024 4096 16384] [--causal both] [--rounds 3]
                              [--config '{"block_n": 128}']   (overrides on every shape's config)
                              [--mod softcap|alibi|window|document|packed|varlen_window]
    python tools/config_ab.py --alts '{"block_n": 176, "persistent": 0}' ...
                              (the shipped config against it with each set of keys changed)

Prints TFLOP/s per value (median of the rounds' medians) and each value's ratio to the first.
Each config is timed as a captured CUDA graph (`captured`): kernel time, not the host's.
With --export FILE, each shape whose fastest config beats the shipped one by --min-gain (and
passed its check where one ran) becomes an entry in the shipped table's format, for
tools/merge_defaults.py: the measured time and this GPU's identity, the winning config whole.
"""
from __future__ import annotations

import argparse
import json
import os
import itertools
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.nn.attention.flex_attention import and_masks

from kernelgen import bench_mods, blockmask, cache, hopper, mods_sm90, packed, tune
from kernelgen.compile import CompileError
from kernelgen.render import render
from kernelgen.bench import time_ms
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import load_spec
from tune_mods import mod_args  # tools/: the bench's modifier arguments, by name

SPEC = load_spec("flash_attn_fwd_sm90")


class Case:
    """The plain Hopper forward, or a shipped mods spec on it with the bench's modifier values
    (tools/tune_mods.py's mod_args): TFLOP/s count only the visible work, as `bench --mods` does."""

    def __init__(self, mod: str | None, head_dim: int, causal: bool, batch: int, seqlen: int,
                 heads: int):
        self.mod, self.causal, self.head_dim = mod, causal, head_dim
        self.spec, self.values, self.block_mask = SPEC, (), None
        self.score_mod, self.mask_mod = None, None
        self.reference_causal = causal
        pairs = batch * bench_mods.window_pairs(seqlen, seqlen, -1, -1, causal)
        if mod not in (None, "varlen_window"):   # varlen_window: its ranges, below
            name, args = mod_args(mod, causal, heads, batch, seqlen)
            self.spec = mods_sm90.sm90_spec(name)
            self.values = tuple(args[a.name] for a in self.spec.mods.args)
        # The float32 reference's view of the same modification, and the visible pairs.
        if mod == "softcap":
            self.score_mod = bench_mods.softcap_score_mod(args["softcap"])
        elif mod == "alibi":
            self.score_mod = bench_mods.alibi_score_mod(args["alibi_slopes"], 0)
        elif mod == "window":
            left, right = args["window_left"], args["window_right"]
            self.mask_mod = bench_mods.window_mask_mod(left, right, 0, causal)
            pairs = batch * bench_mods.window_pairs(seqlen, seqlen, left, right, causal)
        elif mod == "varlen_window":   # the bench's call: the batch's documents flattened
            lengths = bench_mods.document_lengths(batch, seqlen, max(2, seqlen // 1024), seqlen)
            flat = [n for row in lengths for n in row]
            offsets = torch.tensor([0, *itertools.accumulate(flat)], dtype=torch.int32,
                                   device="cuda")
            window = bench_mods.VARLEN_WINDOW[causal]
            start, end, *_, self.causal = packed._varlen(offsets, offsets, causal, True, window)
            self.spec = mods_sm90.sm90_spec("flash_attn_packed")
            self.values = (start, end)
            ids = bench_mods.document_ids([flat]).cuda()
            self.mask_mod = and_masks(bench_mods.document_mask_mod(ids, causal),
                                                 bench_mods.window_mask_mod(*window, 0, causal))
            self.reference_causal = causal   # the ranges hold the causal mask
            pairs = bench_mods.document_pairs(lengths, causal, window)
        elif mod in ("document", "packed"):
            ids = mod_args("document", causal, heads, batch, seqlen)[1]["doc_q"]
            self.mask_mod = bench_mods.document_mask_mod(ids, causal)
            if mod == "document":   # its block mask built once, outside the timing
                self.block_mask = blockmask.create_block_mask(self.spec, self.params, batch,
                                                              heads, seqlen, seqlen, args, "cuda")
            same = (ids[:, :, None] == ids[:, None, :])
            pairs = int((same.tril() if causal else same).sum())
        self.flops = bench_mods.masked_flops(pairs, heads, head_dim)

    @property
    def params(self) -> dict:
        return {"head_dim": self.head_dim, "dtype": "bf16", "causal": self.causal}

    def shipped(self, batch, seqlen, heads) -> dict:
        variant = self.spec.variant(arch="sm_90a", **self.params)
        problem = tune.Problem(batch, heads, heads, seqlen, seqlen)
        return dict(tune.lookup(self.spec, variant, problem).values)

    def __call__(self, q, k, v, config):
        if self.mod is None:
            return hopper.flash_attn_forward_sm90(q, k, v, self.causal, config=config)
        return mods_sm90.forward_sm90(self.spec, q, k, v, self.params, self.head_dim ** -0.5,
                                      self.values, config=config, block_mask=self.block_mask)


def check(case, q, k, v, config) -> str:
    out, _ = case(q, k, v, config)
    mods = {"score_mod": case.score_mod, "mask_mod": case.mask_mod}
    ref, _ = attention_ref(q, k, v, case.reference_causal, upcast=True, **mods)
    pt, _ = attention_ref(q, k, v, case.reference_causal, upcast=False, **mods)
    err, err_pt = max_error(out, ref), max_error(pt, ref)
    ok = err <= 2 * err_pt + rounding_allowance(ref)
    return f"{'ok' if ok else 'WRONG'} err {err:.2e} (torch {err_pt:.2e})"


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn's launches as a CUDA graph, so the timing is the kernel's. Called with a config, the
    launch path plans it anew each call (tensor-map layouts, the kernel's lookup): at 512-1k
    tokens that host work outlasted the kernel and the L2 flush, and the timings were the host's
    (up to 2x low; PERF_NOTES §27)."""
    fn()   # loads the kernel: no module loads during a capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def plan(opts) -> list[tuple]:
    """(head_dim, causal, seqlen, batch, heads, case, variant, configs) of each shape to time:
    the shipped config first, then its variations; alternatives the spec forbids are dropped
    (--alts), and a shape where --key's values are forbidden is skipped."""
    causals = {"both": [False, True], "true": [True], "false": [False]}[opts.causal]
    plans = []
    for head_dim in opts.head_dims:
        for causal in causals:
            for seqlen in opts.seqlens:
                batch, heads = max(1, opts.tokens // seqlen), 2048 // head_dim
                case = Case(opts.mod, head_dim, causal, batch, seqlen, heads)
                if opts.mod == "varlen_window":   # one sequence of the batch's tokens
                    batch, seqlen = 1, batch * seqlen
                base = {**case.shipped(batch, seqlen, heads), **opts.config}
                configs = [{**base, opts.key: value} for value in opts.values] if opts.key else \
                    [base] + [{**base, **alt} for alt in opts.alts]
                variant = case.spec.variant(arch="sm_90a", **case.params)
                where = f"hd{head_dim} {'causal' if causal else 'full'} {seqlen}"
                if opts.alts:   # an alternative the spec forbids here is dropped, not the shape
                    kept = [configs[0]]
                    for alt, c in zip(opts.alts, configs[1:]):
                        problems = case.spec.violations(variant, case.spec.parse_config(c))
                        if problems:
                            print(f"{where}: alternative {alt} dropped: {problems[0]}", flush=True)
                        else:
                            kept.append(c)
                    configs = kept
                invalid = [problem for c in configs
                           for problem in case.spec.violations(variant, case.spec.parse_config(c))]
                if invalid:
                    print(f"{where}: skipped, {base} with {opts.key} {opts.values}: {invalid[0]}",
                          flush=True)
                    continue
                plans.append((head_dim, causal, seqlen, batch, heads, case, variant, configs))
    return plans


def prebuild(plans) -> dict:
    """Every config's kernel compiled up front, in threads (NVRTC releases the GIL): the timing
    loop then finds them in the cache instead of compiling one at a time. Returns the first line
    of each failed compile by (spec, variant, config slug): the timing loop skips those configs
    instead of stopping the lead (a C7520 in one alternative once cost a whole lead)."""
    builds = {}
    for *_, case, variant, configs in plans:
        for c in configs:
            config = case.spec.parse_config(c)
            builds[(case.spec.name, variant.slug, config.slug)] = (case.spec, variant, config)

    def build(item):
        key, (spec, variant, config) = item
        try:
            cache.compile_cached(render(spec, variant, config), variant.arch)
        except CompileError as error:
            print(f"{variant.slug} {config.slug}: {str(error).splitlines()[0]}", flush=True)
            return key, str(error).splitlines()[0]
        return key, None

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return {key: why for key, why in pool.map(build, builds.items()) if why}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--key", help="a tune key of flash_attn_fwd_sm90 (none: the shipped configs "
                   "alone, to compare source trees)")
    p.add_argument("--values", type=int, nargs="+", default=[])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--config", type=json.loads, default={})
    p.add_argument("--alts", type=json.loads, nargs="+", default=[],
                   help="instead of --key: the shipped config, then it with each of these "
                        "JSON objects' keys changed (several keys at once)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--export", metavar="FILE", help="the winners, for tools/merge_defaults.py")
    p.add_argument("--min-gain", type=float, default=0.015,
                   help="a winner's least gain over the shipped config (default 1.5%%)")
    p.add_argument("--mod", help="softcap, alibi, window, document, packed or varlen_window "
                   "(flash_attn_packed on the bench's varlen call's ranges): that shipped mods "
                   "spec with the bench's modifier values")
    opts = p.parse_args()
    plans = plan(opts)
    failed = prebuild(plans)
    rows, winners = [], []
    for head_dim, causal, seqlen, batch, heads, case, variant, configs in plans:
        torch.manual_seed(seqlen + head_dim)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        built = [(case.spec.name, variant.slug, case.spec.parse_config(c).slug) not in failed
                 for c in configs]
        if not built[0]:
            print(f"hd{head_dim} {'causal' if causal else 'full'} {seqlen}: skipped, the shipped "
                  f"config does not compile", flush=True)
            continue
        checks = ["failed to compile" if not ok else "-" if seqlen > 4096
                  else check(case, q, k, v, c) for c, ok in zip(configs, built)]
        graphs = [captured(lambda c=c: case(q, k, v, c)) if ok else None
                  for c, ok in zip(configs, built)]
        times = [[] for _ in configs]
        for _ in range(opts.rounds):
            for i, graph in enumerate(graphs):
                if graph is not None:
                    times[i].append(time_ms(graph.replay))
        tflops = [case.flops / statistics.median(t) / 1e9 if t else 0.0 for t in times]
        rows.append((head_dim, causal, seqlen, configs[0], tflops, checks))
        winner = max(range(len(configs)), key=tflops.__getitem__)
        if opts.export and winner and tflops[winner] >= (1 + opts.min_gain) * tflops[0] \
                and checks[winner].startswith(("ok", "-")):
            problem = tune.Problem(batch, heads, heads, seqlen, seqlen)
            winners.append(entry(case, variant, problem, configs[winner],
                                 statistics.median(times[winner])))
            export(opts.export, winners)   # each time: a call cut short keeps them
        cells = " ".join(f"{t:7.1f} {t / tflops[0]:.3f}x" for t in tflops)
        print(f"hd{head_dim} {'causal' if causal else 'full'} {seqlen}: {cells}  "
              f"{' | '.join(checks)}  base {configs[0]}", flush=True)
    print(f"\n{opts.key or 'shipped'}: " + " ".join(str(v) for v in opts.values or opts.alts))
    for head_dim, causal, seqlen, _, tflops, checks in rows:
        print(f"hd{head_dim:<4} {'causal' if causal else 'full':6} {seqlen:>6} "
              + " ".join(f"{t:7.1f} {t / tflops[0]:5.3f}x" for t in tflops)
              + ("  WRONG" if any(c.startswith("WRONG") for c in checks) else "")
              + ("  (0.0: failed to compile)" if "failed to compile" in checks else ""))
    if opts.export:
        export(opts.export, winners)
        print(f"{len(winners)} winners by >= {opts.min_gain:.1%} written to {opts.export}")


def export(path: str, winners: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"format": tune.DEFAULTS_FORMAT, "entries": winners}, f, indent=1)


def entry(case, variant, problem, config: dict, time_ms: float) -> dict:
    """A shipped-table entry (tune.export_defaults's format) for config measured at time_ms."""
    identity = tune.gpu_identity(torch.cuda.current_device())
    return {"spec": case.spec.name, "spec_hash": case.spec.content_hash, "variant": variant.slug,
            "arch": variant.arch, "bucket": problem.bucket().slug, "gpu": identity.gpu,
            "capability": identity.capability, "sm_count": identity.sm_count, "time_ms": time_ms,
            "driver": identity.driver, "nvrtc": identity.nvrtc, "kernelgen": identity.kernelgen,
            "problem": problem.as_dict(), "config": dict(case.spec.parse_config(config).values)}


if __name__ == "__main__":
    main()
