"""`python -m kernelgen.demo`: the main job in one command.

With a GPU: compile the shipped forward kernel for it, check it against PyTorch's float32
attention on random inputs (FlashAttention's error rule) and time it against torch SDPA.
Without one: build every shipped variant for every arch (what a deployment would ship) and say
that nothing could run.
"""
from __future__ import annotations

import argparse
import sys


def _no_gpu() -> int:
    from kernelgen import build

    print("kernelgen demo: no CUDA GPU here. Building every shipped variant instead.")
    code = build.main(argparse.Namespace(arch=None, spec=None, out=None, jobs=None))
    print("kernelgen demo: built, but nothing could run without a GPU.")
    return code


def _gpu() -> int:
    import torch

    import kernelgen
    from kernelgen.bench import attention_flops, systems, time_ms
    from kernelgen.reference import attention_ref, max_error, rounding_allowance

    print(f"kernelgen demo on {torch.cuda.get_device_name()}")
    failures = 0
    for causal in (False, True):
        for head_dim in (64, 128, 256):
            q = torch.randn(2, 1000, 8, head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 1500, 2, head_dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            out = kernelgen.flash_attn_func(q, k, v, causal=causal)
            ref, _ = attention_ref(q, k, v, causal)
            pt, _ = attention_ref(q, k, v, causal, upcast=False)
            err, bound = max_error(out, ref), 2 * max_error(pt, ref) + rounding_allowance(ref)
            ok = err <= bound
            failures += not ok
            print(f"  check hd{head_dim} causal={causal!s:5}: max error {err:.2e} "
                  f"(bound {bound:.2e}) {'ok' if ok else 'WRONG'}")
    batch, seqlen, heads, head_dim = 4, 4096, 16, 128
    print(f"timing batch {batch}, seqlen {seqlen}, {heads} heads, hd{head_dim}, bf16 (TFLOP/s):")
    for causal in (False, True):
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        cells = []
        for name, fn in systems().items():
            try:
                cells.append(f"{name} {flops / time_ms(lambda: fn(q, k, v, causal)) / 1e9:6.1f}")
            except Exception as exc:
                cells.append(f"{name} unavailable ({type(exc).__name__})")
        print(f"  causal={causal!s:5}: " + " | ".join(cells))
    return 1 if failures else 0


def main() -> int:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    return _gpu() if has_gpu else _no_gpu()


if __name__ == "__main__":
    sys.exit(main())
