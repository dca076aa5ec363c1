"""Time every valid config of the forward spec on a few shapes (a precursor of `kernelgen tune`).

Usage: python tools/sweep.py [--head-dims 64 128 256] [--seqlen 4096]
Prints, per (head_dim, causal), each config's TFLOP/s and whether its output matched the
reference, best first.
"""
import argparse
import math

import torch

from kernelgen import api
from kernelgen.bench import attention_flops, time_ms
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import load_spec


def run(kernel, q, k, v, causal):
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen_q, device="cuda", dtype=torch.float32)
    kernel(q=q, k=k, v=v, o=out, lse=lse,
           q_stride_b=q.stride(0), q_stride_s=q.stride(1), q_stride_h=q.stride(2),
           k_stride_b=k.stride(0), k_stride_s=k.stride(1), k_stride_h=k.stride(2),
           v_stride_b=v.stride(0), v_stride_s=v.stride(1), v_stride_h=v.stride(2),
           o_stride_b=out.stride(0), o_stride_s=out.stride(1), o_stride_h=out.stride(2),
           batch=batch, heads=heads, heads_k=k.shape[2], seqlen_q=seqlen_q, seqlen_k=k.shape[1],
           softmax_scale=1.0 / math.sqrt(head_dim))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--top", type=int, default=6)
    opts = p.parse_args()
    spec = load_spec("flash_attn_fwd")
    arch = api.pick_arch(spec)
    for head_dim in opts.head_dims:
        for causal in (False, True):
            heads, batch = 2048 // head_dim, max(1, 16384 // opts.seqlen)
            q, k, v = (torch.randn(batch, opts.seqlen, heads, head_dim, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            small = [t[:1, :512] for t in (q, k, v)]
            ref, _ = attention_ref(*small, causal)
            pt, _ = attention_ref(*small, causal, upcast=False)
            bound = 2 * max_error(pt, ref) + rounding_allowance(ref)
            variant = spec.variant(arch=arch, head_dim=head_dim, dtype="bf16", causal=causal)
            default = spec.default_config(variant)
            rows = []
            for config in spec.valid_configs(variant):
                try:
                    kernel = api.load(spec, arch=arch, config=config.as_dict(), head_dim=head_dim,
                                      dtype="bf16", causal=causal)
                except Exception as exc:
                    rows.append((0.0, config.slug, f"compile failed: {str(exc)[:80]}"))
                    continue
                b = kernel.binary
                spill = f" SPILLS {b.spill_stores}B" if b.spill_stores or b.stack_bytes else ""
                ok = max_error(run(kernel, *small, causal), ref) <= bound
                ms = time_ms(lambda: run(kernel, q, k, v, causal))
                tflops = attention_flops(batch, heads, opts.seqlen, opts.seqlen, head_dim, causal) / ms / 1e9
                mark = "*" if config == default else " "
                rows.append((tflops, config.slug, f"{'ok' if ok else 'WRONG'} regs={b.registers}{spill}{mark}"))
            rows.sort(reverse=True)
            print(f"== hd{head_dim} {'causal' if causal else 'full'} seqlen {opts.seqlen} (* = default)")
            for tflops, slug, note in rows[: opts.top]:
                print(f"  {tflops:7.1f} TFLOP/s  {slug:40} {note}")
            d = [r for r in rows if r[2].endswith("*")]
            if d and d[0] not in rows[: opts.top]:
                print(f"  {d[0][0]:7.1f} TFLOP/s  {d[0][1]:40} {d[0][2]}")


if __name__ == "__main__":
    main()
