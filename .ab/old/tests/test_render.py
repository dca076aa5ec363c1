"""render.py: Jinja context, strictness, error locations, and generated/ staying current."""
from __future__ import annotations

import os

import pytest

from kernelgen.render import GENERATED_BY, GENERATED_DIR, RenderError, render, render_generated, \
    write_if_changed
from kernelgen.spec import load_spec

FWD = load_spec("flash_attn_fwd")
needs_fwd_template = pytest.mark.skipif(not FWD.template.is_file(),
                                        reason="templates/flash_attn_fwd.cu.j2 not written yet")


def _render_toy(write_spec, template=None, **params):
    spec = load_spec(write_spec(**({} if template is None else {"template": template})))
    variant = spec.variant(**params)
    return spec, render(spec, variant, spec.default_config(variant))


def test_toy_context(write_spec):
    spec, source = _render_toy(write_spec, width=32, flavor="spicy", fast=True)
    assert source.entry == "toy_kernel"
    assert source.name == "toy__width32_flavorspicy_fast1__sm_80__block32_warps8"
    assert 'extern "C" __global__ void toy_kernel(float* x, int n, float scale) {' in source.text
    assert "constexpr int kBlock = 32, kSmem = 8192;  // spicy sm_80" in source.text
    assert "#define TOY_FAST 1\n" in source.text and source.text.endswith("}\n")
    _, plain = _render_toy(write_spec, fast=False)
    assert "TOY_FAST" not in plain.text and "{%" not in plain.text


def test_undefined_name_is_an_error_with_its_line(write_spec):
    template = 'extern "C" __global__ void {{ entry }}() {\n  int a = {{ blocks }};\n}\n'
    with pytest.raises(RenderError, match=r"toy\.cu\.j2:2: 'blocks' is undefined"):
        _render_toy(write_spec, template)


def test_syntax_error_names_file_and_line(write_spec):
    with pytest.raises(RenderError, match=r"toy\.cu\.j2:3: .*"):
        _render_toy(write_spec, "a\n{% if fast %}\nb\n")


def test_missing_template(write_spec, tmp_path):
    spec = load_spec(write_spec(template=None))
    assert not spec.template.is_file()
    with pytest.raises(RenderError, match=r"toy\.yaml: template toy\.cu\.j2 not found in "):
        render(spec, spec.variant(), spec.default_config(spec.variant()))


def test_write_if_changed(tmp_path):
    path = tmp_path / "sub" / "a.cu"
    assert write_if_changed(path, "one\n") is True
    os.utime(path, ns=(1, 1))
    assert write_if_changed(path, "one\n") is False
    assert path.stat().st_mtime_ns == 1  # untouched
    assert write_if_changed(path, "two\n") is True and path.read_text() == "two\n"
    assert [p.name for p in path.parent.iterdir()] == ["a.cu"]  # no temp file left behind


@needs_fwd_template
def test_shipped_spec_renders(tmp_path):
    for variant in FWD.variants():
        source = render(FWD, variant, FWD.default_config(variant))
        assert 'extern "C"' in source.text and FWD.entry in source.text
        assert "{{" not in source.text and "{%" not in source.text


@needs_fwd_template
def test_generated_dir_is_current(tmp_path):
    paths = render_generated(tmp_path)
    produced = {p.relative_to(tmp_path): p.read_text() for p in paths}
    committed = {p.relative_to(GENERATED_DIR): p.read_text() for p in GENERATED_DIR.rglob("*.cu")}
    assert sum(1 for name in produced if name.parts[0] == "flash_attn_fwd") == 20
    assert produced.keys() == committed.keys(), f"generated/ is stale: run `{GENERATED_BY}`"
    stale = [str(name) for name in produced if produced[name] != committed[name]]
    assert not stale, f"generated/ is stale ({', '.join(stale)}): run `{GENERATED_BY}`"


@needs_fwd_template
def test_render_generated_header_and_stale_files(tmp_path):
    old = tmp_path / "flash_attn_fwd" / "head_dim32_dtypebf16_causal0.cu"
    old.parent.mkdir()
    old.write_text("// from an older spec\n")
    paths = render_generated(tmp_path)
    assert not old.exists()
    first = next(p for p in paths if p.parent.name == "flash_attn_fwd").read_text()
    assert first.startswith(f"// Generated from specs/flash_attn_fwd.yaml by `{GENERATED_BY}`")
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert render_generated(tmp_path) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps  # unchanged files are not rewritten
