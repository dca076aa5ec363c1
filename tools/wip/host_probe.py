"""Is a modifier row's backward timed on the GPU or on the host? The bench (bench.time_pass) times
the backward as (forward + backward) - forward with CUDA events around each call; when the host
takes longer to issue a call than the GPU to run it, the events measure the host. This prints,
per bench case (hd128 4k, 16k tokens, 16 heads), the host's time to issue one call (N calls
queued without a sync, so the launch queue never blocks) against the GPU's time for it, forward
and forward + backward, then cProfile's top functions of the slowest case's host path.

    PYTHONPATH=. python tools/wip/host_probe.py [--mods varlen_window packed] [--causal]
"""
import argparse
import cProfile
import functools
import pstats
import time

import torch

import kernelgen
from kernelgen.bench import time_ms
from kernelgen.bench_mods import build_case


def kernels_us(fn) -> float:
    """Microseconds of GPU kernels in one call of fn (torch.profiler), gaps excluded."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 5


def host_us(fn, calls: int = 30, after_warmup=None) -> float:
    """Microseconds the host spends issuing fn once (the GPU runs behind, never waited for):
    `calls` calls queued without a sync, after three untimed ones (then `after_warmup()`)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mods", nargs="+", default=["varlen_window", "varlen", "packed", "document"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    batch, heads, seqlen, hd = 4, 16, 4096, 128
    q, k, v, dout = (torch.randn(batch, seqlen, heads, hd, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    calls = {"plain": functools.partial(kernelgen.flash_attn_func, causal=args.causal),
             **{m: build_case(m, args.causal, batch, heads, seqlen, hd, "cuda").kernelgen
                for m in args.mods}}
    print(f"{'case':16} {'fwd host':>9} {'fwd evts':>9} {'fwd krnl':>9} {'f+b host':>9} "
          f"{'f+b evts':>9} {'f+b krnl':>9}  (us, causal={args.causal}; evts: the bench's timing)")
    slowest, worst = None, 0.0
    for name, call in calls.items():
        def fwd(call=call):
            return call(q, k, v)

        def both(call=call):   # bound now: cProfile reruns the slowest after the loop
            return torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), dout)
        row = (host_us(fwd, args.calls), time_ms(fwd) * 1e3, kernels_us(fwd),
               host_us(both, args.calls), time_ms(both) * 1e3, kernels_us(both))
        print(f"{name:16} " + " ".join(f"{x:9.1f}" for x in row), flush=True)
        if row[3] / row[5] > worst:
            slowest, worst = both, row[3] / row[5]

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        slowest()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
