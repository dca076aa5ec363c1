"""tunedb.py: runs and trials, exact-key answers, many processes at once, corruption; and the cache
archive (`kernelgen cache export | import`) that carries tuned configs and binaries elsewhere."""
from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing
import os
import sqlite3
import tarfile

import pytest

from kernelgen import cache
from kernelgen import compile as compiler
from kernelgen import env, tunedb
from kernelgen.spec import Config
from kernelgen.tunedb import Identity, Key, TrialRow, TuneDB

IDENTITY = Identity(gpu="NVIDIA H200", capability="9.0", sm_count=132, driver=13000, nvrtc="13.0",
                    kernelgen="0.1.0")
PROBLEM = {"batch": 2, "heads": 16, "heads_k": 16, "seqlen_q": 8192, "seqlen_k": 8192}


def key(identity: Identity = IDENTITY, **changes) -> Key:
    fields = {"spec": "flash_attn_fwd", "spec_hash": "ab" * 32, "variant": "head_dim128_dtypebf16_causal0",
              "arch": "sm_90", "bucket": "q8192_k8192_bh32", **changes}
    return Key(identity=identity, **fields)


def config(block_m: int = 128, block_n: int = 64) -> Config:
    return Config((("block_m", block_m), ("block_n", block_n), ("warps", 4), ("stages", 2)))


TRIALS = [
    TrialRow(config(128, 64), "ok", median_ms=1.25, min_ms=1.2, samples=40, registers=255,
             smem=110_592, max_error=0.0039),
    TrialRow(config(64, 32), "wrong", registers=128, smem=40_000, max_error=0.5,
             note="max error 0.5 > 0.0078 at batch 0, rows 0..127"),
    TrialRow(config(256, 128), "spills", registers=255, note="88 B spill stores, 0 B stack"),
    TrialRow(config(128, 128), "compile_error", note="CompileError: NVRTC failed"),
]


def test_record_keeps_every_trial_and_the_choice(cache_dir):
    db = TuneDB()
    assert db.path == cache_dir / "tuning.sqlite3"
    assert db.best(key()) is None
    uid = db.record(key(), PROBLEM, config(128, 64), 1.25, TRIALS)
    assert db.best(key()) == config(128, 64)
    assert db.trials(uid) == TRIALS
    assert db.info().runs == 1 and db.info().trials == len(TRIALS)
    with sqlite3.connect(db.path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        problem, chosen = raw.execute("SELECT problem, config FROM runs").fetchone()
    assert json.loads(problem) == PROBLEM and json.loads(chosen) == config(128, 64).as_dict()


def test_latest_run_wins_and_empty_runs_do_not_hide_it(cache_dir):
    db = TuneDB()
    db.record(key(), PROBLEM, config(128, 64), 1.25, TRIALS)
    db.record(key(), PROBLEM, config(64, 32), 1.10, [])
    assert db.best(key()) == config(64, 32)
    db.record(key(), PROBLEM, None, None, [TrialRow(config(64, 32), "wrong")])   # nothing passed
    assert db.best(key()) == config(64, 32)
    assert db.info().runs == 3


@pytest.mark.parametrize("field, value", [
    ("gpu", "NVIDIA H100 80GB HBM3"), ("capability", "8.0"), ("sm_count", 114),
    ("driver", 12080), ("nvrtc", "12.9"), ("kernelgen", "0.2.0")])
def test_rows_of_another_gpu_or_toolchain_are_not_trusted(cache_dir, field, value):
    db = TuneDB()
    db.record(key(), PROBLEM, config(), 1.0, [])
    assert db.best(key(dataclasses.replace(IDENTITY, **{field: value}))) is None
    assert db.best(key()) == config()


@pytest.mark.parametrize("field, value", [
    ("spec_hash", "cd" * 32), ("variant", "head_dim64_dtypebf16_causal0"), ("arch", "sm_80"),
    ("bucket", "q4096_k4096_bh32")])
def test_every_key_field_matters(cache_dir, field, value):
    db = TuneDB()
    db.record(key(), PROBLEM, config(), 1.0, [])
    assert db.best(key(**{field: value})) is None


def _tune_and_read(root: str, worker: int, runs: int, barrier, results) -> None:
    os.environ["KERNELGEN_CACHE_DIR"] = root
    env.reload_settings()
    db = TuneDB()
    barrier.wait()   # all at once, including creating the schema
    for run in range(runs):
        mine = key(bucket=f"q{2 ** run}_k1_bh{worker}")
        chosen = config(64 * (1 + run % 3), 32 * (1 + worker))
        db.record(mine, PROBLEM, chosen, float(run), TRIALS)
        assert db.best(mine) == chosen   # a process reads its own write at once
        db.best(key(bucket=f"q{2 ** run}_k1_bh{(worker + 1) % 4}"))   # and reads others' meanwhile
    results.put(worker)


def test_four_processes_tuning_and_reading_lose_nothing(cache_dir):
    context = multiprocessing.get_context("spawn")   # fork of a threaded parent may deadlock
    runs, workers = 25, 4
    barrier, results = context.Barrier(workers), context.Queue()
    children = [context.Process(target=_tune_and_read, args=(str(cache_dir), w, runs, barrier, results))
                for w in range(workers)]
    for child in children:
        child.start()
    finished = sorted(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert finished == list(range(workers))
    db = TuneDB()
    assert db.info().runs == runs * workers and db.info().trials == runs * workers * len(TRIALS)
    for worker in range(workers):
        for run in range(runs):
            expected = config(64 * (1 + run % 3), 32 * (1 + worker))
            assert db.best(key(bucket=f"q{2 ** run}_k1_bh{worker}")) == expected


@pytest.mark.parametrize("damage", ["all_random", "pages_after_the_first"])
@pytest.mark.parametrize("new_process", [True, False])
def test_corrupt_database_is_moved_aside_and_recreated(cache_dir, damage, new_process, caplog):
    db = TuneDB()
    for run in range(5):   # tables and indexes: several pages already
        db.record(key(bucket=f"q{2 ** run}_k1_bh1"), PROBLEM, config(), 1.0, TRIALS)
    data = bytearray(db.path.read_bytes())
    start = 0 if damage == "all_random" else 4096
    data[start:] = os.urandom(len(data) - start)
    db.path.write_bytes(bytes(data))
    if new_process:
        tunedb._CHECKED.clear()
    with caplog.at_level("WARNING", logger="kernelgen.tunedb"):
        assert TuneDB().best(key(bucket="q1_k1_bh1")) is None
    assert "is damaged" in caplog.text
    aside = list(cache_dir.glob("tuning.sqlite3.corrupt-*"))
    assert len([p for p in aside if not p.name.endswith(("-wal", "-shm"))]) == 1
    db.record(key(), PROBLEM, config(64, 32), 1.0, TRIALS)
    assert TuneDB().best(key()) == config(64, 32)
    with sqlite3.connect(db.path) as raw:
        assert raw.execute("PRAGMA quick_check").fetchone()[0] == "ok"


def test_a_database_deleted_under_a_running_process_is_created_again(cache_dir):
    db = TuneDB()
    db.record(key(), PROBLEM, config(), 1.0, TRIALS)
    db.path.unlink()
    assert db.best(key()) is None
    db.record(key(), PROBLEM, config(64, 32), 1.0, TRIALS)
    assert db.best(key()) == config(64, 32)


def test_dump_and_merge_are_idempotent(cache_dir, tmp_path):
    source = TuneDB(tmp_path / "source.sqlite3")
    source.record(key(), PROBLEM, config(), 1.0, TRIALS)
    source.record(key(bucket="q512_k512_bh512"), PROBLEM, None, None, TRIALS[1:])
    runs = json.loads(json.dumps(source.dump()))   # as it travels in an archive
    target = TuneDB()
    assert target.merge(runs) == 2
    assert target.merge(runs) == 0
    assert target.dump() == source.dump()
    assert target.best(key()) == config()


# ---- kernelgen cache export / import --------------------------------------------------------------

def fake_binary(tag: bytes) -> compiler.Binary:
    return compiler.Binary(name=f"fake_{tag.decode()}", arch="sm_90", entry="k", cubin=b"\x7fELF" + tag,
                           registers=32, spill_stores=0, spill_loads=0, stack_bytes=0, static_smem=0,
                           compile_seconds=0.1, log="")


def install_fakes(tags=(b"one", b"two")) -> dict[str, compiler.Binary]:
    entries = {}
    for tag in tags:
        entry_key = tag.hex().ljust(64, "0")
        path = cache.entry_path(entry_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        cache.write_entry(path, entry_key, fake_binary(tag))
        entries[entry_key] = fake_binary(tag)
    return entries


def move_to_another_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "elsewhere"))
    env.reload_settings()
    cache.clear_memo()


def test_cache_export_then_import_elsewhere(cache_dir, tmp_path, monkeypatch, capsys):
    entries = install_fakes()
    TuneDB().record(key(), PROBLEM, config(), 1.0, TRIALS)
    archive = tmp_path / "kernelgen-cache.tar.gz"
    assert cache.main(["export", str(archive)]) == 0
    assert "wrote 2 binaries and 1 tuning runs" in capsys.readouterr().out
    move_to_another_machine(monkeypatch, tmp_path)
    assert cache.main(["import", str(archive)]) == 0
    assert "imported 2 binaries (0 already here, 0 damaged) and 1 new tuning runs" in capsys.readouterr().out
    for entry_key, binary in entries.items():
        assert cache.read_entry(cache.entry_path(entry_key), entry_key) == binary
    assert TuneDB().best(key()) == config()
    assert TuneDB().trials(TuneDB().dump()[0]["uid"]) == TRIALS
    again = cache.import_cache(archive)
    assert (again.binaries, again.present, again.damaged, again.runs) == (0, 2, 0, 0)
    assert cache.main(["info"]) == 0
    assert "1 runs, 4 trials" in capsys.readouterr().out


def test_import_verifies_every_entry_and_extracts_nothing_else(cache_dir, tmp_path, monkeypatch, capsys):
    entries = install_fakes()
    archive = tmp_path / "tampered.tar.gz"
    cache.export_cache(archive)
    with tarfile.open(archive) as original:
        members = [(m, original.extractfile(m).read()) for m in original.getmembers()]
    damaged_key = sorted(entries)[0]
    with tarfile.open(archive, "w:gz") as out:
        for member, data in members:
            if member.name.endswith(f"{damaged_key}.kgb"):
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            member.size = len(data)
            out.addfile(member, io.BytesIO(data))
        evil = tarfile.TarInfo("../../evil.kgb")
        evil.size = 4
        out.addfile(evil, io.BytesIO(b"evil"))
    move_to_another_machine(monkeypatch, tmp_path)
    assert cache.main(["import", str(archive)]) == 1
    captured = capsys.readouterr()
    assert "imported 1 binaries (0 already here, 1 damaged)" in captured.out
    assert "ignored unexpected member '../../evil.kgb'" in captured.err
    assert not cache.entry_path(damaged_key).exists()
    good = sorted(entries)[1]
    assert cache.read_entry(cache.entry_path(good), good) == entries[good]
    assert not list(tmp_path.rglob("evil*")) and not list(tmp_path.rglob("*.tmp"))


def test_import_of_something_else_is_a_clear_error(cache_dir, tmp_path, capsys):
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as out:
        out.addfile(tarfile.TarInfo("readme.txt"), io.BytesIO(b""))
    assert cache.main(["import", str(bogus)]) == 1
    assert "not a kernelgen cache archive" in capsys.readouterr().err


def test_clear_keeps_tuning_unless_asked(cache_dir, capsys):
    install_fakes()
    TuneDB().record(key(), PROBLEM, config(), 1.0, TRIALS)
    assert cache.main(["clear"]) == 0
    assert TuneDB().best(key()) == config() and cache.cache_info().entries == 0
    assert cache.main(["clear", "--tuning"]) == 0
    assert "removed 1 tuning runs" in capsys.readouterr().out
    assert TuneDB().best(key()) is None
