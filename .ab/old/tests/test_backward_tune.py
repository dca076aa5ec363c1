"""Tuning the backward (spec flash_attn_bwd): the grid_order key, the workload of measure_bwd.py
(its float32 reference and the check that gates speed), tune()'s choice of workload by spec, the
bwd-grid preset and the table's FLOPs, and backward.py taking its main config from tune.lookup.
On the CPU (the check with hand-written outputs and with the emulated kernels of both grid
orders); the GPU tests at the end tune for real.

Run the GPU part on the GPU machine: python -m pytest -q -m gpu tests/test_backward_tune.py
"""
from __future__ import annotations

import contextlib
import math
import timeit

import pytest
import torch

from kernelgen import api, backward, cache, measure, measure_bwd, tune, tune_cli
from kernelgen import compile as compiler
from kernelgen.cli import main as cli_main
from kernelgen.reference import attention_ref, max_error
from kernelgen.search import Built, Check, DeviceLimits, Timing, Trial
from kernelgen.spec import load_spec
from kernelgen.tune import Problem, TuneError, TuneResult
from kernelgen.tunedb import TuneDB
import test_backward_emulated as emulated   # its Emulated stand-in and launcher
from test_tune import FAKE_GPU, fake_gpu  # noqa: F401  (the fixture: lookup with a fake GPU identity)



@pytest.fixture
def spec():
    return load_spec(backward.MAIN_SPEC)


def autograd_grads(q, k, v, dout, causal, scale, upcast=True):
    """The oracle: autograd through reference.attention_ref (what tests/test_backward.py uses)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, scale, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout)


# ---- grid_order ---------------------------------------------------------------------------------

def test_grid_order_only_for_causal_and_the_defaults_keep_order_0(spec):
    for variant in spec.variants(["sm_80", "sm_90"]):
        orders = {c["grid_order"] for c in spec.valid_configs(variant)}
        assert orders == ({0, 1} if variant["causal"] else {0}), variant.slug
        assert spec.default_config(variant)["grid_order"] == 0
    full = spec.variant("sm_90", head_dim=128, dtype="bf16", causal=False)
    ordered = spec.parse_config({**spec.default_config(full).as_dict(), "grid_order": 1})
    assert spec.violations(full, ordered) == ["causal or grid_order == 0"]


def test_grid_order_1_puts_the_kv_tiles_on_z(spec):
    variant = spec.variant("sm_90", head_dim=128, dtype="bf16", causal=True)
    default = spec.default_config(variant)
    sizes = {"batch": 3, "heads": 16, "heads_k": 4, "seqlen_q": 1000, "seqlen_k": 1000}
    grids = {}
    for order in (0, 1):
        config = spec.parse_config({**default.as_dict(), "grid_order": order})
        env = {**spec.environment(variant, config), **sizes}
        grids[order] = tuple(int(e(env)) for e in spec.grid)
    tiles = math.ceil(1000 / default["block_n"])
    assert grids == {0: (tiles, 4, 3), 1: (4, 3, tiles)}


# ---- the reference and the check ------------------------------------------------------------------

@pytest.mark.parametrize("seqlens, causal", [((70, 50), True), ((50, 70), True), ((64, 64), False)])
def test_the_reference_is_autograds_in_both_precisions(seqlens, causal, monkeypatch):
    torch.manual_seed(0)
    seqlen_q, seqlen_k = seqlens
    q, dout = (torch.randn(1, seqlen_q, 3, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, seqlen_k, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    scale = 0.125
    one = (q[0], k[0, :, 0], v[0, :, 0], dout[0])
    refs = [g[0] if g.shape[2] == 3 else g[0, :, 0] for g in autograd_grads(q, k, v, dout, causal, scale)]
    lows = [g[0] if g.shape[2] == 3 else g[0, :, 0]
            for g in autograd_grads(q, k, v, dout, causal, scale, upcast=False)]
    mine = measure_bwd.reference_grads(*one, causal, scale, torch.float32)
    mine_low = measure_bwd.reference_grads(*one, causal, scale, torch.bfloat16)
    monkeypatch.setattr(measure_bwd, "CHUNK_ELEMENTS", 1)   # 16-row chunks
    chunked = measure_bwd.reference_grads(*one, causal, scale, torch.float32)
    for ref, low, g, g_low, g_chunked in zip(refs, lows, mine, mine_low, chunked):
        ulp = ref.float().abs().max().item() * 2 ** -7
        assert max_error(g, ref) <= ulp and max_error(g_chunked, g) <= ulp
        # The input-dtype error the bound doubles is autograd's, near enough.
        assert 0.5 * max_error(low, ref) <= max_error(g_low, ref) <= 2 * max_error(low, ref) + ulp


@pytest.mark.parametrize("seqlens", [(150, 100), (100, 150), (128, 128)])
def test_the_check_accepts_the_reference_and_rejects_wrong_outputs(spec, seqlens):
    variant = spec.variant("sm_90", head_dim=64, dtype="bf16", causal=True)
    workload = measure_bwd.Workload(spec, variant, Problem(2, 4, 2, *seqlens), device="cpu")
    refs = autograd_grads(workload.q, workload.k, workload.v, workload.dout, True, workload.scale)
    buffers = workload.buffers

    def writes(dq=None, dk=None, dv=None):   # a 'kernel' that writes the given gradients
        def run():
            for buffer, given, ref in zip((buffers.dq, buffers.dk, buffers.dv), (dq, dk, dv), refs):
                buffer.copy_(ref if given is None else given)
        return run

    assert workload.check(writes()).ok
    assert [(s.batch, s.kv_head) for s in workload.slices] == [(0, 0), (1, 1)]
    for name, ref in zip(("dq", "dk", "dv"), refs):
        check = workload.check(writes(**{name: torch.zeros_like(ref)}))
        assert not check.ok and check.note.startswith(f"{name} max error"), check.note
    assert "not finite" in workload.check(lambda: None).note   # writes nothing: the NaN poison stays

    def partly(run, tensor, index):   # run, then leave one region as the poison left it
        return lambda: (run(), tensor.__setitem__(index, float("nan")))

    # An unwritten region outside the compared slices (batch 1, kv head 0) fails too.
    assert "dk is not finite" in workload.check(partly(writes(), buffers.dk, (1, slice(0, 32), 0))).note
    bound = workload.slices[-1].bounds[2]
    off = refs[2].clone()
    off[-1, -1, -1, -1] += 4 * bound
    check = workload.check(writes(dv=off))
    assert not check.ok and "dv max error" in check.note and "batch 1, kv head 1" in check.note
    if seqlens[0] > seqlens[1]:   # the first rows see no key: their dq must be exactly 0
        noise = refs[0].clone()
        noise[0, : seqlens[0] - seqlens[1]] = 1e-6
        assert "see no key" in workload.check(writes(dq=noise)).note


def test_the_workload_refuses_specs_it_cannot_feed():
    forward = load_spec("flash_attn_fwd")
    assert measure_bwd.feeds(load_spec(backward.MAIN_SPEC))
    assert measure_bwd.feeds(load_spec("flash_attn_bwd_sm90"))   # + tensor maps, appended by _run
    assert not measure_bwd.feeds(forward) and not measure_bwd.feeds(load_spec(backward.DQ_SPEC))
    with pytest.raises(TuneError, match="args and params of flash_attn_bwd"):
        measure_bwd.Workload(forward, forward.variant("sm_90"), Problem(1, 2, 2, 64, 64), device="cpu")
    spec = load_spec(backward.MAIN_SPEC)
    with pytest.raises(TuneError, match="heads a multiple of heads_k"):
        measure_bwd.Workload(spec, spec.variant("sm_90"), Problem(1, 3, 2, 64, 64), device="cpu")


# ---- the emulated kernels: both grid orders, through the check ------------------------------------

@pytest.mark.skipif(not emulated.emulate.available(), reason="the emulator needs g++")
@pytest.mark.parametrize("seqlens", [(90, 110), (110, 70)])
def test_grid_order_1_gives_the_gradients_of_order_0(spec, seqlens):
    """Every (KV tile, head, batch) still runs once and only the order changes: dK and dV are
    bitwise the same (each CTA sums alone), dQ the same up to the order of its fp32 atomics."""
    variant = spec.variant("sm_80", head_dim=64, dtype="bf16", causal=True)
    # batch != heads_k, so that mixing up the two grid axes cannot go unnoticed.
    workload = measure_bwd.Workload(spec, variant, Problem(3, 4, 2, *seqlens), device="cpu")
    args = (workload.dout, workload.q, workload.k, workload.v, workload.out, workload.lse,
            workload.scale)
    grads = {}
    for order in (0, 1):
        config = {"block_m": 32, "block_n": 32, "warps": 4, "dsplit": 2, "stages": 2, "grid_order": order}
        kernels = emulated.emulated_kernels(64, torch.bfloat16, True, False, "sm_80", config)
        check = workload.check(lambda: backward._run(kernels, emulated.launch, *args,
                                                     buffers=workload.buffers))
        assert check.ok, check.note
        grads[order] = [t.clone() for t in (workload.buffers.dq, workload.buffers.dk, workload.buffers.dv)]
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads[0], grads[1]
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    assert max_error(dq0, dq1) <= dq0.float().abs().max().item() * 2 ** -7


# ---- tune(): the backward's classes, end to end with a fake GPU -----------------------------------

def test_tune_picks_the_workload_by_spec(spec):
    assert tune._measurers(spec) == (measure_bwd.Workload, measure_bwd.Candidate)
    assert tune._measurers(load_spec("flash_attn_fwd")) == (measure.Workload, measure.AttentionCandidate)
    assert tune._measurers(load_spec(backward.DQ_SPEC))[0] is measure.Workload   # which refuses it


def test_tune_end_to_end_with_a_fake_gpu(fake_gpu, spec, monkeypatch):
    variant = spec.variant("sm_90", head_dim=64, dtype="bf16", causal=True)
    configs = spec.valid_configs(variant)
    fastest, wrong = configs[3], configs[5]
    made = []

    class Workload:
        def __init__(self, *args):
            made.append(args)

    class Candidate:
        def __init__(self, workload, spec, variant, config, rep_ms):
            assert isinstance(workload, Workload)
            self.config = config

        def check(self):
            return Check(self.config != wrong, 0.0, 1.0)

        def run(self):
            ms = 0.5 if self.config == wrong else 1.0 if self.config == fastest else 2.0
            return Timing(ms, ms, 10)

    def fake_compile(source, arch, compile=None):
        return compiler.Binary(name=source.name, arch=arch, entry=source.entry, cubin=b"x",
                               registers=200, spill_stores=0, spill_loads=0, stack_bytes=0,
                               static_smem=0, compile_seconds=0.1, log="")

    monkeypatch.setattr(measure, "device_limits", lambda device: DeviceLimits(232448, 1024))
    monkeypatch.setattr(measure_bwd, "Workload", Workload)
    monkeypatch.setattr(measure_bwd, "Candidate", Candidate)
    monkeypatch.setattr(cache, "compile_cached", fake_compile)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    problem = Problem(2, 8, 4, 1000, 1000)
    result = tune.tune(spec.name, problem, arch="sm_90", device=0, head_dim=64, causal=True)
    assert made == [(spec, variant, problem, 0)]
    assert result.chosen.config == fastest and {t.config for t in result.trials} == set(configs)
    assert tune.resolve(spec, variant, problem, device=0) == tune.Choice(fastest, "tuned")
    tune.clear_memo()
    assert tune.resolve(spec, variant, problem, device=0) == tune.Choice(fastest, "db")
    (run,) = TuneDB().dump()
    assert run["spec"] == "flash_attn_bwd" and len(run["trials"]) == len(configs)


# ---- the command line ---------------------------------------------------------------------------

def test_the_bwd_grid_preset():
    jobs = tune_cli.PRESETS["bwd-grid"]()
    assert [(j.params, j.problem) for j in jobs] == [(j.params, j.problem) for j in tune_cli.fwd_grid()]
    assert {j.spec for j in jobs} == {"flash_attn_bwd"} and len(jobs) == 3 * 2 * 6
    opts = tune_cli._parser().parse_args(["--preset", "bwd-grid", "--head-dims", "128", "--seqlens",
                                          "4096", "--causal", "true"])
    (job,) = tune_cli._jobs(opts)
    assert job.spec == "flash_attn_bwd" and dict(job.params) == {"head_dim": 128, "dtype": "bf16", "causal": True}
    assert job.problem == Problem(4, 16, 16, 4096, 4096)


def test_the_table_counts_the_backward_at_2_5_forwards(spec):
    variant = spec.variant("sm_90", head_dim=128, dtype="bf16", causal=True)
    default = spec.default_config(variant)
    trial = Trial(default, "ok", Timing(2.0, 1.9, 50), Built(255, 0, 0, 177152), Check(True, 0.001, 0.01))
    problem = Problem(4, 16, 16, 4096, 4096)
    result = TuneResult(spec.name, variant, problem, FAKE_GPU, (trial,), trial, default)
    flops = 2.5 * 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert f" {flops / 2.0 / 1e9:.1f} " in tune_cli.format_table(result).splitlines()[2]
    assert f"{flops / 2.0 / 1e9:.1f} TFLOP/s" in tune_cli.summary(result)


def test_the_command_line_tunes_the_backward(monkeypatch, capsys):
    calls = []

    def fake_tune(spec_name, problem, *, arch, jobs, rep_ms, save, progress, **params):
        calls.append((spec_name, problem, params))
        spec = load_spec(spec_name)
        variant = spec.variant("sm_90", **params)
        chosen = Trial(spec.default_config(variant), "ok", Timing(1.0, 0.9, 10), Built(128, 0, 0, 1024),
                       Check(True, 0.001, 0.01))
        return TuneResult(spec.name, variant, problem, FAKE_GPU, (chosen,), chosen, chosen.config)

    monkeypatch.setattr(tune, "tune", fake_tune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli_main(["tune", "flash_attn_bwd", "--set", "head_dim=128", "--set", "causal=true",
                     "--shape", "batch=4,seqlen=4096,heads=16"]) == 0
    assert calls == [("flash_attn_bwd", Problem(4, 16, 16, 4096, 4096), {"head_dim": 128, "causal": True})]
    assert "<- chosen" in capsys.readouterr().out


# ---- backward.py: the main config from tune.lookup -----------------------------------------------

class _Bound:
    """Stands in for an api.BoundKernel."""

    def __init__(self, name, config, loaded=True):
        self.name, self.config, self.loaded = name, config, loaded
        self.kernel = self
        self.source = type("Source", (), {"name": name})()

    def loaded_on(self, device):
        return self.loaded


@pytest.fixture
def wired(monkeypatch, spec):
    """backward._kernels with lookup and loading faked: (lookups, loads, the config lookup gives)."""
    variant = spec.variant("sm_90", head_dim=64, dtype="bf16", causal=True)
    tuned = spec.valid_configs(variant)[7]
    assert tuned != spec.default_config(variant)
    lookups, loads = [], []

    def lookup(spec_, variant_, problem, device):
        lookups.append((spec_.name, variant_, problem, device))
        return tuned

    def load(spec_, *, arch, config=None, **params):
        loads.append((spec_.name, arch, config, params))
        return _Bound(spec_.name, config)

    monkeypatch.setattr(backward, "_KERNELS", {})
    monkeypatch.setattr(tune, "lookup", lookup)
    monkeypatch.setattr(api, "load", load)
    monkeypatch.setattr(api, "pick_arch", lambda spec_, device=None: "sm_90")
    return lookups, loads, tuned, variant


def test_the_backward_takes_its_main_config_from_lookup(wired):
    lookups, loads, tuned, variant = wired
    sizes = (2, 8, 4, 1000, 900)
    kernels = backward._kernels(64, "bf16", True, 0, False, sizes)
    assert lookups == [("flash_attn_bwd", variant, Problem(*sizes), 0)]
    assert kernels.main.name == "flash_attn_bwd" and kernels.main.config == tuned.as_dict()
    assert kernels.prep.config is None and kernels.dq is None   # prep keeps its default
    assert backward._kernels(64, "bf16", True, 0, False, sizes) is kernels   # cached: no new lookup
    assert len(lookups) == 1 and len(loads) == 2
    backward._kernels(64, "bf16", True, 0, False, (2, 8, 4, 1000, 1000))   # another problem
    assert lookups[-1][2] == Problem(2, 8, 4, 1000, 1000)
    deterministic = backward._kernels(64, "bf16", True, 0, True, sizes)
    assert deterministic.main.config == tuned.as_dict() and deterministic.dq.name == "flash_attn_bwd_dq"


def test_a_repeated_backward_adds_no_host_time(wired):
    sizes = (2, 8, 4, 1000, 900)
    backward._kernels(64, "bf16", True, 0, False, sizes)
    seconds = min(timeit.repeat(lambda: backward._kernels(64, "bf16", True, 0, False, sizes),
                                number=1000, repeat=5)) / 1000
    assert seconds < 5e-6, f"{seconds * 1e6:.2f} us per cached lookup"


def test_nothing_is_loaded_during_graph_capture(wired, monkeypatch):
    lookups, loads, tuned, variant = wired
    monkeypatch.setattr(api, "load", lambda spec_, *, arch, config=None, **params:
                        _Bound(spec_.name, config, loaded=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        backward._kernels(64, "bf16", True, 0, False, (1, 2, 2, 64, 64))


# ---- on the GPU ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SMALL = Problem(batch=2, heads=8, heads_k=4, seqlen_q=1000, seqlen_k=1000)   # GQA, partial tiles


@gpu
@pytest.mark.gpu
def test_tuning_the_backward_picks_a_correct_config_and_its_gradients_pass(cache_dir, monkeypatch):
    from test_backward import check as reference_check   # tests/test_backward.py's rule

    tune.clear_memo()
    monkeypatch.setattr(backward, "_KERNELS", {})
    # The main kernel this GPU's backward runs: the Hopper one on compute capability 9.0.
    spec = load_spec(backward.main_spec_name(64, 0, False, SMALL.seqlen_k))
    result = tune.tune(spec, SMALL, device=0, head_dim=64, dtype="bf16", causal=True)
    chosen = result.chosen
    assert chosen is not None, "\n".join(f"{t.config.slug}: {t.status} {t.note}" for t in result.trials)
    assert chosen.check.ok and chosen.timing.samples >= 10 and not chosen.built.spills
    assert {t.config for t in result.trials} == set(spec.valid_configs(result.variant))
    statuses = {t.status for t in result.trials}
    assert "wrong" not in statuses and "run_error" not in statuses, \
        [(t.config.slug, t.note) for t in result.trials if t.status in ("wrong", "run_error")]
    key = tune._key(spec, result.variant, SMALL.bucket(), result.identity)
    assert TuneDB().best(key) == chosen.config
    tune.clear_memo()   # the answer now comes from the DB, as in a new process
    sizes = (SMALL.batch, SMALL.heads, SMALL.heads_k, SMALL.seqlen_q, SMALL.seqlen_k)
    assert backward._kernels(64, "bf16", True, 0, False, sizes).main.config == chosen.config
    torch.manual_seed(5)
    q = torch.randn(SMALL.batch, SMALL.seqlen_q, SMALL.heads, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(SMALL.batch, SMALL.seqlen_k, SMALL.heads_k, 64, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    reference_check(q, k, v, causal=True)
    tune.clear_memo()
