"""The series fingerprint that ties a GPU run to the series it ran: its code and tests only.

``export --author`` re-exports the same change set under the contributor's name, and a reworded
message or an edited design page changes nothing a CUDA test observes; the GPU runs of the first
export must still count for it (:mod:`minicpmo_cg.export.gpuresults`), and a summary recorded with
the older fingerprint of the whole mbox must still count for an identical export.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from minicpmo_cg.export.gitseries import authored_series_fingerprint, series_fingerprint, tree_fingerprint
from minicpmo_cg.export.gpuresults import gpu_runs, pr_tree_fingerprints

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

AUTHORS = {
    "seed": ("From: Seed maintainers\n <maintainers@users.noreply.example>", "Seed maintainers <maintainers@users.noreply.example>"),
    "jane": ("From: Jane Contributor <jane@contributor.org>", "Jane Contributor <jane@contributor.org>"),
}  # fmt: skip


def _patch(path: Path, author: str, commit: str, subject: str = "add a.py", line: str = "+x = 1",
           page: str = "+# A page") -> Path:  # fmt: skip
    """One ``git format-patch`` mbox changing a Python file and a design page, its From: header
    folded as git folds a long one, closed by git's version signature."""
    header, signer = AUTHORS[author]
    path.write_text(
        f"From {commit} Mon Sep 17 00:00:00 2001\n{header}\nDate: Sun, 6 Dec 2026 05:00:00 +0000\n"
        f"Subject: [PATCH] [Model] {subject}\n\nWhy it is needed.\n\nSigned-off-by: {signer}\n---\n"
        f" a.py | 1 +\n\ndiff --git a/a.py b/a.py\n--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n{line}\n"
        f"diff --git a/docs/a.md b/docs/a.md\n--- /dev/null\n+++ b/docs/a.md\n@@ -0,0 +1 @@\n{page}\n"
        "-- \n2.43.0\n\n"
    )
    return path


def test_the_fingerprint_is_the_code_diff_alone(tmp_path: Path) -> None:
    seed = [_patch(tmp_path / "seed.patch", "seed", "1" * 40)]
    jane = [_patch(tmp_path / "jane.patch", "jane", "2" * 40)]
    # author, commit id, date: not part of it; the older fingerprint keeps the author
    assert series_fingerprint(seed) == series_fingerprint(jane)
    assert authored_series_fingerprint(seed) != authored_series_fingerprint(jane)
    assert authored_series_fingerprint(seed) == authored_series_fingerprint(
        [_patch(tmp_path / "seed-again.patch", "seed", "3" * 40)]
    )
    # subject, message, design page, git's version: not part of it
    unchanged = [
        _patch(tmp_path / "subject.patch", "jane", "2" * 40, subject="add b.py"),
        _patch(tmp_path / "page.patch", "jane", "2" * 40, page="+# Another page"),
    ]
    text = jane[0].read_text()
    for name, old, new in (("message", "Why it is needed.", "Why."), ("git", "2.43.0", "2.51.1")):
        (tmp_path / f"{name}.patch").write_text(text.replace(old, new))
        unchanged.append(tmp_path / f"{name}.patch")
    for patch in unchanged:
        assert series_fingerprint([patch]) == series_fingerprint(jane), patch.name
    # a changed code line, or the same change split over two commits, is another series
    other = [_patch(tmp_path / "other.patch", "jane", "2" * 40, line="+x = 2")]
    assert series_fingerprint(other) != series_fingerprint(jane)
    assert series_fingerprint(jane + jane) != series_fingerprint(jane)


def _string_literals(tree: ast.AST) -> list[str]:
    """The string constants of ``tree`` that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_cuda_test_reads_a_markdown_file() -> None:
    """What lets the fingerprint leave the design pages out: a module with a CUDA test names no
    ``.md`` file in its code (the design-page check is a CPU test, run on every export)."""
    root = Path(__file__).resolve().parents[1]
    checked, readers = 0, []
    for module in [
        *root.glob("model_executor/**/test_*.py"),
        *root.glob("vllm_patches/upstream/**/test_*.py"),
    ]:
        source = module.read_text(encoding="utf-8")
        if "mark.cuda" not in source and "is_cuda()" not in source and "cuda.is_available" not in source:
            continue
        checked += 1
        if any(".md" in text for text in _string_literals(ast.parse(source))):
            readers.append(module.name)
    assert checked > 5 and readers == []


class _Pr:
    def __init__(self, folder: str, series: list[Path], depends=(), vllm=()) -> None:
        self.folder, self.series, self.depends, self.vllm = folder, series, list(depends), list(vllm)


def _summary(path: Path, fingerprint: str, key: str = "tree_fingerprint") -> Path:
    run = {"scope": "own", "marks": "core_model and cuda", "status": "ok", "summary": "3 passed",
           "counts": {"passed": 3}, "skip_reasons": {}, "files": ["tests/test_a.py"], "warnings": {}}  # fmt: skip
    entry = {"folder": "02-graphs", "kind": "vllm-omni", "vllm_prs": [], "status": "ok", key: fingerprint,
             "runs": [run]}  # fmt: skip
    doc = {"version": 2, "lane": "current", "date": "2026-12-05", "device": "a GPU", "prs": [entry]}
    path.write_text(json.dumps(doc))
    return path


def test_a_run_counts_for_its_tree_whoever_authors_the_export(tmp_path: Path) -> None:
    base = [_patch(tmp_path / "base.patch", "seed", "0" * 40, line="+y = 0")]
    vllm = [_patch(tmp_path / "vllm.patch", "seed", "9" * 40, line="+z = 0")]
    seed = [_patch(tmp_path / "seed.patch", "seed", "1" * 40)]
    jane = [_patch(tmp_path / "jane.patch", "jane", "2" * 40, page="+# Edited page")]

    def stack(first: list[Path], second: list[Path]) -> list[_Pr]:
        return [_Pr("01-base", first), _Pr("02-graphs", second, depends=["01-base"], vllm=["vllm-x"]),
                _Pr("vllm-x", vllm)]  # fmt: skip

    trees = pr_tree_fingerprints(stack(base, seed))
    fingerprints = {
        name: series_fingerprint(s) for name, s in (("vllm", vllm), ("base", base), ("seed", seed))
    }
    assert trees["02-graphs"] == tree_fingerprint(
        [fingerprints["vllm"], fingerprints["base"], fingerprints["seed"]]
    )
    assert trees["vllm-x"] == tree_fingerprint([fingerprints["vllm"]])
    assert trees["01-base"] == tree_fingerprint([fingerprints["base"]])
    summary = _summary(tmp_path / "new.json", trees["02-graphs"])
    for series in (seed, jane):  # another author, another design page: the same tree
        runs, _ = gpu_runs([summary], stack(base, series))
        assert [run.summary for run in runs["02-graphs"]] == ["3 passed"]
    # the earlier PR's code changed: the same series of its own, another tree
    other_base = [_patch(tmp_path / "base2.patch", "seed", "0" * 40, line="+y = 1")]
    runs, notes = gpu_runs([summary], stack(other_base, seed))
    assert (
        runs == {}
        and "02-graphs: new.json ran another version of its tree (this PR, an earlier one or a vLLM PR it needs); not used"
        in notes
    )
    # recorded before trees: the whole-mbox fingerprint of its series counts for an identical export only
    legacy = _summary(tmp_path / "legacy.json", authored_series_fingerprint(seed), key="series_fingerprint")
    assert list(gpu_runs([legacy], stack(base, seed))[0]) == ["02-graphs"]
    runs, notes = gpu_runs([legacy], stack(base, jane))
    assert (
        runs == {}
        and "02-graphs: legacy.json ran another version of its tree (this PR, an earlier one or a vLLM PR it needs); not used"
        in notes
    )
