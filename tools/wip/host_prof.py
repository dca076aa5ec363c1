"""Where a bench row's host time goes (PERF_NOTES §116, §119): every function of the kernelgen
package (and torch.empty / torch.zeros, which our code looks up at call time) wrapped in a timer,
then N calls of a case queued without a sync; prints per function its calls and inclusive
microseconds per call of the case, largest first. Inclusive: a caller's time holds its callees'.
Then one call of each case under torch.cuda.set_sync_debug_mode("warn"): any host sync it makes.

    PYTHONPATH=. python tools/wip/host_prof.py [--cases varlen_window:fb plain:fb varlen_window:f]
"""
import argparse
import collections
import functools
import inspect
import sys
import time
import warnings

import torch

import kernelgen
from kernelgen.bench_mods import build_case
from host_probe import host_us   # tools/wip, this script's directory

parser = argparse.ArgumentParser()
parser.add_argument("--cases", nargs="+",
                    default=["varlen_window:f", "varlen_window:fb", "plain:fb", "packed:f"])
parser.add_argument("--causal", action="store_true")
parser.add_argument("--calls", type=int, default=40)
parser.add_argument("--top", type=int, default=28)
args = parser.parse_args()

TOTAL = collections.defaultdict(float)   # qualified name -> seconds, inclusive
COUNT = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TOTAL[name] += time.perf_counter() - start
            COUNT[name] += 1
    wrapper.__kg_timed__ = True
    return wrapper


def instrument():
    """Wrap each kernelgen function once, and rebind every module-level reference to it."""
    wrapped = {}
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("kernelgen") and m]
    for mod in mods:
        for name, obj in list(vars(mod).items()):
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                wrapped[obj] = timed(f"{mod.__name__[10:]}.{name}", obj)
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for attr, member in list(vars(obj).items()):
                    raw = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not inspect.isfunction(raw) or attr.startswith("__") and attr != "__call__":
                        continue
                    w = timed(f"{mod.__name__[10:]}.{name}.{attr}", raw)
                    setattr(obj, attr, type(member)(w) if raw is not member else w)
    for mod in mods:
        for name, obj in list(vars(mod).items()):
            if inspect.isfunction(obj) and obj in wrapped:
                setattr(mod, name, wrapped[obj])
    for name in ("empty", "zeros", "empty_like"):
        setattr(torch, name, timed(f"torch.{name}", getattr(torch, name)))


batch, heads, seqlen, hd = 4, 16, 4096, 128
q, k, v, dout = (torch.randn(batch, seqlen, heads, hd, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))
qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
fns = {}
for case in args.cases:
    mod, passes = case.split(":")
    call = (functools.partial(kernelgen.flash_attn_func, causal=args.causal) if mod == "plain"
            else build_case(mod, args.causal, batch, heads, seqlen, hd, "cuda").kernelgen)
    if passes == "f":
        fns[case] = functools.partial(lambda c: c(q, k, v), call)
    else:
        fns[case] = functools.partial(
            lambda c: torch.autograd.grad(c(qg, kg, vg), (qg, kg, vg), dout), call)
for fn in fns.values():   # compile, plan and remember outside the timing
    fn()
torch.cuda.synchronize()

for case, fn in fns.items():   # plain host time first, then with the timers
    print(f"{case}: host {host_us(fn, args.calls):.1f} us a call (no timers)")
instrument()
for case, fn in fns.items():
    whole = host_us(fn, args.calls, after_warmup=lambda: (TOTAL.clear(), COUNT.clear()))
    print(f"\n== {case}: {whole:.1f} us a call with timers; inclusive us / calls a call")
    for name, secs in sorted(TOTAL.items(), key=lambda x: -x[1])[:args.top]:
        print(f"  {secs / args.calls * 1e6:8.1f}  {COUNT[name] / args.calls:5.1f}  {name}")
torch.cuda.synchronize()
for case, fn in fns.items():
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"{case}: {len(caught)} syncing calls" + "".join(
        f"\n    {w.filename}:{w.lineno}: {str(w.message)[:90]}" for w in caught[:4]))
