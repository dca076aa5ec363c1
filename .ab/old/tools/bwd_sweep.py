"""Time every valid config of the backward specs on the GPU (what their defaults should come from).

Usage: python tools/bwd_sweep.py [--head-dims 64 128 256] [--seqlen 4096] [--dq]
Per (head_dim, causal): each flash_attn_bwd config's TFLOP/s for prep + main + dQ cast (the
atomic path; 2.5x forward FLOPs), registers, spills, and whether its gradients match the
reference on a small problem; with --dq the same for flash_attn_bwd_dq configs (deterministic
path, main kernel at its default). Best first; * marks the current default.
"""
import argparse
import math

import torch

from kernelgen import api, backward
from kernelgen.bench import attention_flops, time_ms
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import load_spec


def reference_grads(q, k, v, dout, causal, upcast):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout)


def problem(batch, seqlen, heads, head_dim, causal):
    import kernelgen

    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    with torch.no_grad():
        out, lse = kernelgen.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    return dout, q, k, v, out, lse


def sweep(name, head_dim, causal, opts, arch, device):
    spec = load_spec(name)
    variant = spec.variant(arch=arch, head_dim=head_dim, dtype="bf16", causal=causal)
    default = spec.default_config(variant)
    heads, batch = 2048 // head_dim, max(1, 16384 // opts.seqlen)
    big = problem(batch, opts.seqlen, heads, head_dim, causal)
    small = problem(1, 513, 4, head_dim, causal)
    refs = reference_grads(*small[1:4], small[0], causal, upcast=True)
    pts = reference_grads(*small[1:4], small[0], causal, upcast=False)
    bounds = [2 * max_error(p, r) + rounding_allowance(r) + 1e-4 for p, r in zip(pts, refs)]
    params = dict(head_dim=head_dim, dtype="bf16", causal=causal)
    prep = api.load(backward.PREP_SPEC, arch=arch, dtype="bf16")
    rows = []
    for config in spec.valid_configs(variant):
        try:
            kernel = api.load(spec, arch=arch, config=config.as_dict(), **params)
        except Exception as exc:
            rows.append((0.0, config.slug, f"compile failed: {str(exc)[:80]}"))
            continue
        if name == backward.MAIN_SPEC:
            kernels = backward._Kernels(prep, kernel, None)
        else:
            kernels = backward._Kernels(prep, api.load(backward.MAIN_SPEC, arch=arch, **params), kernel)
        launch = backward._launcher(device)
        scale = 1.0 / math.sqrt(head_dim)
        got = backward._run(kernels, launch, *small, scale)
        ok = all(max_error(g, r) <= b for g, r, b in zip(got, refs, bounds))
        ms = time_ms(lambda: backward._run(kernels, launch, *big, scale))
        tflops = 2.5 * attention_flops(batch, heads, opts.seqlen, opts.seqlen, head_dim, causal) / ms / 1e9
        b = kernel.binary
        spill = f" SPILLS {b.spill_stores}B" if b.spill_stores or b.stack_bytes else ""
        rows.append((tflops, config.slug, f"{'ok' if ok else 'WRONG'} regs={b.registers}{spill}"
                                          f"{'*' if config == default else ''}"))
    rows.sort(reverse=True)
    print(f"== {name} hd{head_dim} {'causal' if causal else 'full'} seqlen {opts.seqlen} (* = default)")
    for tflops, slug, note in rows:
        print(f"  {tflops:7.1f} TFLOP/s  {slug:48} {note}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--dq", action="store_true", help="also sweep flash_attn_bwd_dq (deterministic path)")
    opts = p.parse_args()
    arch = api.pick_arch(load_spec(backward.MAIN_SPEC))
    device = torch.cuda.current_device()
    for head_dim in opts.head_dims:
        for causal in (False, True):
            sweep(backward.MAIN_SPEC, head_dim, causal, opts, arch, device)
            if opts.dq:
                sweep(backward.DQ_SPEC, head_dim, causal, opts, arch, device)


if __name__ == "__main__":
    main()
