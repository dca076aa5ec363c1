"""expr.py: the whitelist, free names and evaluation of spec formulas."""
from __future__ import annotations

import pytest

from kernelgen.expr import ExprError, parse_expr

WHERE = "specs/toy.yaml: tune.constraints[0]"


@pytest.mark.parametrize("text, env, value", [
    ("cdiv(n, 64)", {"n": 129}, 3),
    ("cdiv(n, 64)", {"n": 128}, 2),
    ("max(a, b) - min(a, b) + abs(-a)", {"a": 3, "b": 10}, 10),
    ("a // 4 * 4 + a % 4 + 2 ** 3 / 2", {"a": 7}, 11.0),
    ("(block_m + 2 * stages * block_n) * (head_dim * 2 + 16)",
     {"block_m": 128, "block_n": 64, "stages": 2, "head_dim": 128}, 104448),
    ("x if causal else y", {"x": 1, "y": 2, "causal": False}, 2),
    ("true and not false", {}, True),
    ("a < b <= c and (a == 1 or a != 1)", {"a": 1, "b": 2, "c": 2}, True),
    ("dtype_bytes >= 2", {"dtype_bytes": 2}, True),
])
def test_evaluates(text, env, value):
    result = parse_expr(text, where=WHERE)(env)
    assert result == value and type(result) is type(value)


def test_free_names_exclude_functions_and_constants():
    expr = parse_expr("cdiv(seqlen, block) if true else max(a, false)", where=WHERE)
    assert expr.names == {"seqlen", "block", "a"}
    assert expr.text == "cdiv(seqlen, block) if true else max(a, false)"


def test_compiled_once_and_reused():
    expr = parse_expr("a + 1", where=WHERE)
    code = expr.code
    assert [expr({"a": i}) for i in range(3)] == [1, 2, 3]
    assert expr.code is code


@pytest.mark.parametrize("text, construct", [
    ("__import__('os')", "__import__"),
    ("a.real", "attribute"),
    ("(lambda: 1)()", "lambda"),
    ("a[0]", "subscript"),
    ("'text'", "'text'"),
    ("[x for x in a]", "listcomp"),
    ("open('f')", "open"),
    ("min(a, key=b)", "positional"),
    ("min(*a)", "positional"),
    ("_hidden + 1", "_hidden"),
    ("__builtins__", "__builtins__"),
    ("(a := 1)", "namedexpr"),
    ("a & b", "bitand"),
])
def test_rejects(text, construct):
    with pytest.raises(ExprError) as info:
        parse_expr(text, where=WHERE)
    message = str(info.value)
    assert message.startswith(WHERE) and construct in message and text in message
    assert "allowed:" in message


@pytest.mark.parametrize("text", ["a +", "", "   ", "if a"])
def test_syntax_errors(text):
    with pytest.raises(ExprError, match="tune.constraints"):
        parse_expr(text, where=WHERE)


def test_runs_without_builtins():
    # `len` is a builtin everywhere else; here it is just an unknown name.
    expr = parse_expr("len", where=WHERE)
    assert expr.names == {"len"}
    with pytest.raises(ExprError, match="'len' has no value"):
        expr({})


def test_evaluation_errors_name_the_place():
    with pytest.raises(ExprError, match=r"tune.constraints\[0\].*'a // b' failed"):
        parse_expr("a // b", where=WHERE)({"a": 1, "b": 0})
    with pytest.raises(ExprError, match=r"'missing' has no value.*known: a"):
        parse_expr("a + missing", where=WHERE)({"a": 1})
