"""One variant + one config -> CUDA source text, through the spec's Jinja template."""
from __future__ import annotations

import functools
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import jinja2

from kernelgen.spec import (REPO_ROOT, TEMPLATES_DIR, Config, KernelSpec, Variant, load_spec,
                            shipped_specs)

GENERATED_DIR = REPO_ROOT / "generated"
GENERATED_BY = "kernelgen render --generated"


class RenderError(ValueError):
    pass


@dataclass(frozen=True)
class Source:
    name: str  # readable only (file names, logs); caches key on the text
    text: str
    entry: str
    variant: Variant
    config: Config


@functools.lru_cache(maxsize=None)
def _jinja(search_path: tuple[Path, ...]) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(p) for p in search_path]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _template_line(exc: BaseException) -> str:
    # Jinja rewrites tracebacks so that template frames carry the template's file and line.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith(".j2")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "template"


def _context(spec: KernelSpec, variant: Variant, config: Config) -> dict:
    return {
        **spec.environment(variant, config),
        "arch": variant.arch,
        "entry": spec.entry,
        "args": spec.args,
        "signature": ", ".join(f"{a.ctype} {a.name}" for a in spec.args),
        "mods": spec.mods,
        "param_values": variant.params,
    }


RESUME_LINE = "#line KG_RESUME"


def _resume_lines(text: str, name: str) -> str:
    """A template emits `#line <n> "spec.yaml"` before a user expression (so NVRTC reports errors
    at the spec's line) and RESUME_LINE after it; this points the numbering back at the source."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == RESUME_LINE:
            lines[i] = f'#line {i + 2} "{name}.cu"'
    return "\n".join(lines)


def render(spec: KernelSpec, variant: Variant, config: Config) -> Source:
    search_path = (spec.template.parent, TEMPLATES_DIR)
    try:
        template = _jinja(search_path).get_template(spec.template.name)
        text = template.render(_context(spec, variant, config))
    except jinja2.TemplateNotFound as exc:
        raise RenderError(f"{spec.path}: template {exc.name} not found in "
                          f"{', '.join(map(str, search_path))}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise RenderError(f"{exc.filename}:{exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise RenderError(f"{_template_line(exc)}: {exc} "
                          f"(rendering {variant.slug} on {variant.arch}, {config.slug})") from None
    name = f"{spec.name}__{variant.slug}__{variant.arch}__{config.slug}"
    text = _resume_lines(text, name)
    return Source(name=name, text=text, entry=spec.entry, variant=variant, config=config)


def write_if_changed(path: Path, text: str) -> bool:
    # Unchanged files keep their mtime, so ninja and editors see no spurious change; the rename
    # means a reader never sees half a file.
    path = Path(path)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _generated_text(spec: KernelSpec, source: Source) -> str:
    try:
        spec_file = spec.path.relative_to(REPO_ROOT)
    except ValueError:
        spec_file = spec.path
    return (f"// Generated from {spec_file} by `{GENERATED_BY}`; do not edit.\n"
            f"// {source.name}\n{source.text}")


def render_generated(root: Path = GENERATED_DIR) -> list[Path]:
    """Render every variant of every shipped spec, default config on the spec's first arch."""
    written = []
    for spec in map(load_spec, shipped_specs()):
        directory = Path(root) / spec.name
        paths = set()
        for variant in spec.variants([spec.archs[0]]):
            source = render(spec, variant, spec.default_config(variant))
            path = directory / f"{variant.slug}.cu"
            write_if_changed(path, _generated_text(spec, source))
            paths.add(path)
        for stale in set(directory.glob("*.cu")) - paths:
            stale.unlink()
        written += sorted(paths)
    return written
