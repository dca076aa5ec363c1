"""One forward launch to profile with Nsight Compute (tools/h200_run.sh step `ncu`):

    ncu --clock-control none -k regex:flash_attn_fwd_sm90 -c 1 --launch-skip 3 \
        --section SpeedOfLight --section WarpStateStats ... python3 tools/profile_fwd.py

Runs kernelgen's forward (hd128 bf16 by default) a few times, so the profiled launch is a warm one.
`--mod window|softcap|alibi|document` runs that case of `kernelgen bench --mods` instead;
`--backward` adds a backward to each call (profile it with -k regex:flash_attn_bwd_sm90).
"""
from __future__ import annotations

import argparse

import torch

import kernelgen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--sdpa", choices=["flash", "cudnn"], help="run SDPA's backend instead")
    parser.add_argument("--mod", help="a case of `kernelgen bench --mods` (kernelgen's side)")
    parser.add_argument("--backward", action="store_true", help="a backward after each forward")
    opts = parser.parse_args()
    heads, batch = 2048 // opts.head_dim, max(1, 16384 // opts.seqlen)
    q, k, v = (torch.randn(batch, opts.seqlen, heads, opts.head_dim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=opts.backward) for _ in range(3))
    if opts.mod:
        from kernelgen import bench_mods

        case = bench_mods.build_case(opts.mod, opts.causal, batch, heads, opts.seqlen,
                                     opts.head_dim, "cuda")
    for _ in range(5):
        if opts.mod:
            out = case.kernelgen(q, k, v)
        elif opts.sdpa:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
            with sdpa_kernel(backend[opts.sdpa]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=opts.causal)
        else:
            out = kernelgen.flash_attn_func(q, k, v, causal=opts.causal)
        if opts.backward:
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
