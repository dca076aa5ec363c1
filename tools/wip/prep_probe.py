"""The backward's fixed costs at the bench's size (16k tokens x 16 heads x hd128 bf16): the prep
kernel as shipped (D = rowsum(dO * O) and the fp32 dQ accumulator zeroed in one pass) against
the prep without the accumulator plus torch's zero_ of it (a pure read, then a pure write), and
the dQ cast (copy_) alone. Microseconds by CUDA events, median of 50 each.

    PYTHONPATH=. python tools/wip/prep_probe.py
"""
import torch

from kernelgen import backward

tokens, heads, hd = 16384, 16, 128
o, dout = (torch.randn(1, tokens, heads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
dsum = torch.empty(1, heads, tokens, device="cuda", dtype=torch.float32)
accum = torch.empty(1, tokens, heads, hd, device="cuda", dtype=torch.float32)
dq = torch.empty_like(o)
prep = backward.prep_kernel(0, "bf16")
launch = backward._launcher(0)
sizes = {"batch": 1, "heads": heads, "heads_k": heads, "seqlen_q": tokens, "seqlen_k": tokens,
         "head_dim": hd}
strides = (*o.stride()[:3], *dout.stride()[:3])


def run_prep(with_accum: bool):
    launch(prep, (o, dout, dsum, accum if with_accum else None, *strides, 1, heads, tokens, hd),
           sizes)


def time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[reps // 2] * 1e3


# Correctness of the split: the same D, and a zero accumulator either way.
accum.fill_(1.0)
run_prep(True)
torch.cuda.synchronize()
assert accum.abs().max().item() == 0.0
reference = dsum.clone()
dsum.fill_(float("nan"))
run_prep(False)
torch.cuda.synchronize()
assert torch.equal(dsum, reference)

rows = {
    "prep + zeroing (shipped)": lambda: run_prep(True),
    "prep alone": lambda: run_prep(False),
    "zero_ alone": lambda: accum.zero_(),
    "prep alone + zero_": lambda: (run_prep(False), accum.zero_()),
    "dQ cast (copy_)": lambda: dq.copy_(accum),
}
mb = {"prep + zeroing (shipped)": 4 * o.numel() + 4 * accum.numel(), "prep alone": 4 * o.numel(),
      "zero_ alone": 4 * accum.numel(), "prep alone + zero_": 4 * o.numel() + 4 * accum.numel(),
      "dQ cast (copy_)": 4 * accum.numel() + 2 * dq.numel()}
print(f"{torch.cuda.get_device_name()}: {'case':26} {'us':>8} {'TB/s':>6}")
for name, fn in rows.items():
    us = time_us(fn)
    print(f"  {name:26} {us:8.1f} {mb[name] / us / 1e6:6.2f}")
