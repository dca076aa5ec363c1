"""Tune the shipped modifier specs on the cases `kernelgen bench --mods` runs (hd128 bf16, 16
heads, batch x seqlen = 16k tokens), forward and backward, through AttentionKernel.tune, and
export the tuning DB in the shipped-defaults format.

    python tools/tune_mods.py [--seqlens 4096] [--mods window softcap alibi] [--pass bwd] [--export FILE]
"""
from __future__ import annotations

import argparse
import time

import torch

import kernelgen
from kernelgen import bench_mods, tune
from kernelgen.tune_cli import format_table


def mod_args(mod: str, causal: bool, heads: int, batch: int, seqlen: int) -> tuple[str, dict]:
    if mod == "window":
        left, right = bench_mods.WINDOW[causal]
        return "flash_attn_window", {"window_left": left, "window_right": right}
    if mod == "softcap":
        return "flash_attn_softcap", {"softcap": bench_mods.SOFTCAP}
    if mod == "alibi":
        return "flash_attn_alibi", {"alibi_slopes": bench_mods.alibi_slopes(heads).cuda(),
                                    "alibi_stride_b": 0}
    if mod == "document":   # the bench's documents (same seed)
        lengths = bench_mods.document_lengths(batch, seqlen, max(2, seqlen // 1024), seed=seqlen)
        ids = bench_mods.document_ids(lengths).cuda()
        return "flash_attn_document", {"doc_q": ids, "doc_k": ids}
    if mod == "packed":   # the same documents as key ranges
        ids = mod_args("document", causal, heads, batch, seqlen)[1]["doc_q"]
        start, end = kernelgen.packed_ranges(ids)
        return "flash_attn_packed", {"doc_start": start, "doc_end": end}
    raise ValueError(f"no tuning case for {mod!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    parser.add_argument("--mods", nargs="+", default=["window", "softcap", "alibi", "document", "packed"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pass", dest="passes", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument("--export", metavar="FILE")
    opts = parser.parse_args()
    heads = bench_mods.HIDDEN // opts.head_dim
    for seqlen in opts.seqlens:
        batch = max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, seqlen, heads, opts.head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        for mod in opts.mods:
            for causal in (False, True):
                name, args = mod_args(mod, causal, heads, batch, seqlen)
                kernel = kernelgen.load(name, head_dim=opts.head_dim, dtype="bf16", causal=causal)
                start = time.perf_counter()
                for result in kernel.tune(q, k, v, forward=opts.passes != "bwd",
                                          backward=opts.passes != "fwd", **args):
                    print(format_table(result, top=3 if result.chosen else 0), flush=True)
                print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    if opts.export:
        print(f"exported {tune.export_defaults(opts.export)} entries to {opts.export}")


if __name__ == "__main__":
    main()
