"""compile.py: NVRTC to CUBIN and the ptxas resource report (CPU only: NVRTC needs no GPU).

`cache_dir` (conftest.py): a fresh KERNELGEN_CACHE_DIR with every switch off.
"""
from __future__ import annotations

import pytest

from kernelgen import compile as compiler
from kernelgen import env, sass

MMA_KERNEL = r"""
#include <cuda_bf16.h>
extern "C" __global__ void mma_probe(const __nv_bfloat16* a, float* out) {
    __shared__ float staging[256];
    unsigned A[4] = {threadIdx.x, 1u, 2u, 3u}, B[2] = {4u, 5u};
    float C[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(C[0]), "+f"(C[1]), "+f"(C[2]), "+f"(C[3])
                 : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));
    staging[threadIdx.x] = C[0] + __bfloat162float(a[threadIdx.x]);
    __syncthreads();
    out[threadIdx.x] = staging[255 - threadIdx.x] + C[1];
}
"""

# A runtime-indexed array cannot live in registers: ptxas puts it on the stack (local memory).
STACK_KERNEL = r"""
extern "C" __global__ void stack_probe(const float* x, float* y, int n) {
    float table[256];
    for (int i = 0; i < 256; ++i) table[i] = x[i * n + threadIdx.x];
    y[threadIdx.x] = table[(n * 7 + threadIdx.x) & 255];
}
"""

SPILLING_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'helper_user' for 'sm_80'
ptxas info    : Function properties for helper
ptxas         .     24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for helper_user
ptxas         .     40 bytes stack frame, 36 bytes spill stores, 44 bytes spill loads
ptxas warning : Registers are spilled to local memory in function 'helper_user', 36 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 368 bytes cmem[0]
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiles_to_cubin_with_resources(cache_dir, arch):
    binary = compiler.compile_source(MMA_KERNEL, "mma_probe_test", "mma_probe", arch)
    assert binary.cubin.startswith(b"\x7fELF")
    assert binary.arch == arch and binary.entry == "mma_probe"
    assert 0 < binary.registers <= 255
    assert binary.static_smem == 256 * 4
    assert (binary.spill_stores, binary.spill_loads, binary.stack_bytes) == (0, 0, 0)
    assert f"for '{arch}'" in binary.log
    code = sass.sass(binary.cubin)
    assert sass.count(code, "HMMA") >= 1
    assert not sass.has_local_memory(code)
    # cuobjdump agrees on registers (its SHARED adds the 1 KiB sm_90 reserves per block).
    assert f"REG:{binary.registers} " in sass.resource_usage(binary.cubin)


def test_options_follow_the_contract():
    options = compiler.nvrtc_options("sm_90a")
    assert options[0] == "-arch=sm_90a"
    for expected in ("-std=c++17", "-default-device", "--ptxas-options=--verbose",
                     "--ptxas-options=--warn-on-spills", "-lineinfo", "-DKERNELGEN=1"):
        assert expected in options
    # Without it a hit in NVRTC's own cache (GPU machines only) returns a log with no resources.
    assert ("--no-cache" in options) == (compiler.nvrtc_version() >= (12, 9))
    includes = [o[2:] for o in options if o.startswith("-I")]
    assert includes[0] == str(compiler.TEMPLATE_INCLUDE_DIR)
    assert any(path.endswith("include") for path in includes[1:])
    with pytest.raises(ValueError):
        compiler.nvrtc_options("compute_90")


def test_cuda_home_wins(monkeypatch, tmp_path):
    (tmp_path / "include" / "cccl").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert compiler.cuda_include_dirs() == [tmp_path / "include", tmp_path / "include" / "cccl"]


def test_syntax_error_raises_with_log_and_source(cache_dir):
    broken = "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }\n"
    with pytest.raises(compiler.CompileError) as caught:
        compiler.compile_source(broken, "broken_kernel", "broken", "sm_80")
    error = caught.value
    assert error.name == "broken_kernel"
    assert error.source_path is not None and error.source_path.read_text() == broken
    assert error.source_path.with_suffix(".log").exists()
    assert "undeclared_name" in error.log
    assert "-arch=sm_80" in error.options
    shown = str(error)
    assert "broken_kernel" in shown and str(error.source_path) in shown and "undeclared_name" in shown


def test_recompiling_reports_resources_again(cache_dir):
    first = compiler.compile_source(MMA_KERNEL, "again", "mma_probe", "sm_80")
    second = compiler.compile_source(MMA_KERNEL, "again", "mma_probe", "sm_80")
    assert second.registers == first.registers > 0


def test_wrong_entry_name_is_an_error(cache_dir):
    with pytest.raises(compiler.CompileError, match="not found in the ptxas log"):
        compiler.compile_source(MMA_KERNEL, "mma_probe_test", "not_the_entry", "sm_80")


def test_long_names_keep_distinct_source_files(cache_dir):
    """A mods spec's variant name passes 220 characters; two that differ only at the end (the
    last tune key) must not share a dumped source file."""
    base = "flash_attn_softcap__flash_attn_fwd_sm90__head_dim128__" + "key0_" * 30
    paths = {compiler.source_path(base + tail) for tail in ("carry_qk0", "carry_qk1")}
    assert len(paths) == 2
    assert all(len(p.name) <= 200 for p in paths)
    assert compiler.source_path("short_name").name == "short_name.cu"


def test_dump_sources_writes_successful_sources(cache_dir, monkeypatch):
    monkeypatch.setenv("KERNELGEN_DUMP_SOURCES", "1")
    env.reload_settings()
    compiler.compile_source(MMA_KERNEL, "dumped", "mma_probe", "sm_80")
    assert (cache_dir / "sources" / "dumped.cu").read_text() == MMA_KERNEL


def test_no_compile_refuses(cache_dir, monkeypatch):
    monkeypatch.setenv("KERNELGEN_NO_COMPILE", "1")
    env.reload_settings()
    with pytest.raises(compiler.CompileError, match="compilation disabled"):
        compiler.compile_source(MMA_KERNEL, "refused", "mma_probe", "sm_80")


def test_stack_array_reports_local_memory(cache_dir):
    binary = compiler.compile_source(STACK_KERNEL, "stack_probe", "stack_probe", "sm_80")
    assert binary.stack_bytes >= 256 * 4
    assert sass.has_local_memory(sass.sass(binary.cubin))


def test_spill_fields_parse_for_the_entry_only():
    resources = compiler.parse_ptxas_log(SPILLING_LOG, "helper_user")
    assert resources == compiler.Resources(registers=255, spill_stores=36, spill_loads=44,
                                           stack_bytes=40, static_smem=16384)
    other = compiler.parse_ptxas_log(SPILLING_LOG, "other")
    assert other == compiler.Resources(registers=32, spill_stores=0, spill_loads=0,
                                       stack_bytes=0, static_smem=0)
    assert compiler.parse_ptxas_log(SPILLING_LOG, "missing") is None


@pytest.mark.parametrize("code", ["C7508", "C7510", "C7515", "C7520", "C7599"])
def test_degrading_ptxas_warning_fails(cache_dir, monkeypatch, code):
    canned = SPILLING_LOG.replace("other", "mma_probe") + (
        f"ptxas warning : ({code}) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to the presence of Extern calls in the function 'mma_probe'.\n")
    monkeypatch.setattr(compiler, "_run_nvrtc", lambda text, program, options: (True, canned, b"\x7fELF"))
    with pytest.raises(compiler.CompileError, match=code) as caught:
        compiler.compile_source(MMA_KERNEL, "degraded", "mma_probe", "sm_90a")
    assert caught.value.source_path.exists()
    assert code in str(caught.value)


def test_benign_ptxas_warning_passes(cache_dir, monkeypatch):
    canned = SPILLING_LOG.replace("other", "mma_probe") + (
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 120 by compiler to "
        "allow use of registers in GMMA in function 'mma_probe'\n")
    monkeypatch.setattr(compiler, "_run_nvrtc", lambda text, program, options: (True, canned, b"\x7fELF"))
    assert compiler.compile_source(MMA_KERNEL, "fine", "mma_probe", "sm_90a").registers == 32


def test_long_logs_are_trimmed_in_the_message():
    error = compiler.CompileError("failed", log="\n".join(f"error {i}" for i in range(500)), name="n")
    shown = str(error).splitlines()
    assert len(shown) < 50 and "more lines" in shown[-1]


def test_nvrtc_version():
    major, minor = compiler.nvrtc_version()
    assert major >= 12 and minor >= 0


# ---- the Hopper backward (flash_attn_bwd_sm90): every shipped variant's SASS -------------------
# tests/test_build.py compiles every shipped variant and checks spills and tensor ops; this checks
# the structure of the warp-specialized wgmma kernel (stages 3 too, which no default uses).

def _bwd_sm90_builds():
    from kernelgen.spec import load_spec

    spec = load_spec("flash_attn_bwd_sm90")
    builds = [(v, spec.default_config(v)) for v in spec.variants()]
    builds += [(v, spec.parse_config({**c.as_dict(), "stages": 3})) for v, c in builds
               if v["dtype"] == "bf16"]
    return spec, builds


@pytest.mark.parametrize("index", range(len(_bwd_sm90_builds()[1])))
def test_bwd_sm90_sass(cache_dir, index):
    from kernelgen import render

    spec, builds = _bwd_sm90_builds()
    variant, config = builds[index]
    assert not spec.violations(variant, config)
    source = render.render(spec, variant, config)
    binary = compiler.compile_source(source.text, source.name, source.entry, variant.arch)
    found = sass.mnemonics(sass.sass(binary.cubin))
    head_dim, block_m, block_n = variant["head_dim"], config["block_m"], config["block_n"]
    # S^T and dP^T: head_dim / 16 steps each; dV and dK: block_m / 16 each; dQ: block_n / 16.
    # Causal (not at head dim 96): the diagonal pair peeled after the loop, once in full and once
    # with dQ alone (the warpgroup that sees none of it: kBwdPeelDiagonal).
    pair = 2 * head_dim // 16 + 2 * block_m // 16 + block_n // 16
    peeled = variant["causal"] and head_dim != 96
    assert found["HGMMA"] == (2 * pair + block_n // 16 if peeled else pair)
    assert found["USETMAXREG"] == 2        # the producer's dec and the consumers' inc
    assert found["UTMALDG"] == 4           # K and V once, Q and dO per ring slot
    # dQ by TMA reduce-adds (one per consumer's buffer), not atomics, except at head dim 96.
    assert (found["UTMAREDG"] > 0, found["REDG"] > 0) == ((True, False) if head_dim != 96
                                                          else (False, True))
    assert found["LDL"] + found["STL"] == 0
    assert (binary.spill_stores, binary.spill_loads, binary.stack_bytes) == (0, 0, 0)
    assert "(C75" not in binary.log, binary.log
