"""Merge tuned configs exported on the GPU (`kernelgen tune --export`, tools/tune_mods.py
--export) into the shipped defaults, kernelgen/data/tuned_defaults.json: an entry of the same
spec, variant, arch, bucket and GPU is replaced, others are added.

    python tools/merge_defaults.py EXPORTED.json [...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "kernelgen" / "data" / "tuned_defaults.json"
KEY = ("spec", "variant", "arch", "bucket", "gpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+", type=Path)
    opts = parser.parse_args()
    shipped = json.loads(SHIPPED.read_text())
    entries = {tuple(e[k] for k in KEY): e for e in shipped["entries"]}
    for path in opts.exports:
        doc = json.loads(path.read_text())
        if doc.get("format") != shipped["format"]:
            raise SystemExit(f"{path}: format {doc.get('format')!r}, the shipped file has "
                             f"{shipped['format']!r}")
        for entry in doc["entries"]:
            key = tuple(entry[k] for k in KEY)
            print(f"{'replaced' if key in entries else 'added':8s} {' '.join(map(str, key[:4]))}")
            entries[key] = entry
    shipped["entries"] = [entries[k] for k in sorted(entries)]
    SHIPPED.write_text(json.dumps(shipped, indent=1) + "\n")
    print(f"{SHIPPED}: {len(entries)} entries")


if __name__ == "__main__":
    main()
