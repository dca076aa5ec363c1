"""The tuning database: every tuning run, every timing in it, and the config it chose.

SQLite in WAL mode at <cache_dir>/tuning.sqlite3, shared by every process on the machine. Each
operation opens its own short-lived connection (no connection outlives a fork or crosses threads),
writes take the write lock up front (BEGIN IMMEDIATE) and lock contention is retried. A file that is
not a database or fails `PRAGMA quick_check` is moved aside and recreated: tuned configs are
a cache of measurements, so losing them costs time, never correctness.

A run is keyed by everything that can change its answer: the spec's content hash, the variant and
arch, the problem bucket, and the Identity (GPU, driver, NVRTC, kernelgen). A query matches all of
them exactly, so rows from another toolchain or GPU are never trusted; they stay for export.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import random
import sqlite3
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kernelgen import env
from kernelgen.spec import Config

log = logging.getLogger("kernelgen.tunedb")

DB_FILE = "tuning.sqlite3"
SCHEMA_VERSION = 1
_BUSY_MS = 10_000
_ATTEMPTS = 8   # each waits up to _BUSY_MS inside SQLite before we back off and retry

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    uid TEXT PRIMARY KEY,          -- stable across export/import, so a merge is idempotent
    spec TEXT NOT NULL, spec_hash TEXT NOT NULL, variant TEXT NOT NULL, arch TEXT NOT NULL,
    bucket TEXT NOT NULL,
    gpu TEXT NOT NULL, capability TEXT NOT NULL, sm_count INTEGER NOT NULL,
    driver INTEGER NOT NULL, nvrtc TEXT NOT NULL, kernelgen TEXT NOT NULL,
    problem TEXT NOT NULL,         -- JSON: the shape that was timed (one member of the bucket)
    config TEXT,                   -- JSON: the chosen config; NULL when no candidate passed
    time_ms REAL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_key ON runs (spec_hash, variant, arch, bucket, gpu, capability,
    sm_count, driver, nvrtc, kernelgen, created);
CREATE TABLE IF NOT EXISTS trials (
    run TEXT NOT NULL REFERENCES runs(uid),
    config TEXT NOT NULL, status TEXT NOT NULL,
    median_ms REAL, min_ms REAL, samples INTEGER,
    registers INTEGER, smem INTEGER, max_error REAL, note TEXT
);
CREATE INDEX IF NOT EXISTS trials_by_run ON trials (run);
"""
_KEY_COLUMNS = ("spec", "spec_hash", "variant", "arch", "bucket", "gpu", "capability", "sm_count",
                "driver", "nvrtc", "kernelgen")
_RUN_COLUMNS = ("uid", *_KEY_COLUMNS, "problem", "config", "time_ms", "created")
_TRIAL_COLUMNS = ("config", "status", "median_ms", "min_ms", "samples", "registers", "smem",
                  "max_error", "note")


class TuneDBError(RuntimeError):
    pass


@dataclass(frozen=True)
class Identity:
    """The GPU and toolchain a measurement belongs to. Built by tune.gpu_identity, or by hand."""
    gpu: str              # torch.cuda.get_device_properties(d).name, e.g. "NVIDIA H200"
    capability: str       # "9.0"
    sm_count: int
    driver: int           # cuDriverGetVersion, e.g. 13000
    nvrtc: str            # "13.0"
    kernelgen: str        # kernelgen.__version__


@dataclass(frozen=True)
class Key:
    spec: str             # name, for people and for the shipped defaults
    spec_hash: str        # KernelSpec.content_hash: what the key really depends on
    variant: str          # Variant.slug
    arch: str
    bucket: str           # tune.Bucket.slug
    identity: Identity

    def columns(self) -> dict:
        return {"spec": self.spec, "spec_hash": self.spec_hash, "variant": self.variant,
                "arch": self.arch, "bucket": self.bucket, **asdict(self.identity)}


@dataclass(frozen=True)
class TrialRow:
    config: Config
    status: str           # tune.Trial.status: ok, screened, wrong, spills, compile_error, run_error, device_limit
    median_ms: float | None = None
    min_ms: float | None = None
    samples: int = 0
    registers: int | None = None
    smem: int | None = None
    max_error: float | None = None
    note: str = ""


@dataclass(frozen=True)
class DBInfo:
    path: Path
    runs: int
    trials: int


def db_path() -> Path:
    return env.settings().cache_dir / DB_FILE


def _config_json(config: Config | None) -> str | None:
    return None if config is None else json.dumps(config.as_dict())


def _config(text: str) -> Config:
    return Config(tuple((str(k), int(v)) for k, v in json.loads(text).items()))


class TuneDB:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else db_path()

    # ---- writing ---------------------------------------------------------------------------

    def record(self, key: Key, problem: dict, config: Config | None, time_ms: float | None,
               trials: Sequence[TrialRow]) -> str:
        """Store one tuning run with all of its trials; returns the run's uid."""
        uid = uuid.uuid4().hex
        run = {"uid": uid, **key.columns(), "problem": json.dumps(problem, sort_keys=True),
               "config": _config_json(config), "time_ms": time_ms, "created": time.time()}
        rows = [_trial_values(uid, trial) for trial in trials]
        self._write(lambda db: _insert(db, run, rows))
        return uid

    def merge(self, runs: Iterable[dict]) -> int:
        """Add exported runs (see dump) that are not here yet; returns how many were new."""
        runs = list(runs)

        def insert_new(db) -> int:
            added = 0
            for run in runs:
                values = {name: run[name] for name in _RUN_COLUMNS}
                if db.execute("SELECT 1 FROM runs WHERE uid = ?", (values["uid"],)).fetchone():
                    continue
                rows = [(values["uid"], *(t[name] for name in _TRIAL_COLUMNS)) for t in run["trials"]]
                _insert(db, values, rows)
                added += 1
            return added

        return self._write(insert_new)

    def clear(self) -> DBInfo:
        info = self.info()
        self._write(lambda db: (db.execute("DELETE FROM trials"), db.execute("DELETE FROM runs")))
        return info

    # ---- reading ---------------------------------------------------------------------------

    def best(self, key: Key) -> Config | None:
        """The config chosen by the latest run under exactly this key, or None."""
        where = " AND ".join(f"{name} = ?" for name in _KEY_COLUMNS)
        values = tuple(key.columns()[name] for name in _KEY_COLUMNS)
        row = self._read(lambda db: db.execute(
            f"SELECT config FROM runs WHERE {where} AND config IS NOT NULL "
            "ORDER BY created DESC, rowid DESC LIMIT 1", values).fetchone())
        return None if row is None else _config(row[0])

    def trials(self, uid: str) -> list[TrialRow]:
        rows = self._read(lambda db: db.execute(
            f"SELECT {', '.join(_TRIAL_COLUMNS)} FROM trials WHERE run = ? ORDER BY rowid",
            (uid,)).fetchall())
        return [TrialRow(_config(row[0]), *row[1:]) for row in rows]

    def dump(self) -> list[dict]:
        """Every run with its trials as JSON-ready dicts (the export format; merge reads it)."""
        def read(db):
            runs = [dict(zip(_RUN_COLUMNS, row)) for row in db.execute(
                f"SELECT {', '.join(_RUN_COLUMNS)} FROM runs ORDER BY created, rowid")]
            for run in runs:
                run["trials"] = [dict(zip(_TRIAL_COLUMNS, row)) for row in db.execute(
                    f"SELECT {', '.join(_TRIAL_COLUMNS)} FROM trials WHERE run = ? ORDER BY rowid",
                    (run["uid"],))]
            return runs
        return self._read(read)

    def info(self) -> DBInfo:
        if not self.path.exists():
            return DBInfo(self.path, 0, 0)
        runs, trials = self._read(lambda db: db.execute(
            "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM trials)").fetchone())
        return DBInfo(self.path, runs, trials)

    # ---- connections, retries, corruption ---------------------------------------------------

    def _read(self, work):
        return self._with_retries(work, write=False)

    def _write(self, work):
        return self._with_retries(work, write=True)

    def _with_retries(self, work, write: bool):
        recovered = prepared_again = False
        for attempt in range(_ATTEMPTS):
            try:
                with self._connect() as db:
                    if not write:
                        return work(db)
                    db.execute("BEGIN IMMEDIATE")   # the write lock now, not at the first write
                    try:
                        result = work(db)
                    except BaseException:
                        db.rollback()
                        raise
                    db.commit()
                    return result
            except sqlite3.OperationalError as error:
                if "no such table" in str(error) and not prepared_again:
                    _CHECKED.discard(self.path)   # the file was deleted under us: create it again
                    prepared_again = True
                    continue
                if not _is_busy(error) or attempt == _ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
            except sqlite3.DatabaseError as error:   # not a database, malformed image
                if recovered:
                    raise
                self._recover(error)
                recovered = True
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _connect(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves; timeout is SQLite's busy handler.
        db = sqlite3.connect(self.path, timeout=_BUSY_MS / 1000, isolation_level=None)
        try:
            db.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
            # In WAL mode NORMAL cannot corrupt the file; a power cut may lose the last runs only.
            db.execute("PRAGMA synchronous = NORMAL")
            if self.path not in _CHECKED:
                self._prepare(db)
                _CHECKED.add(self.path)
            yield db
        finally:
            db.close()

    def _prepare(self, db: sqlite3.Connection) -> None:
        """Once per process and file: WAL mode, integrity, schema."""
        db.execute("PRAGMA journal_mode = WAL")   # persistent: stored in the file
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {problem}")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise TuneDBError(f"{self.path}: schema version {version} is not {SCHEMA_VERSION} "
                              "(written by another kernelgen?)")
        if version == 0:   # idempotent, so two processes creating it at once both succeed
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; "
                             "COMMIT;")

    def _recover(self, error: Exception) -> None:
        _CHECKED.discard(self.path)
        # One process at a time: a second process that also saw the damage must not move aside
        # the fresh file the first one just created, so the damage is checked again under the lock.
        with open(self.path.with_name(DB_FILE + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.path.exists() or _healthy(self.path):
                return
            stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            for suffix in ("", "-wal", "-shm"):   # a stale WAL must not replay into the new file
                part = Path(str(self.path) + suffix)
                if part.exists():
                    part.replace(Path(str(aside) + suffix))
            log.warning("tuning database %s is damaged (%s): moved it to %s and starting a new one",
                        self.path, error, aside.name)


_CHECKED: set[Path] = set()


def _healthy(path: Path) -> bool:
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=_BUSY_MS / 1000)) as db:
            return db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    except sqlite3.OperationalError as error:
        return _is_busy(error)   # busy means someone is using it: not ours to move
    except sqlite3.DatabaseError:
        return False


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _trial_values(uid: str, trial: TrialRow) -> tuple:
    values = {f.name: getattr(trial, f.name) for f in fields(TrialRow)}
    values["config"] = _config_json(trial.config)
    return (uid, *(values[name] for name in _TRIAL_COLUMNS))


def _insert(db: sqlite3.Connection, run: dict, trial_rows: list[tuple]) -> int:
    db.execute(f"INSERT INTO runs ({', '.join(_RUN_COLUMNS)}) VALUES "
               f"({', '.join('?' * len(_RUN_COLUMNS))})", tuple(run[name] for name in _RUN_COLUMNS))
    db.executemany(f"INSERT INTO trials (run, {', '.join(_TRIAL_COLUMNS)}) VALUES "
                   f"({', '.join('?' * (len(_TRIAL_COLUMNS) + 1))})", trial_rows)
    return len(trial_rows)
