"""`kernelgen build`: compile every shipped variant into the cache, with ninja as the build engine.

ninja gives us parallelism, a progress line and incrementality for free: each (variant, arch) is
one edge whose output is a small JSON stamp, with the spec, its template and every device header
as implicit inputs. So an unchanged variant is not even started, and a header edit rebuilds all.
Each edge runs `python -m kernelgen.build --one ...` (this file), which renders and calls
compile_cached; that process imports no torch, so it starts in a fraction of a second.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Python modules whose edits change what an edge produces (the compile options live in compile.py).
PIPELINE_MODULES = ("spec.py", "expr.py", "render.py", "compile.py", "cache.py", "env.py", "build.py")


@dataclasses.dataclass(frozen=True)
class Edge:
    spec_path: Path
    arch: str
    slug: str      # Variant.slug: with spec and arch it names the variant
    name: str      # render.Source.name, for file names and the progress line
    inputs: tuple[Path, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    edges: tuple[Edge, ...]
    notes: tuple[str, ...]    # arch a spec does not list: skipped
    errors: tuple[str, ...]   # variant with no config that fits its arch: a spec bug, fails the build


def plan(spec_names, archs) -> Plan:
    from kernelgen import compile as compiler
    from kernelgen import spec as specs

    headers = sorted(p for p in compiler.TEMPLATE_INCLUDE_DIR.rglob("*") if p.is_file())
    modules = [Path(__file__).parent / m for m in PIPELINE_MODULES]
    edges, notes, errors = [], [], []
    for spec_name in spec_names:
        spec = specs.load_spec(spec_name)
        wanted = list(spec.archs) if not archs else [a for a in archs if a in spec.archs]
        notes += [f"{spec.name} does not list {a}; skipped" for a in archs or () if a not in spec.archs]
        inputs = tuple(dict.fromkeys([spec.path, spec.template, *headers, *modules]))
        for variant in spec.variants(wanted):
            try:
                config = spec.default_config(variant)
            except specs.SpecError as error:
                errors.append(str(error))
                continue
            name = f"{spec.name}__{variant.slug}__{variant.arch}__{config.slug}"
            edges.append(Edge(spec.path, variant.arch, variant.slug, name, inputs))
    return Plan(tuple(edges), tuple(notes), tuple(errors))


def _escape_path(path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _escape_value(text: str) -> str:
    return text.replace("$", "$$")


def write_ninja(build_plan: Plan, build_dir: Path, out: Path | None) -> Path:
    lines = [
        "# Written by `kernelgen build`; rewritten on every run.",
        "ninja_required_version = 1.5",
        f"python = {_escape_value(shlex.quote(sys.executable))}",
        "rule compile",
        "  command = $python -m kernelgen.build --one $spec $arch $variant --stamp $stamp $outflag",
        "  description = $name",
    ]
    outflag = f"--out {shlex.quote(str(out))}" if out else ""
    for edge in build_plan.edges:
        outputs = [stamp_path(build_dir, edge.name)] + ([out / f"{edge.name}.cubin"] if out else [])
        lines += [
            f"build {' '.join(map(_escape_path, outputs))}: compile | "
            + " ".join(map(_escape_path, edge.inputs)),
            f"  spec = {_escape_value(shlex.quote(str(edge.spec_path)))}",
            f"  arch = {edge.arch}",
            f"  variant = {_escape_value(shlex.quote(edge.slug))}",
            f"  stamp = {_escape_value(shlex.quote(str(outputs[0])))}",
            f"  outflag = {_escape_value(outflag)}",
            f"  name = {_escape_value(edge.name)}",
        ]
    path = build_dir / "build.ninja"
    build_dir.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    # Rewrite only on change: ninja treats a newer build.ninja as a reason to re-check everything.
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def stamp_path(build_dir: Path, name: str) -> Path:
    return build_dir / "stamps" / f"{name}.json"


def ninja_executable() -> str:
    try:
        import ninja

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise SystemExit("kernelgen build: ninja not found (pip install ninja)")
    return found


def main(args) -> int:
    from kernelgen import env, spec as specs

    out = Path(args.out).resolve() if getattr(args, "out", None) else None
    build_dir = out / "build" if out else env.settings().cache_dir / "build"
    build_plan = plan(args.spec or specs.shipped_specs(), args.arch)
    for note in build_plan.notes:
        print(f"note: {note}")
    for error in build_plan.errors:
        print(f"error: {error}", file=sys.stderr)
    if out:
        out.mkdir(parents=True, exist_ok=True)
    write_ninja(build_plan, build_dir, out)
    jobs = args.jobs or os.cpu_count() or 1
    # The edges import kernelgen from this checkout even where it is not pip-installed.
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    if out:
        # --out is a cache of its own: a deployment points KERNELGEN_CACHE_DIR at it and sets
        # KERNELGEN_NO_COMPILE=1. The loose <name>.cubin copies are for inspection.
        child_env["KERNELGEN_CACHE_DIR"] = str(out)
    started = time.time()
    sys.stdout.flush()
    result = subprocess.run([ninja_executable(), "-C", str(build_dir), "-j", str(jobs), "-k", "0"],
                            env=child_env)
    print(format_table(build_plan, build_dir, started, jobs))
    return 1 if result.returncode or build_plan.errors else 0


def format_table(build_plan: Plan, build_dir: Path, started: float, jobs: int) -> str:
    """One row per edge, from the stamps; an edge whose stamp predates `started` was up to date."""
    headers = ("variant", "arch", "config", "seconds", "regs", "spills", "stack", "smem")
    rows, total, compiled, failed = [], 0.0, 0, 0
    for edge in build_plan.edges:
        try:
            stamp = json.loads(stamp_path(build_dir, edge.name).read_text())
        except (OSError, ValueError):
            failed += 1
            rows.append((f"{edge.spec_path.stem}/{edge.slug}", edge.arch, "-", "FAILED", "", "", "", ""))
            continue
        total += stamp["compile_seconds"]
        compiled += stamp["written_at"] >= started and not stamp["cached"]
        dynamic = stamp["dynamic_smem"]
        smem = stamp["static_smem"] + (dynamic or 0)
        rows.append((f"{stamp['spec']}/{stamp['variant']}", stamp["arch"], stamp["config"],
                     f"{stamp['compile_seconds']:.2f}" + ("" if not stamp["cached"] else " (cached)"),
                     str(stamp["registers"]), f"{stamp['spill_stores']}/{stamp['spill_loads']}",
                     str(stamp["stack_bytes"]), f"{smem}" + ("" if dynamic is not None else "+?")))
    summary = (f"total: {len(rows)} kernels ({compiled} compiled now, {failed} failed), "
               f"{total:.1f} s of NVRTC time, {time.time() - started:.1f} s wall with -j {jobs}")
    return "\n".join([*_aligned([headers, *rows]), summary])


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return [lines[0], "  ".join("-" * width for width in widths), *lines[1:]]


# ---- one edge: `python -m kernelgen.build --one SPEC ARCH VARIANT --stamp FILE [--out DIR]` ----

def build_one(spec_ref: str, arch: str, slug: str, stamp: Path, out: Path | None) -> int:
    from kernelgen import cache, render
    from kernelgen import compile as compiler
    from kernelgen import spec as specs

    start = time.perf_counter()
    stamp.unlink(missing_ok=True)   # a failed edge must not leave an old stamp that looks current
    spec = specs.load_spec(spec_ref)
    variant = next((v for v in spec.variants([arch]) if v.slug == slug), None)
    if variant is None:
        print(f"{spec.path}: no variant {slug} on {arch}", file=sys.stderr)
        return 2
    try:
        config = spec.default_config(variant)
        source = render.render(spec, variant, config)
        was_cached = cache.entry_path(cache.cache_key(source.text, arch)).is_file()
        binary = cache.compile_cached(source, arch)
    except (specs.SpecError, render.RenderError, compiler.CompileError) as error:
        print(error, file=sys.stderr)
        return 1
    try:   # the launch formula may need runtime scalars (a split count from seqlen, say)
        dynamic = int(spec.smem(spec.environment(variant, config)))
    except Exception:  # noqa: BLE001 - any name the compile-time environment lacks
        dynamic = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{source.name}.cubin").write_bytes(binary.cubin)
    record = {
        "name": source.name, "spec": spec.name, "variant": variant.slug, "arch": arch,
        "config": config.slug, "cached": was_cached, "seconds": time.perf_counter() - start,
        "compile_seconds": binary.compile_seconds, "registers": binary.registers,
        "spill_stores": binary.spill_stores, "spill_loads": binary.spill_loads,
        "stack_bytes": binary.stack_bytes, "static_smem": binary.static_smem, "dynamic_smem": dynamic,
        "written_at": time.time(),
    }
    stamp.parent.mkdir(parents=True, exist_ok=True)
    temp = stamp.with_name(f".{stamp.name}.tmp")
    temp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(temp, stamp)
    return 0


def _one_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelgen.build")
    parser.add_argument("--one", nargs=3, metavar=("SPEC", "ARCH", "VARIANT"), required=True)
    parser.add_argument("--stamp", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    return build_one(*args.one, stamp=args.stamp, out=args.out)


if __name__ == "__main__":
    sys.exit(_one_main(sys.argv[1:]))
