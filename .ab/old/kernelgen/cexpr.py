"""C expressions written in a spec (score_mod, mask_mod, ranges): checked before NVRTC sees them.

A spec is trusted like code, but a typo should be reported against the spec, not as a compiler
error deep in a generated file: every identifier an expression uses must be one it may use (a
variable of its context, a declared argument, a param, or a whitelisted math function), and
statements, strings and comments are refused. What passes is emitted under a `#line` directive,
so that NVRTC's own messages (type errors, say) also point at the spec's file and line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FUNCTIONS = frozenset({
    "tanhf", "tanh_approx", "expf", "exp2f", "logf", "log2f", "log1pf", "sqrtf", "rsqrtf", "powf", "fabsf",
    "fminf", "fmaxf", "floorf", "ceilf", "sinf", "cosf", "erff", "min", "max", "abs",
})
KEYWORDS = frozenset({"true", "false", "float", "int", "unsigned", "bool", "long"})

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fFuUlL]*|0[xX][0-9a-fA-F]+[uUlL]*)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>&&|\|\||==|!=|<=|>=|<<|>>|[-+*/%<>!&|^~?:()\[\],.])
""", re.VERBOSE)


class CExprError(ValueError):
    pass


@dataclass(frozen=True)
class CExpr:
    text: str
    file: str   # the spec file, for #line
    line: int   # 1-based line of the expression in that file
    # The variables it reads (not functions): a block mask of a mask_mod that never reads
    # `batch` (or `head`) is the same for every batch element (head), so it keeps one.
    names: frozenset = frozenset()
    # Names read inside a [...] subscript, and names read without one after them (a pointer
    # there is pointer arithmetic): where a per-token index can reach memory (Mods.clamps_indices).
    subscripted: frozenset = frozenset()
    unsubscripted: frozenset = frozenset()


def check_cexpr(text, *, where: str, file: str, line: int, names) -> CExpr:
    """`names`: the variables the expression may use. Raises CExprError naming `where`."""
    if not isinstance(text, str) or not text.strip():
        raise CExprError(f"{where}: expected a C expression in a string, got {text!r}")
    allowed = set(names)
    tokens = list(_tokens(text, where))
    depth = brackets = 0
    used, subscripted, unsubscripted = set(), set(), set()
    for i, (kind, value) in enumerate(tokens):
        if kind == "op":
            depth += {"(": 1, ")": -1}.get(value, 0)
            brackets += {"[": 1, "]": -1}.get(value, 0)
            if depth < 0:
                raise CExprError(f"{where}: unbalanced ')' in {text!r}")
        if kind != "name" or value in KEYWORDS:
            continue
        follows = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        after_dot = i > 0 and tokens[i - 1][1] == "."
        if after_dot:
            raise CExprError(f"{where}: member access ('.{value}') is not allowed in {text!r}")
        if follows == "(":
            if value not in FUNCTIONS:
                raise CExprError(f"{where}: function {value!r} may not be used in {text!r}; "
                                 f"allowed: {', '.join(sorted(FUNCTIONS))}")
        elif value not in allowed:
            raise CExprError(f"{where}: name {value!r} is not defined here (in {text!r}); "
                             f"allowed names: {', '.join(sorted(allowed))}")
        else:
            used.add(value)
            if brackets:
                subscripted.add(value)
            if follows != "[":
                unsubscripted.add(value)
    if depth:
        raise CExprError(f"{where}: unbalanced '(' in {text!r}")
    return CExpr(text.strip(), file, line, frozenset(used), frozenset(subscripted),
                 frozenset(unsubscripted))


def _tokens(text: str, where: str):
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise CExprError(f"{where}: unexpected {text[pos]!r} at column {pos + 1} of {text!r} "
                             "(an expression: no statements, strings or comments)")
        pos = match.end()
        if match.lastgroup != "space":
            yield match.lastgroup, match.group()


def split_factor(expr: CExpr, varying) -> tuple[CExpr, CExpr] | None:
    """expr as (factor, inner) with expr == factor * inner, where the factor reads none of the
    `varying` names, or None: expr must be a product at its top level (every operator outside
    parentheses and brackets a `*`), and some of its factors must read a varying name and some
    not. softcap's `softcap * tanh_approx(qk * c)` gives (`softcap`, `tanh_approx(qk * c)`): the
    Hopper forward multiplies the factor into its exp2's scale, once per tile, instead of into
    every score (flash_fwd_sm90.cuh, kFold). Both keep expr's file and line."""
    factors, start, depth = [], 0, 0
    for match in _TOKEN.finditer(expr.text):
        kind, value = match.lastgroup, match.group()
        if kind != "op":
            continue
        if value in "([":
            depth += 1
        elif value in ")]":
            depth -= 1
        elif depth == 0:
            if value != "*":
                return None
            factors.append(expr.text[start:match.start()].strip())
            start = match.end()
    factors.append(expr.text[start:].strip())
    if len(factors) < 2 or not all(factors):
        return None

    def names(text: str) -> frozenset:
        return frozenset(m.group() for m in _TOKEN.finditer(text)
                         if m.lastgroup == "name") & expr.names

    varying = frozenset(varying)
    uniform = [f for f in factors if not names(f) & varying]
    rest = [f for f in factors if names(f) & varying]
    if not uniform or not rest:
        return None

    def part(texts: list[str]) -> CExpr:
        text = " * ".join(f"({t})" for t in texts) if len(texts) > 1 else texts[0]
        used = frozenset().union(*map(names, texts))
        return CExpr(text, expr.file, expr.line, used, expr.subscripted & used,
                     expr.unsubscripted & used)
    return part(uniform), part(rest)
