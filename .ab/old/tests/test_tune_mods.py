"""Tuning specs with mods, without a GPU: which workload a spec gets, the mod arguments' values
and their errors, the command line's --arg/--onto, and the check against the default config
(measure_mods.py) on CPU tensors with fake launches."""
from __future__ import annotations

import math

import pytest
import torch

from kernelgen import measure_mods, tune, tune_cli
from kernelgen.spec import load_spec
from kernelgen.tune import TuneError


@pytest.mark.parametrize("name, onto, kind", [
    ("flash_attn_fwd", None, None),
    ("flash_attn_fwd_sm90", None, None),
    ("flash_attn_bwd", None, None),
    ("flash_attn_softcap", None, "forward"),
    ("flash_attn_softcap", "flash_attn_fwd_sm90", "forward"),
    ("flash_attn_alibi", "flash_attn_fwd_sm90", "forward"),
    ("flash_attn_document", "flash_attn_fwd_sm90", "forward"),
    ("flash_attn_document", "flash_attn_bwd", "backward"),
    ("flash_attn_window", "flash_attn_bwd", "backward"),
    ("flash_attn_alibi", "flash_attn_bwd", "backward"),
    ("flash_attn_alibi", "flash_attn_bwd_dq", None),   # the deterministic dQ kernel: untuned
])
def test_feeds(name, onto, kind):
    spec = load_spec(name, onto=onto) if onto else load_spec(name)
    assert measure_mods.feeds(spec) == kind
    measurers = tune._measurers(spec)
    if kind == "forward":
        assert measurers[0] is measure_mods.ForwardWorkload
    elif kind == "backward":
        assert measurers[0] is measure_mods.BackwardWorkload
    else:
        assert measurers[0] not in (measure_mods.ForwardWorkload, measure_mods.BackwardWorkload)


def test_mod_values_in_order_and_typed():
    spec = load_spec("flash_attn_alibi")
    slopes = torch.rand(8)
    values = measure_mods.mod_launch_values(spec, {"alibi_stride_b": 0, "alibi_slopes": slopes},
                                            slopes.device)
    assert values == (slopes.data_ptr(), 0)
    softcap = load_spec("flash_attn_softcap")
    assert measure_mods.mod_launch_values(softcap, {"softcap": 30}, slopes.device) == (30.0,)


@pytest.mark.parametrize("given, message", [
    ({}, r"missing \['alibi_slopes', 'alibi_stride_b'\]"),
    ({"alibi_slopes": torch.rand(8), "alibi_stride_b": 0, "cap": 1}, r"unexpected \['cap'\]"),
    ({"alibi_slopes": 3.0, "alibi_stride_b": 0}, "alibi_slopes must be a contiguous tensor"),
    ({"alibi_slopes": torch.rand(8, 2)[:, 0], "alibi_stride_b": 0}, "got a strided tensor"),
    ({"alibi_slopes": torch.rand(8), "alibi_stride_b": torch.zeros(1)}, "must be a number"),
    ({"alibi_slopes": torch.rand(8), "alibi_stride_b": True}, "must be a number"),
])
def test_mod_values_errors(given, message):
    with pytest.raises(TuneError, match=message):
        measure_mods.mod_launch_values(load_spec("flash_attn_alibi"), given, torch.device("cpu"))


def test_mod_values_tensor_on_another_device():
    with pytest.raises(TuneError, match="must be a contiguous tensor on meta"):
        measure_mods.mod_launch_values(load_spec("flash_attn_alibi"),
                                       {"alibi_slopes": torch.rand(8), "alibi_stride_b": 0},
                                       torch.device("meta"))


def _opts(*argv):
    return tune_cli._parser().parse_args(list(argv))


def test_cli_onto_and_args():
    jobs = tune_cli._jobs(_opts("flash_attn_softcap", "--arg", "softcap=30", "--onto",
                                "flash_attn_bwd", "--shape", "batch=2,seqlen=1024,heads=8"))
    assert [(j.spec, j.onto, j.mod_values) for j in jobs] == [
        ("flash_attn_softcap", "flash_attn_bwd", (("softcap", 30.0),))]


@pytest.mark.parametrize("argv, message", [
    (("flash_attn_softcap",), "give --arg softcap=..."),
    (("flash_attn_softcap", "--arg", "cap=3"), r"no mod argument 'cap'"),
    (("flash_attn_softcap", "--arg", "softcap=big"), "not a number of type f32"),
    (("flash_attn_document", "--arg", "doc_q=1"), "tune from Python"),
    (("flash_attn_window", "--arg", "window_left=1.5", "--arg", "window_right=0"),
     "not a number of type i32"),
])
def test_cli_errors(argv, message):
    with pytest.raises(TuneError, match=message):
        tune_cli._jobs(_opts(*argv, "--shape", "batch=2,seqlen=1024,heads=8"))


def test_cli_preset_takes_no_args():
    with pytest.raises(TuneError, match="--preset takes no"):
        tune_cli._jobs(_opts("--preset", "fwd-grid", "--arg", "softcap=3"))


def test_flops_of_a_mods_backward_count_like_the_backward():
    result = tune.TuneResult("flash_attn_softcap__flash_attn_bwd",
                             load_spec("flash_attn_bwd").variant("sm_90", head_dim=64),
                             tune.Problem(1, 1, 1, 128, 128), None, (), None, None)
    plain = tune.TuneResult("flash_attn_softcap", result.variant, result.problem, None, (), None,
                            None)
    assert tune_cli._flops(result) == pytest.approx(2.5 * tune_cli._flops(plain))


def _forward_workload(out_default, lse_default, bound=0.1):
    w = measure_mods.ForwardWorkload.__new__(measure_mods.ForwardWorkload)
    w.device, w.bound = "cpu", bound
    w.out, w.lse = torch.empty_like(out_default), torch.empty_like(lse_default)
    w.out_default, w.lse_default = out_default, lse_default
    return w


def test_forward_check_against_the_default():
    out = torch.randn(1, 16, 2, 8)
    lse = torch.randn(1, 2, 16)
    lse[0, 1, 3] = -math.inf   # a row that sees no key
    w = _forward_workload(out, lse)

    def writes(o, l):
        return lambda: (w.out.copy_(o), w.lse.copy_(l))

    assert w.check(writes(out + 0.05, lse)).ok
    assert not w.check(writes(out + 0.2, lse)).ok                # beyond the bound
    partial = out.clone()
    assert not w.check(lambda: (w.out[:, :8].copy_(partial[:, :8]), w.lse.copy_(lse))).ok
    moved = lse.clone()
    moved[0, 1, 3] = 0.0
    assert "LSE is not -inf" in w.check(writes(out, moved)).note
    shifted = lse + 0.01
    assert "LSE differs" in w.check(writes(out, shifted)).note


def test_backward_check_against_the_default():
    grads = (torch.randn(1, 16, 2, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8))
    w = measure_mods.BackwardWorkload.__new__(measure_mods.BackwardWorkload)
    w.device, w.bounds, w.default_grads = "cpu", (0.1, 0.1, 0.1), grads
    w.buffers = type("B", (), {})()
    b = w.buffers
    b.dsum, b.dq_accum = torch.empty(1, 2, 16), torch.empty(1, 16, 2, 8)
    b.dq, b.dk, b.dv = (torch.empty_like(g) for g in grads)

    def writes(dq, dk, dv):
        return lambda: (b.dq.copy_(dq), b.dk.copy_(dk), b.dv.copy_(dv))

    assert w.check(writes(*grads)).ok
    assert "dk differs" in w.check(writes(grads[0], grads[1] + 0.5, grads[2])).note
    assert "dv is not finite" in w.check(lambda: (b.dq.copy_(grads[0]), b.dk.copy_(grads[1]))).note
