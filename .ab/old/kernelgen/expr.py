"""The formulas of a spec: constraints, derived values and launch geometry.

A formula is a restricted Python expression. Its syntax tree is checked against a whitelist before
it is compiled, and it runs with no builtins, so a spec can compute but never call into Python.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import CodeType


class ExprError(ValueError):
    pass


def cdiv(a, b):
    return -(-a // b)


FUNCTIONS = {"cdiv": cdiv, "min": min, "max": max, "abs": abs}
CONSTANTS = {"true": True, "false": False}
# Names a spec may not give to its own params, config keys or derived values.
RESERVED = frozenset(FUNCTIONS) | frozenset(CONSTANTS)

_GLOBALS = {"__builtins__": {}, **FUNCTIONS, **CONSTANTS}
_OPERATORS = (
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.UAdd, ast.USub, ast.Not, ast.And, ast.Or,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
)
_NODES = (
    ast.Expression, ast.Constant, ast.Name, ast.Load, ast.BinOp, ast.UnaryOp, ast.BoolOp,
    ast.Compare, ast.IfExp, ast.Call, *_OPERATORS,
)
_ALLOWED_SYNTAX = "numbers, names, + - * / // % **, comparisons, and/or/not, x if c else y, " \
                  "calls of " + ", ".join(FUNCTIONS)


@dataclass(frozen=True)
class Expr:
    text: str
    names: frozenset[str]
    where: str = field(default="", compare=False, repr=False)
    code: CodeType | None = field(default=None, compare=False, repr=False)

    def __call__(self, env: Mapping[str, object]) -> object:
        try:
            return eval(self.code, _GLOBALS, env)  # noqa: S307 - whitelisted tree, no builtins
        except NameError as exc:
            raise ExprError(f"{self.where}: {exc.name!r} has no value in {self.text!r}; "
                            f"known: {', '.join(sorted(env))}") from None
        except (ArithmeticError, TypeError, ValueError) as exc:
            raise ExprError(f"{self.where}: {self.text!r} failed: {exc}") from None


def _reject(node: ast.AST, text: str, where: str, what: str) -> ExprError:
    construct = ast.get_source_segment(text, node) or type(node).__name__
    return ExprError(f"{where}: {what} {construct!r} in {text!r}; allowed: {_ALLOWED_SYNTAX}")


def _check(tree: ast.Expression, text: str, where: str) -> frozenset[str]:
    names, called = set(), set()
    for node in ast.walk(tree):  # parents before children: a Call is seen before its callee
        if not isinstance(node, _NODES):
            raise _reject(node, text, where, f"{type(node).__name__.lower()} not allowed:")
        if isinstance(node, ast.Constant) and type(node.value) not in (int, float, bool):
            raise _reject(node, text, where, "only numbers are allowed as constants, not")
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
                raise _reject(node.func, text, where, "call of")
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise _reject(node, text, where, "only positional arguments are allowed:")
            called.add(id(node.func))
        if isinstance(node, ast.Name):
            if node.id.startswith("_"):
                raise _reject(node, text, where, "names starting with '_' are not allowed:")
            if id(node) not in called and node.id not in CONSTANTS:
                names.add(node.id)
    return frozenset(names)


def parse_expr(text: str, *, where: str) -> Expr:
    if not isinstance(text, str) or not text.strip():
        raise ExprError(f"{where}: expected a non-empty expression, got {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"{where}: syntax error in {text!r}: {exc.msg}") from None
    names = _check(tree, text.strip(), where)
    code = compile(tree, f"<{where}>", "eval")
    return Expr(text=text.strip(), names=names, where=where, code=code)
