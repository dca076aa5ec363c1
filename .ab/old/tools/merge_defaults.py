"""Merge tuned configs exported on the GPU (`kernelgen tune --export`, tools/tune_mods.py
--export) into the shipped defaults, kernelgen/data/tuned_defaults.json: an entry of the same
spec, variant, arch, bucket and GPU is replaced, others are added.

    python tools/merge_defaults.py EXPORTED.json [...]
    python tools/merge_defaults.py --as-gpu "NVIDIA H200" EXPORTED.json
                                                      measured on another GPU of the same chip (an
                                                      H100 SXM when no H200 was lent): the entries
                                                      replace that GPU's and say where they were
                                                      measured ("measured_on")
    python tools/merge_defaults.py --rehash SPEC      after an edit of SPEC that leaves its configs'
                                                      meaning alone (a comment, the grid's launch
                                                      order): its entries, those of mods specs put
                                                      onto it and, for a mods spec, those of it put
                                                      onto each base, take the new content hash
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "kernelgen" / "data" / "tuned_defaults.json"
KEY = ("spec", "variant", "arch", "bucket", "gpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="*", type=Path)
    parser.add_argument("--rehash", metavar="SPEC", action="append", default=[])
    parser.add_argument("--as-gpu", metavar="NAME")
    opts = parser.parse_args()
    shipped = json.loads(SHIPPED.read_text())
    entries = {tuple(e[k] for k in KEY): e for e in shipped["entries"]}
    for path in opts.exports:
        doc = json.loads(path.read_text())
        if doc.get("format") != shipped["format"]:
            raise SystemExit(f"{path}: format {doc.get('format')!r}, the shipped file has "
                             f"{shipped['format']!r}")
        for entry in doc["entries"]:
            if opts.as_gpu and entry["gpu"] != opts.as_gpu:
                entry = {**entry, "gpu": opts.as_gpu, "measured_on": entry["gpu"]}
            key = tuple(entry[k] for k in KEY)
            print(f"{'replaced' if key in entries else 'added':8s} {' '.join(map(str, key[:4]))}")
            entries[key] = entry
    for name in opts.rehash:
        from kernelgen.spec import load_spec

        for entry in entries.values():
            child, onto, base = entry["spec"].partition("__")
            if entry["spec"] == name or (onto and name in (base, child)):
                new = load_spec(child, onto=base if onto else None).content_hash
                if new != entry["spec_hash"]:
                    print(f"rehashed {entry['spec']} {entry['variant']} {entry['bucket']}")
                    entry["spec_hash"] = new
    shipped["entries"] = [entries[k] for k in sorted(entries)]
    SHIPPED.write_text(json.dumps(shipped, indent=1) + "\n")
    print(f"{SHIPPED}: {len(entries)} entries")


if __name__ == "__main__":
    main()
