"""The pytest marks of a test file's tests, read from its source (nothing imported or run).

A PR's Test Plan lists a pytest command per hardware level (``-m "core_model and cpu"``, ...);
a command whose ``-m`` expression selects none of the PR's tests makes pytest exit 5, so the
text lists only the levels its test files have tests of. The marks are read from the syntax
tree: the module's ``pytestmark``, a test class's decorators and ``pytestmark``, a test
function's decorators, and the ``marks=`` of its ``pytest.param`` parametrizations. Marks a
conftest adds at collection are not seen (this project's test files mark every test in the file).
"""

from __future__ import annotations

import ast

__all__ = ["expression_selects", "file_marks", "levels_with_tests"]


def _mark_name(node: ast.expr) -> str | None:
    """``pytest.mark.cuda`` or ``pytest.mark.skipif(...)`` -> ``cuda`` / ``skipif``; else None."""
    if isinstance(node, ast.Call):
        node = node.func
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


def _marks_of(value: ast.expr) -> set[str]:
    """The mark names of a ``pytestmark`` value (one mark, or a list or tuple of them)."""
    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return {name for item in items if (name := _mark_name(item))}


def _pytestmark(body: list[ast.stmt]) -> set[str]:
    out: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            out |= _marks_of(stmt.value)
    return out


def _param_marks(decorator: ast.expr) -> list[set[str]]:
    """The ``marks=`` of each ``pytest.param`` of a ``parametrize`` decorator that gives some."""
    out = []
    if isinstance(decorator, ast.Call) and _mark_name(decorator) == "parametrize":
        for node in ast.walk(decorator):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "param"
            ):
                for kw in node.keywords:
                    if kw.arg == "marks":
                        out.append(_marks_of(kw.value))
    return out


def _function_variants(fn: ast.FunctionDef | ast.AsyncFunctionDef, base: set[str]) -> list[frozenset[str]]:
    marks = set(base)
    extra: list[set[str]] = []
    for decorator in fn.decorator_list:
        if name := _mark_name(decorator):
            marks.add(name)
        extra += _param_marks(decorator)
    return [frozenset(marks)] + [frozenset(marks | e) for e in extra]


def file_marks(source: str) -> list[frozenset[str]]:
    """The mark names of each test of ``source`` (one set per test function, and one more per
    ``pytest.param`` with ``marks=``), in file order; ``[]`` when the file has no test."""
    tree = ast.parse(source)
    module = _pytestmark(tree.body)
    out: list[frozenset[str]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            out += _function_variants(node, module)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls = module | _pytestmark(node.body) | {n for d in node.decorator_list if (n := _mark_name(d))}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    out += _function_variants(item, cls)
    return out


def expression_selects(expression: str, marks: frozenset[str]) -> bool:
    """Whether a ``-m`` expression of mark names joined by ``and`` selects a test with ``marks``.

    Raises:
        ValueError: ``expression`` uses ``or``, ``not`` or parentheses (the Test Plan's levels
            are conjunctions; a richer expression needs pytest's own evaluator).
    """
    words = expression.split()
    names = words[::2]
    if not names or any(w != "and" for w in words[1::2]) or {"or", "not"} & set(names) or "(" in expression:
        raise ValueError(f"-m {expression!r} is not mark names joined by 'and'")
    return all(name in marks for name in names)


def levels_with_tests(expressions: tuple[str, ...], sources: list[str]) -> tuple[str, ...]:
    """The ``-m`` expressions of ``expressions`` that select at least one test of ``sources``."""
    tests = [marks for source in sources for marks in file_marks(source)]
    return tuple(e for e in expressions if any(expression_selects(e, marks) for marks in tests))
