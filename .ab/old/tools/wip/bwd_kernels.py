"""Per-kernel GPU times of the modifier benchmark's backward cases (torch.profiler): where a
masked backward's time goes (prep, main, dQ cast) against the plain kernel's.

    PYTHONPATH=. python tools/wip/bwd_kernels.py [--mods document packed varlen] [--causal]
        [--config '{"persistent": 1}']   (keys set on every Hopper backward main kernel's config)
"""
import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

import kernelgen
from kernelgen.bench_mods import build_case

parser = argparse.ArgumentParser()
parser.add_argument("--mods", nargs="+", default=["document", "packed", "varlen", "window", "alibi"])
parser.add_argument("--causal", action="store_true")
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--config", type=json.loads, default={})
args = parser.parse_args()
if args.config:   # every Hopper backward main kernel's config with these keys set (tune.lookup)
    from kernelgen import tune
    _lookup = tune.lookup

    def lookup(spec, variant, problem, device=None):
        config = _lookup(spec, variant, problem, device)
        if "flash_attn_bwd_sm90" in spec.name:
            config = spec.parse_config({**config.as_dict(), **args.config})
        return config
    tune.lookup = lookup
seqlen, hd = args.seqlen, args.head_dim
batch, heads = 16384 // seqlen, 2048 // hd
q, k, v, dout = (torch.randn(batch, seqlen, heads, hd, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
calls = {"plain": lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=args.causal)}
for mod in args.mods:
    calls[mod] = build_case(mod, args.causal, batch, heads, seqlen, hd, "cuda").kernelgen
for name, call in calls.items():
    for _ in range(3):
        torch.autograd.grad(call(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(call(q, k, v), (q, k, v), dout)
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time / reps
    total = sum(times.values())
    print(f"--- {name}: {total:8.1f} us of kernels per fwd+bwd")
    for kname, us in sorted(times.items(), key=lambda x: -x[1]):
        print(f"   {us:8.1f}  {kname}")
