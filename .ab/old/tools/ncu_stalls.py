"""Where a profiled kernel's warps wait, per SASS instruction: the source page of an Nsight
Compute report (PC sampling, collected with `--section SourceCounters --import-source no`) as
`ncu --import R.ncu-rep --page source --csv --print-source sass` writes it, summed and ranked.

    ncu --import R.ncu-rep --page source --csv --print-source sass > R.csv
    python3 tools/ncu_stalls.py R.csv [--top 40] [--lines KERNEL.sass]

Prints the instructions holding the most warp-stall samples until they cover 90% of them (at
most --top), each with its share, the running share, its offset in the kernel (from the first
row's address, nvdisasm's /*offset*/), its two largest stall reasons and, with --lines (the
kernel's SASS with line info: tools/sass_lines.py, from the profiled kernel's NVRTC), the
template lines it came from (innermost first), then the samples by opcode. tools/h200_run.sh step `ncusrc` runs both commands (PERF_NOTES §73 says what
it is for: the fixed costs of short tiles)."""
from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys

SAMPLES = ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", "")) if text.strip() else 0.0
    except ValueError:
        return 0.0


def _address(text: str) -> int | None:
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


def opcode(sass: str) -> str:
    """HGMMA for '@P0 HGMMA.64x128x16.F32.BF16 gdesc[UR4], ...'."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def read(text: str) -> tuple[list[str], list[dict]]:
    """The CSV's header and rows, from its header line on (ncu prints ==PROF== lines first)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source")
                  or '"Address"' in line), None)
    if start is None:
        raise SystemExit("no source-page header (a column named Source or Address) in the input")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    return list(reader.fieldnames or []), list(reader)


def source_lines(text: str) -> dict[int, str]:
    """Offset -> 'file:line < caller:line' from nvdisasm --print-line-info-inline's output: each
    instruction takes the `//## File "...", line N inlined at ...` group before it (nvdisasm
    writes one where the line changes)."""
    where, group, lines = {}, [], []
    for line in text.splitlines():
        info = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if info:
            if not lines:
                group = []
            name = info.group(1).rsplit("/", 1)[-1]
            name = "kernel.cu" if "__sm_" in name else name   # the rendered source's long name
            group.append(f"{name}:{info.group(2)}")
            lines = group
            continue
        lines = []
        code = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if code and group:
            where[int(code.group(1), 16)] = " < ".join(group[:2])
    return where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="the source page as CSV ('-': standard input)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--lines", metavar="SASS", help="the kernel's SASS with line info "
                   "(tools/sass_lines.py): each instruction's template lines")
    opts = p.parse_args(argv)
    where = source_lines(open(opts.lines).read()) if opts.lines else {}
    text = sys.stdin.read() if opts.csv == "-" else open(opts.csv).read()
    header, rows = read(text)
    total_col = next((c for c in SAMPLES if c in header), None)
    if total_col is None:
        raise SystemExit(f"no stall-sampling column among {header[:12]}...")
    source_col = "Source" if "Source" in header else header[1]
    address_col = next((c for c in header if "Address" in c), None)
    # Per-reason columns: "stall_<reason>" style names or "Warp Stall Sampling ... <reason>".
    # (ncu 2025 names the latter "stall_barrier (Not Issued)": a subset of the former's samples)
    reasons = [c for c in header if c not in SAMPLES and "stall" in c.lower() and c != total_col
               and "not-issued" not in c.lower() and "not issued" not in c.lower()]
    counted = [(r, _number(r[total_col])) for r in rows]
    total = sum(n for _, n in counted)
    if total <= 0:
        raise SystemExit("no stall samples in the report")
    print(f"{len(rows)} instructions, {int(total)} stall samples ({total_col})")
    first = _address(rows[0].get(address_col, "")) if address_col and rows else None
    running = 0.0
    for row, n in sorted(counted, key=lambda x: -x[1])[:opts.top]:
        running += n
        top = sorted(((_number(row[c]), c) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{c.split('(')[0].strip()[-28:]} {v / n:.0%}" for v, c in top if v > 0)
        address = _address(row.get(address_col, "")) if address_col else None
        offset = f"{address - first:#06x}" if address is not None and first is not None else ""
        line = f"  {where.get(address - first, '')}" if where and offset else ""
        print(f"{n / total:6.1%} {running / total:6.1%}  {offset:>7}  "
              f"{row[source_col].strip()[:60]:60}  {why}{line}")
        if running >= 0.9 * total:
            break
    by_op = collections.Counter()
    for row, n in counted:
        by_op[opcode(row[source_col])] += n
    print("by opcode: " + ", ".join(f"{op} {n / total:.0%}" for op, n in by_op.most_common(12)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
