"""Run a kernelgen kernel on the CPU: render it, compile it with g++ against the emulator headers
in this directory (cuda_emu.h, and CPU stand-ins for kernelgen/types.cuh and mma_sm80.cuh
in include/), and
launch it on CPU tensors. Slow (fibers, one CTA at a time): for small shapes in tests only.

    emulate.run(spec, variant, config, {"q": q, ..., "seqlen_q": 17}, seed=0, defer=True)

Tensor arguments are copied into one arena (256-byte aligned, with guard bytes between them that
must survive the launch) and copied back afterwards, so outputs land in the tensors passed in.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch

from kernelgen import render, tma
from kernelgen.spec import REPO_ROOT

HERE = Path(__file__).resolve().parent
INCLUDE = REPO_ROOT / "templates" / "include"
BUILD_DIR = Path(tempfile.gettempdir()) / f"kernelgen-emulator-{os.getuid()}"
_GUARD = 256
# What a grid expression's `sm_count` reads here: few, so a persistent kernel's CTAs each loop over
# several tiles.
EMULATED_SMS = 3
_CANARY = 0xA5


def available() -> bool:
    return shutil.which("g++") is not None


def _harness(spec, source_name: str) -> str:
    casts = {"i32": "emu::arg_i32({i})", "i64": "emu::arg_i64({i})", "f32": "emu::arg_f32({i})",
             "tmap": "*reinterpret_cast<const kg::TensorMap*>(emu::arg_map({i}))"}
    values = [f"({a.ctype}) emu::arg_ptr({i})" if a.type == "ptr" else casts[a.type].format(i=i)
              for i, a in enumerate(spec.args)]
    return (f'#include "harness.h"\n#include "{source_name}"\n'
            f"static void body() {{ {spec.entry}({', '.join(values)}); }}\n"
            "int main(int argc, char** argv) { return emu::harness_main(argc, argv, body); }\n")


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*HERE.rglob("*.h"), *HERE.rglob("*.cuh"), *INCLUDE.rglob("*.cuh")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build(spec, variant, config, transform=None) -> Path:
    """`transform` rewrites the rendered text first: what the template renders as inline PTX
    (the sm90 wgmma wrappers) has no CPU stand-in header to replace it."""
    source = render.render(spec, variant, config)
    text = transform(source.text) if transform else source.text
    harness = _harness(spec, "kernel.cu")
    key = hashlib.sha256((text + harness + _headers_digest()).encode()).hexdigest()[:24]
    exe = BUILD_DIR / f"{source.name[:160]}-{key}"  # (the key tells apart what the cut merges)
    if exe.is_file():
        return exe
    work = BUILD_DIR / f"{key}.src"
    work.mkdir(parents=True, exist_ok=True)
    (work / "kernel.cu").write_text(text)
    (work / "main.cpp").write_text(harness)
    tmp = exe.with_suffix(f".{os.getpid()}.tmp")
    # The emulator's kernelgen/ headers come first, so the kernel picks up the CPU primitives.
    command = ["g++", "-std=c++17", "-O1", "-w", "-x", "c++", f"-I{HERE}", f"-I{HERE / 'include'}",
               f"-I{INCLUDE}",
               str(work / "main.cpp"), "-o", str(tmp)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"g++ failed for {source.name}:\n{result.stderr[-6000:]}")
    os.replace(tmp, exe)
    return exe


def _launch_geometry(spec, variant, config, scalars: dict):
    env = spec.environment(variant, config)
    env["sm_count"] = EMULATED_SMS
    env.update(scalars)
    grid = tuple(int(e(env)) for e in spec.grid)
    block = tuple(int(e(env)) for e in spec.block)
    return grid, block[0] * block[1] * block[2], int(spec.smem(env))


def _map_words(tiled, offset: int) -> list[int]:
    """sm90_emu.h's MapFields for a kernelgen.tma.TiledMap, as 16 words (the address an offset);
    a map the kernel never reads, given as its bytes, as they are."""
    if isinstance(tiled, bytes):
        return list(struct.unpack("<16Q", tiled))
    fields = struct.pack("<Q5Q4Q5IIII", offset, *tiled.dims, *tiled.strides, *tiled.box,
                         tiled.swizzle, len(tiled.dims), tma.ELEMENT_BYTES[tiled.dtype])
    return list(struct.unpack("<16Q", fields.ljust(128, b"\0")))


def run(spec, variant, config, args: dict, *, seed: int = 0, defer: bool = True,
        transform=None) -> None:
    """Launch once; tensors in `args` (CPU) receive what the kernel wrote. A `tmap` argument is
    a (kernelgen.tma.TiledMap, tensor) pair."""
    exe = build(spec, variant, config, transform)
    # A null pointer may come as 0 (what the GPU launch takes, e.g. a block mask's bm_order).
    args = {**args, **{a.name: None for a in spec.args
                       if a.type == "ptr" and isinstance(args[a.name], int) and args[a.name] == 0}}
    storages, offsets, arena = {}, {}, bytearray()
    for arg in spec.args:
        value = args[arg.name]
        if arg.type == "tmap":
            value = value[1]
        if arg.type in ("ptr", "tmap") and value is not None:
            storage = value.untyped_storage()
            if storage.data_ptr() not in storages:
                start = (len(arena) + _GUARD + 255) // 256 * 256
                arena += bytes([_CANARY]) * (start - len(arena))
                storages[storage.data_ptr()] = storage
                offsets[storage.data_ptr()] = start
                arena += ctypes.string_at(storage.data_ptr(), storage.nbytes())
    arena += bytes([_CANARY]) * _GUARD

    scalars = {a.name: args[a.name] for a in spec.args if a.type not in ("ptr", "tmap")}
    grid, threads, smem = _launch_geometry(spec, variant, config, scalars)
    lines = [f"grid {grid[0]} {grid[1]} {grid[2]}", f"threads {threads}", f"smem {smem}",
             f"seed {seed}", f"defer {int(defer)}"]
    lines += [f"alloc {offsets[key]} {storage.nbytes()}" for key, storage in storages.items()]
    for arg in spec.args:
        value = args[arg.name]
        if arg.type == "ptr":
            if value is None:
                lines.append("null")
            else:
                base = value.untyped_storage().data_ptr()
                lines.append(f"ptr {offsets[base] + value.data_ptr() - base}")
        elif arg.type == "tmap":
            tiled, tensor = value
            base = tensor.untyped_storage().data_ptr()
            words = _map_words(tiled, offsets[base] + tensor.data_ptr() - base)
            lines.append("tmap " + " ".join(map(str, words)))
        elif arg.type == "f32":
            lines.append(f"f32 {struct.unpack('<I', struct.pack('<f', float(value)))[0]}")
        else:
            lines.append(f"{arg.type} {int(value)}")

    with tempfile.TemporaryDirectory() as tmp:
        launch, arena_in, arena_out = Path(tmp, "launch"), Path(tmp, "in"), Path(tmp, "out")
        launch.write_text("\n".join(lines) + "\n")
        arena_in.write_bytes(arena)
        result = subprocess.run([str(exe), str(launch), str(arena_in), str(arena_out)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"emulated {spec.entry} failed: {result.stderr.strip()}")
        written = arena_out.read_bytes()
    end = 0
    for key, storage in storages.items():
        start = offsets[key]
        if any(b != _CANARY for b in written[end:start]):
            raise RuntimeError(f"emulated {spec.entry} wrote outside its tensors (before offset {start})")
        ctypes.memmove(storage.data_ptr(), written[start:start + storage.nbytes()], storage.nbytes())
        end = start + storage.nbytes()
    if any(b != _CANARY for b in written[end:]):
        raise RuntimeError(f"emulated {spec.entry} wrote past its last tensor")


def tensor_like_nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)
