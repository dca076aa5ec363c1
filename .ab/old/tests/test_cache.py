"""cache.py: content-addressed keys, hits from disk, integrity, concurrent writers."""
from __future__ import annotations

import multiprocessing
import shutil
from types import SimpleNamespace

import pytest

from kernelgen import cache
from kernelgen import compile as compiler
from kernelgen import env

KERNEL = r"""
extern "C" __global__ void scale(float* x, float factor) { x[threadIdx.x] *= factor * %s; }
"""


def source(tag: str = "1.0f", name: str = "scale_test"):
    # compile_cached reads only .text, .name and .entry of a render.Source.
    return SimpleNamespace(text=KERNEL % tag, name=name, entry="scale")


@pytest.fixture(autouse=True)
def no_memo():
    # The in-process memo would hide whether a test's binary came from disk or from NVRTC.
    cache.clear_memo()
    yield
    cache.clear_memo()


def forbid_compiling(monkeypatch):
    monkeypatch.setenv("KERNELGEN_NO_COMPILE", "1")
    env.reload_settings()
    cache.clear_memo()


def test_miss_then_hit_from_disk(cache_dir, monkeypatch):
    first = cache.compile_cached(source(), "sm_80")
    key = cache.cache_key(source().text, "sm_80")
    assert cache.entry_path(key).is_file()
    assert cache.compile_cached(source(), "sm_80") is first   # in-process memo
    forbid_compiling(monkeypatch)
    loaded = cache.compile_cached(source(), "sm_80")
    assert loaded == first and loaded is not first
    with pytest.raises(compiler.CompileError, match="compilation disabled"):
        cache.compile_cached(source("2.0f"), "sm_80")   # proves the hit above did not compile
    info = cache.cache_info()
    assert info.entries == 1 and info.bytes > len(first.cubin)


def test_always_compile_skips_reads(cache_dir, monkeypatch):
    first = cache.compile_cached(source(), "sm_80")
    monkeypatch.setenv("KERNELGEN_ALWAYS_COMPILE", "1")
    env.reload_settings()
    cache.clear_memo()
    calls = []
    real = compiler.compile_source
    monkeypatch.setattr(compiler, "compile_source", lambda *a: calls.append(a) or real(*a))
    again = cache.compile_cached(source(), "sm_80")
    assert len(calls) == 1 and again.cubin == first.cubin


def test_key_depends_on_every_input(cache_dir, monkeypatch, tmp_path):
    base = cache.cache_key(source().text, "sm_80")
    assert cache.cache_key(source().text, "sm_80") == base
    assert cache.cache_key(source("2.0f").text, "sm_80") != base
    assert cache.cache_key(source().text, "sm_86") != base

    real_options = compiler.nvrtc_options
    monkeypatch.setattr(compiler, "nvrtc_options", lambda arch: real_options(arch) + ["--use_fast_math"])
    assert cache.cache_key(source().text, "sm_80") != base
    monkeypatch.setattr(compiler, "nvrtc_options", real_options)

    real_version = compiler.nvrtc_version
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (99, 9))
    assert cache.cache_key(source().text, "sm_80") != base
    monkeypatch.setattr(compiler, "nvrtc_version", real_version)
    assert cache.cache_key(source().text, "sm_80") == base

    headers = tmp_path / "include"
    shutil.copytree(compiler.TEMPLATE_INCLUDE_DIR, headers)
    (headers / "kernelgen_test_probe.cuh").write_text("#pragma once\n")
    monkeypatch.setattr(compiler, "TEMPLATE_INCLUDE_DIR", headers)
    with_probe = cache.cache_key(source().text, "sm_80")
    assert with_probe != base   # the -I path changed too, so also check an edit in place:
    (headers / "kernelgen_test_probe.cuh").write_text("#pragma once\n// edited\n")
    edited = cache.cache_key(source().text, "sm_80")
    assert edited != with_probe
    assert cache.cache_key(source().text, "sm_80") == edited   # memoized digest still current


def test_header_digest_tracks_edits(tmp_path):
    (tmp_path / "sub").mkdir()
    header = tmp_path / "sub" / "tile.cuh"
    header.write_text("int a;\n")
    first = cache.header_digest(tmp_path)
    assert cache.header_digest(tmp_path) == first
    header.write_text("int b;\n")   # same size: the mtime change must invalidate the memo
    second = cache.header_digest(tmp_path)
    assert second != first
    header.rename(tmp_path / "sub" / "renamed.cuh")
    assert cache.header_digest(tmp_path) not in (first, second)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage_meta"])
def test_damaged_entry_is_rebuilt(cache_dir, damage, caplog):
    good = cache.compile_cached(source(), "sm_80")
    path = cache.entry_path(cache.cache_key(source().text, "sm_80"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 3]
    elif damage == "empty":
        data = bytearray()
    else:   # a valid checksum over a payload whose metadata belongs to another key
        binary = cache.read_entry(path, cache.cache_key(source().text, "sm_80"))
        cache.write_entry(path, "0" * 64, binary)
        data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data))
    with pytest.raises(cache.DamagedEntry):
        cache.read_entry(path, cache.cache_key(source().text, "sm_80"))
    cache.clear_memo()
    with caplog.at_level("WARNING", logger="kernelgen.cache"):
        rebuilt = cache.compile_cached(source(), "sm_80")
    assert "damaged cache entry" in caplog.text
    assert rebuilt.cubin == good.cubin
    assert cache.read_entry(path, cache.cache_key(source().text, "sm_80")).cubin == good.cubin


def _compile_in_child(cache_root, barrier, results):
    import os

    os.environ["KERNELGEN_CACHE_DIR"] = cache_root
    env.reload_settings()
    compiled = []
    real = compiler.compile_source
    compiler.compile_source = lambda *a: compiled.append(1) or real(*a)
    barrier.wait()
    binary = cache.compile_cached(source("3.0f", name="race"), "sm_80")
    results.put((len(compiled), binary.cubin))


def test_concurrent_processes_compile_once(cache_dir):
    context = multiprocessing.get_context("spawn")   # fork of a threaded parent may deadlock
    barrier, results = context.Barrier(3), context.Queue()
    children = [context.Process(target=_compile_in_child, args=(str(cache_dir), barrier, results))
                for _ in range(3)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sum(count for count, _ in outcomes) == 1
    assert len({cubin for _, cubin in outcomes}) == 1
    entries = list((cache_dir / "binaries").glob("*/*.kgb"))
    assert len(entries) == 1 and not list((cache_dir / "binaries").glob("*/*.tmp"))
    key = cache.cache_key(source("3.0f").text, "sm_80")
    assert cache.read_entry(entries[0], key).cubin == outcomes[0][1]


def test_clear_cache(cache_dir):
    cache.compile_cached(source(), "sm_80")
    assert cache.clear_cache().entries == 1
    assert cache.cache_info().entries == 0
