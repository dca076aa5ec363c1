"""Tuning specs with mods on the GPU (measure_mods.py): a forward on the Hopper family (onto
flash_attn_fwd_sm90) and on the mma.sync family, and a backward main kernel (onto
flash_attn_bwd), each with real mod argument values; the chosen config passes the check, is
stored, answers lookup, and matches a float32 reference applying the same modification.

Run on the GPU machine: python -m pytest -q -m gpu tests/test_tune_mods_gpu.py
"""
from __future__ import annotations

import math

import pytest
import torch

from kernelgen import api, env, tune
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.spec import load_spec
from kernelgen.tune import Problem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBLEM = Problem(batch=2, heads=4, heads_k=2, seqlen_q=777, seqlen_k=777)
PARAMS = {"head_dim": 64, "dtype": "bf16", "causal": False}
SOFTCAP = 20.0


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KERNELGEN_AUTOTUNE", raising=False)
    env.reload_settings()
    tune.clear_memo()
    yield
    env.reload_settings()
    tune.clear_memo()


def _documents(batch: int, seqlen: int) -> torch.Tensor:
    """int32 document ids per token, random boundaries (some inside a tile)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.zeros(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        cuts = torch.randint(1, seqlen, (5,), generator=generator).sort().values
        for cut in cuts:
            ids[b, cut:] += 1
    return ids.cuda()


def _few(spec, variant, count: int = 6) -> list:
    """The default config and a spread of the tuner's others: the Hopper forward's whole search
    (966 configs at hd64) takes minutes per tune, which the tuning plumbing tested here does not
    need (test_tune_gpu.py runs a whole search of the mma.sync forward)."""
    space = spec.tuned_configs(variant)
    default = spec.default_config(variant)
    return [default] + [c for c in space[::max(1, len(space) // (count - 1))] if c != default]


def _tuned(spec, mod_values, configs=None):
    result = tune.tune(spec, PROBLEM, device=0, mod_values=mod_values, configs=configs,
                       **{k: v for k, v in PARAMS.items() if k in {p.name for p in spec.params}})
    assert result.chosen is not None, "no config passed the check"
    statuses = {t.status for t in result.trials}
    assert "ok" in statuses
    variant = result.variant
    assert tune.lookup(spec, variant, PROBLEM, 0) == result.chosen.config
    return result


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper family needs compute capability 9.0")
def test_softcap_forward_on_hopper_tunes_and_runs_the_choice():
    import kernelgen

    spec = load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90")
    configs = _few(spec, spec.variant("sm_90a", **PARAMS))
    result = _tuned(spec, {"softcap": SOFTCAP}, configs)
    assert {t.config for t in result.trials} == set(configs)   # configs= narrowed the search
    # AttentionKernel's Hopper path looks the config up: the tuned one runs, and is correct.
    q, k, v = (torch.randn(PROBLEM.batch, PROBLEM.seqlen_q, h, PARAMS["head_dim"], device="cuda",
                           dtype=torch.bfloat16) for h in (PROBLEM.heads, PROBLEM.heads_k,
                                                           PROBLEM.heads_k))
    out = kernelgen.flash_attn_func(q, k, v, softcap=SOFTCAP)

    def capped(s, b, h, i, j):
        return SOFTCAP * torch.tanh(s / SOFTCAP)

    ref, _ = attention_ref(q, k, v, score_mod=capped)
    low, _ = attention_ref(q, k, v, score_mod=capped, upcast=False)
    assert max_error(out, ref) <= 2 * max_error(low, ref) + rounding_allowance(ref)
    assert result.chosen.timing.median_ms <= result.trial(result.default).timing.median_ms * 1.0001


def test_document_forward_on_the_mma_sync_family_tunes():
    docs = _documents(PROBLEM.batch, PROBLEM.seqlen_q)
    _tuned(load_spec("flash_attn_document"), {"doc_q": docs, "doc_k": docs})


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper family needs compute capability 9.0")
def test_document_kernel_with_ordered_ids_tunes_the_forward_it_runs(monkeypatch):
    """flash_attn_document's tune() with ids packed in order tunes flash_attn_packed's Hopper
    forward on their ranges, the kernel a call with create_block_mask's mask runs (PERF_NOTES
    §103), and that call then looks the tuned config up."""
    import kernelgen

    whole = tune.prune   # a few configs (see _few)
    monkeypatch.setattr(tune, "prune", lambda spec, variant, limits, configs=None: whole(
        spec, variant, limits, _few(spec, variant) if configs is None else configs))
    kernel = kernelgen.load("flash_attn_document", **PARAMS)
    docs = _documents(PROBLEM.batch, PROBLEM.seqlen_q)
    q, k, v = (torch.randn(PROBLEM.batch, PROBLEM.seqlen_q, h, PARAMS["head_dim"], device="cuda",
                           dtype=torch.bfloat16) for h in (PROBLEM.heads, PROBLEM.heads_k,
                                                           PROBLEM.heads_k))
    (result,) = kernel.tune(q, k, v, backward=False, doc_q=docs, doc_k=docs)
    assert result.spec == "flash_attn_packed__flash_attn_fwd_sm90" and result.chosen is not None
    spec = load_spec("flash_attn_packed", onto="flash_attn_fwd_sm90")
    assert tune.resolve(spec, result.variant, PROBLEM, 0).config == result.chosen.config
    mask = kernel.create_block_mask(PROBLEM.batch, PROBLEM.heads, PROBLEM.seqlen_q,
                                    PROBLEM.seqlen_k, doc_q=docs, doc_k=docs)
    out = kernel(q, k, v, doc_q=docs, doc_k=docs, block_mask=mask)
    same = (docs[:, :, None] == docs[:, None, :])[:, None]
    ref, _ = attention_ref(q, k, v, mask_mod=lambda *_: same)
    low, _ = attention_ref(q, k, v, mask_mod=lambda *_: same, upcast=False)
    assert max_error(out, ref) <= 2 * max_error(low, ref) + rounding_allowance(ref)


def test_window_backward_tunes():
    spec = load_spec("flash_attn_window", onto="flash_attn_bwd")
    result = _tuned(spec, {"window_left": 100, "window_right": 20})
    assert all(math.isfinite(t.timing.median_ms) for t in result.trials if t.status == "ok")


def test_attention_kernel_tune_fills_the_db_its_calls_read(monkeypatch):
    import kernelgen

    whole = tune.prune   # AttentionKernel.tune searches whole spaces: narrow them (see _few)
    monkeypatch.setattr(tune, "prune", lambda spec, variant, limits, configs=None: whole(
        spec, variant, limits, _few(spec, variant) if configs is None else configs))

    kernel = kernelgen.load("flash_attn_alibi", **PARAMS)
    q, k, v = (torch.randn(PROBLEM.batch, PROBLEM.seqlen_q, h, PARAMS["head_dim"], device="cuda",
                           dtype=torch.bfloat16) for h in (PROBLEM.heads, PROBLEM.heads_k,
                                                           PROBLEM.heads_k))
    slopes = torch.rand(PROBLEM.heads, device="cuda")
    results = kernel.tune(q, k, v, alibi_slopes=slopes, alibi_stride_b=0)
    assert len(results) == 2 and all(r.chosen is not None for r in results)
    from kernelgen import backward

    base = backward.main_spec_name(PARAMS["head_dim"], 0, False, PROBLEM.seqlen_k,
                                   kernel.spec, kernel.params)
    assert results[1].spec == f"flash_attn_alibi__{base}"   # the main kernel its gradients run
    for result in results:
        base = result.spec.partition("__")[2]
        spec = load_spec("flash_attn_alibi", onto=base) if base else load_spec("flash_attn_alibi")
        assert tune.resolve(spec, result.variant, PROBLEM, 0).config == result.chosen.config
    # A call after tuning runs (and is correct: the mods GPU tests hold every config to the
    # float32 reference; here, that it runs the tuned forward at all).
    out = kernel(q, k, v, alibi_slopes=slopes, alibi_stride_b=0)
    assert torch.isfinite(out).all()
