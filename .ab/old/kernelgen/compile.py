"""CUDA source text -> CUBIN with NVRTC, plus the resource usage ptxas reports. No caching here.

The wrapper follows tinygrad's compiler_cuda.py: create a program, compile, read the log and the
CUBIN, destroy the program. Everything kernelgen knows about a binary's resources comes from the
ptxas verbose log, so the options below always ask for it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import sys
import time
from pathlib import Path

from cuda.bindings import nvrtc

from kernelgen import env

log = logging.getLogger("kernelgen.compile")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Our device-header library. A module global (read at call time) so tests can point it at a copy.
TEMPLATE_INCLUDE_DIR = REPO_ROOT / "templates" / "include"

# ptxas warnings that mean the Hopper fast path silently degraded (wgmma serialized, setmaxnreg
# ignored, ...): the kernel would be correct but slow, so they fail the build like errors do.
# Besides these codes, any ptxas line saying wgmma instructions "are serialized" counts (ptxas
# 13.0 gives C7520, "... due to program dependence on compiler-inserted WG.AR in divergent
# path", where 13.5 gives nothing); C7519, an injected warpgroup.arrive, does not serialize.
FATAL_PTXAS_WARNINGS = ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515", "C7516",
                        "C7517", "C7518", "C7520")
_FATAL_RE = re.compile(r"\((" + "|".join(FATAL_PTXAS_WARNINGS) + r")\)")
_SERIALIZED_RE = re.compile(r"\((C\d+)\)[^\n]*instructions are serialized")
_ARCH_RE = re.compile(r"sm_\d{2,3}a?")
_LOG_LINES_SHOWN = 40


@dataclasses.dataclass(frozen=True)
class Binary:
    name: str
    arch: str
    entry: str
    cubin: bytes
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem: int
    compile_seconds: float
    log: str


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem: int


class CompileError(RuntimeError):
    def __init__(self, message: str, *, log: str = "", source_path: Path | None = None,
                 name: str = "", options: tuple[str, ...] = ()):
        super().__init__(message)
        self.message = message
        self.log = log
        self.source_path = source_path
        self.name = name
        self.options = tuple(options)

    def __str__(self) -> str:
        parts = [self.message]
        if self.name:
            parts.append(f"  kernel: {self.name}")
        if self.source_path is not None:
            parts.append(f"  source: {self.source_path}")
        if self.log:
            parts.append(_trim_log(self.log))
        return "\n".join(parts)


def _trim_log(text: str) -> str:
    # The ptxas "info" lines are noise next to an error; keep them only if nothing else is there.
    lines = [line for line in text.splitlines() if line.strip()]
    diagnostics = [line for line in lines if not line.startswith(("ptxas info", "ptxas         ."))]
    lines = diagnostics or lines
    if len(lines) > _LOG_LINES_SHOWN:
        hidden = len(lines) - _LOG_LINES_SHOWN
        lines = lines[:_LOG_LINES_SHOWN] + [f"... ({hidden} more lines; see the .log next to the source)"]
    return "\n".join("  | " + line for line in lines)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    result, major, minor = nvrtc.nvrtcVersion()
    _check(result, "nvrtcVersion")
    return (major, minor)


def cuda_include_dirs() -> list[Path]:
    """CUDA toolkit headers (cuda_fp16.h, cuda_bf16.h, CCCL): CUDA_HOME/CUDA_PATH, else pip wheels."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        base = Path(home) / "include"
        # CUDA 13 moved CCCL (cuda/std, cuda/ptx) under include/cccl.
        return [base] + ([base / "cccl"] if (base / "cccl").is_dir() else [])
    return _pip_include_dirs()


@functools.cache
def _pip_include_dirs() -> list[Path]:
    import cuda.pathfinder

    find = getattr(cuda.pathfinder, "find_nvidia_header_directory", None)
    dirs = []
    for library in ("cudart", "cccl"):
        try:
            found = find(library) if find else None
        except RuntimeError:   # an older cuda-pathfinder that does not know the library
            found = None
        if found and Path(found) not in dirs:
            dirs.append(Path(found))
    if not dirs:   # a cuda-pathfinder too old to look: the CUDA 13 wheels' layout
        dirs = [p for p in (Path(s) / "nvidia" / "cu13" / "include" for s in sys.path) if p.is_dir()][:1]
    if len(dirs) == 1 and (dirs[0] / "cccl").is_dir():   # CUDA 13 wheels: nvidia/cu13/include/cccl
        dirs.append(dirs[0] / "cccl")
    if not dirs:
        raise CompileError("CUDA headers not found: install nvidia-cuda-runtime and nvidia-cuda-cccl, "
                           "or set CUDA_HOME")
    return dirs


def include_dirs() -> list[Path]:
    return [TEMPLATE_INCLUDE_DIR, *cuda_include_dirs()]


def nvrtc_options(arch: str) -> list[str]:
    if not _ARCH_RE.fullmatch(arch):
        # A virtual compute_XX target would give PTX only, which an older driver may not JIT.
        raise ValueError(f"arch must be a real target like 'sm_80' or 'sm_90a', got {arch!r}")
    return [
        f"-arch={arch}",
        "-std=c++17",
        "-default-device",
        # One entry per ptxas option: NVRTC rejects a comma-separated list here.
        "--ptxas-options=--verbose",
        "--ptxas-options=--warn-on-spills",
        "-lineinfo",
        "-DKERNELGEN=1",
        # NVRTC >= 12.9 keeps its own cache in the driver's compute cache (only where a driver is
        # installed); a hit there skips ptxas, so the log has no resource report. We cache anyway.
        *(["--no-cache"] if nvrtc_version() >= (12, 9) else []),
        *(f"-I{d}" for d in include_dirs()),
    ]


def source_path(name: str) -> Path:
    return env.settings().cache_dir / "sources" / f"{_safe_file_name(name)}.cu"


def _safe_file_name(name: str) -> str:
    """A file name for a kernel's name: a long one (a mods spec's variant with every tune key
    spelled out passes 220 characters) keeps its first 180 and a digest of the whole, so that
    two variants never share a dumped source."""
    safe = re.sub(r"[^\w.=-]", "_", name) or "kernel"
    if len(safe) <= 200:
        return safe
    return f"{safe[:180]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def compile_source(source_text: str, name: str, entry: str, arch: str) -> Binary:
    settings = env.settings()
    options = tuple(nvrtc_options(arch))
    if settings.no_compile:
        raise CompileError(f"compilation disabled (KERNELGEN_NO_COMPILE=1) and {name} is not cached",
                           name=name, options=options)
    path = source_path(name)
    if settings.dump_sources:
        _write_source(path, source_text)
    start = time.perf_counter()
    ok, text, cubin = _run_nvrtc(source_text, str(path), options)
    seconds = time.perf_counter() - start

    def fail(message: str) -> CompileError:
        _write_source(path, source_text, text)
        return CompileError(message, log=text, source_path=path, name=name, options=options)

    if not ok:
        raise fail(f"NVRTC failed to compile {name} for {arch}")
    fatal = sorted(set(_FATAL_RE.findall(text)) | set(_SERIALIZED_RE.findall(text)))
    if fatal:
        raise fail(f"ptxas degraded {name} for {arch} (warning {', '.join(fatal)})")
    resources = parse_ptxas_log(text, entry)
    if resources is None:
        raise fail(f"entry {entry!r} not found in the ptxas log of {name} (is it extern \"C\"?)")
    log.debug("compiled %s for %s in %.2fs: %s", name, arch, seconds, resources)
    return Binary(name=name, arch=arch, entry=entry, cubin=cubin, compile_seconds=seconds, log=text,
                  **dataclasses.asdict(resources))


def _write_source(path: Path, text: str, compile_log: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if compile_log is not None:
        path.with_suffix(".log").write_text(compile_log)


def _run_nvrtc(source_text: str, program_name: str, options: tuple[str, ...]) -> tuple[bool, str, bytes]:
    """(compiled?, log, cubin). The program name shows up in error messages and -lineinfo."""
    result, program = nvrtc.nvrtcCreateProgram(source_text.encode(), program_name.encode(), 0, [], [])
    _check(result, "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        result, size = nvrtc.nvrtcGetProgramLogSize(program)
        _check(result, "nvrtcGetProgramLogSize")
        buffer = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(program, buffer)[0], "nvrtcGetProgramLog")
        text = buffer.rstrip(b"\0").decode(errors="replace").strip()
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return False, text, b""
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(result, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin)[0], "nvrtcGetCUBIN")
        return True, text, cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _check(result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, message = nvrtc.nvrtcGetErrorString(result)
        raise CompileError(f"{what} failed: {message.decode()}")


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(text: str, entry: str) -> Resources | None:
    """Resources of `entry` from a ptxas --verbose log; None when the log does not mention it."""
    sections = _ENTRY_RE.split(text)   # [preamble, name1, body1, name2, body2, ...]
    for index in range(1, len(sections) - 1, 2):
        if sections[index] != entry:
            continue
        body = sections[index + 1]
        # Non-inlined device functions get their own "Function properties" block; skip to ours.
        own = body.find(f"Function properties for {entry}")
        frame = _FRAME_RE.search(body, max(own, 0))
        registers = _REGS_RE.search(body)
        smem = _SMEM_RE.search(body)   # ptxas leaves it out when there is no static shared memory
        stack, stores, loads = (int(g) for g in frame.groups()) if frame else (0, 0, 0)
        return Resources(registers=int(registers.group(1)) if registers else 0,
                         spill_stores=stores, spill_loads=loads, stack_bytes=stack,
                         static_smem=int(smem.group(1)) if smem else 0)
    return None
