"""YAML spec -> frozen dataclasses.

Everything a spec says is checked here, once, so the later stages can trust a KernelSpec. Every
error names the file, the key path and what would have been allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernelgen.cexpr import CExpr, CExprError, check_cexpr, split_factor
from kernelgen.expr import RESERVED, Expr, ExprError, parse_expr

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECS_DIR = REPO_ROOT / "specs"
TEMPLATES_DIR = REPO_ROOT / "templates"


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class ArchInfo:
    name: str
    number: int
    max_smem: int  # bytes of shared memory one block may opt in to
    max_regs_per_thread: int


ARCHS = {
    info.name: info
    for info in (
        ArchInfo("sm_80", 80, 166912, 255),
        ArchInfo("sm_86", 86, 101376, 255),
        ArchInfo("sm_89", 89, 101376, 255),
        ArchInfo("sm_90", 90, 232448, 255),
        ArchInfo("sm_90a", 90, 232448, 255),
    )
}
ARG_CTYPES = {"ptr": "void*", "i32": "int", "i64": "long long", "f32": "float",
              # a TMA tensor map (128 bytes, 64-aligned), passed by value: see tma.cuh / tma.py
              "tmap": "const __grid_constant__ kg::TensorMap"}
# Names the environment and the template context define themselves (see render.py).
CONTEXT_NAMES = frozenset({"max_smem", "arch_number", "arch", "entry", "args", "signature", "mods",
                           "param_values", "sm_count", "kv_blocks_vary", "kv_ranged",
                           "block_sparse"})

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SLUG_TEXT = re.compile(r"[A-Za-z0-9_]+\Z")  # string param values end up in file names


@dataclass(frozen=True)
class Param:
    name: str
    values: tuple
    default: object


@dataclass(frozen=True)
class Arg:
    name: str
    type: str
    ctype: str
    # A tensor argument's shape in the problem's sizes (SHAPE_SIZES), checked before a launch:
    # a per-token tensor of the wrong size would be read past its end. () = not checked.
    shape: tuple[str, ...] = ()


SHAPE_SIZES = ("batch", "heads", "seqlen_q", "seqlen_k")


class _Pairs:
    """Lookup, dict view and file-name slug over a tuple of (name, value) pairs."""

    def _pairs(self) -> tuple[tuple[str, object], ...]:
        raise NotImplementedError

    def __getitem__(self, name: str):
        for key, value in self._pairs():
            if key == name:
                return value
        raise KeyError(name)

    def as_dict(self) -> dict:
        return dict(self._pairs())

    @property
    def slug(self) -> str:
        parts = [f"{key}{int(value) if isinstance(value, bool) else value}"
                 for key, value in self._pairs()]
        return "_".join(parts) or "default"


@dataclass(frozen=True)
class Variant(_Pairs):
    spec: str
    arch: str
    params: tuple[tuple[str, object], ...]

    def _pairs(self):
        return self.params


@dataclass(frozen=True)
class Config(_Pairs):
    values: tuple[tuple[str, int], ...]

    def _pairs(self):
        return self.values


@dataclass(frozen=True)
class _At:
    """Where a value sits, for error messages: `specs/x.yaml: tune.space.block_m[1]`."""

    file: str
    key: str = ""

    def __getitem__(self, key: str | int) -> _At:
        if isinstance(key, int):
            return _At(self.file, f"{self.key}[{key}]")
        return _At(self.file, f"{self.key}.{key}" if self.key else key)

    def __str__(self) -> str:
        return f"{self.file}: {self.key or '<top level>'}"

    def error(self, what: str, allowed: Iterable | str | None = None) -> SpecError:
        if allowed is not None and not isinstance(allowed, str):
            allowed = ", ".join(_show(a) for a in allowed) or "(none)"
        return SpecError(f"{self}: {what}" + ("" if allowed is None else f"; allowed: {allowed}"))


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _same(a, b) -> bool:
    # YAML and Python both treat True == 1; a spec value never does.
    return type(a) is type(b) and a == b


def _member(value, values) -> bool:
    return any(_same(value, v) for v in values)


# The variables each user C expression of `mods` may use (besides its args and the params).
MOD_CONTEXTS = {
    # score = softmax_scale * qk; an expression may start from the raw dot product qk instead,
    # so that a factor of its own folds into the scale (softcap: one multiply per score fewer).
    "score_mod": ("score", "qk", "softmax_scale", "batch", "head", "q_idx", "kv_idx", "seqlen_q",
                  "seqlen_k"),
    "score_mod_grad": ("score", "qk", "softmax_scale", "batch", "head", "q_idx", "kv_idx",
                       "seqlen_q", "seqlen_k"),
    "mask_mod": ("batch", "head", "q_idx", "kv_idx", "seqlen_q", "seqlen_k"),
    "kv_range": ("q_first", "q_last", "batch", "head", "seqlen_q", "seqlen_k"),
    "score_bound": ("batch", "head"),
    "distance_slopes": ("batch", "head"),
}
DISTANCE_SLOPES_KEYS = ("before", "after")
KV_RANGE_KEYS = ("lo", "hi", "full_lo", "full_hi")
# load_spec(block_mask=True)'s name suffix: a spec's mods put on a block mask.
BLOCK_MASK_SUFFIX = "_bm"

# `mods.block_sparse: true` adds these kernel arguments after the mod args: a block mask's lists
# for the kernel's tile (kernelgen/blockmask.py). Row r = batch * bm_stride_b + head * bm_stride_h
# + block (a query block: forward and dQ kernels; a KV block: the backward's main kernel) has
# bm_num[r] partially visible blocks bm_idx[r * bm_width ...] and bm_full_num[r] fully visible
# ones bm_full_idx[r * bm_width ...], each list ascending.
BLOCK_SPARSE_ARGS = (
    Arg("bm_num", "ptr", "const int*"), Arg("bm_idx", "ptr", "const int*"),
    Arg("bm_full_num", "ptr", "const int*"), Arg("bm_full_idx", "ptr", "const int*"),
    Arg("bm_stride_b", "i32", "int"), Arg("bm_stride_h", "i32", "int"),
    Arg("bm_width", "i32", "int"),
    # The Hopper backward's launch order of KV tiles (BlockMask.tile_order); null elsewhere.
    Arg("bm_order", "ptr", "const int*"),
)


@dataclass(frozen=True)
class Mods:
    """Attention modifiers: C expressions the kernel applies (see docs/writing-specs.md).

    score_mod rewrites each scaled score; score_mod_grad is its derivative for the backward (a
    spec without one is forward-only); mask_mod says which (q_idx, kv_idx) are visible; kv_range
    (lo, hi, full_lo, full_hi), functions of a query tile's rows q_first..q_last, bound the keys
    that can be visible ([lo, hi): tiles outside are skipped) and those certainly visible
    ([full_lo, full_hi): tiles inside skip the per-element mask)."""
    score_mod: CExpr | None = None
    score_mod_grad: CExpr | None = None
    mask_mod: CExpr | None = None
    kv_range: tuple[CExpr, ...] | None = None
    args: tuple = ()  # the Args the mods introduce (also appended to the spec's args)
    # block_sparse: the kernel visits only the KV (or query) blocks a runtime block mask lists,
    # and evaluates mask_mod only in the partially visible ones; its list arguments
    # (BLOCK_SPARSE_ARGS) follow `args` in the spec's args.
    block_sparse: bool = False
    # kv_range.exact: for a single row (q_first = q_last = i) [lo, hi) is exactly the keys
    # mask_mod shows row i, so the Hopper forward masks partially visible tiles with two
    # compares per score against each row's bounds instead of evaluating mask_mod.
    exact_range: bool = False
    # score_bound: B (a function of the mod args, batch and head) with |score_mod(s)| <= B for
    # every score (softcap's cap). The Hopper forward then subtracts B where the online softmax
    # subtracts each row's running max, when exp(-2 B) stays in the 16-bit type's normal range:
    # no row max, no rescale of O (PERF_NOTES §41). Otherwise the online softmax, as without it.
    score_bound: CExpr | None = None
    # distance_slopes (before, after): functions of the mod args, batch and head with
    # score_mod(s) = s + slope * d for the key's distance d = kv_idx - q_idx - (seqlen_k -
    # seqlen_q) from the diagonal, slope `before` where d <= 0 and `after` where d >= 0 (ALiBi:
    # slopes[head] and -slopes[head]). The Hopper forward then adds one value per key column on
    # a block wholly on one side of its rows' diagonal, and takes the rows' terms out of the
    # softmax (back into the LSE), instead of evaluating score_mod per score (PERF_NOTES §45).
    # Elsewhere (blocks across the diagonal, the other kernels) score_mod runs as it is.
    distance_slopes: tuple[CExpr, CExpr] | None = None

    @property
    def any(self) -> bool:
        return bool(self.score_mod or self.mask_mod or self.kv_range or self.block_sparse)

    @property
    def score_factor(self) -> tuple[CExpr, CExpr] | None:
        """(factor, inner) of a bounded score_mod that is a product factor * inner whose factor
        reads no score or index (softcap's `softcap * tanh_approx(...)`: the cap), else None. The
        Hopper forward's bounded softmax, P = exp2(score_mod * log2e - B * log2e), then computes
        only `inner` per score and takes the factor into the exp2's scale once per tile: one
        multiply a score fewer (PERF_NOTES §106). The other kernels run score_mod as it is."""
        if self.score_mod is None or self.score_bound is None:
            return None
        return split_factor(self.score_mod, ("score", "qk", "q_idx", "kv_idx"))

    @property
    def clamps_indices(self) -> bool:
        """Whether a per-score expression may read memory at an address that depends on q_idx or
        kv_idx (a subscript naming one, or a tensor argument used as a pointer): the forwards
        then clamp the indices into the sequences, so that the padding rows and columns of a
        tile read in bounds. Otherwise (ALiBi's slopes[head], a window) they pass them as they
        are: a min per index and score fewer."""
        tensors = {a.name for a in self.args if a.type == "ptr"}
        return any(expr is not None and bool(tensors & expr.unsubscripted
                                             or {"q_idx", "kv_idx"} & expr.subscripted)
                   for expr in (self.score_mod, self.score_mod_grad, self.mask_mod))

    @property
    def range_reads_memory(self) -> bool:
        """Whether a kv_range bound reads a tensor argument: the Hopper forward's exact path, which
        evaluates the range at each of a tile's rows (padding rows past seqlen_q too), then clamps
        those rows into the sequence (per-token bounds, say). The other callers evaluate it at
        rows inside the sequence."""
        tensors = {a.name for a in self.args if a.type == "ptr"}
        return bool(self.kv_range) and any(tensors & bound.names for bound in self.kv_range)

    @property
    def block_args(self) -> tuple:
        return BLOCK_SPARSE_ARGS if self.block_sparse else ()

    @property
    def members(self) -> tuple:
        """The Mods struct's runtime members, in kernel-argument order: args, then block_args."""
        return self.args + self.block_args


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    entry: str
    path: Path
    template: Path
    archs: tuple[str, ...]
    params: tuple[Param, ...]
    args: tuple[Arg, ...]
    derived: tuple[tuple[str, Expr], ...]
    space: tuple[tuple[str, tuple[int, ...]], ...]
    constraints: tuple[Expr, ...]
    defaults: tuple[tuple[Expr, Config], ...]
    grid: tuple[Expr, Expr, Expr]
    block: tuple[Expr, Expr, Expr]
    smem: Expr
    content_hash: str
    mods: Mods = Mods()
    # Tune keys a config may leave out, and the value that stands for them: a key added to a
    # space later (tuned defaults, tuning DBs and callers' configs written before it lack it).
    space_defaults: tuple[tuple[str, int], ...] = ()
    # tune.skip: valid configs the tuner does not try (a way not yet measured, say); a caller's
    # explicit config may still use them.
    skip: tuple[Expr, ...] = ()

    def _at(self, key: str = "") -> _At:
        return _At(_display(self.path), key)

    def variant(self, arch: str | None = None, **params) -> Variant:
        arch = self.archs[0] if arch is None else arch
        if arch not in self.archs:
            raise self._at("archs").error(f"arch {arch!r} is not one of this spec's archs",
                                          self.archs)
        known = [p.name for p in self.params]
        for name in params:
            if name not in known:
                raise self._at("params").error(f"unknown param {name!r}", known)
        chosen = []
        for param in self.params:
            value = params.get(param.name, param.default)
            if not _member(value, param.values):
                raise self._at(f"params.{param.name}").error(
                    f"value {value!r} is not allowed", param.values)
            chosen.append((param.name, value))
        return Variant(self.name, arch, tuple(chosen))

    def variants(self, archs: Iterable[str] | None = None) -> list[Variant]:
        names = [p.name for p in self.params]
        combos = list(itertools.product(*(p.values for p in self.params)))
        return [self.variant(arch, **dict(zip(names, combo)))
                for arch in (self.archs if archs is None else archs) for combo in combos]

    def configs(self) -> list[Config]:
        """Every point of the tune space, in YAML order; constraints not applied."""
        keys = [key for key, _ in self.space]
        return [Config(tuple(zip(keys, combo)))
                for combo in itertools.product(*(values for _, values in self.space))]

    def environment(self, variant: Variant, config: Config) -> dict:
        if variant.spec != self.name:
            raise SpecError(f"variant of spec {variant.spec!r} used with spec {self.name!r}")
        info = ARCHS[variant.arch]
        # kv_blocks_vary: whether the spec's mods make a query tile's KV blocks depend on its rows
        # beyond causal (a kv range, a block mask), for constraints on configs that need them equal;
        # kv_ranged: whether a kv range (not a block mask) decides them, for keys that only it reads;
        # block_sparse: whether a block mask does.
        env = {**dict(variant.params), **dict(config.values),
               "max_smem": info.max_smem, "arch_number": info.number,
               "kv_blocks_vary": bool(self.mods.kv_range or self.mods.block_sparse),
               "kv_ranged": bool(self.mods.kv_range and not self.mods.block_sparse),
               "block_sparse": bool(self.mods.block_sparse)}
        for name, expr in self.derived:  # in order: each may use the ones before it
            env[name] = expr(env)
        return env

    def violations(self, variant: Variant, config: Config) -> list[str]:
        return self._failing(self.environment(variant, config))

    def _failing(self, env: dict) -> list[str]:
        return [c.text for c in self.constraints if not c(env)]

    def valid_configs(self, variant: Variant) -> list[Config]:
        return [c for c in self.configs() if not self.violations(variant, c)]

    def tuned_configs(self, variant: Variant) -> list[Config]:
        """The valid configs the tuner searches: those no `tune.skip` condition holds for."""
        return [c for c in self.valid_configs(variant)
                if not any(e(self.environment(variant, c)) for e in self.skip)]

    def default_config(self, variant: Variant) -> Config:
        for when, config in self.defaults:
            env = self.environment(variant, config)
            if when(env) and not self._failing(env):
                return config
        for config in self.configs():
            if not self.violations(variant, config):
                return config
        raise self._at("tune").error(
            f"no config of the tune space fits {variant.slug} on {variant.arch} "
            f"(max_smem {ARCHS[variant.arch].max_smem}); constraints: "
            + "; ".join(c.text for c in self.constraints))

    def parse_config(self, values: Mapping) -> Config:
        return _config(self.space, values, self._at("config"), self.space_defaults)


# ---- loading ------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """safe_load, but a key given twice is an error instead of silently keeping the last one."""


def _unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            continue  # construct_mapping reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _display(path: Path) -> str:
    for base in (Path.cwd(), REPO_ROOT):
        try:
            return str(path.relative_to(base))
        except ValueError:
            pass
    return str(path)


def _kind(value) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping", type(None): "nothing (null)"}
    return f"{kinds.get(type(value), type(value).__name__)} ({_show(value)!s:.40})"


def _keys(value, at: _At, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    value = _mapping(value, at)
    for key in value:
        if key not in required + optional:
            raise at[key].error("unknown key", required + optional)
    for key in required:
        if key not in value:
            raise at[key].error("missing required key")
    return value


def _mapping(value, at: _At) -> dict:
    if not isinstance(value, dict):
        raise at.error(f"expected a mapping, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str):
            raise at.error(f"key {key!r} is {_kind(key)}, not a name")
    return value


def _list(value, at: _At, *, nonempty: bool = True) -> list:
    if not isinstance(value, list):
        raise at.error(f"expected a list, got {_kind(value)}")
    if nonempty and not value:
        raise at.error("empty list; give at least one value")
    return value


def _string(value, at: _At) -> str:
    if not isinstance(value, str):
        raise at.error(f"expected a string, got {_kind(value)}")
    return value


def _identifier(value, at: _At) -> str:
    if not (isinstance(value, str) and _IDENTIFIER.match(value)):
        raise at.error(f"expected an identifier, got {_kind(value)}", "letters, digits and _")
    return value


def _integer(value, at: _At) -> int:
    if type(value) is not int:
        raise at.error(f"expected an integer, got {_kind(value)}")
    return value


class _Names:
    """Every name a spec defines, so that none is defined twice or shadows a built-in one."""

    def __init__(self):
        self.defined: dict[str, _At] = {}

    def define(self, name: str, at: _At) -> str:
        if name in RESERVED or name in CONTEXT_NAMES:
            raise at.error(f"{name!r} is a reserved name", "any other identifier")
        if name in self.defined:
            raise at.error(f"{name!r} is already defined at {self.defined[name].key}")
        self.defined[name] = at
        return name


def _formula(value, at: _At, allowed: Iterable[str]) -> Expr:
    if type(value) is int:  # `block: [128, 1, 1]` reads as numbers
        value = str(value)
    if not isinstance(value, str):
        raise at.error(f"expected an expression in a string, got {_kind(value)}")
    try:
        expr = parse_expr(value, where=str(at))
    except ExprError as exc:
        raise SpecError(str(exc)) from None
    unknown = sorted(expr.names - set(allowed))
    if unknown:
        raise at.error(f"unknown name {unknown[0]!r} in {expr.text!r}", sorted(allowed))
    return expr


def _param(name: str, value, at: _At) -> Param:
    body = _keys(value, at, ("values",), ("default",))
    values = _list(body["values"], at["values"])
    for i, v in enumerate(values):
        if type(v) not in (int, bool, str) or (isinstance(v, str) and not _SLUG_TEXT.match(v)):
            raise at["values"][i].error(f"{_kind(v)} is not a param value",
                                        "integers, booleans, strings of letters, digits and _")
        if type(v) is not type(values[0]):
            raise at["values"][i].error(f"{_kind(v)} mixed with {_kind(values[0])}",
                                        "values of one type")
        if _member(v, values[:i]):
            raise at["values"][i].error(f"value {_show(v)} is given twice")
    default = body.get("default", values[0])
    if not _member(default, values):
        raise at["default"].error(f"{_kind(default)} is not among the values", values)
    return Param(name, tuple(values), default)


def _arg(value, at: _At) -> Arg:
    body = _keys(value, at, ("name", "type"), ("ctype", "shape"))
    kind = body["type"]
    if not isinstance(kind, str) or kind not in ARG_CTYPES:
        raise at["type"].error(f"unknown arg type {kind!r}", ARG_CTYPES)
    ctype = _string(body.get("ctype", ARG_CTYPES[kind]), at["ctype"])
    shape = tuple(_list(body.get("shape", []), at["shape"], nonempty=False))
    if shape and kind != "ptr":
        raise at["shape"].error("only a tensor (type ptr) has a shape")
    for i, size in enumerate(shape):
        if size not in SHAPE_SIZES:
            raise at["shape"][i].error(f"unknown size {size!r}", SHAPE_SIZES)
    return Arg(_identifier(body["name"], at["name"]), kind, ctype, shape)


def _space_values(value, at: _At) -> tuple[tuple[int, ...], int | None]:
    """A key's values, and the value a config that omits it means: a list must be given in every
    config; {values: [...], default: v} may be left out (v stands for it)."""
    body = _keys(value, at, ("values", "default")) if isinstance(value, dict) else None
    values_at = at["values"] if body else at
    values = [_integer(v, values_at[i])
              for i, v in enumerate(_list(body["values"] if body else value, values_at))]
    for i, v in enumerate(values):
        if v in values[:i]:
            raise values_at[i].error(f"value {v} is given twice")
    if body is None:
        return tuple(values), None
    default = _integer(body["default"], at["default"])
    if default not in values:
        raise at["default"].error(f"{default} is not among the values", values)
    return tuple(values), default


def _config(space, values, at: _At, defaults=()) -> Config:
    values = _mapping(values, at)
    ranges = dict(space)
    for key in values:
        if key not in ranges:
            raise at[key].error("not a key of the tune space", ranges)
    values = {**dict(defaults), **values}
    chosen = []
    for key, allowed in space:
        if key not in values:
            raise at[key].error("missing; a config gives every key of the tune space")
        if not _member(values[key], allowed):
            raise at[key].error(f"{_kind(values[key])} is not in the tune space", allowed)
        chosen.append((key, values[key]))
    return Config(tuple(chosen))


def _triple(value, at: _At, allowed: Iterable[str]) -> tuple[Expr, Expr, Expr]:
    items = _list(value, at)
    if len(items) != 3:
        raise at.error(f"expected a list of 3 expressions (x, y, z), got {len(items)}")
    return tuple(_formula(v, at[i], allowed) for i, v in enumerate(items))


def _template_path(value, spec_path: Path, name: str, at: _At) -> Path:
    # A user's spec may keep its template beside it; shipped specs pair with templates/<name>.cu.j2.
    # A template that does not exist yet is reported by render, so a spec can be checked first.
    relative = Path(_string(value, at) if value is not None else f"{name}.cu.j2")
    candidates = [spec_path.parent / relative, TEMPLATES_DIR / relative]
    return next((c for c in candidates if c.is_file()), candidates[-1]).resolve()


def _archs(value, at: _At) -> tuple[str, ...]:
    archs = _list(value, at)
    for i, arch in enumerate(archs):
        if not isinstance(arch, str) or arch not in ARCHS:
            raise at[i].error(f"unknown arch {arch!r}", ARCHS)
        if arch in archs[:i]:
            raise at[i].error(f"arch {arch} is given twice")
    return tuple(archs)


def _read_yaml(text: bytes, at: _At) -> dict:
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        raise SpecError(f"{at.file}: {where}: {getattr(exc, 'problem', None) or exc}") from None
    return _keys(doc, at, ("name", "entry", "archs", "params", "args", "tune", "launch"),
                 ("description", "derived", "template", "mods"))


def _extended(text: bytes, path: Path, at: _At, seen: tuple[Path, ...] = (),
              onto: str | None = None, block_mask: bool = False) -> tuple[dict, bytes]:
    """The spec's top-level mapping with `extends:` resolved, and the bytes its hash covers.

    The child's keys replace the base's, except `params`, `derived` and `tune`, which are merged
    one level deep (the child adds or redefines entries: `tune: {defaults: [...]}` keeps the
    base's space and constraints). The base's template is kept unless the child names one.
    `onto`: extend that spec instead of the one named (see load_spec), without the child's
    `tune` (written for the other base's space), under the name `<child>__<onto>`; the child's
    `onto: {<base name>: {tune: ...}}` section for that base, if any, gives the tune instead.
    `block_mask`: the child's mods with `block_sparse: true` (see load_spec), under the name
    `<child>_bm` where its own mods are not block-sparse already."""
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return _read_yaml(text, at), text  # _read_yaml reports the error with its line
    if not isinstance(doc, dict) or "extends" not in doc:
        if onto is not None or block_mask:
            raise at.error(f"only a spec that extends another can be put onto "
                           f"{onto or 'a block mask'!r}", "a spec with `extends:`")
        return _read_yaml(text, at), text
    base_name = doc.pop("extends")
    sections = _mapping(doc.pop("onto", {}), at["onto"])
    for base_key, section in sections.items():
        _keys(section, at["onto"][base_key], (), ("tune",))
    if block_mask:
        mods = doc.get("mods")
        if not isinstance(mods, dict) or "mask_mod" not in mods:
            raise at.error("only a spec with a mods.mask_mod can run on a block mask",
                           "mods.mask_mod")
        if mods.get("block_sparse") is not True:
            doc["mods"] = {**mods, "block_sparse": True}
            doc["name"] = f"{doc.get('name')}{BLOCK_MASK_SUFFIX}"
            text = text + b"\0block_sparse"   # the hash tells the two apart
    if onto is not None:
        base_name = onto
        doc.pop("tune", None)
        doc.update(sections.get(Path(onto).stem, {}))
        doc["name"] = f"{doc.get('name')}__{Path(onto).stem}"
    if not isinstance(base_name, str):
        raise at["extends"].error(f"expected a spec name or path, got {_kind(base_name)}")
    relative = path.parent / base_name
    try:
        base_path = _locate(relative if relative.suffix in (".yaml", ".yml") and relative.is_file()
                            else base_name)
    except SpecError as exc:
        raise at["extends"].error(str(exc)) from None
    if base_path in seen or base_path == path:
        raise at["extends"].error(f"{base_name!r} extends itself (a cycle)")
    base, base_bytes = _extended(base_path.read_bytes(), base_path, _At(_display(base_path)),
                                 (*seen, path))
    merged = dict(base)
    for key, value in doc.items():
        if key in ("params", "derived", "tune") and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = {**base[key], **value}
        else:
            merged[key] = value
    if "template" not in doc:
        merged["template"] = str(_template_path(base.get("template"), base_path, base["name"],
                                                at["template"]))
    merged.pop("mods", None) if "mods" not in doc else None
    child = _read_yaml(yaml.safe_dump(merged, sort_keys=False).encode(), at)
    return child, base_bytes + b"\0" + text


def _yaml_lines(text: bytes, *keys: str) -> int:
    """1-based line of the value at mapping path `keys` in a YAML document (0 if not found)."""
    node = yaml.compose(text, Loader=_Loader)
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            return 0
        node = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
        if node is None:
            return 0
    return node.start_mark.line + 1


def _mods(value, text: bytes, at: _At, names: _Names, params) -> Mods:
    body = _keys(value, at, (), ("args", "block_sparse", *MOD_CONTEXTS))
    args = tuple(_arg(v, at["args"][i])
                 for i, v in enumerate(_list(body.get("args", []), at["args"], nonempty=False)))
    for i, arg in enumerate(args):
        names.define(arg.name, at["args"][i]["name"])
    visible = {a.name for a in args} | {p.name for p in params}

    def check(key: str, text_value, *path: str) -> CExpr:
        try:
            return check_cexpr(text_value, where=str(at[".".join(path)]), file=at.file,
                               line=_yaml_lines(text, "mods", *path),
                               names=visible | set(MOD_CONTEXTS[key]))
        except CExprError as exc:
            raise SpecError(str(exc)) from None

    found = {k: check(k, body[k], k) for k in ("score_mod", "score_mod_grad", "mask_mod",
                                                "score_bound") if k in body}
    if "score_mod_grad" in found and "score_mod" not in found:
        raise at["score_mod_grad"].error("a derivative without a score_mod")
    if "score_bound" in found and "score_mod" not in found:
        raise at["score_bound"].error("a bound on the scores of a score_mod; this spec has none")
    slopes = None
    if "distance_slopes" in body:
        given = _keys(body["distance_slopes"], at["distance_slopes"], DISTANCE_SLOPES_KEYS)
        slopes = tuple(check("distance_slopes", given[k], "distance_slopes", k)
                       for k in DISTANCE_SLOPES_KEYS)
        if "score_mod" not in found:
            raise at["distance_slopes"].error("the slopes of a score_mod's bias; this spec has none")
        if "score_bound" in found:
            raise at["distance_slopes"].error("a score_mod with a score_bound subtracts the bound, "
                                              "not a max the slopes could shift; give one of the two")
    kv_range, exact = None, False
    if "kv_range" in body:
        bounds = _keys(body["kv_range"], at["kv_range"], KV_RANGE_KEYS, ("exact",))
        kv_range = tuple(check("kv_range", bounds[k], "kv_range", k) for k in KV_RANGE_KEYS)
        exact = bounds.get("exact", False)
        if not isinstance(exact, bool):
            raise at["kv_range"]["exact"].error(f"expected true or false, got {_kind(exact)}")
        if exact and "mask_mod" not in found:
            raise at["kv_range"]["exact"].error("an exact range stands for a mask_mod; this spec "
                                                "has none")
    block_sparse = body.get("block_sparse", False)
    if not isinstance(block_sparse, bool):
        raise at["block_sparse"].error(f"expected true or false, got {_kind(block_sparse)}")
    if block_sparse and "mask_mod" not in found:
        raise at["block_sparse"].error("a block mask classifies a mask_mod; this spec has none",
                                       "block_sparse with a mask_mod")
    if block_sparse:
        for arg in BLOCK_SPARSE_ARGS:
            names.define(arg.name, at["block_sparse"])
    return Mods(found.get("score_mod"), found.get("score_mod_grad"), found.get("mask_mod"),
                kv_range, args, block_sparse, exact, found.get("score_bound"), slopes)


def _derived(value, at: _At, names: _Names) -> tuple[tuple[str, Expr], ...]:
    derived = []
    for key, text in _mapping(value, at).items():
        # Only the names defined so far: derived values are computed in order.
        expr = _formula(text, at[key], [*names.defined, "max_smem", "arch_number"])
        derived.append((names.define(key, at[key]), expr))
    return tuple(derived)


def _rules(tune: dict, at: _At, space, known: list[str], space_defaults=()):
    constraints = _list(tune.get("constraints", []), at["constraints"], nonempty=False)
    constraints = tuple(_formula(v, at["constraints"][i], known) for i, v in enumerate(constraints))
    skip = _list(tune.get("skip", []), at["skip"], nonempty=False)
    skip = tuple(_formula(v, at["skip"][i], known) for i, v in enumerate(skip))
    defaults = []
    for i, rule in enumerate(_list(tune.get("defaults", []), at["defaults"], nonempty=False)):
        rule_at = at["defaults"][i]
        rule = _keys(rule, rule_at, ("config",), ("when",))
        defaults.append((_formula(rule.get("when", "true"), rule_at["when"], known),
                         _config(space, rule["config"], rule_at["config"], space_defaults)))
    return constraints, tuple(defaults), skip


# Known only when launching, on the device at hand: grid expressions may use it (a persistent
# kernel launches one CTA per SM), block and smem may not (they are fixed per compiled kernel).
GRID_NAMES = ("sm_count",)


def _launch(value, at: _At, names: list[str]) -> tuple:
    launch = _keys(value, at, ("grid", "block"), ("smem",))
    return (_triple(launch["grid"], at["grid"], [*names, *GRID_NAMES]),
            _triple(launch["block"], at["block"], names),
            _formula(launch.get("smem", "0"), at["smem"], names))


def _parse(path: Path, text: bytes, onto: str | None = None,
           block_mask: bool = False) -> KernelSpec:
    at = _At(_display(path))
    top, hashed = _extended(text, path, at, onto=onto, block_mask=block_mask)
    name = _identifier(top["name"], at["name"])
    names = _Names()
    params = tuple(_param(names.define(key, at["params"][key]), value, at["params"][key])
                   for key, value in _mapping(top["params"], at["params"]).items())
    tune = _keys(top["tune"], at["tune"], ("space",), ("constraints", "defaults", "skip"))
    space_at = at["tune"]["space"]
    keys = {names.define(key, space_at[key]): _space_values(values, space_at[key])
            for key, values in _mapping(tune["space"], space_at).items()}
    space = tuple((key, values) for key, (values, _) in keys.items())
    space_defaults = tuple((key, default) for key, (_, default) in keys.items()
                           if default is not None)
    derived = _derived(top.get("derived", {}), at["derived"], names)
    known = [*names.defined, "max_smem", "arch_number", "kv_blocks_vary", "kv_ranged",
             "block_sparse"]
    constraints, defaults, skip = _rules(tune, at["tune"], space, known, space_defaults)

    args = _list(top["args"], at["args"], nonempty=False)
    args = tuple(_arg(v, at["args"][i]) for i, v in enumerate(args))
    for i, arg in enumerate(args):
        names.define(arg.name, at["args"][i]["name"])
    mods = _mods(top["mods"], text, at["mods"], names, params) if "mods" in top else Mods()
    if onto is not None and Path(onto).stem == "block_mask":
        # The classify kernel (templates/block_mask.yaml) evaluates the mask: it takes no lists.
        mods = dataclasses.replace(mods, block_sparse=False)
    args = args + mods.members
    # Launch geometry may also depend on the runtime scalars (a grid over seqlen_q, say).
    grid, block, smem = _launch(top["launch"], at["launch"],
                                known + [a.name for a in args if a.type != "ptr"])

    template = _template_path(top.get("template"), path, name, at["template"])
    digest = hashlib.sha256(hashed)
    digest.update(b"\0" + (template.read_bytes() if template.is_file() else b""))
    return KernelSpec(
        name=name, description=_string(top.get("description", ""), at["description"]),
        entry=_identifier(top["entry"], at["entry"]), path=path, template=template,
        archs=_archs(top["archs"], at["archs"]), params=params, args=args, derived=derived,
        space=space, constraints=constraints, defaults=defaults, grid=grid, block=block,
        smem=smem, content_hash=digest.hexdigest(), mods=mods, space_defaults=space_defaults,
        skip=skip,
    )


def shipped_specs() -> list[str]:
    return sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))


def _locate(spec: str | Path) -> Path:
    text = str(spec)
    if isinstance(spec, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpecError(f"{text}: no such spec file")
        return path.resolve()
    path = SPECS_DIR / f"{text}.yaml"
    if not path.is_file():
        shipped = ", ".join(shipped_specs()) or "(none shipped)"
        raise SpecError(f"unknown spec {text!r}; allowed: {shipped}, or a path to a .yaml file")
    return path.resolve()


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


_loaded: dict[tuple[Path, str | None, bool], tuple[tuple, KernelSpec]] = {}


def load_spec(spec: str | Path, onto: str | None = None, block_mask: bool = False) -> KernelSpec:
    """The spec of a shipped name or a .yaml path. `onto`: a spec that extends one base (a mods
    spec extending flash_attn_fwd, say) put onto another base instead (flash_attn_bwd: the same
    mods in the backward; flash_attn_fwd_sm90: in the Hopper forward), with that base's tune
    space and defaults, named `<spec>__<onto>`; its expressions keep their file and lines.
    `block_mask`: the spec's mods with `block_sparse: true`, named `<spec>_bm` (`<spec>_bm__<onto>`)
    unless its file says so already: a kv range's backward runs on a block mask built from its
    ranges (attention.py; PERF_NOTES §109)."""
    path = _locate(spec)
    key = (path, onto, block_mask)
    cached = _loaded.get(key)
    # The template is part of content_hash, so an edit to either one reloads.
    if cached and cached[0] == (_stamp(path), _stamp(cached[1].template)):
        return cached[1]
    stamp = _stamp(path)  # before reading: an edit during the read then reloads next time
    loaded = _parse(path, path.read_bytes(), onto, block_mask)
    _loaded[key] = ((stamp, _stamp(loaded.template)), loaded)
    return loaded


def load_named(name: str) -> KernelSpec:
    """The spec a loaded spec's name stands for (`<spec>[_bm][__<onto>]`, as load_spec names
    them), for the tuning DB's rows."""
    child, _, onto = name.partition("__")
    try:
        return load_spec(child, onto=onto or None)
    except SpecError:
        if not child.endswith(BLOCK_MASK_SUFFIX):
            raise
    return load_spec(child[:-len(BLOCK_MASK_SUFFIX)], onto=onto or None, block_mask=True)
