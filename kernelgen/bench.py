"""`kernelgen bench`: kernelgen against the peers on one GPU, in one process.

Peers: torch SDPA with its flash backend (FlashAttention-2) and its cuDNN backend. The grid is the
FlashAttention papers': batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / head_dim),
seqlen 512 .. 16k, causal both ways. FLOPs = 4 * batch * heads * seqlen^2 * head_dim (halved for
causal). Times are medians of CUDA-event-timed repeats after warm-up; every system gets fresh
inputs of the same shape. Results are printed as a table and saved as JSON.
"""
from __future__ import annotations

import argparse
import json
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


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):
        # SDPA takes (batch, heads, seqlen, head_dim): transpose views, no copies.
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                v.transpose(1, 2), is_causal=causal)
    return run


def systems():
    from torch.nn.attention import SDPBackend

    import kernelgen

    found = {
        "kernelgen": lambda q, k, v, causal: kernelgen.flash_attn_func(q, k, v, causal=causal),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    if torch.cuda.get_device_capability() == (9, 0):  # the opt-in Hopper family, forward only
        from kernelgen.hopper import flash_attn_forward_sm90

        found["kg_sm90"] = lambda q, k, v, causal: flash_attn_forward_sm90(q, k, v, causal)[0]
    return found


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


def _timed(fn, q, k, v, causal, backward: bool) -> float:
    """Forward milliseconds, or backward milliseconds timed as (forward + backward) - forward."""
    forward = time_ms(lambda: fn(q, k, v, causal))
    if not backward:
        return forward
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        out = fn(q, k, v, causal)
        if out.dim() == 4 and out.shape != dout.shape:  # SDPA's (batch, heads, seqlen, dim) view
            out = out.transpose(1, 2)
        torch.autograd.grad(out, (q, k, v), dout)

    return time_ms(step) - forward


def run_grid(head_dims, seqlens, causals, passes=("fwd",), dtype=torch.bfloat16, tokens=16384,
             hidden=2048):
    results = []
    for direction in passes:
        for head_dim in head_dims:
            heads = hidden // head_dim
            for causal in causals:
                for seqlen in seqlens:
                    batch = max(1, tokens // seqlen)
                    row = {"pass": direction, "head_dim": head_dim, "causal": causal,
                           "seqlen": seqlen, "batch": batch, "heads": heads, "tflops": {}, "ms": {}}
                    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                    flops *= 2.5 if direction == "bwd" else 1.0
                    for name, fn in systems().items():
                        if direction == "bwd" and name == "kg_sm90":
                            continue  # forward only
                        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                                               dtype=dtype) for _ in range(3))
                        try:
                            ms = _timed(fn, q, k, v, causal, backward=direction == "bwd")
                        except Exception as exc:  # a peer without a kernel for this shape
                            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:200]
                            continue
                        row["ms"][name] = ms
                        row["tflops"][name] = flops / ms / 1e9
                        del q, k, v
                    results.append(row)
                    print(_format_row(row), flush=True)
    return results


COLUMNS = ("kernelgen", "kg_sm90", "sdpa_flash", "sdpa_cudnn")
# (ours, peer) pairs shown as ratios.
RATIOS = (("kernelgen", "sdpa_flash"), ("kernelgen", "sdpa_cudnn"), ("kg_sm90", "sdpa_cudnn"))


def _format_row(row) -> str:
    t = row["tflops"]
    cells = [f"{t[c]:8.1f}" if c in t else f"{'-':>8}" for c in COLUMNS]
    ratios = [f"{t[a] / t[b]:6.2f}x" if a in t and b in t else f"{'-':>7}" for a, b in RATIOS]
    return (f"{row['pass']:4} hd{row['head_dim']:<4} {'causal' if row['causal'] else 'full':7} {row['seqlen']:>6} "
            + " ".join(cells) + "  " + " ".join(ratios))


def header() -> str:
    names = {"kernelgen": "kg", "kg_sm90": "sm90", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}
    return (f"{'pass':4} {'hd':5} {'mask':7} {'seqlen':>6} " + " ".join(f"{c[:8]:>8}" for c in COLUMNS)
            + "  " + " ".join(f"{names[a] + '/' + names[b]:>7}" for a, b in RATIOS))


def main(args=None) -> int:
    parser = argparse.ArgumentParser(prog="kernelgen bench", description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--pass", dest="passes", choices=["fwd", "bwd", "both"], default="fwd",
                        help="bwd: backward TFLOP/s (2.5x forward FLOPs), timed as fwd+bwd minus fwd")
    parser.add_argument("--out", default="bench-results", help="directory for the JSON results")
    rest = getattr(args, "rest", None) if isinstance(args, argparse.Namespace) else args
    opts = parser.parse_args(rest)
    if not torch.cuda.is_available():
        print("kernelgen bench: no CUDA GPU here; nothing to time")
        return 1
    causals = {"both": [False, True], "true": [True], "false": [False]}[opts.causal]
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; TFLOP/s (bf16), ratios = kernelgen / peer")
    overhead = python_overhead_us()
    print(f"python overhead per flash_attn_func call: {overhead:.1f} us")
    print(header())
    passes = ("fwd", "bwd") if opts.passes == "both" else (opts.passes,)
    results = run_grid(opts.head_dims, opts.seqlens, causals, passes)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                "python_overhead_us": overhead, "results": results}, indent=1))
    print(f"saved {path}")
    return 0
