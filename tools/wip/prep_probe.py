"""The backward's fixed costs at the bench's size (16k tokens x 16 heads x hd128 bf16): the prep
kernel as shipped (D = rowsum(dO * O) and the fp32 dQ accumulator zeroed in one pass) against
the prep without the accumulator plus torch's zero_ of it (a pure read, then a pure write), and
the dQ cast (copy_) alone. Microseconds as the bench times them (bench.time_ms: CUDA events, an
L2 flush before each repeat, the median).

    PYTHONPATH=. python tools/wip/prep_probe.py
"""
import torch

from kernelgen import backward
from kernelgen.bench import time_ms

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
# D against float32: rowsum(dO * O) per (head, token).
expected = (o.float() * dout.float()).sum(-1).permute(0, 2, 1)
assert torch.allclose(reference, expected, rtol=1e-4, atol=1e-3), (reference - expected).abs().max()

read, accum_bytes = 4 * o.numel(), 4 * accum.numel()   # O and dO; the fp32 accumulator
rows = {   # name: (call, bytes it moves)
    "prep + zeroing (shipped)": (lambda: run_prep(True), read + accum_bytes),
    "prep alone": (lambda: run_prep(False), read),
    "zero_ alone": (lambda: accum.zero_(), accum_bytes),
    "prep alone + zero_": (lambda: (run_prep(False), accum.zero_()), read + accum_bytes),
    "dQ cast (copy_)": (lambda: dq.copy_(accum), accum_bytes + 2 * dq.numel()),
}
print(f"{torch.cuda.get_device_name()}: {'case':26} {'us':>8} {'TB/s':>6}")
for name, (fn, moved) in rows.items():
    us = time_ms(fn) * 1e3
    print(f"  {name:26} {us:8.1f} {moved / us / 1e6:6.2f}")
