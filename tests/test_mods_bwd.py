"""The backward of specs with mods, without a GPU: every shipped mod spec put onto flash_attn_bwd
and flash_attn_bwd_dq compiles clean with NVRTC (no spills, no stack) at its untuned defaults, a
spec's `onto:` section gives those defaults, a score_mod without a score_mod_grad is refused with
an error naming the spec and the key, and the autograd function hands the forward's mods (tensors
and scalars) to the backward.

`cache_dir` (conftest.py): a fresh KERNELGEN_CACHE_DIR with every switch off.
"""
from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kernelgen import attention, backward, cache, render
from kernelgen.compile import CompileError
from kernelgen.reference import attention_ref
from kernelgen.spec import REPO_ROOT, SpecError, load_spec

MOD_SPECS = ["flash_attn_softcap", "flash_attn_window", "flash_attn_alibi", "flash_attn_document",
             "flash_attn_packed", str(REPO_ROOT / "examples" / "prefix_lm.yaml")]
BASES = [backward.MAIN_SPEC, backward.DQ_SPEC]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_backward_of_every_mod_spec_compiles_without_spills(arch, cache_dir):
    """Every head dim and causal, bf16 (fp16 compiles to the same registers; `kernelgen build`
    style sweeps of both dtypes and sm_86 were clean when the defaults were chosen)."""
    jobs = [(spec, variant) for name in MOD_SPECS for base in BASES
            for spec in [load_spec(name, onto=base)] for variant in spec.variants([arch])
            if variant["dtype"] == "bf16"]
    assert len(jobs) == 2 * (5 * 10 + 5)   # prefix_lm pins causal to false

    def build(job):
        spec, variant = job
        source = render.render(spec, variant, spec.default_config(variant))
        binary = cache.compile_cached(source, arch)
        return source.name, binary.spill_stores + binary.spill_loads, binary.stack_bytes

    with ThreadPoolExecutor(4) as pool:
        problems = [f"{name}: spills {spills} bytes, stack {stack}"
                    for name, spills, stack in pool.map(build, jobs) if spills or stack]
    assert not problems, "\n".join(problems)


def test_onto_section_gives_the_defaults_for_that_base():
    window = load_spec("flash_attn_window", onto=backward.MAIN_SPEC)
    bwd, dq = load_spec(backward.MAIN_SPEC), load_spec(backward.DQ_SPEC)
    assert window.space == bwd.space and window.constraints == bwd.constraints
    assert window.defaults != bwd.defaults   # its own: flash_attn_bwd's spill with mods
    variant = window.variant("sm_80", head_dim=64)
    assert window.default_config(variant).as_dict()["warps"] == 4
    # No section for the dQ kernel: flash_attn_bwd_dq's own defaults (document has one).
    assert load_spec("flash_attn_window", onto=backward.DQ_SPEC).defaults == dq.defaults
    assert load_spec("flash_attn_document", onto=backward.DQ_SPEC).defaults != dq.defaults
    # And the forward, where the section does not apply, keeps the spec's own tune.
    forward = load_spec("flash_attn_window")
    assert forward.space == load_spec("flash_attn_fwd").space
    assert forward.defaults[0][1].as_dict() == {"block_m": 64, "block_n": 64, "warps": 4,
                                                "stages": 2, "grid_order": 0}


def write(tmp_path, body: str, name="my_attention"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


MASKED = """
    name: my_attention
    extends: flash_attn_fwd
    mods:
      mask_mod: "kv_idx <= q_idx"
    onto:
      flash_attn_bwd:
    """


def test_onto_section_is_checked(tmp_path):
    path = write(tmp_path, MASKED + "        params: {head_dim: {values: [64]}}\n")
    with pytest.raises(SpecError, match="onto.flash_attn_bwd.params: unknown key; allowed: tune"):
        load_spec(path, onto=backward.MAIN_SPEC)
    config = "{block_m: 48, block_n: 64, warps: 4, dsplit: 2, stages: 2, grid_order: 0}"
    path = write(tmp_path, MASKED + f"        tune: {{defaults: [{{config: {config}}}]}}\n")
    # (reported as the tune it becomes: that of the spec put onto flash_attn_bwd)
    with pytest.raises(SpecError, match=r"tune.defaults\[0\].config.block_m: an integer \(48\) is "
                                        "not in the tune space"):
        load_spec(path, onto=backward.MAIN_SPEC)
    load_spec(path)   # the forward does not read it


FORWARD_ONLY = """
    name: my_temperature
    extends: flash_attn_fwd
    mods:
      args:
        - {name: temperature, type: f32}
      score_mod: "score / temperature"
    """


def test_a_score_mod_without_its_derivative_is_forward_only(tmp_path, cache_dir):
    path = write(tmp_path, FORWARD_ONLY, name="my_temperature")
    spec = load_spec(path)
    with pytest.raises(NotImplementedError, match=r"my_temperature \(.*my_temperature.yaml\) is "
                                                  r"forward-only: its mods.score_mod has no "
                                                  r"mods.score_mod_grad"):
        backward.check_differentiable(spec)
    for name in ("flash_attn_window", "flash_attn_softcap", "flash_attn_alibi"):
        backward.check_differentiable(load_spec(name))   # masks need no derivative
    # Asking the kernel for a gradient fails at the call, before anything needs a GPU.
    kernel = attention.load(path, head_dim=64, dtype="bf16")
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="my_temperature .* is forward-only"):
        kernel(q, q.detach(), q.detach(), temperature=2.0)
    with pytest.raises(NotImplementedError, match="forward-only"):
        backward._kernels(64, "bf16", False, 0, False, (1, 2, 2, 8, 8),
                          backward.ModArgs(spec, spec.variant(head_dim=64).params, (2.0,)))
    # And a backward rendered anyway stops NVRTC with the same words, at the spec's file.
    onto = load_spec(path, onto=backward.MAIN_SPEC)
    variant = onto.variant("sm_80", head_dim=64)
    source = render.render(onto, variant, onto.default_config(variant))
    assert "float score_mod_grad(" not in source.text
    with pytest.raises(CompileError, match="forward-only"):
        cache.compile_cached(source, "sm_80")


def rendered(spec, **params) -> str:
    variant = spec.variant(**params)
    return render.render(spec, variant, spec.default_config(variant)).text


def test_the_backward_renders_score_mod_grad_and_the_forward_does_not():
    variant = dict(head_dim=64, dtype="bf16", causal=False)
    text = rendered(load_spec("flash_attn_softcap", onto=backward.MAIN_SPEC), **variant)
    assert "float score_mod_grad(float qk, float softmax_scale" in text
    assert "flash_bwd_sm80<Config>(args, mods)" in text
    assert ("(1.0f - tanh_approx(qk * (softmax_scale / softcap))) * "
            "(1.0f + tanh_approx(qk * (softmax_scale / softcap)))") in text
    assert "score_mod_grad" not in rendered(load_spec("flash_attn_softcap"), **variant)
    text = rendered(load_spec(backward.MAIN_SPEC), **variant)
    assert "struct Mods" not in text and "kg::flash_bwd_sm80<Config>(args);" in text


# ---- the autograd function, with the kernels faked by the reference on the CPU -------------------

class _FakeKernel:
    """Stands in for an AttentionKernel: the float32 reference with ALiBi for its forward."""

    def __init__(self):
        self.spec = load_spec("flash_attn_alibi")
        self.variant = self.spec.variant(head_dim=64, dtype="bf16", causal=True)
        self.params = self.variant.as_dict()

    def forward(self, q, k, v, scale, values, block_mask=None):
        slopes, stride_b = values
        assert stride_b == 0
        return attention_ref(q, k, v, True, scale, score_mod=self.score_mod(slopes, q, k))

    @staticmethod
    def score_mod(slopes, q, k):
        sq, sk = q.shape[1], k.shape[1]
        return lambda s, b, h, i, j: s - slopes.view(1, -1, 1, 1) * (i + sk - sq - j).abs().float()


def test_autograd_hands_the_mods_to_the_backward(monkeypatch):
    kernel = _FakeKernel()
    calls = []

    def fake_backward(dout, q, k, v, out, lse, causal, scale, deterministic, mods):
        calls.append((causal, scale, deterministic, mods))
        with torch.enable_grad():   # autograd runs backward functions without it
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            score_mod = kernel.score_mod(mods.values[0], q, k)
            ref, _ = attention_ref(*leaves, causal, scale, score_mod=score_mod)
            return torch.autograd.grad(ref, leaves, dout)

    monkeypatch.setattr(backward, "saved_backward", fake_backward)   # autograd's entry
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, n, h, 64, dtype=torch.bfloat16, requires_grad=True)
               for n, h in ((9, 4), (13, 2), (13, 2)))
    slopes = torch.rand(4)
    out, lse = attention._AttentionFunction.apply(kernel, 0.125, True, None, None, q, k, v, slopes, 0)
    assert not lse.requires_grad
    out.float().square().sum().backward()
    (causal, scale, deterministic, mods), = calls
    assert (causal, scale, deterministic) == (True, 0.125, True)
    assert mods.spec is kernel.spec and mods.params == kernel.variant.params
    assert mods.values[0] is slopes and mods.values[1] == 0
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*leaves, True, 0.125, score_mod=kernel.score_mod(slopes, q, k))
    ref.float().square().sum().backward()
    for got, want in zip((q, k, v), leaves):
        assert torch.equal(got.grad, want.grad)
    # A mod tensor changed in place between forward and backward is caught (saved tensors).
    out, _ = attention._AttentionFunction.apply(kernel, 0.125, False, None, None, q, k, v, slopes, 0)
    slopes.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---- the Hopper backward main kernel (flash_attn_bwd_sm90) with mods ----------------------------

# The variants each mods spec's `onto: {flash_attn_bwd_sm90: ...}` section leaves without a config
# (they spill at 240 registers and keep flash_attn_bwd): (head_dim, causal).
SM90_EXCLUDED = {"flash_attn_window": {(96, False), (96, True)},
                 "flash_attn_document": {(96, False)},
                 "flash_attn_packed": {(96, False), (96, True)},
                 "flash_attn_packed_bm": {(96, False), (96, True)},
                 "prefix_lm": {(96, False)}}


def sm90_jobs(dtype="bf16"):
    from kernelgen import backward_sm90

    jobs, excluded = [], {}
    specs = [load_spec(name, onto=backward_sm90.SPEC) for name in MOD_SPECS]
    # A kv range that reads tensors also runs its backward on a block mask (load_spec's
    # block_mask=, AttentionKernel.range_spec).
    specs += [load_spec(spec.path, onto=backward_sm90.SPEC, block_mask=True) for spec in specs
              if spec.mods.range_reads_memory and not spec.mods.block_sparse]
    for spec in specs:
        for variant in spec.variants():
            if variant["dtype"] != dtype:
                continue
            try:
                jobs.append((spec, variant, spec.default_config(variant)))
            except SpecError:
                excluded.setdefault(spec.name.partition("__")[0], set()).add(
                    (variant["head_dim"], variant["causal"]))
    return jobs, excluded


def test_backward_sm90_of_every_mod_spec_compiles_clean(cache_dir):
    """Every shipped mods spec onto the Hopper kernel, bf16 (fp16 compiles to the same registers:
    checked by hand when the onto sections were written): no spills, no local memory, no C75xx
    (serialized wgmma), the plain kernel's wgmma count; the variants left out are exactly the
    documented ones."""
    from kernelgen import compile as compiler
    from kernelgen import sass

    jobs, excluded = sm90_jobs()
    assert excluded == SM90_EXCLUDED
    assert len(jobs) == 5 * 6 + 3 - 6 + 4   # prefix_lm pins causal to false; packed_bm

    def build(job):
        spec, variant, config = job
        source = render.render(spec, variant, config)
        binary = compiler.compile_source(source.text, source.name, source.entry, variant.arch)
        found = sass.mnemonics(sass.sass(binary.cubin))
        head_dim, block_m, block_n = variant["head_dim"], config["block_m"], config["block_n"]
        hgmma = 2 * head_dim // 16 + 2 * block_m // 16 + block_n // 16
        # Causal without a kv range or block mask (not hd96): the diagonal pair peeled, once in
        # full and once with dQ alone (kBwdPeelDiagonal, PERF_NOTES §91).
        if (variant["causal"] and head_dim != 96 and not spec.mods.kv_range
                and not spec.mods.block_sparse):
            hgmma = 2 * hgmma + block_n // 16
        bad = []
        if binary.spill_stores or binary.spill_loads or binary.stack_bytes:
            bad.append(f"spills {binary.spill_stores}/{binary.spill_loads}, stack {binary.stack_bytes}")
        if found["LDL"] + found["STL"]:
            bad.append("local memory")
        if "(C75" in binary.log:
            bad.append("C75xx: " + binary.log)
        if found["HGMMA"] != hgmma:
            bad.append(f"{found['HGMMA']} HGMMA, expected {hgmma}")
        return source.name, bad

    with ThreadPoolExecutor(2) as pool:
        problems = [f"{name}: {'; '.join(bad)}" for name, bad in pool.map(build, jobs) if bad]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("setting", ["ranges", "blockmask"])
def test_which_specs_take_a_block_mask_of_their_ranges(monkeypatch, setting):
    """AttentionKernel.range_spec on compute capability 9.0 (faked): with
    KERNELGEN_RANGE_BACKWARD=blockmask, a kv range that reads tensors (flash_attn_packed) runs
    its backward on its mods put on a block mask, where the Hopper backward takes the variant
    (not head_dim 96, nor at a sequence length it leaves to flash_attn_bwd); never an analytic
    range (window), a block-sparse spec (document) or a spec without a mask; the default keeps
    the ranges."""
    from kernelgen import api, backward_sm90, env

    monkeypatch.setattr(api, "device_arch", lambda device=None: "sm_90")
    if setting == "blockmask":
        monkeypatch.setenv("KERNELGEN_RANGE_BACKWARD", setting)
    env.reload_settings()
    try:
        for name in ("flash_attn_packed", "flash_attn_window", "flash_attn_document",
                     "flash_attn_softcap"):
            for head_dim in (64, 96, 128):
                kernel = attention.AttentionKernel(load_spec(name),   # nothing compiled
                                                   head_dim=head_dim, dtype="bf16", causal=True)
                twin = kernel.range_spec(head_dim, 0, 4096)
                taken = setting == "blockmask" and name == "flash_attn_packed" and head_dim != 96
                assert (twin is not None) == taken, (name, head_dim)
                if taken:   # not at a length the backward leaves to flash_attn_bwd
                    assert twin.name == "flash_attn_packed_bm" and twin.mods.block_sparse
                    short = backward_sm90.SHORT_SEQLEN_K
                    monkeypatch.setattr(backward_sm90, "SHORT_SEQLEN_K", 4096)
                    assert kernel.range_spec(head_dim, 0, 4096) is None
                    monkeypatch.setattr(backward_sm90, "SHORT_SEQLEN_K", short)
    finally:
        monkeypatch.undo()
        env.reload_settings()


def test_backward_sm90_takes_mods_specs_where_they_fit(monkeypatch):
    """On compute capability 9.0 (faked): a mods spec's backward runs flash_attn_bwd_sm90 except
    for the variants its onto section leaves out, short sequences, and the deterministic path;
    the kernel's arguments are the plain Hopper kernel's (tensor maps last) and then the mod
    arguments, which measure_mods recognises as a backward to tune."""
    from kernelgen import api, backward_sm90, env, measure_mods

    monkeypatch.setattr(api, "device_arch", lambda device=None: "sm_90")
    long, short = backward_sm90.SHORT_SEQLEN_K + 1, backward_sm90.SHORT_SEQLEN_K
    for name in MOD_SPECS:
        spec = load_spec(name)
        left_out = SM90_EXCLUDED.get(spec.name, set())
        for variant in spec.variants(["sm_80"]):
            params = dict(variant.params)
            expected = (variant["head_dim"] in backward_sm90.head_dims()
                        and (variant["head_dim"], variant["causal"]) not in left_out)
            assert backward_sm90.applies(variant["head_dim"], 0, False, long, spec, params) == expected
            assert not backward_sm90.applies(variant["head_dim"], 0, False, short, spec, params)
            assert not backward_sm90.applies(variant["head_dim"], 0, True, long, spec, params)
        onto = load_spec(name, onto=backward_sm90.SPEC)
        assert backward_sm90.is_sm90(SimpleNamespace(spec=onto))
        assert onto.name == f"{spec.name}__flash_attn_bwd_sm90"
        names = [a.name for a in onto.args]
        plain = [a.name for a in load_spec(backward_sm90.SPEC).args]
        assert names == plain + [a.name for a in onto.mods.members]
        assert measure_mods.feeds(onto) == "backward"
    assert backward_sm90.applies(128, 0, False, long)           # plain
    assert not backward_sm90.applies(128, 0, False, short)
    monkeypatch.setenv("KERNELGEN_BACKWARD", "sm80")
    env.reload_settings()
    try:
        assert not backward_sm90.applies(128, 0, False, long, load_spec("flash_attn_softcap"),
                                         dict(head_dim=128, dtype="bf16", causal=False))
    finally:
        monkeypatch.undo()
        env.reload_settings()
