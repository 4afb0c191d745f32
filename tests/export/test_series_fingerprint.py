"""The series fingerprint that ties a GPU run to the series it ran: the author is not part of it.

``export --author`` re-exports the same change set under the contributor's name; the GPU runs of
the first export must still count for it (:mod:`minicpmo_cg.export.gpuresults`), and a summary
recorded with the older, author-bound fingerprint must still count for an export by its author.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minicpmo_cg.export.gitseries import authored_series_fingerprint, series_fingerprint
from minicpmo_cg.export.gpuresults import gpu_runs

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

AUTHORS = {
    "seed": ("From: Seed maintainers\n <maintainers@users.noreply.example>", "Seed maintainers <maintainers@users.noreply.example>"),
    "jane": ("From: Jane Contributor <jane@contributor.org>", "Jane Contributor <jane@contributor.org>"),
}  # fmt: skip


def _patch(path: Path, author: str, commit: str, subject: str = "add a.py", line: str = "+x = 1") -> Path:
    """One ``git format-patch`` mbox, its From: header folded as git folds a long one."""
    header, signer = AUTHORS[author]
    path.write_text(
        f"From {commit} Mon Sep 17 00:00:00 2001\n{header}\nDate: Sun, 6 Dec 2026 05:00:00 +0000\n"
        f"Subject: [PATCH] [Model] {subject}\n\nWhy it is needed.\n\nSigned-off-by: {signer}\n---\n"
        f" a.py | 1 +\n\ndiff --git a/a.py b/a.py\n--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n{line}\n-- \n2.43.0\n"
    )
    return path


def test_the_fingerprint_leaves_out_the_author_commit_id_and_date_and_nothing_else(tmp_path: Path) -> None:
    seed = [_patch(tmp_path / "seed.patch", "seed", "1" * 40)]
    jane = [_patch(tmp_path / "jane.patch", "jane", "2" * 40)]
    assert series_fingerprint(seed) == series_fingerprint(jane)
    assert authored_series_fingerprint(seed) != authored_series_fingerprint(jane)
    assert authored_series_fingerprint(seed) == authored_series_fingerprint(
        [_patch(tmp_path / "seed-again.patch", "seed", "3" * 40)]
    )
    for change in ({"subject": "add b.py"}, {"line": "+x = 2"}):
        other = [_patch(tmp_path / "other.patch", "jane", "2" * 40, **change)]
        assert series_fingerprint(other) != series_fingerprint(jane), change
    # a changed message (not the trailer) changes it too
    text = jane[0].read_text().replace("Why it is needed.", "Why it is needed now.")
    (tmp_path / "message.patch").write_text(text)
    assert series_fingerprint([tmp_path / "message.patch"]) != series_fingerprint(jane)


class _Pr:
    def __init__(self, folder: str, series: list[Path]) -> None:
        self.folder, self.series = folder, series


def _summary(path: Path, fingerprint: str) -> Path:
    run = {"scope": "own", "marks": "core_model and cuda", "status": "ok", "summary": "3 passed",
           "counts": {"passed": 3}, "skip_reasons": {}, "files": ["tests/test_a.py"], "warnings": {}}  # fmt: skip
    entry = {"folder": "02-graphs", "kind": "vllm-omni", "vllm_prs": [], "status": "ok",
             "series_fingerprint": fingerprint, "runs": [run]}  # fmt: skip
    doc = {"version": 2, "lane": "current", "date": "2026-12-05", "device": "a GPU", "prs": [entry]}
    path.write_text(json.dumps(doc))
    return path


def test_a_re_export_under_another_author_keeps_the_gpu_runs(tmp_path: Path) -> None:
    seed = [_patch(tmp_path / "seed.patch", "seed", "1" * 40)]
    jane = [_patch(tmp_path / "jane.patch", "jane", "2" * 40)]
    # recorded now: the author-free fingerprint counts for either author's export
    summary = _summary(tmp_path / "new.json", series_fingerprint(seed))
    for series in (seed, jane):
        runs, _ = gpu_runs([summary], [_Pr("02-graphs", series)])
        assert [run.summary for run in runs["02-graphs"]] == ["3 passed"]
    # recorded before: the author-bound fingerprint counts for its own author's export only
    legacy = _summary(tmp_path / "legacy.json", authored_series_fingerprint(seed))
    assert list(gpu_runs([legacy], [_Pr("02-graphs", seed)])[0]) == ["02-graphs"]
    runs, notes = gpu_runs([legacy], [_Pr("02-graphs", jane)])
    assert runs == {} and "02-graphs: legacy.json ran another version of this series; not used" in notes
