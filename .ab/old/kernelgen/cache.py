"""Content-addressed disk cache of compiled binaries: the only way the rest of kernelgen compiles.

Layout under settings().cache_dir:
    binaries/<key[:2]>/<key>.kgb     MAGIC | sha256(payload) | payload
    binaries/<key[:2]>/<key>.lock    per-key flock, so concurrent processes compile a key once
    tuning.sqlite3                   the tuning DB (tunedb.py); export/import below carry both
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
import io
import json
import logging
import os
import re
import shutil
import struct
import sys
import tarfile
import tempfile
import time
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


def compile_cached(source, arch: str, compile=None) -> compiler.Binary:
    """Binary for a render.Source (uses .text, .name, .entry) from memory, disk, or NVRTC
    (`compile`, compile.compile_source's signature: by default that, in this process)."""
    key = cache_key(source.text, arch)
    binary = _memo.get(key)
    if binary is not None:
        return binary
    settings = env.settings()
    path = entry_path(key)
    binary = None if settings.always_compile else _read_or_warn(path, key)
    if binary is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            # Another process may have compiled this key while we waited for the lock.
            if not settings.always_compile and path.exists():
                binary = _read_or_warn(path, key)
            if binary is None:
                binary = (compile or compiler.compile_source)(source.text, source.name,
                                                              source.entry, arch)
                write_entry(path, key, binary)
                log.info("compiled %s in %.2fs -> %s", binary.name, binary.compile_seconds, path.name)
    _memo[key] = binary
    return binary


def clear_memo() -> None:
    """Forget the in-process copies (tests use it to prove a load comes from disk)."""
    _memo.clear()


@contextlib.contextmanager
def file_lock(lock_path: Path):
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


# ---- moving a cache to another machine ----------------------------------------------------------
# An archive is a tar.gz of manifest.json, tuning.json (every run of the tuning DB, see
# TuneDB.dump) and binaries/<key[:2]>/<key>.kgb. Import never extracts paths: it reads each member
# named like an entry, verifies it with read_entry under the key its name gives, and only then
# moves it into place; tuning runs are merged by their uid, so importing twice adds nothing.

ARCHIVE_FORMAT = 1
_MEMBER_RE = re.compile(r"binaries/[0-9a-f]{2}/([0-9a-f]{64})\.kgb")


@dataclasses.dataclass(frozen=True)
class ImportReport:
    binaries: int    # new entries installed
    present: int     # already here
    damaged: int     # failed verification: skipped
    runs: int        # new tuning runs
    notes: tuple[str, ...]


def _toolchain_note() -> dict:
    return {"kernelgen": _kernelgen_version(), "nvrtc": "%d.%d" % compiler.nvrtc_version()}


def _kernelgen_version() -> str:
    import kernelgen

    return kernelgen.__version__


def export_cache(path: Path) -> tuple[int, int]:
    """Write binaries and tuning runs to a tar.gz; returns (binaries, runs)."""
    from kernelgen import tunedb

    root = env.settings().cache_dir
    entries = sorted((root / "binaries").glob("*/*.kgb"))
    runs = tunedb.TuneDB().dump() if tunedb.db_path().exists() else []
    manifest = {"format": ARCHIVE_FORMAT, **_toolchain_note(), "binaries": len(entries),
                "runs": len(runs)}
    with tarfile.open(path, "w:gz") as archive:
        _add_bytes(archive, "manifest.json", json.dumps(manifest, indent=1).encode())
        _add_bytes(archive, "tuning.json", json.dumps(runs).encode())
        for entry in entries:
            archive.add(entry, arcname=entry.relative_to(root).as_posix(), recursive=False)
    return len(entries), len(runs)


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
    archive.addfile(info, io.BytesIO(data))


def import_cache(path: Path) -> ImportReport:
    from kernelgen import tunedb

    installed = present = damaged = 0
    notes = []
    with tarfile.open(path, "r:*") as archive:
        manifest = _json_member(archive, "manifest.json", path)
        if manifest.get("format") != ARCHIVE_FORMAT:
            raise ValueError(f"{path}: archive format {manifest.get('format')!r}, expected {ARCHIVE_FORMAT}")
        here = _toolchain_note()
        for name, value in here.items():
            if manifest.get(name) != value:
                notes.append(f"exported with {name} {manifest.get(name)}, this machine has {value}: "
                             "its binaries and tuned configs will not match here")
        runs = _json_member(archive, "tuning.json", path)
        for member in archive:
            match = _MEMBER_RE.fullmatch(member.name)
            if not match:
                if member.name not in ("manifest.json", "tuning.json"):
                    notes.append(f"ignored unexpected member {member.name!r}")
                continue
            outcome = _install(match.group(1), archive.extractfile(member).read() if member.isfile() else b"")
            installed += outcome == "installed"
            present += outcome == "present"
            damaged += outcome == "damaged"
    added = tunedb.TuneDB().merge(runs) if runs else 0
    if damaged:
        notes.append(f"{damaged} damaged binaries skipped")
    return ImportReport(installed, present, damaged, added, tuple(notes))


def _json_member(archive: tarfile.TarFile, name: str, path: Path):
    try:
        return json.loads(archive.extractfile(name).read())
    except (KeyError, AttributeError, ValueError) as error:
        raise ValueError(f"{path}: not a kernelgen cache archive ({name}: {error})") from None


def _install(key: str, data: bytes) -> str:
    target = entry_path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{key[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        try:
            read_entry(Path(temp), key)
        except DamagedEntry as error:
            log.warning("archive entry %s is damaged (%s): skipped", key, error)
            return "damaged"
        with file_lock(target.with_suffix(".lock")):
            if target.exists() and _read_or_warn(target, key) is not None:
                return "present"
            os.replace(temp, target)
        return "installed"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _describe_db() -> str:
    from kernelgen import tunedb

    info = tunedb.TuneDB().info()
    return f"tuning DB {info.path}: {info.runs} runs, {info.trials} trials"


def main(argv: list[str]) -> int:
    """`kernelgen cache [info | clear [--tuning] | export FILE | import FILE]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="kernelgen cache",
                                     description="the compiled-kernel cache and the tuning database")
    parser.add_argument("action", nargs="?", choices=("info", "clear", "export", "import"), default="info")
    parser.add_argument("file", nargs="?", help="the archive (.tar.gz) for export and import")
    parser.add_argument("--tuning", action="store_true", help="clear: the tuning database too")
    opts = parser.parse_args(argv)
    if (opts.file is None) == (opts.action in ("export", "import")):
        parser.error(f"{opts.action} takes {'a FILE' if opts.file is None else 'no FILE'}")
    if opts.tuning and opts.action != "clear":
        parser.error("--tuning goes with clear")
    if opts.action == "export":
        binaries, runs = export_cache(Path(opts.file))
        print(f"wrote {binaries} binaries and {runs} tuning runs to {opts.file}")
        return 0
    if opts.action == "import":
        try:
            report = import_cache(Path(opts.file))
        except (OSError, ValueError, tarfile.TarError) as error:
            print(f"kernelgen: error: {error}", file=sys.stderr)
            return 1
        for note in report.notes:
            print(f"kernelgen: warning: {note}", file=sys.stderr)
        print(f"imported {report.binaries} binaries ({report.present} already here, "
              f"{report.damaged} damaged) and {report.runs} new tuning runs")
        return 1 if report.damaged else 0
    info = clear_cache() if opts.action == "clear" else cache_info()
    verb = "removed" if opts.action == "clear" else "holds"
    print(f"{info.root} {verb} {info.entries} binaries, {info.bytes / 2**20:.1f} MiB")
    if opts.action == "clear" and opts.tuning:
        from kernelgen import tunedb

        cleared = tunedb.TuneDB().clear()
        print(f"removed {cleared.runs} tuning runs from {cleared.path}")
    elif opts.action == "info":
        print(_describe_db())
    return 0
