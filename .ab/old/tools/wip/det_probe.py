"""Whether dQ's fp32 accumulator traffic is what slows the short-window backward: the bench's
varlen-with-a-window backward (16k flattened tokens, 16 heads, hd128 bf16; ~1k-token documents,
window (256, 256) / causal (256, 0)) and plain varlen, timed with dQ by atomics into dq_accum
(the Hopper backward) against deterministic=True (sm_80 main kernel without atomics + a dQ kernel
that recomputes S and dP per query tile: no accumulator). Backward ms as bench.time_pass times it.

    PYTHONPATH=. python tools/wip/det_probe.py
"""
import torch

import kernelgen
from kernelgen.bench import time_pass
from kernelgen.bench_mods import VARLEN_WINDOW, document_lengths

batch, seqlen, heads, hd = 4, 4096, 16, 128
lengths = document_lengths(batch, seqlen, seqlen // 1024, seed=seqlen)
flat = [n for row in lengths for n in row]
offsets = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(1, batch * seqlen, heads, hd, device="cuda", dtype=torch.bfloat16)
           for _ in range(3))
print(f"{'case':24} {'atomics ms':>10} {'determ. ms':>10} {'ratio':>6}")
for causal in (False, True):
    for name, window in (("varlen", (-1, -1)), ("varlen_window", VARLEN_WINDOW[causal])):
        ms = {}
        for det in (False, True):
            def call(q, k, v, det=det, window=window):
                return kernelgen.flash_attn_varlen_func(
                    q[0], k[0], v[0], offsets, offsets, causal=causal, window_size=window,
                    deterministic=det)[None]
            ms[det] = min(time_pass(call, q, k, v, backward=True) for _ in range(3))
        label = f"{name}{' causal' if causal else ''}"
        print(f"{label:24} {ms[False]:10.3f} {ms[True]:10.3f} {ms[True] / ms[False]:6.2f}")
