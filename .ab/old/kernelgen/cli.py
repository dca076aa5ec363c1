"""`kernelgen list | check | render | build | bench | tune | cache`.

Only the spec and render stages are imported up front; build, bench, tune and cache are imported
when their command runs, so `kernelgen list` starts fast and never imports torch or CUDA.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from kernelgen.env import SettingsError
from kernelgen.expr import ExprError
from kernelgen.render import RenderError, render, render_generated, write_if_changed
from kernelgen.spec import ARCHS, KernelSpec, Param, SpecError, load_spec, shipped_specs

_BOOLS = {"true": True, "1": True, "false": False, "0": False}
# These commands own their flags: everything after the command name goes to their main().
_PASS_THROUGH = {"bench": "kernelgen.bench", "tune": "kernelgen.tune", "cache": "kernelgen.cache"}
_PASS_THROUGH_HELP = {
    "bench": "time kernelgen against SDPA and FlexAttention (--mods: the modifiers; "
             "--plot FILE.json: redraw the PNG without a GPU); see `kernelgen bench --help`",
}


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _values(param: Param) -> str:
    return ", ".join(f"[{_show(v)}]" if v == param.default and type(v) is type(param.default)
                     else _show(v) for v in param.values)


def cmd_list(args) -> int:
    for spec in map(load_spec, shipped_specs()):
        per_arch = len(spec.variants([spec.archs[0]]))
        print(f"{spec.name}: {spec.description}")
        print(f"  archs:    {', '.join(spec.archs)}")
        for param in spec.params:
            print(f"  {param.name + ':':<9} {_values(param)}")
        print(f"  variants: {per_arch} per arch, {per_arch * len(spec.archs)} in all")
    return 0


def _check_arch(spec: KernelSpec, arch: str) -> list[str]:
    problems = []
    print(f"  {arch} (max_smem {ARCHS[arch].max_smem}):")
    for variant in spec.variants([arch]):
        try:
            config = spec.default_config(variant)
            render(spec, variant, config)
        except (SpecError, ExprError, RenderError) as exc:
            problems.append(str(exc))
            print(f"    {variant.slug:<36} ERROR")
            continue
        valid, tuned = len(spec.valid_configs(variant)), len(spec.tuned_configs(variant))
        skipped = f", {valid - tuned} skipped by the tuner" if valid != tuned else ""
        print(f"    {variant.slug:<36} {config.slug}  ({valid} valid configs{skipped})")
    return problems


def cmd_check(args) -> int:
    spec = load_spec(args.spec)
    print(f"{spec.name}: {spec.path}")
    print(f"  template: {spec.template}{'' if spec.template.is_file() else '  (MISSING)'}")
    print(f"  hash:     {spec.content_hash[:16]}")
    print(f"  variants: {len(spec.variants([spec.archs[0]]))} per arch on {', '.join(spec.archs)}")
    print(f"  configs:  {len(spec.configs())} in the space, {len(spec.constraints)} constraints")
    print("  default config per variant (rendered to check the template):")
    problems = [p for arch in spec.archs for p in _check_arch(spec, arch)]
    if problems:
        # One template error usually fails every variant alike: show the first, count the rest.
        print(f"kernelgen: error: {len(problems)} variants fail; the first: {problems[0]}",
              file=sys.stderr)
    return 1 if problems else 0


def _assignments(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SpecError(f"{flag} {item!r}: expected NAME=VALUE")
        pairs[name.strip()] = value.strip()
    return pairs


def _param_value(spec: KernelSpec, name: str, text: str):
    # Parsed by the param's own type; membership is then checked by spec.variant().
    param = next((p for p in spec.params if p.name == name), None)
    if param is None or isinstance(param.default, str):
        return text
    if isinstance(param.default, bool):
        if text.lower() not in _BOOLS:
            raise SpecError(f"--set {name}={text}: not a boolean; allowed: true, false, 1, 0")
        return _BOOLS[text.lower()]
    return _integer(f"--set {name}", text)


def _integer(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecError(f"{flag}={text}: not an integer") from None


def cmd_render(args) -> int:
    if args.generated:
        if args.spec or args.set or args.config or args.output or args.arch:
            raise SpecError("render --generated takes no spec, --set, --config, --arch or -o")
        paths = render_generated()
        print(f"{len(paths)} files under generated/")
        return 0
    if not args.spec:
        raise SpecError("render: give a SPEC (name or path), or --generated")
    spec = load_spec(args.spec)
    params = {name: _param_value(spec, name, text)
              for name, text in _assignments(args.set, "--set").items()}
    variant = spec.variant(args.arch, **params)
    chosen = {name: _integer(f"--config {name}", text)
              for name, text in _assignments(args.config, "--config").items()}
    # Keys not given keep the variant's default config, so `--config stages=3` is enough.
    config = spec.parse_config({**spec.default_config(variant).as_dict(), **chosen})
    for problem in spec.violations(variant, config):
        print(f"kernelgen: warning: {config.slug} violates {problem!r}", file=sys.stderr)
    source = render(spec, variant, config)
    if args.output:
        write_if_changed(Path(args.output), source.text)
    else:
        sys.stdout.write(source.text)
    return 0


def _delegate(module_name: str, args) -> int:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # a dependency of the module is missing: a real error
            raise
        print(f"kernelgen: error: {module_name} is not available in this install", file=sys.stderr)
        return 2
    return module.main(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelgen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("list", help="shipped specs, their params and archs").set_defaults(run=cmd_list)

    check = sub.add_parser("check", help="validate a spec and show its default configs")
    check.add_argument("spec", help="shipped spec name or path to a .yaml file")
    check.set_defaults(run=cmd_check)

    rend = sub.add_parser("render", help="print the CUDA source of one variant and config")
    rend.add_argument("spec", nargs="?", help="shipped spec name or path to a .yaml file")
    rend.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE")
    rend.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                      help="tile config; keys not given keep the default config")
    rend.add_argument("--arch", choices=sorted(ARCHS), help="default: the spec's first arch")
    rend.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    rend.add_argument("--generated", action="store_true",
                      help="regenerate generated/ from every shipped spec")
    rend.set_defaults(run=cmd_render)

    build = sub.add_parser("build", help="render and compile shipped variants into the cache")
    build.add_argument("--arch", action="append", choices=sorted(ARCHS),
                       help="repeatable; default: every arch of each spec")
    build.add_argument("--out", metavar="DIR", help="write binaries here instead of the cache")
    build.add_argument("-j", "--jobs", type=int, metavar="N", help="parallel compiles")
    build.add_argument("--spec", action="append", metavar="NAME", help="repeatable; default: all")
    build.set_defaults(run=lambda args: _delegate("kernelgen.build", args))

    for name, module in _PASS_THROUGH.items():
        # add_help=False: `kernelgen bench --help` is answered by bench itself.
        help_text = _PASS_THROUGH_HELP.get(name, f"see `kernelgen {name} --help`")
        sub.add_parser(name, add_help=False, help=help_text).set_defaults(
            run=lambda args, module=module: _delegate(module, args.rest))
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    errors = [SpecError, ExprError, RenderError, SettingsError]
    # A CompileError can only have been raised if its module is loaded: no import needed here.
    compile_module = sys.modules.get("kernelgen.compile")
    if compile_module is not None and hasattr(compile_module, "CompileError"):
        errors.append(compile_module.CompileError)
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in _PASS_THROUGH and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kernelgen check x | head`: the reader went away; stop quietly, as Unix tools do, and
        # point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"kernelgen: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
