"""The modifier specs on the Hopper forward, on CPU: each shipped mods spec (and the tutorial's
prefix LM) put onto flash_attn_fwd_sm90 keeps that family's arguments with its mod arguments after
the tensor maps, its default configs compile with NVRTC to a warp-specialized wgmma kernel without
spills or local memory (what tests/test_sm90.py checks of the plain kernels), and
kernelgen.mods_sm90.forward_sm90 launches it with every argument in the kernel's order. Numerics:
tests/test_mods_sm90_emulated.py (emulator) and tests/test_mods_sm90_gpu.py (H200)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernelgen import api, blockmask, mods_sm90, ops, render, sass, tma, tune
from kernelgen import compile as compiler
from kernelgen.spec import REPO_ROOT, load_spec

BASE = load_spec("flash_attn_fwd_sm90")
MOD_SPECS = ["flash_attn_softcap", "flash_attn_window", "flash_attn_alibi", "flash_attn_document",
             "flash_attn_packed", str(REPO_ROOT / "examples" / "prefix_lm.yaml")]
ONTO = {name: mods_sm90.sm90_spec(name) for name in MOD_SPECS}


@pytest.mark.parametrize("name", MOD_SPECS, ids=lambda n: n.rsplit("/", 1)[-1])
def test_mod_args_follow_the_tensor_maps(name):
    spec, own = ONTO[name], load_spec(name)
    assert spec.name == f"{own.name}__flash_attn_fwd_sm90" and spec.entry == BASE.entry
    assert spec.args == BASE.args + own.mods.members   # a block mask's lists last
    assert spec.mods == own.mods and spec.archs == ("sm_90a",)
    # The Hopper spec's tune space (a mods spec's own tune is for the sm80 family's).
    assert spec.space == BASE.space


@pytest.mark.parametrize("name, aligns", [
    ("flash_attn_packed", True), ("flash_attn_window", True),     # kv ranges
    ("flash_attn_document", False), ("flash_attn_softcap", False), (None, False),
])
def test_kv_align_is_searched_only_where_a_kv_range_decides_the_blocks(name, aligns):
    """kv_align 1 moves a kv range's blocks; a block mask's lists and the plain kernels have none
    to move, so the tuner must not time those configs twice (`kv_ranged` in the constraints)."""
    spec = ONTO[name] if name else BASE
    variant = spec.variant(head_dim=128, dtype="bf16", causal=False)
    values = {c.as_dict().get("kv_align", 0) for c in spec.tuned_configs(variant)}
    assert values == ({0, 1} if aligns else {0})
    config = spec.parse_config({**spec.default_config(variant).as_dict(), "kv_align": 1})
    assert bool(spec.violations(variant, config)) != aligns


@pytest.mark.parametrize("causal", [False, True])
def test_grid_order_is_valid_only_for_causal_grids_of_a_cta_per_tile(causal):
    """grid_order 1 reorders a causal grid's tiles; persistent configs have their own order and
    non-causal tiles are all alike, so those configs would be the same kernels twice."""
    variant = BASE.variant(head_dim=128, dtype="bf16", causal=causal)
    seen = {(c.as_dict()["persistent"], c.as_dict().get("grid_order", 0))
            for c in BASE.valid_configs(variant)}
    assert seen == ({(0, 0), (0, 1), (1, 0), (2, 0)} if causal else {(0, 0), (1, 0), (2, 0)})
    # Searched since it won on the H200 (PERF_NOTES §70), where it is valid.
    searched = {(c.as_dict()["persistent"], c.as_dict().get("grid_order", 0))
                for c in BASE.tuned_configs(variant)}
    assert searched == seen


@pytest.mark.parametrize("causal", [False, True])
def test_half_diag_is_valid_only_for_causal_overlapped_schedules(causal):
    variant = BASE.variant(head_dim=64, dtype="bf16", causal=causal)
    seen = {(c.as_dict()["schedule"], c.as_dict().get("half_diag", 0))
            for c in BASE.valid_configs(variant)}
    assert seen == ({(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)} if causal
                    else {(0, 0), (1, 0), (2, 0)})
    # Out of the search: it won at causal 512-1k only (tune.skip; PERF_NOTES §70, §71).
    assert all(c.as_dict().get("half_diag", 0) == 0 for c in BASE.tuned_configs(variant))


@pytest.mark.parametrize("causal", [False, True])
def test_carry_qk_needs_two_q_buffers_and_no_skipped_first_blocks(causal):
    variant = BASE.variant(head_dim=64, dtype="bf16", causal=causal)
    carried = [c.as_dict() for c in BASE.valid_configs(variant) if c.as_dict()["carry_qk"]]
    assert carried and all(c["persistent"] and c["q_buffers"] == 2 and c["schedule"] > 0
                           for c in carried)
    assert any(c["half_diag"] for c in carried) == causal
    assert all(c["block_n"] >= c["block_m"] for c in carried) if causal else \
        any(c["block_n"] < c["block_m"] for c in carried)
    # Not for the specs whose KV blocks vary by tile (kv ranges, block masks).
    for name in ("flash_attn_window", "flash_attn_packed", "flash_attn_document"):
        spec = ONTO[name]
        assert not any(c.as_dict()["carry_qk"]
                       for c in spec.valid_configs(spec.variant(head_dim=64, dtype="bf16",
                                                                causal=causal)))
    # Out of the search until measured on the H200 (tune.skip; PERF_NOTES §75).
    assert not any(c.as_dict()["carry_qk"] for c in BASE.tuned_configs(variant))


@pytest.mark.parametrize("causal", [False, True])
def test_q_prefetch_is_for_persistent_ctas_with_one_q_buffer(causal):
    variant = BASE.variant(head_dim=256, dtype="bf16", causal=causal)
    prefetching = [c.as_dict() for c in BASE.valid_configs(variant) if c.as_dict()["q_prefetch"]]
    assert prefetching and all(c["persistent"] and c["q_buffers"] == 1 for c in prefetching)
    assert {c["persistent"] for c in prefetching} == {1, 2}
    assert not any(c.as_dict()["q_prefetch"] for c in BASE.tuned_configs(variant))  # PERF_NOTES §77


def test_a_parsed_specs_hopper_spec_is_remembered(tmp_path):
    """forward_sm90 runs on every call: a KernelSpec's Hopper spec is parsed once, and a spec
    whose text changed (a new KernelSpec) gets its own."""
    own = load_spec("flash_attn_softcap")
    assert mods_sm90.sm90_spec(own) is mods_sm90.sm90_spec(own)
    assert mods_sm90.sm90_spec(own).content_hash == ONTO["flash_attn_softcap"].content_hash
    path = tmp_path / "mine.yaml"
    text = (REPO_ROOT / "examples" / "prefix_lm.yaml").read_text()
    path.write_text(text)
    first = mods_sm90.sm90_spec(load_spec(path))
    path.write_text(text + "\n# changed\n")
    second = mods_sm90.sm90_spec(load_spec(path))
    assert second is not first and second.content_hash != first.content_hash


# bf16 only, like tests/test_sm90.py: fp16 differs in the wgmma and cvt suffixes. Besides the
# defaults, persistent configs (the tile loop keeps the kv range's state) and three consumers.
BUILDS = [(name, variant, ONTO[name].default_config(variant))
          for name in MOD_SPECS for variant in ONTO[name].variants() if variant["dtype"] == "bf16"]
BUILDS += [(name, ONTO[name].variant(head_dim=d, dtype="bf16", causal=c),
            ONTO[name].parse_config(cfg)) for name, d, c, cfg in [
    ("flash_attn_window", 128, True,
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1}),
    ("flash_attn_alibi", 128, False,
     {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 1}),
    ("flash_attn_document", 64, False,
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1}),
    ("flash_attn_softcap", 256, True,
     {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 1}),
    (MOD_SPECS[-1], 64, False,
     {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1}),
    # An exact kv range that reads tensors (per-token document bounds), as the tuned table runs it.
    ("flash_attn_packed", 128, False,
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}),
    ("flash_attn_packed", 128, True,
     {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2}),
]]


@pytest.fixture(scope="module")
def built():
    def compile_one(build):
        name, variant, config = build
        source = render.render(ONTO[name], variant, config)
        binary = compiler.compile_source(source.text, source.name, source.entry, variant.arch)
        return source.name, binary, sass.sass(binary.cubin)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return {name: (binary, code) for name, binary, code in pool.map(compile_one, BUILDS)}


@pytest.mark.parametrize("name, variant, config", BUILDS,
                         ids=[f"{v.spec.split('__')[0]}-{v.slug}-{c.slug}" for _, v, c in BUILDS])
def test_sass_of_the_mods_kernels(built, name, variant, config):
    spec = ONTO[name]
    source = render.render(spec, variant, config)
    binary, code = built[source.name]
    assert not spec.violations(variant, config)
    found = sass.mnemonics(code)
    gemm_steps = variant["head_dim"] // 16 + config["block_n"] // 16
    assert found["HGMMA"] == gemm_steps * (1 if config["schedule"] == 0 else 2)
    assert found["USETMAXREG"] == 2 and found["UTMALDG"] == 3
    assert not sass.has_local_memory(code)
    assert (binary.spill_stores, binary.spill_loads, binary.stack_bytes) == (0, 0, 0)
    assert "(C75" not in binary.log and "warning" not in binary.log, binary.log
    # The mods' expressions are in the kernel, not switched off.
    mods = spec.mods
    assert ("kScoreMod = true" in source.text) == bool(mods.score_mod)
    assert ("kMaskMod = true" in source.text) == bool(mods.mask_mod)
    assert ("kKvRange = true" in source.text) == bool(mods.kv_range)


# ---- forward_sm90 without a GPU: the launch it makes ------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch, cache_dir):
    """forward_sm90 with the GPU-only steps replaced: the launches it makes are recorded, each
    packed into the kernel's parameter buffer first (the argument types and their order)."""
    launches, problems = [], []
    monkeypatch.setattr(ops, "forward_family", lambda device, family=None: "sm90")
    monkeypatch.setattr(api, "sm_count", lambda device: 5)
    monkeypatch.setattr(api, "_current_stream", lambda device: 0)
    monkeypatch.setattr(tma, "encode", lambda m, address: address.to_bytes(8, "little") * 16)

    def lookup(spec, variant, problem, device=None):
        problems.append(problem)
        return spec.default_config(variant)

    def launch(self, values, grid, device, stream):
        self.kernel._packer.pack_into(self.kernel._buffer, self.kernel._start, *values)
        launches.append((self, values, grid))

    monkeypatch.setattr(tune, "lookup", lookup)
    monkeypatch.setattr(api.BoundKernel, "launch", launch)
    mods_sm90._PLANS.clear()
    yield launches, problems
    mods_sm90._PLANS.clear()


def test_forward_sm90_launches_the_hopper_kernel_with_the_mod_args_last(no_gpu):
    launches, problems = no_gpu
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 200, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    doc_q, doc_k = torch.zeros(2, 300, dtype=torch.int32), torch.zeros(2, 200, dtype=torch.int32)
    params = {"head_dim": 64, "dtype": "bf16", "causal": True}
    config = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1}
    # flash_attn_document is block-sparse: its lists (here from a dense mask) follow the ids.
    mask = blockmask.from_dense(load_spec("flash_attn_document"),
                                torch.rand(2, 1, 300, 200) > 0.5, True, batch=2)
    out, lse = mods_sm90.forward_sm90("flash_attn_document", q, k, v, params, 0.125,
                                      (doc_q.data_ptr(), doc_k), config=config, block_mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, 300)
    (kernel, values, grid), = launches
    assert kernel.spec.name == "flash_attn_document__flash_attn_fwd_sm90"
    defaults = {"q_buffers": 1, "sum_mma": 0, "rescale": 0, "q_split": 0, "cluster": 1,
                "kv_align": 0, "grid_order": 0, "half_diag": 0, "carry_qk": 0, "q_prefetch": 0,
                "pv_wait": 0, "wg_skip": 0}
    assert kernel.config.as_dict() == {**config, **defaults} and not problems   # explicit: no lookup
    assert grid == (5, 1, 1)   # persistent: min(3 query tiles * 4 heads * 2, sm_count)
    names = [a.name for a in kernel.spec.args]
    named = dict(zip(names, values))
    assert named["doc_q"] == doc_q.data_ptr() and named["doc_k"] == doc_k.data_ptr()
    assert names[-10:-8] == ["doc_q", "doc_k"]
    assert names[-15:-10] == ["tmap_q", "tmap_k", "tmap_v", "tmap_o", "tile_counter"]
    assert named["tile_counter"] == 0   # persistent 1: no counter
    lists = mask.lists(128, 64)
    assert named["bm_num"] == lists.kv_num.data_ptr()
    assert named["bm_full_idx"] == lists.full_kv_idx.data_ptr()
    assert (named["bm_stride_b"], named["bm_stride_h"], named["bm_width"]) == (3, 0, 4)
    assert named["bm_order"] == 0   # the backward's launch order only
    assert named["tmap_k"] == k.data_ptr().to_bytes(8, "little") * 16
    assert (named["seqlen_q"], named["seqlen_k"], named["heads_k"], named["softmax_scale"]) == (
        300, 200, 2, 0.125)
    assert named["o"] == out.data_ptr() and named["lse"] == lse.data_ptr()


    # Without a config: tune.lookup's, for this problem; the plan is kept for the next call.
    cap = mods_sm90.forward_sm90(load_spec("flash_attn_softcap"), q, k, v,
                                 {"head_dim": 64, "dtype": "bf16", "causal": False}, 0.125, (30.0,))
    mods_sm90.forward_sm90("flash_attn_softcap", q, k, v,
                           {"head_dim": 64, "dtype": "bf16", "causal": False}, 0.125, (30.0,))
    assert problems == [tune.Problem(2, 4, 2, 300, 200)]
    assert launches[1][1][-1] == launches[2][1][-1] == 30.0 and cap[0].shape == q.shape
    default = launches[1][0].spec.default_config(launches[1][0].variant)
    assert launches[1][0].config == default and launches[1][2] == (3, 4, 2)   # a CTA per tile

    # wg_skip: the lists grouped for the two warpgroups, two columns wider (their groups' sizes)
    mods_sm90.forward_sm90("flash_attn_document", q, k, v, params, 0.125, (doc_q.data_ptr(), doc_k),
                           config={**config, "wg_skip": 1}, block_mask=mask)
    named = dict(zip(names, launches[-1][1]))
    grouped = mask.lists(128, 64, grouped=True)
    assert grouped is not lists and named["bm_idx"] == grouped.kv_idx.data_ptr()
    assert named["bm_full_num"] == grouped.full_kv_num.data_ptr() and named["bm_width"] == 4 + 2


def test_forward_sm90_checks_the_mod_values(no_gpu):
    q = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16)
    params = {"head_dim": 64, "dtype": "bf16", "causal": False}
    with pytest.raises(TypeError, match=r"1 mod values for the mod arguments \['window_left', "):
        mods_sm90.forward_sm90("flash_attn_window", q, q, q, params, 0.125, (3,))
    with pytest.raises(ValueError, match="a tensor for softcap"):
        mods_sm90.forward_sm90("flash_attn_softcap", q, q, q, params, 0.125, (torch.ones(1),))
    assert not no_gpu[0]


def test_grid_is_kept_per_scalars_and_still_follows_them(cache_dir):
    """BoundKernel.grid keeps its answer per scalars (PERF_NOTES §119): a repeated call is a
    lookup, different scalars a different grid, and an unhashable value is evaluated, not kept."""
    kernel = api.load("flash_attn_bwd_prep", arch="sm_90", dtype="bf16")
    sizes = {"batch": 2, "heads": 3, "seqlen_q": 130}
    first = kernel.grid(sizes)
    assert first == (3, 3, 2) and kernel.grid(dict(sizes)) is first   # cdiv(130, 64), heads, batch
    assert kernel.grid({**sizes, "seqlen_q": 129 + 64}) == (4, 3, 2)
    assert kernel.grid({**sizes, "unused": []}) == (3, 3, 2)   # a list: no key, still right


def test_backward_launcher_converts_each_kind_of_argument(monkeypatch):
    """The backward's launch: tensors as their addresses, None as 0, a tensor map pair encoded,
    numbers (and anything else) as they are; the grid from the sizes."""
    from kernelgen import backward, backward_sm90

    monkeypatch.setattr(api, "_current_stream", lambda device: 7)
    monkeypatch.setattr(backward_sm90, "encode", lambda pair: b"map:" + pair[0])
    seen = []

    class Kernel:
        def grid(self, sizes):
            return (sizes["n"], 1, 1)

        def launch(self, values, grid, device, stream):
            seen.append((values, grid, device, stream))

    t = torch.zeros(4)
    backward._launcher(3)(Kernel(), (t, None, (b"q", t), 5, 0.5, True, "x"), {"n": 9})
    assert seen == [((t.data_ptr(), 0, b"map:q", 5, 0.5, True, "x"), (9, 1, 1), 3, 7)]


def test_saved_backward_still_checks_dout():
    """Autograd's entry skips re-checking what the forward saved, not the caller's dout."""
    from kernelgen import backward

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="dout must have the shape of out"):
        backward.saved_backward(q[:, :4], q, q, q, q, lse, False, 0.125)
    with pytest.raises(TypeError, match="dout must have the dtype of out"):
        backward.saved_backward(q.half(), q, q, q, q, lse, False, 0.125)
