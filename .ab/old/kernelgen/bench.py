"""`kernelgen bench`: kernelgen against the peers on one GPU, in one process.

Systems: kernelgen (flash_attn_func, whichever family it dispatches to), kg_sm80 (the mma.sync
family forced; only on sm_90, where flash_attn_func runs the Hopper family), torch SDPA with its
flash backend (FlashAttention-2) and its cuDNN backend, and FlexAttention (torch.compile'd once
per process; causal through a BlockMask built once per shape, outside the timed region).
The grid is the FlashAttention papers': batch x seqlen = 16k tokens, hidden 2048
(heads = 2048 / head_dim), seqlen 512 .. 16k, causal both ways. FLOPs = 4 * batch * heads *
seqlen^2 * head_dim (halved for causal); backward 2.5x that, timed as (fwd + bwd) - fwd. Times
are medians of CUDA-event-timed repeats after warm-up; every system gets fresh inputs of the
same shape. A system that fails on a shape is recorded in that row's errors; the run goes on.

Output: a line per row as it is measured, bench.json, bench.png (TFLOP/s against seqlen, needs
matplotlib: pip install kernelgen[plot]) and, last, a summary table.
  kernelgen bench --plot DIR/bench.json   redraws DIR/bench.png from saved results (no GPU)
  kernelgen bench --mods [NAME ...]       the modifier benchmark (kernelgen/bench_mods.py)
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import torch


def time_ms(fn, warmup_ms: float = 30.0, rep_ms: float = 150.0) -> float:
    """Median milliseconds of fn() by CUDA events, each repeat after an L2 flush."""
    return statistics.median(time_samples(fn, warmup_ms, rep_ms, min_repeats=5, rounds=1))


def time_samples(fn, warmup_ms: float = 25.0, rep_ms: float = 50.0, min_repeats: int = 10,
                 max_repeats: int = 1000, rounds: int = 3, tolerance: float = 0.01) -> list[float]:
    """Milliseconds of every timed repeat of fn() by CUDA events, each after an L2 flush.

    A round is about rep_ms of repeats; another round follows until two consecutive rounds agree
    on the median within `tolerance` (at most `rounds`), so a clock ramp or a noisy neighbour
    shows up as disagreement instead of a confident wrong number. Within a round the repeats are
    queued back to back and read after one synchronize, as Triton's do_bench does: the flush
    before each repeat keeps the GPU busy while the host queues the next launch.
    """
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")  # 256 MB > L2
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    repeats = max(min_repeats, min(max_repeats, int(rep_ms / estimate)))
    samples: list[float] = []
    for _ in range(rounds):
        batch = _timed_round(fn, flush, repeats)
        previous = statistics.median(samples) if samples else None
        samples += batch
        if previous is not None and abs(statistics.median(batch) - previous) <= tolerance * previous:
            break
    return samples


def _timed_round(fn, flush, repeats: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def time_pass(call, q, k, v, backward: bool, tries: int = 3) -> float:
    """Milliseconds of call(q, k, v) -> out (batch, seqlen, heads, head_dim); with `backward`,
    of its backward, timed as (forward + backward) - forward (PEERS.md's rule). On a shape of
    microseconds, or a GPU that other work shares, that difference can come out at or below zero
    (a negative TFLOP/s in the table once, tiny causal 256 while the GPU suite ran beside it):
    both are timed again, and after `tries` such pairs it is an error, not a figure."""
    forward = time_ms(lambda: call(q, k, v))
    if not backward:
        return forward
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    for attempt in range(tries):
        if attempt:
            forward = time_ms(lambda: call(q, k, v))
        both = time_ms(lambda: torch.autograd.grad(call(q, k, v), (q, k, v), dout))
        if both > forward:
            return both - forward
    raise RuntimeError(f"backward not measurable: forward + backward took {both:.4f} ms, no more "
                       f"than the forward's {forward:.4f} ms, in {tries} tries (a shape this "
                       f"small, or a GPU shared with other work)")


# --- the systems: fn(q, k, v, causal) -> out, all in kernelgen's (batch, seqlen, heads, dim) ---

def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):
        # SDPA takes (batch, heads, seqlen, head_dim): transpose views in and out, no copies.
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}  # torch >= 2.5
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                v.transpose(1, 2), is_causal=causal,
                                                **gqa).transpose(1, 2)
    return run


_FLEX = None
_CAUSAL_MASKS: dict[tuple, object] = {}


def _compiled_flex():
    """flex_attention compiled once per process. Every grid shape is its own graph
    (dynamic=False, the fastest kernels), so the recompile limit is raised: past it dynamo would
    fall back to eager flex, which materializes the scores and times something else entirely."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4096))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_bshd(q, k, v, score_mod=None, block_mask=None):
    """FlexAttention on kernelgen's layout (transposed views in and out)."""
    return _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def causal_mask_mod(offset: int):
    """Bottom-right aligned causal mask_mod: query i sees key j <= i + (seqlen_k - seqlen_q)."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return causal


def causal_block_mask(seqlen_q: int, seqlen_k: int, device):
    """The causal BlockMask of a shape, built on first use and then reused (B, H = None:
    the same mask for every batch element and head)."""
    key = (seqlen_q, seqlen_k, str(device))
    mask = _CAUSAL_MASKS.get(key)
    if mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        mask = _CAUSAL_MASKS[key] = create_block_mask(causal_mask_mod(seqlen_k - seqlen_q), None,
                                                      None, seqlen_q, seqlen_k, device=device)
    return mask


def _flex(q, k, v, causal):
    mask = causal_block_mask(q.shape[1], k.shape[1], q.device) if causal else None
    return flex_bshd(q, k, v, block_mask=mask)


def _kg_sm80():
    """The mma.sync family forced, or a reason why it is not a separate system here."""
    from kernelgen import ops

    if torch.cuda.get_device_capability() != (9, 0):
        return "flash_attn_func runs the sm80 family on this GPU (same as kernelgen)"
    try:
        parameters = inspect.signature(ops.flash_attn_forward).parameters
    except (AttributeError, TypeError, ValueError) as exc:
        return f"kernelgen.ops.flash_attn_forward: {exc}"
    if "family" not in parameters:
        return "kernelgen.ops.flash_attn_forward takes no family= keyword in this version"

    def run(q, k, v, causal):
        return ops.flash_attn_forward(q, k, v, bool(causal), 1.0 / math.sqrt(q.shape[-1]),
                                      family="sm80")[0]
    return run


def systems(unavailable: dict | None = None) -> dict:
    """name -> fn(q, k, v, causal). A system that cannot run here is left out, with its reason
    in `unavailable` when given."""
    from torch.nn.attention import SDPBackend

    import kernelgen

    found = {"kernelgen": lambda q, k, v, causal: kernelgen.flash_attn_func(q, k, v, causal=causal)}
    sm80 = _kg_sm80()
    if callable(sm80):
        found["kg_sm80"] = sm80
    elif unavailable is not None:
        unavailable["kg_sm80"] = sm80
    found["sdpa_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    found["sdpa_cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    found["flex"] = _flex
    return found


FORWARD_ONLY = ("kg_sm80",)  # kernelgen's backward does not depend on the forward family


def python_overhead_us(calls: int = 2000, repeats: int = 7) -> float:
    """Host time per kernelgen.flash_attn_func call on a problem too small to be GPU-bound:
    the minimum over repeats, since the host's own noise only ever adds time."""
    import kernelgen

    q = torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16)
    kernelgen.flash_attn_func(q, q, q)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            kernelgen.flash_attn_func(q, q, q)
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best / calls * 1e6


def record_error(row: dict, name: str, exc: BaseException) -> None:
    row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()


def measure_row(found: dict, direction: str, head_dim: int, causal: bool, seqlen: int,
                tokens: int, hidden: int, dtype=torch.bfloat16) -> dict:
    batch, heads = max(1, tokens // seqlen), max(1, hidden // head_dim)
    row = {"pass": direction, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
           "batch": batch, "heads": heads, "tflops": {}, "ms": {}}
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    flops *= 2.5 if direction == "bwd" else 1.0
    for name, fn in found.items():
        if direction == "bwd" and name in FORWARD_ONLY:
            continue
        try:
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                       for _ in range(3))
            ms = time_pass(lambda q, k, v: fn(q, k, v, causal), q, k, v, direction == "bwd")
        except Exception as exc:  # a peer without a kernel for this shape, a compile failure, OOM
            record_error(row, name, exc)
            continue
        finally:
            q = k = v = None
        row["ms"][name] = ms
        row["tflops"][name] = flops / ms / 1e9
    return row


def measure_each(points, measure, show) -> list[dict]:
    """measure(*point) for every point of the product of `points`, each row printed by show(row)
    as soon as it is measured."""
    results = []
    for point in itertools.product(*points):
        results.append(measure(*point))
        print(show(results[-1]), flush=True)
    return results


def run_grid(head_dims, seqlens, causals, passes=("fwd",), tokens=16384, hidden=2048,
             found=None):
    found = systems() if found is None else found
    return measure_each((passes, head_dims, causals, seqlens),
                        lambda *point: measure_row(found, *point, tokens, hidden),
                        lambda row: format_row(row, list(found)))


# --- tables ---

# (ours, peer) pairs shown as ratios.
RATIOS = (("kernelgen", "sdpa_flash"), ("kernelgen", "sdpa_cudnn"), ("kernelgen", "flex"))
SHORT = {"kernelgen": "kg", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}


def _cell(value, width: int, spec: str = ".1f", suffix: str = "") -> str:
    return f"{value:{width - len(suffix)}{spec}}{suffix}" if value is not None else f"{'-':>{width}}"


def format_row(row: dict, columns) -> str:
    t = row["tflops"]
    cells = [_cell(t.get(c), 8) for c in columns]
    ratios = [_cell(t[a] / t[b] if a in t and b in t else None, 8, ".2f", "x") for a, b in RATIOS]
    return (f"{row['pass']:4} hd{row['head_dim']:<4} {'causal' if row['causal'] else 'full':7} "
            f"{row['seqlen']:>6} " + " ".join(cells) + "  " + " ".join(ratios))


def header(columns) -> str:
    names = [SHORT.get(c, c)[:8] for c in columns]
    ratios = [f"{SHORT.get(a, a)}/{SHORT.get(b, b)}"[:8] for a, b in RATIOS]
    return (f"{'pass':4} {'hd':6} {'mask':7} {'seqlen':>6} " + " ".join(f"{n:>8}" for n in names)
            + "  " + " ".join(f"{r:>8}" for r in ratios))


def columns_of(doc: dict) -> list[str]:
    """The systems of a results document: its list, else every name its rows timed."""
    names = list(doc.get("systems") or [])
    for row in doc.get("results", []):
        names += [name for name in row["tflops"] if name not in names]
    return names


def summary(doc: dict) -> str:
    """The compact table printed last: a line per row, then the errors, one line each."""
    columns = columns_of(doc)
    lines = [f"summary: TFLOP/s on {doc.get('device', '?')}, ratios = kernelgen / peer",
             header(columns)]
    lines += [format_row(row, columns) for row in doc.get("results", [])]
    for name, reason in (doc.get("unavailable") or {}).items():
        lines.append(f"  not run: {name}: {reason}")
    for row in doc.get("results", []):
        for name, error in (row.get("errors") or {}).items():
            lines.append(f"  error {row['pass']} hd{row['head_dim']} "
                         f"{'causal' if row['causal'] else 'full'} {row['seqlen']} {name}: "
                         f"{error[:120]}")
    return "\n".join(lines)


# --- the command ---

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelgen bench", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kernelgen bench --head-dims 128 --pass both      the grid, forward and backward\n"
               "  kernelgen bench --mods                           every modifier, hd128, 4k and 8k\n"
               "  kernelgen bench --plot bench-results/bench.json  redraw bench.png, no GPU needed")
    parser.add_argument("--head-dims", type=int, nargs="+",
                        help="default: 64 128 256 (with --mods: 128)")
    parser.add_argument("--seqlens", type=int, nargs="+",
                        help="default: 512 .. 16384 (with --mods: 4096 8192)")
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--pass", dest="passes", choices=["fwd", "bwd", "both"], default="fwd",
                        help="bwd: backward TFLOP/s (2.5x forward FLOPs), timed as fwd+bwd minus fwd")
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (default 16384)")
    parser.add_argument("--out", default="bench-results",
                        help="directory for bench.json and bench.png (mods.json with --mods)")
    parser.add_argument("--mods", nargs="*", metavar="NAME",
                        help="the modifier benchmark instead of the grid: window, softcap, alibi, "
                             "document, packed, varlen (none named: all)")
    parser.add_argument("--systems", nargs="+", metavar="NAME",
                        help="time only these (kernelgen, kg_sm80, sdpa_flash, sdpa_cudnn, flex); "
                             "default: all that run here")
    parser.add_argument("--plot", metavar="FILE.json",
                        help="only redraw the PNG (FILE.png beside it) from a saved bench.json")
    return parser


def write_plot(doc: dict, path: Path) -> Path | None:
    from kernelgen.bench_plot import plot_grid

    try:
        written = plot_grid(doc, path)
    except Exception as exc:  # never lose a run's numbers to a plotting problem
        print(f"note: no plot ({type(exc).__name__}: {exc})")
        return None
    print(f"saved {written}" if written else
          "note: matplotlib is not installed (pip install kernelgen[plot]); no PNG written")
    return written


def _replot(json_path: Path) -> int:
    doc = json.loads(json_path.read_text())
    if not doc.get("results") or "mods" in doc:  # mods.json is a table only
        print(f"kernelgen bench: {json_path} holds no grid results to plot")
        return 1
    write_plot(doc, json_path.with_suffix(".png"))
    print(summary(doc))
    return 0


def main(args=None) -> int:
    rest = getattr(args, "rest", None) if isinstance(args, argparse.Namespace) else args
    parser = build_parser()
    opts = parser.parse_args(rest)
    if opts.mods:
        from kernelgen.bench_mods import MODS

        unknown = [name for name in opts.mods if name not in MODS]
        if unknown:
            parser.error(f"--mods: unknown modifier {', '.join(unknown)}; allowed: {', '.join(MODS)}")
    if opts.plot:
        return _replot(Path(opts.plot))
    if not torch.cuda.is_available():
        print("kernelgen bench: no CUDA GPU here; nothing to time")
        return 1
    causals = {"both": [False, True], "true": [True], "false": [False]}[opts.causal]
    passes = ("fwd", "bwd") if opts.passes == "both" else (opts.passes,)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if opts.mods is not None:
        from kernelgen import bench_mods

        return bench_mods.run(opts.mods, opts.head_dims or [128], opts.seqlens or [4096, 8192],
                              causals, passes, opts.tokens, out_dir / "mods.json")
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; TFLOP/s (bf16), ratios = kernelgen / peer")
    overhead = python_overhead_us()
    print(f"python overhead per flash_attn_func call: {overhead:.1f} us")
    unavailable: dict = {}
    found = systems(unavailable)
    if opts.systems:
        unknown = [name for name in opts.systems if name not in found and name not in unavailable]
        if unknown:
            parser.error(f"--systems: unknown {', '.join(unknown)}; allowed: "
                         f"{', '.join([*found, *unavailable])}")
        found = {name: fn for name, fn in found.items() if name in opts.systems}
    print(header(list(found)))
    results = run_grid(opts.head_dims or [64, 128, 256],
                       opts.seqlens or [512, 1024, 2048, 4096, 8192, 16384], causals, passes,
                       opts.tokens, found=found)
    doc = {"device": device, "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "tokens": opts.tokens, "python_overhead_us": overhead,
           "systems": list(found),
           "unavailable": unavailable, "results": results}
    path = out_dir / "bench.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"saved {path}")
    write_plot(doc, out_dir / "bench.png")
    print(summary(doc))
    return 0
