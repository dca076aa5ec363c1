"""cli.py: every command through main([...]), exit codes and one-line errors."""
from __future__ import annotations

import re
import sys
import types

import pytest

from kernelgen.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "flash_attn_fwd:" in out
    assert "head_dim: 64, 96, [128], 192, 256" in out and "causal:   [false], true" in out
    assert "archs:    sm_80, sm_86, sm_89, sm_90" in out
    assert "variants: 20 per arch, 80 in all" in out


def test_check_toy(write_spec, capsys):
    assert main(["check", str(write_spec())]) == 0
    out = capsys.readouterr().out
    assert "variants: 12 per arch on sm_80, sm_86" in out
    assert "configs:  6 in the space, 3 constraints" in out
    assert re.search(r"width32_flavorplain_fast0 +block16_warps4  \(4 valid configs\)", out)


def test_check_reports_spec_errors_in_one_line(write_spec, capsys):
    path = write_spec(lambda doc: doc["archs"].append("sm_99"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"kernelgen: error: {path}: archs[2]: unknown arch 'sm_99'; allowed: " \
                  "sm_80, sm_86, sm_89, sm_90, sm_90a\n"


def test_check_reports_template_errors(write_spec, capsys):
    path = write_spec(template="{{ entry }} {{ missing_name }}\n")
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out
    assert captured.err.startswith("kernelgen: error: 24 variants fail; the first: ")
    assert captured.err.count("\n") == 1
    assert "toy.cu.j2:1: 'missing_name' is undefined" in captured.err


def test_check_unknown_spec(capsys):
    assert main(["check", "nope"]) == 1
    assert "unknown spec 'nope'; allowed: " in capsys.readouterr().err


def test_render_with_set_and_config(write_spec, capsys, tmp_path):
    args = ["render", str(write_spec()), "--set", "width=256", "--set", "fast=true",
            "--set", "flavor=spicy", "--arch", "sm_86", "--config", "warps=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # The default for this variant on sm_86 is block=32, warps=8; --config changes only warps.
    assert "constexpr int kBlock = 32," in out and "spicy sm_86" in out and "TOY_FAST" in out
    out_file = tmp_path / "out.cu"
    assert main([*args, "-o", str(out_file)]) == 0
    assert out_file.read_text() == out


def test_render_warns_on_violated_constraint(write_spec, capsys):
    assert main(["render", str(write_spec()), "--set", "width=32", "--config", "block=64"]) == 0
    assert "warning: block64_warps4 violates 'block <= width'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--set", "width=48"], "params.width: value 48 is not allowed; allowed: 32, 64, 256"),
    (["--set", "fast=maybe"], "--set fast=maybe: not a boolean; allowed: true, false, 1, 0"),
    (["--set", "width=wide"], "--set width=wide: not an integer"),
    (["--set", "colour=red"], "params: unknown param 'colour'; allowed: width, flavor, fast"),
    (["--set", "width"], "--set 'width': expected NAME=VALUE"),
    (["--config", "block=48"], "config.block: an integer (48) is not in the tune space"),
    (["--config", "tiles=2"], "config.tiles: not a key of the tune space"),
])
def test_render_errors(write_spec, capsys, args, message):
    assert main(["render", str(write_spec()), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kernelgen: error: ") and message in err and err.count("\n") == 1


def test_render_needs_a_spec_or_generated(capsys):
    assert main(["render"]) == 1
    assert "give a SPEC" in capsys.readouterr().err
    assert main(["render", "flash_attn_fwd", "--generated"]) == 1


def test_bad_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["list", "--bogus"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["render", "flash_attn_fwd", "--arch", "sm_75"])


@pytest.fixture
def fake_module(monkeypatch):
    def install(name):
        module = types.ModuleType(name)
        module.calls = []
        module.main = lambda args: module.calls.append(args) or 3
        monkeypatch.setitem(sys.modules, name, module)
        return module
    return install


def test_build_delegates_parsed_options(fake_module):
    build = fake_module("kernelgen.build")
    assert main(["build", "--arch", "sm_80", "--arch", "sm_90a", "-j", "4", "--spec", "x"]) == 3
    (args,) = build.calls
    assert (args.arch, args.jobs, args.spec, args.out) == (["sm_80", "sm_90a"], 4, ["x"], None)


@pytest.mark.parametrize("command", ["bench", "tune", "cache"])
def test_pass_through_commands_own_their_flags(fake_module, command):
    module = fake_module(f"kernelgen.{command}")
    assert main([command, "--quick", "--out", "dir", "--help"]) == 3
    assert module.calls == [["--quick", "--out", "dir", "--help"]]


def test_missing_delegate_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kernelgen.tune", None)  # import raises ModuleNotFoundError
    assert main(["tune"]) == 2
    assert capsys.readouterr().err == \
        "kernelgen: error: kernelgen.tune is not available in this install\n"


def test_compile_errors_are_user_errors(fake_module, capsys, monkeypatch):
    compile_module = types.ModuleType("kernelgen.compile")

    class CompileError(RuntimeError):
        pass

    compile_module.CompileError = CompileError
    monkeypatch.setitem(sys.modules, "kernelgen.compile", compile_module)
    def fail(args):
        raise CompileError("toy.cu(3): error: bad")

    fake_module("kernelgen.build").main = fail
    assert main(["build"]) == 1
    assert capsys.readouterr().err == "kernelgen: error: toy.cu(3): error: bad\n"


def test_other_exceptions_keep_their_traceback(fake_module):
    build = fake_module("kernelgen.build")
    build.main = lambda args: 1 / 0
    with pytest.raises(ZeroDivisionError):
        main(["build"])
