"""Gradients of one `kernelgen bench --mods` case (or plain attention) from both backward main
kernels (the Hopper one and mma.sync's, KERNELGEN_BACKWARD), against a float32 reference on a few
heads, and each kernel against its own second run (dQ is accumulated by atomics: run-to-run
differences are rounding, a race shows as more):

    python tools/bwd_check.py --mod window --causal [--seqlen 4096] [--heads-checked 2]
"""
from __future__ import annotations

import argparse
import os

import torch

import kernelgen
from kernelgen import backward, bench_mods, env
from kernelgen.reference import attention_ref, max_error


def grads(call, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    call(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mod", choices=bench_mods.MODS)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads-checked", type=int, default=2)
    opts = parser.parse_args()
    heads, batch = bench_mods.HIDDEN // opts.head_dim, max(1, 16384 // opts.seqlen)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, opts.seqlen, heads, opts.head_dim, device="cuda",
                                 dtype=torch.bfloat16) for _ in range(4))
    mask_mod = score_mod = None
    if opts.mod:
        case = bench_mods.build_case(opts.mod, opts.causal, batch, heads, opts.seqlen,
                                     opts.head_dim, "cuda")
        call, score_mod = case.kernelgen, case.score_mod
        if opts.mod == "window":
            left, right = bench_mods.WINDOW[opts.causal]
            mask_mod = bench_mods.window_mask_mod(left, right, 0, opts.causal)
        elif opts.mod == "document":
            lengths = bench_mods.document_lengths(batch, opts.seqlen, max(2, opts.seqlen // 1024),
                                                  seed=opts.seqlen)
            mask_mod = bench_mods.document_mask_mod(bench_mods.document_ids(lengths).cuda(),
                                                    opts.causal)
    else:
        call = lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=opts.causal)  # noqa: E731
    causal_ref = opts.causal and opts.mod not in ("window", "document")   # those masks hold it
    h = slice(0, opts.heads_checked)
    sl = [t[:1, :, h] for t in (q, k, v, dout)]
    refs = grads(lambda q, k, v: attention_ref(q, k, v, causal_ref, upcast=True, score_mod=score_mod,
                                               mask_mod=mask_mod)[0], *sl[:3], sl[3].float())
    lows = grads(lambda q, k, v: attention_ref(q, k, v, causal_ref, upcast=False,
                                               score_mod=score_mod, mask_mod=mask_mod)[0], *sl)
    print(f"case {opts.mod or 'plain'} causal={opts.causal} seqlen={opts.seqlen} "
          f"hd={opts.head_dim}: errors on batch 0, heads {h.start}..{h.stop - 1}")
    print("  torch bf16 vs fp32:", " ".join(f"d{n}={max_error(lo, r):.3g}"
                                            for n, lo, r in zip("qkv", lows, refs)))
    for kernel in ("sm90", "sm80"):
        os.environ["KERNELGEN_BACKWARD"] = "auto" if kernel == "sm90" else kernel
        env.reload_settings()
        backward._KERNELS.clear()   # its key does not hold the switch
        first, second = grads(call, q, k, v, dout), grads(call, q, k, v, dout)
        finite = all(bool(torch.isfinite(g).all()) for g in first)
        errors = " ".join(f"d{n}={max_error(g[:1, :, h], r):.3g}" for n, g, r in zip("qkv", first, refs))
        rerun = " ".join(f"d{n}={max_error(a, b):.3g}" for n, a, b in zip("qkv", first, second))
        ran = {kernels.main.spec.name for kernels in backward._KERNELS.values()}
        print(f"  {kernel} ({', '.join(sorted(ran))}): finite={finite} vs fp32: {errors} | run to run: {rerun}")


if __name__ == "__main__":
    main()
