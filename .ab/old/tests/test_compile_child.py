"""compile_child.compile_isolated: NVRTC in a child process, so that a compiler that dies with a
signal (or hangs) fails its kernel, not the tuner's process. Real NVRTC for the ordinary paths;
stand-in targets (run in the child) for the crash and the hang."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kernelgen import compile as compiler
from kernelgen import compile_child
from kernelgen.compile_child import compile_isolated

SOURCE = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }'
HERE = str(Path(__file__).resolve().parent)


def crashy(text: str, name: str, entry: str, arch: str) -> compiler.Binary:
    """In the child: dies like a crashing ptxas on kernels named crash*, hangs on hang*, else a
    Binary that says which process made it."""
    if name.startswith("crash"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if name.startswith("hang"):
        time.sleep(60)
    return compiler.Binary(name=name, arch=arch, entry=entry, cubin=b"x", registers=os.getpid(),
                           spill_stores=0, spill_loads=0, stack_bytes=0, static_smem=0,
                           compile_seconds=0.0, log="")


@pytest.fixture
def tests_importable(monkeypatch):
    """The child finds this module (its PYTHONPATH is the caller's plus kernelgen's root)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))


def test_a_real_compile_in_a_child_matches_one_here(cache_dir):
    child = compile_isolated(SOURCE, "pool_add_one", "add_one", "sm_80")
    here = compiler.compile_source(SOURCE, "pool_add_one", "add_one", "sm_80")
    assert child.cubin == here.cubin and child.registers == here.registers
    assert child.entry == "add_one" and child.spill_stores == 0


def test_a_compile_error_comes_back_with_its_log(cache_dir):
    with pytest.raises(compiler.CompileError) as error:
        compile_isolated(SOURCE.replace("+=", "+=="), "pool_broken", "add_one", "sm_80")
    assert "NVRTC failed to compile pool_broken" in str(error.value)
    assert "expected an expression" in error.value.log


def test_a_crash_fails_its_kernel_not_this_process(tests_importable):
    made = compile_isolated("", "ok_before", "k", "sm_80", target="test_compile_child:crashy")
    assert made.name == "ok_before" and made.registers != os.getpid()   # made in a child
    with pytest.raises(compiler.CompileError, match="crashed on crash_b for sm_80 .*SIGSEGV"):
        compile_isolated("", "crash_b", "k", "sm_80", target="test_compile_child:crashy")
    assert compile_isolated("", "ok_after", "k", "sm_80",
                            target="test_compile_child:crashy").name == "ok_after"


def test_a_hang_is_stopped(tests_importable, monkeypatch):
    monkeypatch.setattr(compile_child, "TIMEOUT_S", 3.0)
    start = time.monotonic()
    with pytest.raises(compiler.CompileError, match="ran past 3 s on hang_c"):
        compile_isolated("", "hang_c", "k", "sm_80", target="test_compile_child:crashy")
    assert time.monotonic() - start < 30


def test_the_child_uses_the_callers_template_dir(cache_dir, tmp_path, monkeypatch):
    """A test (or a user) pointing TEMPLATE_INCLUDE_DIR at a copy: the child reads the copy."""
    include = tmp_path / "include"
    (include / "kernelgen").mkdir(parents=True)
    (include / "kernelgen" / "one.cuh").write_text("#define KG_ONE 1.0f\n")
    monkeypatch.setattr(compiler, "TEMPLATE_INCLUDE_DIR", include)
    text = '#include "kernelgen/one.cuh"\n' + SOURCE.replace("1.0f", "KG_ONE")
    assert compile_isolated(text, "pool_include", "add_one", "sm_80").entry == "add_one"
