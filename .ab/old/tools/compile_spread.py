"""Compile a spread of the Hopper forward's configs that set one tune key, with NVRTC on the CPU:
for each shipped spec asked for (plain: flash_attn_fwd_sm90; else a mods spec put onto it), head
dim and causal mode, the valid configs with KEY = VALUE, grouped by block_m, schedule,
persistent, stages and the --group-by keys, the smallest and largest block_n of each group (rescale
and sum_mma left at 0). Prints registers and spills per config and a count at the end: how a new
key fares at the register budget's edge before any GPU time is spent on it (PERF_NOTES §75, §77).
With --exps, also how many of a block's exp2s ptxas left beside the previous block's P V (sass.
exps_beside_wgmma; the overlapped schedules, PERF_NOTES §79), flagged where fewer than the block's.

    python tools/compile_spread.py --key carry_qk --group-by half_diag --specs plain flash_attn_softcap
"""
from __future__ import annotations

import argparse
import itertools

from kernelgen import cache, mods_sm90, sass
from kernelgen.compile import CompileError
from kernelgen.render import render
from kernelgen.spec import load_spec


def spread(spec, variant, key: str, value: int, group_by: list[str]) -> list:
    groups: dict[tuple, list] = {}
    for config in spec.valid_configs(variant):
        d = config.as_dict()
        if d.get(key) != value or d.get("rescale") or d.get("sum_mma"):
            continue
        group = (d["block_m"], d["schedule"], d["persistent"], d["stages"],
                 *(d.get(k, 0) for k in group_by))
        groups.setdefault(group, []).append(config)
    picks = []
    for configs in groups.values():
        configs.sort(key=lambda c: c.as_dict()["block_n"])
        picks += [configs[0]] + ([configs[-1]] if len(configs) > 1 else [])
    return picks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", nargs="+", default=["plain"],
                   help="plain (flash_attn_fwd_sm90) and/or shipped mods specs")
    p.add_argument("--key", required=True)
    p.add_argument("--value", type=int, default=1)
    p.add_argument("--group-by", nargs="+", default=[], help="more tune keys that split the groups")
    p.add_argument("--exps", action="store_true", help="count the exp2s beside the P V (SASS)")
    opts = p.parse_args(argv)
    compiled = spilled = failed = apart = 0
    for name in opts.specs:
        spec = load_spec("flash_attn_fwd_sm90") if name == "plain" else mods_sm90.sm90_spec(name)
        head_dims = next(p.values for p in spec.params if p.name == "head_dim")
        for head_dim, causal in itertools.product(head_dims, (False, True)):
            variant = spec.variant(arch="sm_90a", head_dim=head_dim, dtype="bf16", causal=causal)
            for config in spread(spec, variant, opts.key, opts.value, opts.group_by):
                compiled += 1
                try:
                    binary = cache.compile_cached(render(spec, variant, config), "sm_90a")
                except CompileError as error:
                    failed += 1
                    print(name, head_dim, int(causal), config.slug, "FAILED", str(error).splitlines()[0])
                    continue
                spilled += bool(binary.spill_stores)
                exps = ""
                if opts.exps and config["schedule"] > 0:
                    beside = sass.exps_beside_wgmma(sass.sass(binary.cubin))
                    apart += beside < config["block_n"] // 2
                    exps = f"exps beside P V {beside}" + (
                        " APART" if beside < config["block_n"] // 2 else "")
                print(name, head_dim, int(causal), config.slug, "registers", binary.registers,
                      "SPILL" if binary.spill_stores else "", exps, flush=True)
    print(f"compiled {compiled}: {spilled} spill, {failed} failed"
          + (f", {apart} with fewer exp2s beside the P V than a block's" if opts.exps else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
