"""Compare `kernelgen bench` runs of two source trees, interleaved A B A B on one GPU (the grid's
bench.json, or --mods' mods.json: its rows keyed by modifier too):
    python tools/ab_trees.py A1/bench.json B1/bench.json A2/bench.json B2/bench.json
Prints each shape's kernelgen TFLOP/s per tree (mean of its runs) and the ratio B / A, with both
runs' ratios, so the spread shows next to the difference."""
from __future__ import annotations

import json
import statistics
import sys


def rows(path):
    doc = json.loads(open(path).read())
    return {(r["head_dim"], r["causal"], r["seqlen"], r.get("pass", "fwd"), r.get("mod", "")):
            r["tflops"]["kernelgen"] for r in doc["results"] if "kernelgen" in r["tflops"]}


def main() -> None:
    runs = [rows(p) for p in sys.argv[1:]]
    a, b = runs[0::2], runs[1::2]
    print(f"{'shape':33} {'A':>7} {'B':>7}  B/A   (per pair)")
    ratios = []
    for key in a[0]:
        ta, tb = statistics.mean(r[key] for r in a), statistics.mean(r[key] for r in b)
        pairs = " ".join(f"{y[key] / x[key]:.3f}" for x, y in zip(a, b))
        ratios.append(tb / ta)
        hd, causal, seqlen, kind, mod = key
        print(f"{mod:8} hd{hd} {'causal' if causal else 'full':6} {seqlen:>6} {kind:4} "
              f"{ta:7.1f} {tb:7.1f}  {tb / ta:.3f} ({pairs})")
    print(f"geomean B/A {statistics.geometric_mean(ratios):.3f} over {len(ratios)} shapes")


if __name__ == "__main__":
    main()
