"""The Hopper forward family on CPU: spec and arguments, tensor-map construction, the `tmap`
launch argument, and what ptxas made of every shipped default (wgmma, setmaxnreg, TMA, no local
memory). Numerics need an H200: tests/test_sm90_gpu.py."""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernelgen import render, sass, tma
from kernelgen import compile as compiler
from kernelgen.compile import Binary
from kernelgen.launch import Kernel
from kernelgen.spec import load_spec

SPEC = load_spec("flash_attn_fwd_sm90")


# ---- the spec -------------------------------------------------------------------------------

def test_arguments_extend_the_sm80_family():
    """The same runtime arguments in the same order (one launcher drives both), then the maps and
    the dynamic schedule's counter."""
    sm80 = load_spec("flash_attn_fwd")
    shared = len(sm80.args)
    assert [(a.name, a.type) for a in SPEC.args[:shared]] == [(a.name, a.type) for a in sm80.args]
    assert [(a.name, a.type) for a in SPEC.args[shared:]] == [
        ("tmap_q", "tmap"), ("tmap_k", "tmap"), ("tmap_v", "tmap"), ("tmap_o", "tmap"),
        ("tile_counter", "ptr")]
    assert SPEC.archs == ("sm_90a",)
    assert {p.name: p.values for p in SPEC.params} == {p.name: p.values for p in sm80.params}


@pytest.mark.parametrize("variant", SPEC.variants(), ids=lambda v: v.slug)
def test_default_configs_fit(variant):
    env = SPEC.environment(variant, SPEC.default_config(variant))
    assert env["smem_bytes"] <= env["max_smem"]
    assert env["threads"] == 128 * (env["block_m"] // 64 + 1)
    # wgmma N of both GEMMs is at most 256 and P splits into whole k16 steps.
    assert env["block_n"] % 16 == 0 and env["block_n"] <= 256 and env["head_dim"] <= 256


# ---- tensor maps (no driver needed) ---------------------------------------------------------

def test_attention_map_of_a_contiguous_tensor():
    # (batch 2, seqlen 1000, heads 8, head_dim 128) bf16, contiguous: 64-column panels.
    m = tma.attention_map((2, 1000, 8, 128), (1000 * 8 * 128, 8 * 128, 128, 1), "bf16", 176, 128)
    assert m.dims == (64, 1000, 2, 8, 2)
    assert m.strides == (8 * 128 * 2, 128, 128 * 2, 1000 * 8 * 128 * 2)  # bytes
    assert m.box == (64, 176, 2, 1, 1)
    assert m.swizzle == 128 and m.dtype == "bf16"


def test_attention_map_of_a_strided_view_with_64b_swizzle():
    # head_dim 96 (not a multiple of 64): three 32-column panels; q out of a packed qkv tensor.
    batch, seqlen, heads, head_dim = 3, 300, 4, 96
    strides = (seqlen * 3 * heads * head_dim, 3 * heads * head_dim, head_dim, 1)
    m = tma.attention_map((batch, seqlen, heads, head_dim), strides, "fp16", 128, 64)
    assert m.dims == (32, 300, 3, 4, 3)
    assert m.strides == (3 * heads * head_dim * 2, 64, head_dim * 2, strides[0] * 2)
    assert m.box == (32, 128, 3, 1, 1)


def test_the_backward_maps_its_fp32_dq_accumulator_by_each_consumers_columns():
    """flash_attn_bwd_sm90's fifth map: dq_accum (fp32, q's shape) in 32-column panels (128B
    swizzle), a box of block_m rows and one consumer's dq_n columns (hd128: halves; hd64: the
    whole, each consumer in turn); none at hd96, which adds dQ with atomics."""
    from types import SimpleNamespace

    import torch

    from kernelgen import backward_sm90
    from kernelgen.spec import load_spec

    spec = load_spec(backward_sm90.SPEC)
    for head_dim, panels in ((64, 2), (96, None), (128, 2)):
        variant = spec.variant("sm_90a", head_dim=head_dim, dtype="bf16", causal=False)
        kernel = SimpleNamespace(spec=spec, variant=variant, config=spec.default_config(variant))
        q = torch.empty(2, 300, 4, head_dim, dtype=torch.bfloat16)
        kv = torch.empty(2, 200, 2, head_dim, dtype=torch.bfloat16)
        dq_accum = torch.empty(q.shape, dtype=torch.float32)
        maps = backward_sm90.tensor_maps(kernel, q, kv, kv, q, dq_accum)
        assert len(maps) == 5 and maps[4][1] is dq_accum
        assert [x[0].dtype for x in maps[:4]] == ["bf16"] * 4
        m = maps[4][0]
        if panels is None:
            assert m == bytes(tma.MAP_BYTES)
            continue
        assert m.dtype == "fp32" and m.swizzle == 128
        assert m.dims == (32, 300, head_dim // 32, 4, 2)
        assert m.strides == (4 * head_dim * 4, 128, head_dim * 4, 300 * 4 * head_dim * 4)
        assert m.box == (32, kernel.config["block_m"], panels, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        tma.attention_map((1, 16, 1, 64), (1024, 64, 64, 1), "fp8", 64, 128)


def test_empty_dimensions_are_clamped():
    m = tma.attention_map((1, 0, 1, 64), (0, 64, 64, 1), "bf16", 128, 128)
    assert m.dims == (64, 1, 1, 1, 1)


@pytest.mark.parametrize("shape, strides, swizzle, rows, match", [
    ((1, 16, 2, 96), (16 * 2 * 96, 2 * 96, 96, 1), 128, 64, "not a multiple of the 64-column"),
    ((1, 16, 2, 64), (16 * 2 * 64, 2 * 64, 64, 2), 128, 64, "head_dim must be contiguous"),
    ((1, 16, 2, 64), (16 * 2 * 68, 2 * 68 + 4, 68, 1), 128, 64, "seqlen stride must be a multiple"),
    ((1, 16, 2, 64), (16 * 2 * 64, 2 * 64, 60, 1), 128, 64, "heads stride must be a multiple"),
    ((1, 16, 2, 64), (16 * 2 * 64, 2 * 64, 64, 1), 32, 64, "swizzle must be one of"),
    ((1, 16, 2, 64), (16 * 2 * 64, 2 * 64, 64, 1), 128, 512, "a box holds 1..256 rows"),
])
def test_attention_map_rejects_what_tma_cannot_describe(shape, strides, swizzle, rows, match):
    with pytest.raises(ValueError, match=match):
        tma.attention_map(shape, strides, "bf16", rows, swizzle)


def test_encode_arguments_pass_the_binding_type_checks():
    """cuda-bindings converts every argument before it needs libcuda: with the driver missing the
    call fails for that reason only (a wrong type would be a TypeError first); with a driver it
    encodes 128 bytes."""
    from cuda.bindings import driver

    m = tma.attention_map((2, 1000, 8, 128), (1000 * 8 * 128, 8 * 128, 128, 1), "bf16", 128, 128)
    arguments = tma.encode_arguments(m, 0x7F0000001000)
    assert arguments[1] == 5 and arguments[2] == 0x7F0000001000
    assert [int(d) for d in arguments[3]] == list(m.dims)
    assert [int(b) for b in arguments[5]] == list(m.box)
    try:
        err, tensor_map = driver.cuTensorMapEncodeTiled(*arguments)
    except RuntimeError as error:  # cuda.pathfinder found no libcuda on this machine
        assert "driver" in str(error)
        return
    if err == driver.CUresult.CUDA_SUCCESS:
        assert len(tensor_map.opaque) * 8 == tma.MAP_BYTES
    else:  # a driver without cuInit: the arguments got through the binding
        assert err == driver.CUresult.CUDA_ERROR_NOT_INITIALIZED


def test_encode_needs_an_aligned_address():
    m = tma.attention_map((1, 16, 1, 64), (1024, 64, 64, 1), "bf16", 64, 128)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode(m, 0x1008)


@pytest.fixture
def fresh_maps(monkeypatch):
    for name, value in (("_CACHE", {}), ("_TEMPLATES", {}), ("_PATCHABLE", None)):
        monkeypatch.setattr(tma, name, value)


def test_encode_is_cached_per_map_and_address(monkeypatch, fresh_maps):
    calls = []   # a driver whose maps do not hold the address where patching expects it
    monkeypatch.setattr(tma, "_encode", lambda m, address: calls.append(address) or bytes(128))
    m = tma.attention_map((1, 16, 1, 64), (1024, 64, 64, 1), "bf16", 64, 128)
    for address in (0x1000, 0x1000, 0x2000, 0x1000, 0x3000):
        assert tma.encode(m, address) == bytes(128)
    assert calls == [0x1000, 0x2000, 0x3000] and tma._PATCHABLE is False


def test_a_new_address_is_patched_in_once_patching_is_verified(monkeypatch, fresh_maps):
    calls = []

    def expected(m, address):   # the H200's driver: the address in word 0, the layout after it
        return address.to_bytes(8, "little") + bytes([m.box[1]]) * 120

    monkeypatch.setattr(tma, "_encode", lambda m, address: calls.append(address) or expected(m, address))
    m = tma.attention_map((1, 16, 1, 64), (1024, 64, 64, 1), "bf16", 64, 128)
    other = tma.attention_map((1, 16, 1, 64), (1024, 64, 64, 1), "bf16", 32, 128)
    for address in (0x1000, 0x2000, 0x3000, 0x4000):
        assert tma.encode(m, address) == expected(m, address)
    assert calls[:2] == [0x1000, 0x2000] and tma._PATCHABLE is True
    calls.clear()
    assert tma.encode(m, 0x5000) == expected(m, 0x5000)
    assert tma.encode(other, 0x5000) == expected(other, 0x5000)
    assert tma.encode(other, 0x6000) == expected(other, 0x6000)
    assert calls == [0x5000]   # only the new layout's first map is encoded
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode(m, 0x5008)


# ---- the `tmap` launch argument --------------------------------------------------------------

def test_tmap_arguments_are_packed_64_byte_aligned():
    binary = Binary(name="probe", arch="sm_90a", entry="probe", cubin=b"", registers=0,
                    spill_stores=0, spill_loads=0, stack_bytes=0, static_smem=0,
                    compile_seconds=0.0, log="")
    kernel = Kernel(binary, ("ptr", "i32", "tmap", "f32", "tmap", "i64"))
    pointers = [kernel._pointers[i] for i in range(6)]
    base = pointers[0]
    assert [p - base for p in pointers] == [0, 8, 64, 192, 256, 384]
    assert pointers[2] % 64 == 0 and pointers[4] % 64 == 0
    first, second = bytes(range(128)), bytes(range(128, 256))
    kernel._packer.pack_into(kernel._buffer, kernel._start, 0xABCDEF, -3, first, 0.5, second, 7)
    assert ctypes.string_at(pointers[2], 128) == first
    assert ctypes.string_at(pointers[4], 128) == second
    assert ctypes.c_int.from_address(pointers[1]).value == -3
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0xABCDEF
    assert ctypes.c_int64.from_address(pointers[5]).value == 7


# ---- ptxas: degraded Hopper code fails the build (real compiles, not canned logs) ------------

NO_LAUNCH_BOUNDS = r"""
extern "C" __global__ void no_bounds(float* x) {
    if (threadIdx.x < 128) { asm volatile("setmaxnreg.dec.sync.aligned.u32 24;"); return; }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    x[threadIdx.x] = 1.f;
}
"""

# An ordinary instruction writes an accumulator between two wgmmas of one group.
TOUCHED_ACCUMULATOR = r"""
__device__ __forceinline__ void mma(float (&d)[8], unsigned long long a, unsigned long long b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "l"(a), "l"(b));
}
extern "C" __global__ void __launch_bounds__(128, 1) touched(float* x, unsigned long long a,
                                                             unsigned long long b) {
    float d[8];
    for (int i = 0; i < 8; ++i) d[i] = x[i];
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    mma(d, a, b);
    d[0] = d[0] * x[threadIdx.x];
    mma(d, a + 2, b + 2);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int i = 0; i < 8; ++i) x[i * 128 + threadIdx.x] = d[i];
}
"""


@pytest.mark.parametrize("source, entry", [(NO_LAUNCH_BOUNDS, "no_bounds"),
                                           (TOUCHED_ACCUMULATOR, "touched")])
def test_degraded_hopper_code_fails_to_compile(cache_dir, source, entry):
    with pytest.raises(compiler.CompileError, match=r"ptxas degraded .* \(warning C75(08|1[0-5])"):
        compiler.compile_source(source, entry, entry, "sm_90a")


# ---- every shipped default variant: the SASS of a warp-specialized wgmma kernel ---------------

# tests/test_build.py compiles every variant (fp16 too) and checks for HGMMA and local memory; the
# fp16 kernels differ from these only in the wgmma and cvt type suffixes, so the structure is
# checked on the bf16 defaults (and the schedules no default uses), compiling them once more.
BF16_VARIANTS = [v for v in SPEC.variants() if v["dtype"] == "bf16"]
OTHER_CONFIGS = [  # (head_dim, causal, config)
    (128, True, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 0, "persistent": 0}),
    (128, False, {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 1, "persistent": 0}),
    (64, True, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 0}),  # 3 consumers
    # Persistent, each schedule: the tile loop keeps the same instructions, no spills.
    (128, False, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 1}),
    (128, True, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 1}),
    (256, True, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 0, "persistent": 1}),
    (64, False, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1}),
    # Two Q buffers, O stored by TMA: the largest hd128 tile that fits, 3 consumers, 64B swizzle.
    (128, False, {"block_m": 128, "block_n": 160, "stages": 2, "schedule": 2, "persistent": 1,
                  "q_buffers": 2}),
    (64, True, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1,
                "q_buffers": 2}),
    (96, True, {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 1, "persistent": 1,
                "q_buffers": 2}),
    # Three Q buffers: hd128 with 2 stages of 128 keys (225 KiB, near the limit), dynamic.
    (128, True, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2,
                 "q_buffers": 3}),
    # The row sums from the tensor cores: P V with N = 72 (sum_mma).
    (64, False, {"block_m": 192, "block_n": 144, "stages": 2, "schedule": 0, "persistent": 0,
                 "sum_mma": 1}),
    # Clusters of two CTAs sharing K and V by multicast: half the panels each (hd128: one,
    # hd256: two), with pingpong and with the early rescale.
    (128, False, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0,
                  "cluster": 2}),
    (256, False, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0,
                  "rescale": 1, "cluster": 2}),
    # pv_wait: the softmax beside the previous block's P V (test_pv_wait_...): the hd128 8k
    # entry's config, 3 consumers dynamic with the row sums by wgmma, hd256 with the early rescale.
    (128, False, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0,
                  "cluster": 2, "pv_wait": 1}),
    (64, True, {"block_m": 192, "block_n": 112, "stages": 2, "schedule": 2, "persistent": 2,
                "sum_mma": 1, "pv_wait": 1}),
    (256, False, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 1,
                  "rescale": 1, "pv_wait": 1}),
]
BUILDS = [(v, SPEC.default_config(v)) for v in BF16_VARIANTS] + [
    (SPEC.variant(head_dim=d, dtype="bf16", causal=c), SPEC.parse_config(cfg))
    for d, c, cfg in OTHER_CONFIGS]


def compile_all(builds) -> list[tuple[str, Binary, str]]:
    """(source name, binary, SASS) of each (spec, variant, config), compiled in threads (NVRTC
    releases the GIL)."""
    def compile_one(build):
        spec, variant, config = build
        source = render.render(spec, variant, config)
        binary = compiler.compile_source(source.text, source.name, source.entry, variant.arch)
        return source.name, binary, sass.sass(binary.cubin)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(compile_one, builds))


@pytest.fixture(scope="module")
def built():
    """Those kernels, compiled once."""
    return {name: (binary, code)
            for name, binary, code in compile_all([(SPEC, v, c) for v, c in BUILDS])}


@pytest.mark.parametrize("variant, config", BUILDS,
                         ids=[f"{v.slug}-{c.slug}" for v, c in BUILDS])
def test_sass_of_a_warp_specialized_wgmma_kernel(built, variant, config):
    binary, code = built[render.render(SPEC, variant, config).name]
    assert not SPEC.violations(variant, config)
    found = sass.mnemonics(code)
    # head_dim / 16 QK^T steps and block_n / 16 PV steps per KV block, all wgmma; the overlapped
    # schedules unroll a prologue QK^T and an epilogue PV besides the loop's.
    gemm_steps = variant["head_dim"] // 16 + config["block_n"] // 16
    assert found["HGMMA"] == gemm_steps * (1 if config["schedule"] == 0 else 2)
    wide = code.count(f"HGMMA.64x{variant['head_dim'] + 8}x16")  # sum_mma: P V's N + 8
    assert wide == (config["block_n"] // 16 * (1 if config["schedule"] == 0 else 2)
                    if config["sum_mma"] else 0)
    assert found["USETMAXREG"] == 2         # the producer's dec and the consumers' inc
    assert found["UTMALDG"] == 3            # Q, K and V, each one TMA load per tile
    # cluster 2: K and V multicast (each CTA its panels), the CTAs meet after the barriers' init
    # and before they exit (a CTA past seqlen_q on its own path), and a K/V slot is released to
    # both CTAs' barriers.
    clustered = config["cluster"] == 2
    source = render.render(SPEC, variant, config).text
    assert ("__cluster_dims__(2, 1, 1)" in source) == clustered   # what makes the launch a cluster
    assert code.count("UTMALDG.5D.MULTICAST") == (2 if clustered else 0)
    assert code.count("UCGABAR_WAIT") == (3 if clustered else 0)
    assert ("SYNCS.ARRIVE.TRANS64.RED" in code) == clustered
    # q_buffers 2 or 3: O by TMA stores, one per panel of head_dim (a warpgroup's rows of a panel).
    panels = variant["head_dim"] // (64 if variant["head_dim"] % 64 == 0 else 32)
    assert found["UTMASTG"] == (panels if config["q_buffers"] >= 2 else 0)
    assert not sass.has_local_memory(code)
    assert (binary.spill_stores, binary.spill_loads, binary.stack_bytes) == (0, 0, 0)
    # ptxas found nothing to serialize: no wgmma.wait_group of its own (C7517) either.
    assert "(C75" not in binary.log, binary.log
    # The reported count is the launch-bound share (65536 / threads), not the setmaxnreg budgets.
    assert binary.registers <= 65536 // (128 * (config["block_m"] // 64 + 1))


PV_WAIT = [(v, c) for v, c in BUILDS if c["pv_wait"]]


@pytest.mark.parametrize("variant, config", PV_WAIT, ids=[f"{v.slug}-{c.slug}" for v, c in PV_WAIT])
def test_pv_wait_keeps_the_softmax_beside_the_previous_p_v(built, variant, config):
    """With pv_wait 1 the wait for the previous block's P V comes after the block's exp2s (each
    thread's block_n / 2 scores), not before them, where ptxas (NVRTC 13.0 and 13.5) places it
    otherwise: the softmax overlaps that GEMM, as the overlapped schedules mean it to."""
    _, code = built[render.render(SPEC, variant, config).name]
    assert sass.exps_beside_wgmma(code) >= config["block_n"] // 2


# ---- every shipped tuned config: what flash_attn_func and the mods run on an H200 ----------------

def _shipped_forward_configs():
    """(spec, variant, config) of every entry of the shipped tuning table for this family and the
    mods specs put onto it, each kernel once."""
    import json
    from pathlib import Path

    table = Path(__file__).resolve().parent.parent / "kernelgen" / "data" / "tuned_defaults.json"
    found = {}
    for entry in json.loads(table.read_text())["entries"]:
        child, _, onto = entry["spec"].partition("__")
        if entry["spec"] != SPEC.name and onto != SPEC.name:
            continue
        spec = load_spec(child, onto=onto or None)
        variant = next(v for v in spec.variants([entry["arch"]]) if v.slug == entry["variant"])
        config = spec.parse_config(entry["config"])
        found[(spec.name, variant.slug, config.slug)] = (spec, variant, config)
    return list(found.values())


SHIPPED = _shipped_forward_configs()


def test_every_shipped_tuned_config_compiles_clean():
    """The tuned table is what users run: a template change that makes one of its configs spill,
    serialize its wgmmas or stop compiling would slow them silently (the tuner dropped such configs
    when it measured; nothing rechecks them later). sum_mma's configs: P V as m64n72k16."""
    assert len(SHIPPED) > 20 and any(c["sum_mma"] for _, _, c in SHIPPED)

    problems = []
    for (_, _, config), (name, binary, code) in zip(SHIPPED, compile_all(SHIPPED)):
        if (binary.spill_stores, binary.spill_loads, binary.stack_bytes) != (0, 0, 0) \
                or sass.has_local_memory(code):
            problems.append(f"{name}: spills or local memory")
        if "(C75" in binary.log or "warning" in binary.log:  # (NVRTC's own too: a sign of a slip)
            problems.append(f"{name}: {binary.log}")
        pv = code.count("HGMMA.64x72x16")
        if (pv > 0) != bool(config["sum_mma"]):
            problems.append(f"{name}: {pv} m64n72 wgmmas with sum_mma {config['sum_mma']}")
    assert not problems, "\n".join(problems)


# ---- dispatch: which family flash_attn_func runs ------------------------------------------------

def test_the_forward_family_follows_the_gpu_unless_forced(monkeypatch):
    import torch

    from kernelgen import ops

    capabilities = {0: (9, 0), 1: (8, 0), 2: (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[device])
    monkeypatch.setattr(ops, "FORCED_FAMILY", None)
    monkeypatch.setattr(ops, "_FAMILY_OF_DEVICE", {})
    assert [ops.forward_family(d) for d in (0, 1, 2)] == ["sm90", "sm80", "sm80"]
    assert ops.forward_family(0, "sm80") == "sm80"
    monkeypatch.setattr(ops, "FORCED_FAMILY", "sm80")   # KERNELGEN_FORWARD=sm80
    assert ops.forward_family(0) == "sm80" and ops.forward_family(0, "sm90") == "sm90"
    with pytest.raises(RuntimeError, match="needs an sm_90 GPU"):
        ops.forward_family(1, "sm90")
    with pytest.raises(ValueError, match="KERNELGEN_FORWARD"):
        ops.forward_family(0, "sm100")


def test_tensor_maps_follow_the_kernel_tiles_and_the_operand_strides():
    import torch

    from kernelgen import hopper

    spec = load_spec("flash_attn_fwd_sm90")
    variant = spec.variant("sm_90a", head_dim=64, dtype="fp16", causal=True)

    class Kernel:
        def __init__(self, block_m, block_n, **more):
            self.spec, self.variant = spec, variant
            self.config = spec.parse_config({**spec.default_config(variant).as_dict(),
                                             "block_m": block_m, "block_n": block_n, **more})

    q = torch.randn(2, 100, 8, 64, dtype=torch.float16)
    kv = torch.randn(2, 8, 300, 64, dtype=torch.float16).transpose(1, 2)   # (b, s, h, d) view
    maps = hopper.tensor_maps(Kernel(192, 96), q, kv, kv)
    assert [m.box for m in maps[:3]] == [(64, 192, 1, 1, 1), (64, 96, 1, 1, 1), (64, 96, 1, 1, 1)]
    assert maps[0].strides == (8 * 64 * 2, 128, 64 * 2, 100 * 8 * 64 * 2)
    assert maps[1].strides == (64 * 2, 128, 300 * 64 * 2, 8 * 300 * 64 * 2)
    assert maps[1].dims == (64, 300, 1, 8, 2)
    assert maps[3] == bytes(tma.MAP_BYTES)   # q_buffers 1: O is stored by the threads
    empty = hopper.tensor_maps(Kernel(128, 128), q, kv[:, :0], kv[:, :0])
    assert empty == (bytes(tma.MAP_BYTES),) * 4
    # q_buffers 2 stores O by TMA: one panel of one warpgroup's 64 rows per box, in the layout of
    # the output every caller allocates (q's shape, contiguous), whatever q's strides are.
    strided_q = torch.randn(2, 8, 100, 64, dtype=torch.float16).transpose(1, 2)
    stored = hopper.tensor_maps(Kernel(128, 128, persistent=1, q_buffers=2), strided_q, kv, kv)[3]
    assert stored.box == (64, 64, 1, 1, 1) and stored.dims == (64, 100, 1, 8, 2)
    assert stored.strides == (8 * 64 * 2, 128, 64 * 2, 100 * 8 * 64 * 2)
    # q_split loads Q as each consumer warpgroup's 64 rows, a box per panel.
    split = hopper.tensor_maps(Kernel(192, 96, q_split=1), q, kv, kv)[0]
    assert split.box == (64, 64, 1, 1, 1) and split.strides == maps[0].strides


def test_counters_are_words_of_a_zeroed_buffer_handed_out_once(monkeypatch):
    """hopper.counter_address: each dynamic-schedule launch gets counter_words zero words of its
    (device, stream)'s buffer, 16-byte aligned, never handed out twice; a full buffer is replaced
    by a fresh zeroed one; another stream has its own; other configs get no counter (0)."""
    import types

    import torch

    from kernelgen import hopper

    monkeypatch.setattr(hopper, "_POOLS", {})
    monkeypatch.setattr(hopper, "POOL_WORDS", 64)
    dynamic = types.SimpleNamespace(config={"persistent": 2, "block_m": 128})
    q = torch.empty(1, 300, 2, 64, dtype=torch.bfloat16)   # 3 tiles x 2 heads: 4 + 6 words -> 12
    assert hopper.counter_address(types.SimpleNamespace(config={"persistent": 1}), q, 7) == (0, None)
    taken = [hopper.counter_address(dynamic, q, 7)[0] for _ in range(5)]   # 5 x 12 of 64 words
    first = hopper._POOLS[(None, 7)][0]
    assert taken == [first.data_ptr() + 48 * i for i in range(5)]
    taken.append(hopper.counter_address(dynamic, q, 7)[0])                # the 6th: a new buffer
    fresh = hopper._POOLS[(None, 7)]
    assert fresh[0] is not first and taken[5] == fresh[0].data_ptr() and fresh[1] == 12
    assert first.count_nonzero() == 0 and fresh[0].count_nonzero() == 0
    other, alive = hopper.counter_address(dynamic, q, 8)
    assert alive is None and other not in taken and len(hopper._POOLS) == 2
    big = torch.empty(4, 4096, 8, 64, dtype=torch.bfloat16)  # 4 + 1024 words: a buffer of 4 x that
    address, _ = hopper.counter_address(dynamic, big, 7)
    buffer = hopper._POOLS[(None, 7)][0]
    assert buffer.numel() == 4 * 1028 and buffer.data_ptr() == address


def test_a_cluster_loads_its_share_of_the_kv_panels():
    import torch

    from kernelgen import hopper

    for head_dim, panels in ((128, 1), (256, 2)):
        variant = SPEC.variant("sm_90a", head_dim=head_dim, dtype="bf16", causal=False)

        class Kernel:
            spec = SPEC

        Kernel.variant = variant
        Kernel.config = SPEC.parse_config({**SPEC.default_config(variant).as_dict(), "cluster": 2})
        assert not SPEC.violations(variant, Kernel.config)
        q = torch.randn(1, 300, 2, head_dim, dtype=torch.bfloat16)
        maps = hopper.tensor_maps(Kernel, q, q, q)
        assert maps[0].box[2] == head_dim // 64                    # Q: every panel, as before
        assert maps[1].box[2] == maps[2].box[2] == panels          # K, V: this CTA's half


def test_clusters_only_where_both_ctas_see_the_same_kv_blocks():
    def allowed(spec, head_dim, causal, **more):
        variant = spec.variant("sm_90a", head_dim=head_dim, dtype="bf16", causal=causal)
        config = spec.parse_config({**spec.default_config(variant).as_dict(), "cluster": 2,
                                    "persistent": 0, "q_buffers": 1, **more})
        return not spec.violations(variant, config)

    assert allowed(SPEC, 128, False) and allowed(SPEC, 256, False)
    assert not allowed(SPEC, 128, True)                  # causal: neighbours see other blocks
    assert not allowed(SPEC, 64, False) and not allowed(SPEC, 192, False)   # odd panel shares
    assert not allowed(SPEC, 128, False, persistent=1)
    for name, ok in (("flash_attn_softcap", True), ("flash_attn_alibi", True),
                     ("flash_attn_window", False), ("flash_attn_document", False)):
        assert allowed(load_spec(name, onto="flash_attn_fwd_sm90"), 128, False) == ok, name


def test_a_cluster_grid_rounds_the_query_tiles_up_to_whole_clusters():
    from kernelgen import api

    variant = SPEC.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    config = SPEC.parse_config({**SPEC.default_config(variant).as_dict(), "block_m": 128,
                                "cluster": 2})
    env = {**SPEC.environment(variant, config), "seqlen_q": 300, "heads": 3, "batch": 2}
    assert tuple(int(e(env)) for e in SPEC.grid) == (4, 3, 2)     # 3 tiles -> 2 clusters
    env["cluster"] = 1
    assert tuple(int(e(env)) for e in SPEC.grid) == (3, 3, 2)


def test_a_tune_key_with_a_default(write_spec):
    """tune.space KEY: {values: [...], default: v} may be left out of a config (spec.py)."""
    from kernelgen.spec import SpecError

    def optional(default):
        def mutate(doc):
            doc["tune"]["space"]["unroll"] = {"values": [1, 2], "default": default}
        return mutate

    toy = load_spec(write_spec(optional(2)))
    assert toy.parse_config({"block": 32, "warps": 4})["unroll"] == 2
    assert all(config["unroll"] == 2 for _, config in toy.defaults)
    assert {config["unroll"] for config in toy.configs()} == {1, 2}
    with pytest.raises(SpecError, match=r"tune.space.unroll.default: 3 is not among the values"):
        load_spec(write_spec(optional(3)))
    with pytest.raises(SpecError, match="config.warps: missing"):   # keys without one: required
        toy.parse_config({"block": 32})


def test_a_tune_key_added_later_may_be_left_out():
    """Configs from before q_buffers (shipped tuned defaults, tuning DBs, callers) mean 1."""
    old = {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1}
    assert SPEC.parse_config(old) == SPEC.parse_config({**old, "q_buffers": 1, "sum_mma": 0})
    assert dict(SPEC.space)["q_buffers"] == (1, 2, 3) and dict(SPEC.space)["sum_mma"] == (0, 1)
    variant = SPEC.variant(head_dim=128, dtype="bf16", causal=False)
    for config in SPEC.valid_configs(variant):   # a second Q buffer only for a persistent CTA
        assert config["q_buffers"] == 1 or (config["persistent"] and config["schedule"] > 0)
    fits = SPEC.parse_config({**old, "block_n": 160, "q_buffers": 2})
    assert not SPEC.violations(variant, fits)
    assert SPEC.violations(variant, SPEC.parse_config({**old, "block_n": 176, "q_buffers": 2}))
