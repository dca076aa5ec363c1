"""NVRTC in a child process, for the tuner: a compiler crash costs one config, not the caller.

kernelgen compiles in-process (compile.py), and NVRTC's embedded ptxas can die on a kernel with
a signal: NVRTC 13.5's segfaulted on one state of the persistent backward (PERF_NOTES §96), and
the whole Python process went with it. A user's own spec or mods can do the same, and the tuner
compiles every config of a space, most of which nobody compiled before; PyTorch's max-autotune
compiles in subprocesses for the same reason. So tune() compiles with compile_isolated: one
`python -c` child per kernel (it imports kernelgen.compile, not torch: ~0.1 s on top of a
0.3-0.6 s compile, on threads that overlap them), its result back through a file. Not
multiprocessing's spawn: that re-imports the caller's main script in each child, and a training
script without a `__main__` guard would run again there.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kernelgen import compile as compiler

DEFAULT_TARGET = "kernelgen.compile:compile_source"
TIMEOUT_S = 900.0   # a ptxas that hangs fails its kernel too
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def compile_isolated(text: str, name: str, entry: str, arch: str, *,
                     target: str = DEFAULT_TARGET) -> compiler.Binary:
    """compile.compile_source's result (or its CompileError), computed in a child process;
    a child that dies with a signal or hangs is a CompileError naming the kernel. `target`
    ("module:function") is what the child runs: compile_source, or a test's stand-in."""
    with tempfile.TemporaryDirectory(prefix="kernelgen-compile-") as scratch:
        result_path = Path(scratch) / "result.pickle"
        request = (target, text, name, entry, arch, str(compiler.TEMPLATE_INCLUDE_DIR),
                   str(result_path))
        env = dict(os.environ)
        # The child imports this kernelgen, wherever the caller found it.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            child = subprocess.run(
                [sys.executable, "-c", "from kernelgen.compile_child import _child; _child()"],
                input=pickle.dumps(request), capture_output=True, env=env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise compiler.CompileError(f"the compiler ran past {TIMEOUT_S:.0f} s on {name} "
                                        f"for {arch}; stopped", name=name) from None
        if child.returncode < 0:
            raise compiler.CompileError(
                f"the compiler crashed on {name} for {arch} (its process died with "
                f"{signal.Signals(-child.returncode).name})", name=name,
                log=child.stderr.decode(errors="replace")[-4000:])
        if child.returncode != 0 or not result_path.exists():
            raise compiler.CompileError(
                f"the compile process for {name} failed (exit status {child.returncode})",
                name=name, log=child.stderr.decode(errors="replace")[-4000:])
        ok, value = pickle.loads(result_path.read_bytes())
    if not ok:
        raise value
    return value


def _child() -> None:
    """The child's side: read the request from stdin, write (ok, Binary or exception)."""
    target, text, name, entry, arch, include_dir, result_path = pickle.loads(sys.stdin.buffer.read())
    compiler.TEMPLATE_INCLUDE_DIR = Path(include_dir)   # a test may have pointed it elsewhere
    module, _, function = target.partition(":")
    run = getattr(importlib.import_module(module), function)
    try:
        result = (True, run(text, name, entry, arch))
    except Exception as exc:   # a CompileError above all: it goes back whole, log included
        result = (False, exc)
    Path(result_path).write_bytes(pickle.dumps(result))
