"""Content-addressed disk cache of compiled binaries: the only way the rest of kernelgen compiles.

Layout under settings().cache_dir:
    binaries/<key[:2]>/<key>.kgb     MAGIC | sha256(payload) | payload
    binaries/<key[:2]>/<key>.lock    per-key flock, so concurrent processes compile a key once
payload = u32 length of the JSON metadata | metadata (Binary fields but the cubin, plus the key) | cubin

The key is a content hash; the readable kernel name is stored in the metadata and used in logs only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

from kernelgen import compile as compiler   # `compile` would shadow the builtin
from kernelgen import env

log = logging.getLogger("kernelgen.cache")

MAGIC = b"KGBIN01\n"
FORMAT_VERSION = "1"   # bump when the entry layout or the key recipe changes
_DIGEST = 32
_HEADER = len(MAGIC) + _DIGEST
_TYPES = {"str": str, "int": int, "float": (int, float)}
_FIELDS = {f.name: _TYPES[f.type] for f in dataclasses.fields(compiler.Binary) if f.name != "cubin"}
_memo: dict[str, compiler.Binary] = {}
_header_digests: dict[Path, tuple[tuple, str]] = {}


class DamagedEntry(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    root: Path
    entries: int
    bytes: int


def cache_key(source_text: str, arch: str) -> str:
    # CUDA's own headers are many and versioned as packages: their paths (in the -I options) and
    # package versions stand for their contents. Our headers are few and edited often: hash them.
    parts = [FORMAT_VERSION, source_text, arch, "nvrtc %d.%d" % compiler.nvrtc_version(),
             *compiler.nvrtc_options(arch), header_digest(compiler.TEMPLATE_INCLUDE_DIR), _toolchain()]
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode()
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return digest.hexdigest()


def header_digest(directory: Path) -> str:
    """sha256 over every file under `directory`; recomputed only when a file's (mtime, size) changes."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else []
    signature = tuple((str(p.relative_to(directory)), p.stat().st_mtime_ns, p.stat().st_size)
                      for p in files)
    cached = _header_digests.get(directory)
    if cached and cached[0] == signature:
        return cached[1]
    digest = hashlib.sha256()
    for path, (relative, _, _) in zip(files, signature):
        digest.update(relative.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    _header_digests[directory] = (signature, digest.hexdigest())
    return digest.hexdigest()


@functools.cache
def _toolchain() -> str:
    versions = []
    for package in ("nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-nvrtc"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "version.json").is_file():
        versions.append((Path(home) / "version.json").read_text())
    return "\n".join(versions)


def entry_path(key: str) -> Path:
    return env.settings().cache_dir / "binaries" / key[:2] / f"{key}.kgb"


def compile_cached(source, arch: str) -> compiler.Binary:
    """Binary for a render.Source (uses .text, .name, .entry) from memory, disk, or NVRTC."""
    key = cache_key(source.text, arch)
    binary = _memo.get(key)
    if binary is not None:
        return binary
    settings = env.settings()
    path = entry_path(key)
    binary = None if settings.always_compile else _read_or_warn(path, key)
    if binary is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_suffix(".lock")):
            # Another process may have compiled this key while we waited for the lock.
            if not settings.always_compile and path.exists():
                binary = _read_or_warn(path, key)
            if binary is None:
                binary = compiler.compile_source(source.text, source.name, source.entry, arch)
                write_entry(path, key, binary)
                log.info("compiled %s in %.2fs -> %s", binary.name, binary.compile_seconds, path.name)
    _memo[key] = binary
    return binary


def clear_memo() -> None:
    """Forget the in-process copies (tests use it to prove a load comes from disk)."""
    _memo.clear()


@contextlib.contextmanager
def _locked(lock_path: Path):
    # The lock file stays: deleting it would let a third process lock a fresh inode meanwhile.
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_or_warn(path: Path, key: str):
    try:
        return read_entry(path, key)
    except FileNotFoundError:
        return None
    except DamagedEntry as error:
        log.warning("damaged cache entry %s (%s): rebuilding it", path, error)
        return None


def read_entry(path: Path, key: str) -> compiler.Binary:
    data = path.read_bytes()
    if len(data) < _HEADER + 4 or not data.startswith(MAGIC):
        raise DamagedEntry("bad header or truncated")
    payload = data[_HEADER:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):_HEADER]:
        raise DamagedEntry("checksum mismatch")
    (meta_size,) = struct.unpack_from("<I", payload)
    try:
        meta = json.loads(payload[4:4 + meta_size])
    except ValueError as error:
        raise DamagedEntry(f"bad metadata: {error}") from None
    if not isinstance(meta, dict) or meta.pop("key", None) != key or set(meta) != set(_FIELDS):
        raise DamagedEntry("metadata does not match this key or this kernelgen version")
    if not all(isinstance(meta[name], kind) for name, kind in _FIELDS.items()):
        raise DamagedEntry("metadata has a field of the wrong type")
    cubin = payload[4 + meta_size:]
    if not cubin:
        raise DamagedEntry("empty cubin")
    return compiler.Binary(cubin=cubin, **meta)


def write_entry(path: Path, key: str, binary: compiler.Binary) -> None:
    meta = {name: getattr(binary, name) for name in _FIELDS}
    meta_bytes = json.dumps({"key": key, **meta}, sort_keys=True).encode()
    payload = struct.pack("<I", len(meta_bytes)) + meta_bytes + binary.cubin
    data = MAGIC + hashlib.sha256(payload).digest() + payload
    # Same directory as the target so os.replace is an atomic rename, never a copy.
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def cache_info() -> CacheInfo:
    root = env.settings().cache_dir
    sizes = [p.stat().st_size for p in (root / "binaries").glob("*/*.kgb")]
    return CacheInfo(root=root, entries=len(sizes), bytes=sum(sizes))


def clear_cache() -> CacheInfo:
    """Delete every binary, dumped source and build stamp; returns what was there."""
    info = cache_info()
    for sub in ("binaries", "sources", "build"):
        shutil.rmtree(info.root / sub, ignore_errors=True)
    clear_memo()
    return info


def main(argv: list[str]) -> int:
    """`kernelgen cache [info | clear]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="kernelgen cache", description="the compiled-kernel cache")
    parser.add_argument("action", nargs="?", choices=("info", "clear"), default="info")
    action = parser.parse_args(argv).action
    info = clear_cache() if action == "clear" else cache_info()
    verb = "removed" if action == "clear" else "holds"
    print(f"{info.root} {verb} {info.entries} binaries, {info.bytes / 2**20:.1f} MiB")
    return 0
