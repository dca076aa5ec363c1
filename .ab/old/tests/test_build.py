"""build.py: `kernelgen build` through ninja, and the resource checks on every shipped variant.

`cache_dir` (conftest.py): a fresh KERNELGEN_CACHE_DIR with every switch off.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest

from kernelgen import build, sass
from kernelgen import compile as compiler

TINY_SPEC = """\
name: tiny_scale
entry: tiny_scale
archs: [sm_80, sm_90]
params:
  width: {values: [1, 2], default: 1}
args:
  - {name: x, type: ptr, ctype: "float*"}
  - {name: n, type: i32}
tune:
  space:
    threads: [64, 128]
launch:
  grid: ["cdiv(n, threads)", "1", "1"]
  block: ["threads", "1", "1"]
  smem: "threads * 4"
"""

TINY_TEMPLATE = """\
// x[i] *= {{ width }} for every i < n.
extern "C" __global__ void __launch_bounds__({{ threads }}) {{ entry }}({{ signature }}) {
    __shared__ float staging[{{ threads }}];
    const int i = blockIdx.x * {{ threads }} + threadIdx.x;
    staging[threadIdx.x] = i < n ? x[i] : 0.f;
    __syncthreads();
    if (i < n) x[i] = staging[threadIdx.x] * {{ width }}.f{{ extra }};
}
"""


def write_spec(directory, name="tiny_scale", extra=""):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(TINY_SPEC.replace("tiny_scale", name))
    (directory / f"{name}.cu.j2").write_text(TINY_TEMPLATE.replace("{{ extra }}", extra))
    return directory / f"{name}.yaml"


def run_build(capfd, specs, archs=None, out=None):
    code = build.main(argparse.Namespace(arch=archs, spec=[str(s) for s in specs],
                                         out=str(out) if out else None, jobs=2))
    captured = capfd.readouterr()   # ninja writes straight to fd 1/2, so capsys would miss it
    return code, captured.out + captured.err


def test_plan_skips_archs_a_spec_does_not_list(tmp_path):
    plan = build.plan([write_spec(tmp_path)], ["sm_80", "sm_90a"])
    assert {edge.arch for edge in plan.edges} == {"sm_80"}
    assert len(plan.edges) == 2 and not plan.errors
    assert plan.notes == ("tiny_scale does not list sm_90a; skipped",)
    headers = [p for p in compiler.TEMPLATE_INCLUDE_DIR.rglob("*") if p.is_file()]
    assert set(headers) <= set(plan.edges[0].inputs)   # a header edit rebuilds every edge


def test_build_is_incremental(cache_dir, tmp_path, capfd):
    spec = write_spec(tmp_path / "specs")
    code, output = run_build(capfd, [spec])
    assert code == 0, output
    assert "[4/4]" in output
    assert "tiny_scale/width1  sm_80" in output and "tiny_scale/width2  sm_90" in output
    assert "total: 4 kernels (4 compiled now, 0 failed)" in output
    stamps = sorted((cache_dir / "build" / "stamps").glob("*.json"))
    assert len(stamps) == 4
    record = json.loads(stamps[0].read_text())
    assert record["registers"] > 0 and record["static_smem"] == 64 * 4
    assert record["dynamic_smem"] == 64 * 4   # the spec's launch smem formula, threads = 64

    code, output = run_build(capfd, [spec])
    assert code == 0 and "no work to do" in output, output
    assert "total: 4 kernels (0 compiled now, 0 failed)" in output

    # A template edit reruns every edge; the new source text misses the cache and compiles.
    write_spec(tmp_path / "specs", extra=" + 0.5f")
    code, output = run_build(capfd, [spec], archs=["sm_80"])
    assert code == 0 and "[2/2]" in output and "(2 compiled now, 0 failed)" in output, output


def test_build_out_dir_is_a_deployable_cache(cache_dir, tmp_path, capfd, monkeypatch):
    out = tmp_path / "out"
    code, output = run_build(capfd, [write_spec(tmp_path / "specs")], archs=["sm_90"], out=out)
    assert code == 0, output
    cubins = sorted(out.glob("*.cubin"))
    assert [c.name for c in cubins] == [
        "tiny_scale__width1__sm_90__threads64.cubin", "tiny_scale__width2__sm_90__threads64.cubin"]
    assert cubins[0].read_bytes().startswith(b"\x7fELF")
    assert len(list((out / "binaries").glob("*/*.kgb"))) == 2
    assert not (cache_dir / "binaries").exists()


def test_failed_edge_fails_the_build(cache_dir, tmp_path, capfd):
    good = write_spec(tmp_path / "specs")
    broken = write_spec(tmp_path / "specs", name="tiny_broken", extra=" + undefined_thing")
    code, output = run_build(capfd, [good, broken], archs=["sm_80"])
    assert code != 0
    assert "NVRTC failed to compile tiny_broken__width1__sm_80__threads64" in output
    assert "undefined_thing" in output
    assert "FAILED" in output and "(2 compiled now, 2 failed)" in output


# ---- every shipped variant: compiles, no spills, no local memory, tensor cores in the SASS ----

def _shipped_or_skip():
    if importlib.util.find_spec("kernelgen.render") is None:
        pytest.skip("kernelgen/render.py does not exist yet")
    from kernelgen import spec as specs

    names = specs.shipped_specs()
    if not names:
        pytest.skip("no shipped specs yet")
    missing = [str(s.template) for s in map(specs.load_spec, names) if not s.template.is_file()]
    if missing:
        pytest.skip(f"templates not written yet: {', '.join(missing)}")
    return names


def test_every_shipped_variant_compiles_clean(cache_dir, tmp_path, capfd):
    names = _shipped_or_skip()
    out = tmp_path / "shipped"
    code = build.main(argparse.Namespace(arch=["sm_80", "sm_90", "sm_90a"], spec=names,
                                         out=str(out), jobs=os.cpu_count()))
    output = capfd.readouterr()
    assert code == 0, output.out + output.err
    problems = []
    stamps = sorted((out / "build" / "stamps").glob("*.json"))
    assert stamps
    for stamp in stamps:
        record = json.loads(stamp.read_text())
        code_text = sass.sass((out / f"{record['name']}.cubin").read_bytes())
        # sm_90a kernels use wgmma (HGMMA in SASS); the rest the mma.sync path (HMMA).
        tensor_op = "HGMMA" if record["arch"] == "sm_90a" else "HMMA"
        if record["spill_stores"] or record["spill_loads"]:
            problems.append(f"{record['name']}: spills {record['spill_stores']}/{record['spill_loads']}")
        if record["stack_bytes"] or sass.has_local_memory(code_text):
            problems.append(f"{record['name']}: {record['stack_bytes']} bytes of stack/local memory")
        if not sass.count(code_text, tensor_op):
            problems.append(f"{record['name']}: no {tensor_op} in the SASS")
    assert not problems, "\n".join(problems)
