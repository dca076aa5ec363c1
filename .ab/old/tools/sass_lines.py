"""The SASS of the forward kernel tools/profile_fwd.py runs, with each instruction's source lines
(nvdisasm --print-line-info-inline; kernels are compiled with -lineinfo), for tools/ncu_stalls.py
--lines: it names the template line behind each sampled instruction.

    python3 tools/sass_lines.py --head-dim 64 --seqlen 512 --causal > hd64c512.sass
    python3 tools/ncu_stalls.py src.csv --lines hd64c512.sass

The config is the one flash_attn_func takes for profile_fwd.py's problem (on a GPU: its tuning
database or the shipped table; without one: the shipped table's entry for --gpu), or --config's. Offsets match a report's only when the SASS
comes from the same NVRTC as the profiled kernel (the H200's is 13.0.88: run this there, or here
in a venv with nvidia-cuda-nvrtc==13.0.88); the NVRTC version goes to standard error.
"""
from __future__ import annotations

import argparse
import json
import sys

from kernelgen import cache, sass, tune
from kernelgen.compile import nvrtc_version
from kernelgen.render import render
from kernelgen.spec import load_spec


def has_gpu() -> bool:
    try:   # (a venv holding only another NVRTC for this script need not have torch)
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def shipped(spec, variant, problem, gpu: str):
    """The shipped table's config for the problem's nearest bucket on `gpu` (tune._from_shipped's
    choice, without a GPU to identify)."""
    rows = [row for (name, slug, arch, name_gpu, *_), found in tune._shipped_table().items()
            if (name, slug, arch, name_gpu) == (spec.name, variant.slug, variant.arch, gpu)
            for row in found]
    if not rows:
        raise SystemExit(f"no shipped entry of {variant.slug} for {gpu}: pass --config")
    wanted = problem.bucket()
    return spec.parse_config(dict(min(rows, key=lambda row: row[0].distance(wanted))[1].values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--config", type=json.loads, help="instead of the table's: a JSON object")
    p.add_argument("--gpu", default="NVIDIA H200", help="without a GPU: whose shipped entries")
    opts = p.parse_args()
    spec = load_spec("flash_attn_fwd_sm90")
    variant = spec.variant(arch="sm_90a", head_dim=opts.head_dim, dtype=opts.dtype,
                           causal=opts.causal)
    heads, batch = 2048 // opts.head_dim, max(1, 16384 // opts.seqlen)   # profile_fwd.py's
    problem = tune.Problem(batch, heads, heads, opts.seqlen, opts.seqlen)
    if opts.config is not None:
        config = spec.parse_config(opts.config)
    elif has_gpu():
        config = tune.lookup(spec, variant, problem)
    else:
        config = shipped(spec, variant, problem, opts.gpu)
    binary = cache.compile_cached(render(spec, variant, config), variant.arch)
    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}; {variant.slug} {config.slug}",
          file=sys.stderr)
    sys.stdout.write(sass._run_on_cubin([str(sass.tool("nvdisasm")), "--print-code",
                                         "--print-line-info-inline"], binary.cubin))


if __name__ == "__main__":
    main()
