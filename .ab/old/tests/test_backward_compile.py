"""The backward kernels without a GPU: every shipped default variant of the three backward specs
compiles clean (no spills, no stack, tensor cores in the SASS) on the archs whose shared-memory
limits pick different defaults, and flash_attn_backward rejects a bad dout before anything runs.

`cache_dir` (conftest.py): a fresh KERNELGEN_CACHE_DIR with every switch off.
"""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from kernelgen import backward, build, sass
from kernelgen.spec import ARCHS, load_spec

SPECS = [backward.PREP_SPEC, backward.MAIN_SPEC, backward.DQ_SPEC]


@pytest.mark.parametrize("name", SPECS)
def test_every_variant_has_a_default_on_every_arch(name):
    spec = load_spec(name)
    for variant in spec.variants():
        config = spec.default_config(variant)
        assert not spec.violations(variant, config)
        assert spec.environment(variant, config).get("smem_bytes", 0) <= ARCHS[variant.arch].max_smem


def test_defaults_compile_clean(cache_dir, tmp_path, capfd):
    # sm_86 stands for sm_89 too (same shared-memory limit, so the same defaults).
    archs = ["sm_80", "sm_86", "sm_90"]
    code = build.main(argparse.Namespace(arch=archs, spec=SPECS, out=str(tmp_path),
                                         jobs=os.cpu_count()))
    output = capfd.readouterr()
    assert code == 0, output.out + output.err
    stamps = sorted((tmp_path / "build" / "stamps").glob("*.json"))
    expected = sum(len(load_spec(name).variants(archs)) for name in SPECS)
    assert len(stamps) == expected
    problems = []
    for stamp in stamps:
        record = json.loads(stamp.read_text())
        code_text = sass.sass((tmp_path / f"{record['name']}.cubin").read_bytes())
        if record["spill_stores"] or record["spill_loads"] or record["stack_bytes"]:
            problems.append(f"{record['name']}: spills {record['spill_stores']}/{record['spill_loads']}, "
                            f"stack {record['stack_bytes']}")
        if sass.has_local_memory(code_text):
            problems.append(f"{record['name']}: local memory in the SASS")
        if not sass.count(code_text, "HMMA"):
            problems.append(f"{record['name']}: no HMMA in the SASS")
    assert not problems, "\n".join(problems)


# ---- bad input to flash_attn_backward (checked before any GPU is needed) ----------------------

def t(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def saved(batch=2, seqlen=8, heads=4, head_dim=64):
    q, k, v = t(batch, seqlen, heads, head_dim), t(batch, seqlen, 2, head_dim), t(batch, seqlen, 2, head_dim)
    return q, k, v, t(batch, seqlen, heads, head_dim), torch.zeros(batch, heads, seqlen)


@pytest.mark.parametrize(
    "dout, error, match",
    [
        ("dout", TypeError, "dout must be a torch.Tensor"),
        (t(2, 8, 4, 32), ValueError, r"dout must have the shape of out \(2, 8, 4, 64\), got \(2, 8, 4, 32\)"),
        (t(8, 4, 64), ValueError, "dout must have the shape of out"),
        (t(2, 8, 4, 64, dtype=torch.float16), TypeError, "dout must have the dtype of out"),
        (t(2, 8, 4, 64, dtype=torch.float32), TypeError, "dout must have the dtype of out"),
        (t(2, 8, 4, 64, device="meta"), ValueError, "dout is on meta but out is on cpu"),
    ],
)
def test_bad_dout(dout, error, match):
    q, k, v, out, lse = saved()
    with pytest.raises(error, match=match):
        backward.flash_attn_backward(dout, q, k, v, out, lse, False, 0.125)


def test_bad_saved_tensors():
    q, k, v, out, lse = saved()
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        backward.flash_attn_backward(out, q, k, v, out, lse[:, :2], False, 0.125)
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        backward.flash_attn_backward(out, q, k, v, out, lse.double(), False, 0.125)
    k3, v3 = (x[:, :, :1].expand(-1, -1, 3, -1) for x in (k, v))
    with pytest.raises(ValueError, match="q heads"):
        backward.flash_attn_backward(out, q, k3, v3, out, lse, False, 0.125)
    with pytest.raises(ValueError, match="out must match q"):
        backward.flash_attn_backward(out[:, :4], q, k, v, out[:, :4], lse, False, 0.125)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_no_gpu_is_a_clear_runtime_error():
    q, k, v, out, lse = saved()
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        backward.flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, True, 0.125)
