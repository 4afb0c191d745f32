# SPDX-License-Identifier: Apache-2.0
"""Docstring and comment lines as a share of all lines: ``python tools/doc_ratio.py [FILE|DIR ...]``."""

import ast
import io
import sys
import tokenize
from pathlib import Path


def doc_lines(source: str) -> tuple[int, int]:
    """``(docstring or comment-only lines, all lines)`` of one module's ``source``."""
    marked: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                marked.update(range(first.lineno, first.end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
            marked.add(tok.start[0])
    return len(marked), len(source.splitlines())


def main(args: list[str]) -> None:
    paths = [Path(a) for a in args] or [Path("vllm_omni")]
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    total_doc = total = 0
    for f in files:
        doc, lines = doc_lines(f.read_text())
        total_doc, total = total_doc + doc, total + lines
        print(f"{doc / max(lines, 1):6.1%} {doc:5d}/{lines:5d} {f}")
    print(f"{total_doc / max(total, 1):6.1%} {total_doc:5d}/{total:5d} total")


if __name__ == "__main__":
    main(sys.argv[1:])
