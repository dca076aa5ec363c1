"""tune.py and search.py on the CPU: buckets, the search loop's rules with fake candidates, pruning by device
limits, lookup's order (memo, DB, shipped defaults, heuristic) with a fake GPU identity, tuning on a
miss, CUDA-graph capture, the shipped-defaults file, and the `kernelgen tune` command line."""
from __future__ import annotations

import dataclasses
import json
import threading
import timeit
import tomllib
from concurrent.futures import ThreadPoolExecutor

import pytest

import kernelgen
from kernelgen import cache, env, search, tune, tune_cli, tunedb
from kernelgen import compile as compiler
from kernelgen.cli import main as cli_main
from kernelgen.spec import REPO_ROOT, Config, load_spec
from kernelgen.render import render
from kernelgen.search import Built, Check, DeviceLimits, Timing, Trial
from kernelgen.tune import Bucket, Problem, TuneError, TuneResult
from kernelgen.tunedb import Identity, TuneDB

FAKE_GPU = Identity(gpu="Fake GPU", capability="9.0", sm_count=132, driver=13000, nvrtc="13.0",
                    kernelgen=kernelgen.__version__)
PROBLEM = Problem(batch=2, heads=16, heads_k=16, seqlen_q=8192, seqlen_k=8192)


def cfg(block_m: int, block_n: int = 64, warps: int = 4, stages: int = 2) -> Config:
    """A config of the shipped forward's tune space (its other keys as in the default)."""
    spec = load_spec("flash_attn_fwd")
    default = spec.default_config(spec.variant("sm_90", head_dim=128, dtype="bf16", causal=False))
    return spec.parse_config({**default.as_dict(), "block_m": block_m, "block_n": block_n,
                              "warps": warps, "stages": stages})


@pytest.fixture
def spec():
    return load_spec("flash_attn_fwd")


@pytest.fixture
def variant(spec):
    return spec.variant("sm_90", head_dim=128, dtype="bf16", causal=False)


@pytest.fixture
def fake_gpu(cache_dir, monkeypatch, tmp_path):
    """lookup() on the CPU: a hand-made GPU identity and an empty shipped-defaults file."""
    monkeypatch.setattr(tune, "gpu_identity", lambda device: FAKE_GPU)
    defaults = tmp_path / "tuned_defaults.json"
    defaults.write_text('{"format": 1, "entries": []}')
    monkeypatch.setattr(tune, "DEFAULTS_PATH", defaults)
    tune.clear_memo()
    yield defaults
    tune.clear_memo()


# ---- problems and buckets ----------------------------------------------------------------------

@pytest.mark.parametrize("problem, slug", [
    (Problem(2, 16, 16, 8192, 8192), "q8192_k8192_bh32"),
    (Problem(2, 16, 4, 8193, 100), "q16384_k128_bh32"),
    (Problem(3, 5, 5, 1, 1), "q1_k1_bh16"),
    (Problem(1, 1, 1, 0, 0), "q1_k1_bh1"),
])
def test_bucket_rounds_up_to_powers_of_two(problem, slug):
    assert problem.bucket().slug == slug
    assert Bucket.from_slug(slug) == problem.bucket()


def test_bucket_distance_prefers_the_same_seqlens():
    here = Bucket(4096, 4096, 64)
    assert here.distance(here) == 0
    assert here.distance(Bucket(4096, 4096, 128)) < here.distance(Bucket(8192, 4096, 64))


# ---- the search loop ---------------------------------------------------------------------------

CLEAN = Built(registers=128, spill_stores=0, stack_bytes=0, smem=65536)


class FakeCandidate:
    def __init__(self, config: Config, ms: float, correct: bool = True, events=None, fail=None):
        self.config, self.ms, self.correct, self.fail = config, ms, correct, fail
        self.events = events if events is not None else []

    def check(self) -> Check:
        self.events.append(("check", self.config))
        if self.fail == "check":
            raise RuntimeError("illegal memory access")
        return Check(self.correct, 0.001 if self.correct else 0.9, 0.008,
                     "" if self.correct else "max error 0.9 > 0.008")

    def run(self) -> Timing:
        self.events.append(("run", self.config))
        if self.fail == "run":
            raise RuntimeError("launch timed out")
        return Timing(self.ms, self.ms * 0.97, 40)

    def screen(self) -> Timing:
        # A screening's noise: 2% either way, which may misrank close configs but not far ones.
        self.events.append(("screen", self.config))
        if self.fail == "screen":
            raise RuntimeError("launch timed out")
        noisy = self.ms * (0.98 if hash(self.config) % 2 else 1.02)
        return Timing(noisy, noisy * 0.97, 5)


def fake_build(outcomes: dict):
    def build(config: Config) -> Built:
        outcome = outcomes.get(config, CLEAN)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    return build


def test_a_wrong_candidate_never_wins_however_fast():
    events = []
    candidates = [FakeCandidate(cfg(64), 2.0, events=events),
                  FakeCandidate(cfg(128), 0.1, correct=False, events=events),   # fastest, wrong
                  FakeCandidate(cfg(256), 1.5, events=events),
                  FakeCandidate(cfg(64, 32), 0.05, events=events),               # does not compile
                  FakeCandidate(cfg(64, 48), 0.05, events=events),               # spills
                  FakeCandidate(cfg(64, 96), 0.05, events=events),               # too much smem
                  FakeCandidate(cfg(128, 32), 0.05, events=events, fail="check"),
                  FakeCandidate(cfg(128, 48), 0.05, events=events, fail="run")]
    outcomes = {cfg(64, 32): compiler.CompileError("NVRTC failed to compile x\nmore lines"),
                cfg(64, 48): Built(255, spill_stores=24, stack_bytes=24, smem=65536),
                cfg(64, 96): search.DeviceLimit("240000 B shared memory (with static) > 232448")}
    with ThreadPoolExecutor(3) as pool:
        trials = search.search(candidates, fake_build(outcomes), pool)
    assert [t.config for t in trials] == [c.config for c in candidates]   # every trial is kept
    assert [t.status for t in trials] == ["ok", "wrong", "ok", "compile_error", "spills",
                                          "device_limit", "run_error", "run_error"]
    chosen = search.choose(trials)
    assert chosen.config == cfg(256) and chosen.timing.median_ms == 1.5
    assert ("run", cfg(128)) not in events          # a wrong candidate is not even timed
    assert ("check", cfg(64, 32)) not in events and ("check", cfg(64, 48)) not in events
    assert events.index(("check", cfg(64))) < events.index(("run", cfg(64)))
    assert trials[1].check.max_error == 0.9 and "0.9 > 0.008" in trials[1].note
    assert trials[3].note == "CompileError: NVRTC failed to compile x"
    assert trials[6].note == "RuntimeError: illegal memory access"


def test_screening_times_only_the_fastest_and_the_default_in_full():
    events = []
    times = {cfg(64): 3.0, cfg(128): 1.0, cfg(256): 1.01, cfg(64, 128): 2.0, cfg(128, 128): 0.5,
             cfg(128, 32): 4.0}
    candidates = [FakeCandidate(c, ms, events=events) for c, ms in times.items()]
    candidates[4].correct = False                                   # fastest, wrong
    candidates.append(FakeCandidate(cfg(256, 128), 0.1, events=events, fail="screen"))
    default = cfg(128, 32)                                          # the slowest that passes
    with ThreadPoolExecutor(2) as pool:
        trials = search.search(candidates, fake_build({}), pool, finalists=2, default=default)
    status = {t.config: t.status for t in trials}
    assert [t.config for t in trials] == [c.config for c in candidates]   # every trial kept
    # cfg(128) and cfg(256) are 1% apart: a screening may misrank them, both are finalists.
    assert status == {cfg(64): "screened", cfg(128): "ok", cfg(256): "ok", cfg(64, 128): "screened",
                      cfg(128, 128): "wrong", cfg(128, 32): "ok", cfg(256, 128): "run_error"}
    timed = [c for kind, c in events if kind == "run"]
    assert sorted(map(str, timed)) == sorted(map(str, [cfg(128), cfg(256), default]))
    assert ("screen", cfg(128, 128)) not in events                 # wrong: never timed at all
    assert search.choose(trials).config == cfg(128)                # the full timings decide
    assert search.choose(trials).timing.samples == 40
    assert next(t for t in trials if t.config == cfg(64)).timing.samples == 5   # screening kept
    # No more candidates than finalists: no screening at all.
    events.clear()
    with ThreadPoolExecutor(2) as pool:
        trials = search.search(candidates[:3], fake_build({}), pool, finalists=3, default=default)
    assert {t.status for t in trials} == {"ok"} and not [e for e in events if e[0] == "screen"]


def test_nothing_passes_nothing_is_chosen():
    candidates = [FakeCandidate(cfg(64), 0.1, correct=False)]
    with ThreadPoolExecutor(1) as pool:
        assert search.choose(search.search(candidates, fake_build({}), pool)) is None


def test_timing_overlaps_compilation():
    first_timed = threading.Event()

    class First(FakeCandidate):
        def run(self):
            first_timed.set()
            return super().run()

    def build(config):
        # The last build finishes only once the first candidate is being timed: a loop that
        # compiled everything before timing anything would wait here until the timeout.
        if config == cfg(256):
            assert first_timed.wait(timeout=20), "timing did not start while builds were running"
        return CLEAN

    candidates = [First(cfg(64), 1.0), FakeCandidate(cfg(128), 1.0), FakeCandidate(cfg(256), 1.0)]
    with ThreadPoolExecutor(3) as pool:
        trials = search.search(candidates, build, pool)
    assert [t.status for t in trials] == ["ok", "ok", "ok"]


def test_timing_from_samples():
    assert Timing.of([3.0, 1.0, 2.0]) == Timing(2.0, 1.0, 3)
    assert Timing.of([4.0, 1.0, 2.0, 3.0]) == Timing(2.5, 1.0, 4)


def test_prune_by_device_limits(spec, variant):
    limits = DeviceLimits(max_smem=100_000, max_threads=128)
    kept, rejected = search.prune(spec, variant, limits)
    assert kept and rejected
    assert set(kept) | {t.config for t in rejected} == set(spec.valid_configs(variant))
    for config in kept:
        assert config["warps"] * 32 <= 128
        assert spec.smem(spec.environment(variant, config)) <= 100_000
    assert {t.status for t in rejected} == {"device_limit"}
    notes = " ".join(t.note for t in rejected)
    assert "256 threads per block > 128" in notes and "B shared memory > 100000" in notes


def test_build_rejects_spills_and_static_smem_beyond_the_device(spec, variant, monkeypatch):
    def fake_compile(source, arch, static_smem=0, spill=0):
        return compiler.Binary(name=source.name, arch=arch, entry=source.entry, cubin=b"x",
                               registers=200, spill_stores=spill, spill_loads=spill, stack_bytes=0,
                               static_smem=static_smem, compile_seconds=0.1, log="")

    config = cfg(128, 64)
    dynamic = int(spec.smem(spec.environment(variant, config)))
    monkeypatch.setattr(cache, "compile_cached", lambda s, a, **_: fake_compile(s, a, spill=16))
    built = search.build(spec, variant, DeviceLimits(dynamic, 1024), config)
    assert built.spills and built.smem == dynamic and built.registers == 200
    monkeypatch.setattr(cache, "compile_cached", lambda s, a, **_: fake_compile(s, a, static_smem=16))
    with pytest.raises(search.DeviceLimit, match="with static"):
        search.build(spec, variant, DeviceLimits(dynamic, 1024), config)


@pytest.mark.parametrize("seqlens", [(150, 400), (400, 150), (300, 300)])
def test_the_check_accepts_the_reference_and_rejects_wrong_outputs(spec, seqlens):
    torch = pytest.importorskip("torch")
    from kernelgen import measure
    from kernelgen.reference import attention_ref

    variant = spec.variant("sm_90", head_dim=64, dtype="bf16", causal=True)
    workload = measure.Workload(spec, variant, Problem(2, 2, 1, *seqlens), device="cpu")
    ref_out, ref_lse = attention_ref(workload.q, workload.k, workload.v, causal=True)

    def writes(out=None, lse=None):   # a 'kernel' that writes the given output
        return lambda: (workload.out.copy_(ref_out if out is None else out),
                        workload.lse.copy_(ref_lse if lse is None else lse))

    assert workload.check(writes()).ok
    assert not workload.check(writes(out=torch.zeros_like(ref_out))).ok
    assert not workload.check(lambda: None).ok   # writes nothing: the NaN poison stays
    if seqlens[1] >= seqlens[0]:   # otherwise the first rows see no key: 0 either way
        first_tile_unwritten = ref_out.clone()
        first_tile_unwritten[:, :64] = float("nan")
        assert not workload.check(writes(out=first_tile_unwritten)).ok
    last_row_off = ref_out.clone()
    last_row_off[-1, -1] += 0.25
    check = workload.check(writes(out=last_row_off))
    assert not check.ok and f"batch 1, rows {seqlens[0] - 128}..{seqlens[0] - 1}" in check.note
    assert "LSE error" in workload.check(writes(lse=ref_lse + 0.01)).note


def test_the_workload_refuses_specs_it_cannot_feed(write_spec):
    pytest.importorskip("torch")
    from kernelgen import measure

    toy = load_spec(write_spec())
    with pytest.raises(TuneError, match="args and params of flash_attn_fwd"):
        measure.Workload(toy, toy.variant(), PROBLEM, device="cpu")


def test_the_workload_feeds_tensor_maps_shaped_by_each_config(monkeypatch):
    """The Hopper family: every candidate gets Q/K/V maps whose boxes are its own tile rows."""
    pytest.importorskip("torch")
    from kernelgen import api, measure, tma

    spec = load_spec("flash_attn_fwd_sm90")
    variant = spec.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    workload = measure.Workload(spec, variant, Problem(1, 2, 2, 300, 200), device="cpu")
    monkeypatch.setattr(tma, "encode", lambda tiled, address: (tiled.box, address))
    monkeypatch.setattr(api, "_current_stream", lambda device: 0)
    launched = []

    class Kernel:
        def __init__(self, block_m, block_n):
            self.spec, self.variant = spec, variant
            self.config = spec.parse_config({**spec.default_config(variant).as_dict(),
                                             "block_m": block_m, "block_n": block_n})

        def grid(self, sizes):
            return (1, 1, 1)

        def launch(self, values, grid, device, stream):
            launched.append(dict(zip(workload.names, values)))

    for block_m, block_n in ((128, 176), (192, 64)):
        workload.launcher(Kernel(block_m, block_n))()
        values = launched[-1]
        assert values["tmap_q"] == ((64, block_m, 2, 1, 1), workload.q.data_ptr())
        assert values["tmap_k"] == ((64, block_n, 2, 1, 1), workload.k.data_ptr())
        assert values["tmap_v"] == ((64, block_n, 2, 1, 1), workload.v.data_ptr())
        assert values["q"] == workload.q.data_ptr() and values["seqlen_k"] == 200


def test_tune_end_to_end_with_a_fake_gpu(fake_gpu, spec, variant, monkeypatch, capsys):
    """tune() wired up: pruning, the pool, the DB row with every trial, the memo. The GPU parts
    (device queries, inputs, candidates, compiling) are fakes; test_tune_gpu.py has the real run."""
    torch = pytest.importorskip("torch")
    import contextlib

    from kernelgen import measure

    wrong, fastest = cfg(64, 64), cfg(128, 64)

    class Candidate(FakeCandidate):
        def __init__(self, workload, spec, variant, config, rep_ms):
            ms = 0.5 if config == wrong else 1.0 if config == fastest else 2.0 + config["block_n"] / 100
            super().__init__(config, ms, correct=config != wrong)

    def fake_compile(source, arch, compile=None):
        return compiler.Binary(name=source.name, arch=arch, entry=source.entry, cubin=b"x",
                               registers=128, spill_stores=0, spill_loads=0, stack_bytes=0,
                               static_smem=0, compile_seconds=0.1, log="")

    monkeypatch.setattr(measure, "device_limits", lambda device: DeviceLimits(120_000, 1024))
    monkeypatch.setattr(measure, "Workload", lambda *args: None)
    monkeypatch.setattr(measure, "AttentionCandidate", Candidate)
    monkeypatch.setattr(cache, "compile_cached", fake_compile)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    # configs= narrows the search to those given (Configs or mappings); a duplicate is searched
    # once.
    given = [cfg(64, 128), fastest.as_dict(), cfg(64, 128)]
    narrowed = tune.tune(spec, PROBLEM, variant=variant, device=0, save=False, configs=given)
    assert sorted(t.config.slug for t in narrowed.trials) == sorted([cfg(64, 128).slug, fastest.slug])
    assert narrowed.chosen.config == fastest
    tune.clear_memo()
    result = tune.tune(spec, PROBLEM, variant=variant, device=0, progress=True)
    assert result.chosen.config == fastest
    assert {t.config for t in result.trials} == set(spec.valid_configs(variant))
    statuses = {t.config: t.status for t in result.trials}
    assert statuses[wrong] == "wrong" and "device_limit" in statuses.values()
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(fastest, "tuned")
    tune.clear_memo()
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(fastest, "db")
    (run,) = TuneDB().dump()
    assert len(run["trials"]) == len(result.trials) and run["time_ms"] == 1.0
    assert json.loads(run["problem"]) == PROBLEM.as_dict()
    assert variant.slug in capsys.readouterr().err   # the progress bar


# ---- lookup ---------------------------------------------------------------------------------

def record(spec, variant, config: Config, problem: Problem = PROBLEM, identity: Identity = FAKE_GPU,
           spec_hash: str | None = None) -> None:
    key = tune._key(spec, variant, problem.bucket(), identity)
    if spec_hash is not None:
        key = tunedb.Key(key.spec, spec_hash, key.variant, key.arch, key.bucket, key.identity)
    TuneDB().record(key, problem.as_dict(), config, 1.0, [tunedb.TrialRow(config, "ok", 1.0, 1.0, 10)])


def ship(path, spec, variant, config: Config, bucket: str, gpu: str = FAKE_GPU.gpu,
         sm_count: int = 132) -> None:
    doc = json.loads(path.read_text())
    doc["entries"].append({"spec": spec.name, "variant": variant.slug, "arch": variant.arch,
                           "bucket": bucket, "gpu": gpu, "capability": "9.0", "sm_count": sm_count,
                           "config": config.as_dict()})
    path.write_text(json.dumps(doc))
    tune.clear_memo()


def test_lookup_order_db_then_shipped_then_heuristic(fake_gpu, spec, variant):
    heuristic = spec.default_config(variant)
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(heuristic, "heuristic")
    shipped, tuned = cfg(128, 64), cfg(64, 64)
    assert shipped != heuristic and tuned != heuristic
    ship(fake_gpu, spec, variant, shipped, PROBLEM.bucket().slug)
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(shipped, "shipped")
    record(spec, variant, tuned)
    assert tune.resolve(spec, variant, PROBLEM, device=0).source == "shipped"   # memoized per bucket
    tune.clear_memo()
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(tuned, "db")
    assert tune.lookup(spec, variant, PROBLEM, device=0) == tuned


def test_lookup_is_memoized(fake_gpu, spec, variant, monkeypatch):
    record(spec, variant, cfg(64, 64))
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)

    def no_database(*args):
        raise AssertionError("a memoized lookup read the database")

    monkeypatch.setattr(TuneDB, "best", no_database)
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)
    same_bucket = Problem(2, 16, 16, 5000, 6000)
    assert tune.lookup(spec, variant, same_bucket, device=0) == cfg(64, 64)   # bucket memo


def test_memoized_lookup_takes_under_5_microseconds(fake_gpu, spec, variant):
    tune.lookup(spec, variant, PROBLEM, device=0)
    calls = 20_000
    best = min(timeit.repeat(lambda: tune.lookup(spec, variant, PROBLEM, 0), number=calls, repeat=7))
    assert best / calls < 5e-6, f"{best / calls * 1e6:.2f} us per memoized lookup"


def test_stale_and_invalid_rows_are_ignored(fake_gpu, spec, variant, caplog):
    heuristic = spec.default_config(variant)
    record(spec, variant, cfg(64, 64), identity=dataclasses.replace(FAKE_GPU, driver=12000))
    record(spec, variant, cfg(64, 64), spec_hash="0" * 64)
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(heuristic, "heuristic")
    tune.clear_memo()
    record(spec, variant, cfg(256, 64, warps=4))   # 64 rows per warp: violates the spec
    with caplog.at_level("WARNING", logger="kernelgen.tune"):
        assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"
    assert "violates" in caplog.text


def test_an_unreadable_database_never_fails_a_call(fake_gpu, spec, variant, monkeypatch):
    def broken(self, key):
        raise tunedb.sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(TuneDB, "best", broken)
    assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"


def test_shipped_defaults_nearest_bucket_and_own_gpu_first(fake_gpu, spec, variant):
    ship(fake_gpu, spec, variant, cfg(64, 64), "q1024_k1024_bh256")
    ship(fake_gpu, spec, variant, cfg(128, 64), "q16384_k16384_bh16")
    ship(fake_gpu, spec, variant, cfg(64, 32), "q8192_k8192_bh32", gpu="Other GPU")
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(cfg(128, 64), "shipped")
    small = Problem(16, 16, 16, 900, 900)
    assert tune.lookup(spec, variant, small, device=0) == cfg(64, 64)
    other = spec.variant("sm_90", head_dim=64, dtype="bf16", causal=False)
    assert tune.resolve(spec, other, PROBLEM, device=0).source == "heuristic"


def test_a_gpu_not_in_the_table_borrows_the_same_chips_tuning(fake_gpu, spec, variant):
    """An H100 SXM finds the H200's entries (same capability, same 132 SMs); a GPU with another SM
    count does not, and the GPU's own entries always win."""
    ship(fake_gpu, spec, variant, cfg(64, 32), PROBLEM.bucket().slug, gpu="Other GPU", sm_count=114)
    assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"
    ship(fake_gpu, spec, variant, cfg(128, 64), PROBLEM.bucket().slug, gpu="Same chip GPU")
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(cfg(128, 64), "shipped")
    ship(fake_gpu, spec, variant, cfg(64, 64), "q1024_k1024_bh256")       # its own, another bucket
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)


def test_shipped_defaults_of_the_other_16_bit_dtype_stand_in(fake_gpu, spec, variant):
    ship(fake_gpu, spec, variant, cfg(128, 64), PROBLEM.bucket().slug)            # bf16 measured
    fp16 = spec.variant("sm_90", head_dim=128, dtype="fp16", causal=False)
    assert tune.resolve(spec, fp16, PROBLEM, device=0) == tune.Choice(cfg(128, 64), "shipped")
    ship(fake_gpu, spec, fp16, cfg(64, 32), PROBLEM.bucket().slug)               # its own wins
    tune.clear_memo()
    assert tune.lookup(spec, fp16, PROBLEM, device=0) == cfg(64, 32)
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(128, 64)


@pytest.mark.parametrize("text", ["not json", '{"format": 2, "entries": []}', '{"format": 1}',
                                  '{"format": 1, "entries": [{"spec": "flash_attn_fwd"}]}'])
def test_a_broken_shipped_file_is_ignored(fake_gpu, spec, variant, text, caplog):
    fake_gpu.write_text(text)
    with caplog.at_level("WARNING", logger="kernelgen.tune"):
        assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"
    assert "unusable" in caplog.text


def test_the_packaged_defaults_file(spec):
    doc = json.loads((REPO_ROOT / "kernelgen" / "data" / "tuned_defaults.json").read_text())
    assert doc["format"] == tune.DEFAULTS_FORMAT and isinstance(doc["entries"], list)
    tune._read_shipped(doc)
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]   # the wheel carries it (kernelgen.data: data only)
    assert "kernelgen.data" in setuptools["packages"]
    assert "*.json" in setuptools["package-data"]["kernelgen.data"]


def test_packaged_defaults_carry_their_specs_current_hashes():
    """Every shipped entry names the content hash of its spec as it is now: an edit of a spec or
    template either keeps its configs' meaning (then `tools/merge_defaults.py --rehash SPEC`) or
    needs the entries tuned again; either way the file says which spec text was measured."""
    doc = json.loads((REPO_ROOT / "kernelgen" / "data" / "tuned_defaults.json").read_text())
    stale = set()
    for entry in doc["entries"]:
        child, _, onto = entry["spec"].partition("__")
        if load_spec(child, onto=onto or None).content_hash != entry["spec_hash"]:
            stale.add(entry["spec"])
    assert not stale, f"entries of {sorted(stale)} were measured on an older spec text"


def test_export_writes_the_shipped_format(fake_gpu, spec, variant, tmp_path, monkeypatch):
    record(spec, variant, cfg(64, 64))
    record(spec, variant, cfg(128, 64))                  # a later run: replaces the first
    record(spec, variant, cfg(64, 32), spec_hash="0" * 64)   # the spec has changed since
    record(spec, variant, cfg(64, 64), problem=Problem(1, 16, 16, 512, 512))
    out = tmp_path / "exported.json"
    assert cli_main(["tune", "--export", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["entries"]) == 2 and doc["format"] == 1
    assert {e["bucket"]: e["config"]["block_m"] for e in doc["entries"]} == \
        {"q8192_k8192_bh32": 128, "q512_k512_bh16": 64}
    entry = next(e for e in doc["entries"] if e["bucket"] == "q8192_k8192_bh32")
    assert entry["spec_hash"] == spec.content_hash and entry["problem"] == PROBLEM.as_dict()
    TuneDB().clear()
    tune.clear_memo()
    monkeypatch.setattr(tune, "DEFAULTS_PATH", out)
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(cfg(128, 64), "shipped")


def test_export_keeps_a_mods_spec_put_onto_a_base(fake_gpu, tmp_path, monkeypatch):
    window = load_spec("flash_attn_window", onto="flash_attn_bwd")
    variant = window.variant("sm_90", head_dim=128, dtype="bf16", causal=True)
    config = window.default_config(variant)
    record(window, variant, config)
    out = tmp_path / "exported.json"
    assert cli_main(["tune", "--export", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [e["spec"] for e in doc["entries"]] == ["flash_attn_window__flash_attn_bwd"]
    TuneDB().clear()
    tune.clear_memo()
    monkeypatch.setattr(tune, "DEFAULTS_PATH", out)
    tune._shipped_table.cache_clear()
    assert tune.resolve(window, variant, PROBLEM, device=0) == tune.Choice(config, "shipped")


# ---- tuning on a miss, and CUDA-graph capture -------------------------------------------------

@pytest.fixture
def fake_tuner(fake_gpu, monkeypatch):
    """tune.tune replaced: it 'measures' cfg(64, 64) and saves the run as the real one does."""
    calls = []

    def fake_tune(spec, problem, *, variant, device, **options):
        calls.append(problem)
        chosen = Trial(cfg(64, 64), "ok", timing=Timing(1.0, 0.9, 10))
        result = TuneResult(spec.name, variant, problem, FAKE_GPU, (chosen,), chosen,
                            spec.default_config(variant))
        tune._save(tune._key(spec, variant, problem.bucket(), FAKE_GPU), result)
        return result

    monkeypatch.setattr(tune, "tune", fake_tune)
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    env.reload_settings()
    return calls


def test_autotune_tunes_once_per_bucket(fake_tuner, spec, variant, caplog):
    with caplog.at_level("WARNING", logger="kernelgen.tune"):
        assert tune.lookup(spec, variant, Problem(2, 16, 16, 5000, 5000), device=0) == cfg(64, 64)
    assert "tuning flash_attn_fwd head_dim128_dtypebf16_causal0 on Fake GPU for bucket " \
           "q8192_k8192_bh32 (KERNELGEN_AUTOTUNE=1)" in caplog.text
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)   # same bucket
    assert len(fake_tuner) == 1
    tune.clear_memo()   # as in a new process: the answer now comes from the DB
    assert tune.resolve(spec, variant, PROBLEM, device=0) == tune.Choice(cfg(64, 64), "db")
    assert len(fake_tuner) == 1
    tune.lookup(spec, variant, Problem(2, 16, 16, 512, 512), device=0)
    assert len(fake_tuner) == 2


def test_without_autotune_a_miss_never_tunes(fake_tuner, spec, variant, monkeypatch):
    monkeypatch.delenv("KERNELGEN_AUTOTUNE")
    env.reload_settings()
    assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"
    assert fake_tuner == []


def test_a_failed_tuning_falls_back_to_the_heuristic(fake_gpu, spec, variant, monkeypatch, caplog):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    env.reload_settings()

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(tune, "tune", out_of_memory)
    with caplog.at_level("WARNING", logger="kernelgen.tune"):
        assert tune.resolve(spec, variant, PROBLEM, device=0).source == "heuristic"
    assert "tuning head_dim128_dtypebf16_causal0 failed" in caplog.text


def test_nothing_is_tuned_during_graph_capture(fake_tuner, spec, variant, monkeypatch):
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)
    monkeypatch.setattr(tune, "_capturing", lambda: True)
    assert tune.lookup(spec, variant, PROBLEM, device=0) == cfg(64, 64)   # memoized: fine
    with pytest.raises(TuneError, match="capturing a CUDA graph: run the op once"):
        tune.lookup(spec, variant, Problem(1, 16, 16, 512, 512), device=0)
    assert len(fake_tuner) == 1
    monkeypatch.delenv("KERNELGEN_AUTOTUNE")
    env.reload_settings()
    assert tune.resolve(spec, variant, Problem(1, 16, 16, 512, 512), device=0).source == "heuristic"


BASE = cfg(64).as_dict()


@pytest.mark.parametrize("configs, match", [
    ([{**BASE, "block_m": 96}], r"configs\[0\]: .*block_m"),        # not a value of the space
    ([BASE, {**BASE, "blok_n": 64}], r"configs\[1\]: .*blok_n"),    # not a key of the space
    ([{**BASE, "block_n": 128, "block_m": 128}], r"configs\[0\] .* constraints"),
    ([], "configs is empty"),
])
def test_tune_configs_are_checked_before_anything_compiles(spec, variant, configs, match):
    # No device, no compiler here: the error comes first, naming the entry.
    with pytest.raises(TuneError, match=match):
        tune.tune(spec, PROBLEM, variant=variant, device=0, configs=configs)


@pytest.mark.parametrize("finalists", [0, -3, 2.5, True])
def test_tune_finalists_must_be_a_count(spec, variant, finalists):
    with pytest.raises(TuneError, match="finalists must be a whole number"):
        tune.tune(spec, PROBLEM, variant=variant, device=0, finalists=finalists)


def test_finalists_by_default():
    # Small spaces are timed in full, as before screening existed; large ones keep a tenth.
    assert [tune._finalists(n) for n in (23, 80, 128, 129, 966, 7612)] == [23, 80, 128, 32, 96, 761]


def test_tune_configs_must_be_a_list(spec, variant):
    with pytest.raises(TypeError, match="list of configs, not dict"):
        tune.tune(spec, PROBLEM, variant=variant, device=0, configs={"block_m": 64})


def test_tune_itself_refuses_during_capture(spec, monkeypatch):
    monkeypatch.setattr(tune, "_capturing", lambda: True)
    with pytest.raises(TuneError, match="during CUDA-graph capture"):
        tune.tune(spec, PROBLEM, device=0, head_dim=128)


def test_the_module_is_callable(monkeypatch):
    seen = []
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: seen.append((args, kwargs)) or "result")
    assert kernelgen.tune("flash_attn_fwd", PROBLEM, head_dim=64) == "result"
    assert seen == [(("flash_attn_fwd", PROBLEM), {"head_dim": 64})]
    assert kernelgen.tune.lookup is tune.lookup


# ---- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, problem", [
    ("batch=4,seqlen=8192,heads=16", Problem(4, 16, 16, 8192, 8192)),
    ("batch=1, seqlen_q=1000, seqlen_k=4096, heads=8, heads_k=2", Problem(1, 8, 2, 1000, 4096)),
    ("seqlen=512,seqlen_k=128,heads=4,batch=2", Problem(2, 4, 4, 512, 128)),
])
def test_parse_shape(text, problem):
    assert tune_cli.parse_shape(text) == problem


@pytest.mark.parametrize("text, message", [
    ("batch=4,seqlen=8192", "missing heads"),
    ("batch=4,heads=2", "missing seqlen_q, seqlen_k"),
    ("batch=4,seqlen=8k,heads=2", "seqlen=8k is not an integer"),
    ("batch=4,seqlen=128,heads=2,dim=64", "'dim=64' is not KEY=VALUE with a key of"),
    ("batch=0,seqlen=128,heads=2", "at least 1"),
])
def test_parse_shape_errors(text, message):
    with pytest.raises(TuneError, match=message):
        tune_cli.parse_shape(text)


@pytest.mark.parametrize("argv, message", [
    (["tune"], "give a SPEC with --shape, --preset NAME, or --export FILE"),
    (["tune", "flash_attn_fwd"], "give at least one --shape"),
    (["tune", "flash_attn_fwd", "--preset", "fwd-grid"], "not both"),
    (["tune", "--preset", "fwd-grid", "--shape", "batch=1,seqlen=1,heads=1"], "takes no --set, --shape"),
    (["tune", "flash_attn_fwd", "--seqlens", "512", "--shape", "batch=1,seqlen=1,heads=1"],
     "go with --preset"),
])
def test_command_line_errors(argv, message, capsys):
    assert cli_main(argv) == 1
    assert message in capsys.readouterr().err


def test_bad_params_are_spec_errors(capsys):
    assert cli_main(["tune", "flash_attn_fwd", "--set", "head_dim=100", "--shape",
                     "batch=1,seqlen=128,heads=2"]) == 1
    assert "params.head_dim: value 100 is not allowed" in capsys.readouterr().err


def test_the_fwd_grid_preset():
    jobs = tune_cli.fwd_grid()
    assert len(jobs) == 3 * 2 * 6
    for job in jobs:
        params, p = dict(job.params), job.problem
        assert job.spec == "flash_attn_fwd" and params["dtype"] == "bf16"
        assert p.batch * p.seqlen_q == 16384 and p.heads * params["head_dim"] == 2048
        assert p.seqlen_q == p.seqlen_k and p.heads == p.heads_k
    assert {dict(j.params)["head_dim"] for j in jobs} == {64, 128, 256}
    assert {j.problem.seqlen_q for j in jobs} == {512, 1024, 2048, 4096, 8192, 16384}


def test_tune_without_a_gpu_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would tune")
    assert cli_main(["tune", "flash_attn_fwd", "--shape", "batch=1,seqlen=128,heads=2"]) == 1
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_table(spec, variant):
    default = spec.default_config(variant)
    fast, slow = cfg(64, 64), default
    trials = (Trial(slow, "ok", Timing(2.0, 1.9, 50), Built(255, 0, 0, 73728), Check(True, 0.001, 0.01)),
              Trial(cfg(256, 128, warps=8), "spills", built=Built(255, 88, 88, 200000), note="88 B spill stores"),
              Trial(fast, "ok", Timing(1.0, 0.95, 60), Built(168, 0, 0, 40960), Check(True, 0.001, 0.01)),
              Trial(cfg(128, 32), "wrong", built=Built(200, 0, 0, 50000), note="max error 0.5 > 0.01"))
    result = TuneResult(spec.name, variant, PROBLEM, FAKE_GPU, trials, trials[2], default)
    lines = tune_cli.format_table(result).splitlines()
    assert "bucket q8192_k8192_bh32" in lines[0] and "Fake GPU" in lines[0]
    assert lines[1].split() == ["config", "regs", "smem", "KiB", "median", "ms", "min", "ms", "n",
                                "TFLOP/s", "status"]
    assert lines[2].startswith(fast.slug) and lines[2].endswith("ok  <- chosen")
    flops = 4 * 2 * 16 * 8192 * 8192 * 128
    assert f"{flops / 1.0 / 1e9:.1f}" in lines[2] and " 168 " in lines[2] and "40.0" in lines[2]
    assert lines[3].startswith(slow.slug) and lines[3].endswith("(default)")
    assert "wrong: max error 0.5 > 0.01" in lines[4] and "spills: 88 B" in lines[5]
    assert lines[-1].endswith("2.00x the default")
    top = tune_cli.format_table(result, top=1).splitlines()
    assert len(top) == 5 and top[3].startswith(slow.slug)   # the default stays in view


def test_preset_subsets():
    opts = tune_cli._parser().parse_args(["--preset", "fwd-grid", "--head-dims", "128", "--seqlens",
                                          "4096", "8192", "--causal", "true"])
    jobs = tune_cli._jobs(opts)
    assert [(dict(j.params)["head_dim"], dict(j.params)["causal"], j.problem.seqlen_q) for j in jobs] == \
        [(128, True, 4096), (128, True, 8192)]


def test_the_command_line_flow(fake_gpu, spec, monkeypatch, tmp_path, capsys):
    """What `kernelgen tune` prints and stores, with tune() itself faked (no GPU here)."""
    torch = pytest.importorskip("torch")
    calls = []

    def fake_tune(spec_name, problem, *, arch, jobs, rep_ms, save, progress, **params):
        calls.append((spec_name, problem, jobs, rep_ms, save, progress, params))
        spec = load_spec(spec_name)
        variant = spec.variant("sm_90", **params)
        chosen = Trial(spec.default_config(variant), "ok", Timing(1.0, 0.9, 10), Built(128, 0, 0, 1024),
                       Check(True, 0.001, 0.01))
        result = TuneResult(spec.name, variant, problem, FAKE_GPU, (chosen,), chosen, chosen.config)
        tune._save(tune._key(spec, variant, problem.bucket(), FAKE_GPU), result)
        return result

    monkeypatch.setattr(tune, "tune", fake_tune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    exported = tmp_path / "defaults.json"
    assert cli_main(["tune", "flash_attn_fwd", "--set", "head_dim=64", "--shape", "batch=2,seqlen=512,heads=8",
                     "--shape", "batch=1,seqlen_q=128,seqlen_k=4096,heads=8,heads_k=1", "-j", "3",
                     "--rep-ms", "20", "--export", str(exported)]) == 0
    out = capsys.readouterr().out
    assert [c[1] for c in calls] == [Problem(2, 8, 8, 512, 512), Problem(1, 8, 1, 128, 4096)]
    assert calls[0][2:] == (3, 20.0, True, True, {"head_dim": 64})
    assert "[1/2] tuning flash_attn_fwd" in out and "== summary" in out and "<- chosen" in out
    assert "wrote 2 tuned configs" in out
    assert {e["bucket"] for e in json.loads(exported.read_text())["entries"]} == \
        {"q512_k512_bh16", "q128_k4096_bh8"}


def test_build_compiles_for_real(cache_dir, spec, variant):
    config = spec.default_config(variant)
    built = search.build(spec, variant, DeviceLimits(232448, 1024), config)
    binary = cache.compile_cached(render(spec, variant, config), variant.arch)   # a memory hit
    assert built == Built(binary.registers, binary.spill_stores, binary.stack_bytes,
                          int(spec.smem(spec.environment(variant, config))) + binary.static_smem)
    assert 0 < built.registers <= 255


@pytest.fixture
def config_ab(monkeypatch):
    """tools/config_ab.py on the CPU: lookup() answers from the shipped table as on the H200."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tools"))
    import config_ab

    h200 = dataclasses.replace(FAKE_GPU, gpu="NVIDIA H200")   # the shipped table's entries
    monkeypatch.setattr(tune, "gpu_identity", lambda device: h200)
    monkeypatch.setattr(config_ab.torch.cuda, "current_device", lambda: 0)
    tune.clear_memo()
    yield config_ab
    tune.clear_memo()


def test_an_ab_winner_is_an_entry_of_the_shipped_table(config_ab):
    """tools/config_ab.py --export writes a shape's winner in the shipped table's format, keyed as
    the entry it replaces (tools/merge_defaults.py), with the whole config, which the shipped
    table's reader takes back."""
    case = config_ab.Case(None, 128, False, 4, 4096, 16)
    variant = case.spec.variant(arch="sm_90a", **case.params)
    config = {**case.shipped(4, 4096, 16), "rescale": 1}
    entry = config_ab.entry(case, variant, Problem(4, 16, 16, 4096, 4096), config, 0.85)
    assert (entry["spec"], entry["variant"], entry["bucket"], entry["gpu"]) == \
        ("flash_attn_fwd_sm90", "head_dim128_dtypebf16_causal0", "q4096_k4096_bh64", "NVIDIA H200")
    assert entry["spec_hash"] == case.spec.content_hash and entry["time_ms"] == 0.85
    assert set(entry["config"]) == {name for name, _ in case.spec.space}
    table = tune._read_shipped({"format": tune.DEFAULTS_FORMAT, "entries": [entry]})
    (where, [(bucket, read)]), = table.items()
    assert bucket.slug == "q4096_k4096_bh64" and read == case.spec.parse_config(config)


def test_an_ab_run_plans_its_shapes_and_builds_each_kernel_once(config_ab, monkeypatch):
    """config_ab's plan: the shipped config (here with --config's keys) first, an alternative the
    spec forbids at a shape dropped there (pv_wait with the plain schedule); prebuild compiles
    each distinct kernel once, however many shapes share it."""
    import argparse

    alts = [{"pv_wait": 1}, {"pv_wait": 1, "schedule": 2, "block_n": 112}]
    plain = {"schedule": 0, "persistent": 0, "q_buffers": 1}
    opts = argparse.Namespace(head_dims=[64], causal="false", seqlens=[1024, 16384], tokens=16384,
                              mod=None, config=plain, key=None, values=[], alts=alts)
    plans = config_ab.plan(opts)
    assert [p[2] for p in plans] == [1024, 16384]
    for *_, configs in plans:
        assert configs[0] == {**configs[0], **plain} and configs[1:] == [{**configs[0], **alts[1]}]
    built = []
    monkeypatch.setattr(config_ab.cache, "compile_cached", lambda source, arch: built.append(source.name))
    assert config_ab.prebuild(plans + plans) == {}
    kernels = {config_ab.render(case.spec, variant, case.spec.parse_config(c)).name
               for *_, case, variant, configs in plans for c in configs}
    assert sorted(built) == sorted(kernels) and len(kernels) >= 3


def test_an_ab_run_reports_a_config_that_does_not_compile(config_ab, monkeypatch):
    """A config whose compile fails (ptxas's C7520 once stopped a whole lead) comes back from
    prebuild by spec, variant and config slug, for the timing loop to skip; the others build."""
    import argparse

    alts = [{"pv_wait": 1}]
    opts = argparse.Namespace(head_dims=[128], causal="false", seqlens=[4096], tokens=16384,
                              mod=None, config={}, key=None, values=[], alts=alts)
    (*_, case, variant, configs), = config_ab.plan(opts)
    bad = case.spec.parse_config(configs[1]).slug

    def compile_cached(source, arch):
        if bad in source.name:
            raise config_ab.CompileError("ptxas degraded it (warning C7520)\n  kernel: x")

    monkeypatch.setattr(config_ab.cache, "compile_cached", compile_cached)
    failed = config_ab.prebuild([(None,) * 5 + (case, variant, configs)])
    assert failed == {(case.spec.name, variant.slug, bad): "ptxas degraded it (warning C7520)"}
