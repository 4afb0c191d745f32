"""Checks of an export against what a vllm-omni maintainer would run.

- the vllm-omni series applies with ``git am`` to the pinned release (the cached wheel whose
  sha256 the manifest names), every commit signed off by its author and titled with a prefix;
- the vLLM series applies with ``git am`` to the lane's pristine vLLM files;
- the exported files pass vllm-omni's lint (:mod:`.lint`);
- optionally, the exported tests pass with pytest run from the resulting vllm-omni tree (its
  ``vllm_omni`` first on ``sys.path``, vLLM from the lane), with this project's ``minicpmo_cg``
  made unimportable, under vllm-omni's registered markers and ``--strict-markers``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import fetch, lint
from minicpmo_cg.export.changeset import read_change_set
from minicpmo_cg.export.gitseries import Identity, git

__all__ = ["VerifyReport", "apply_series", "result_line", "run_exported_tests", "verify"]

#: As in vllm-omni's tree, where this project's package is not installed (``importorskip`` skips).
_BLOCKER = 'raise ModuleNotFoundError("the exported tests must not import minicpmo_cg (this patch set\'s package)")\n'


@dataclass
class VerifyReport:
    """Problems found (empty: the export passed) and the exported tests' pytest summary."""

    problems: list[str] = field(default_factory=list)
    lint_notes: list[str] = field(default_factory=list)
    tests_summary: str | None = None
    tests_output: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def apply_series(tree: Path, patches: list[Path], identity: Identity) -> list[str]:
    """``git am`` ``patches`` onto ``tree`` (committed as the base first); return the problems."""
    git(tree, "init", "-q", "-b", "verify")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--allow-empty", "--no-verify", "-m", "base", env=identity.env())
    base = git(tree, "rev-parse", "HEAD").strip()
    try:
        git(
            tree,
            "am",
            "--quiet",
            "--keep-non-patch",
            "--whitespace=error",
            *map(str, patches),
            env=identity.env(),
        )
    except RuntimeError as exc:
        return [f"the series does not apply to {tree.name}: {exc}"]
    problems = []
    log = git(tree, "log", "--reverse", "--format=%H%x00%an <%ae>%x00%s%x00%b%x01", f"{base}..HEAD")
    for entry in filter(str.strip, log.split("\x01")):
        sha, author, subject, body = entry.strip().split("\x00")
        if f"Signed-off-by: {author}" not in body:
            problems.append(f"{sha[:10]} {subject!r}: no Signed-off-by of its author {author}")
        if not re.match(r"^\[[A-Z][\w/.-]*\]", subject):
            problems.append(f"{sha[:10]} {subject!r}: the title has no [Prefix]")
    if len(log.split("\x01")) - 1 != len(patches):
        problems.append(f"{len(patches)} patches gave {len(log.split(chr(1))) - 1} commits")
    return problems


def _pytest_ini(path: Path) -> Path:
    lines = ["[pytest]", "addopts = --strict-markers -p no:cacheprovider", "markers ="]
    lines += [f"    {name}: registered by vllm-omni" for name in conv.UPSTREAM_MARKERS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_exported_tests(tree: Path, tests: list[str], marks: str, work: Path) -> tuple[int, str]:
    """pytest on ``tests`` from ``tree`` with ``-m marks``; ``(exit code, output)``."""
    blocker = work / "blocker" / "minicpmo_cg"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(_BLOCKER, encoding="utf-8")
    ini = _pytest_ini(work / "pytest.ini")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(tree), "-q", "-m", marks, *tests]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _summary(output: str) -> str | None:
    lines = [l.strip("= ").strip() for l in output.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    return re.sub(r"\s+in [\d.]+s.*$", "", lines[-1]) if lines else None


def result_line(marks: str, summary: str) -> str:
    """The Test Result line of the PR text for the exported tests run with ``-m marks``."""
    return f"`pytest -m '{marks}'`: `{summary}`"


def _check_vllm(out: Path, repo: Path, manifest: dict, identity: Identity, work: Path) -> list[str]:
    patches = sorted((out / "vllm").glob("*.patch"))
    if not patches:
        return []
    from minicpmo_cg.export.vllm_base import pristine_files

    cs = read_change_set(repo, manifest["lane"])
    rels = sorted({rel for patch in cs.vllm_patches for rel in patch.file_paths})
    tree = work / "vllm"
    for rel, data in pristine_files(cs, rels, None).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    return [f"vllm: {p}" for p in apply_series(tree, patches, identity)]


def verify(out: Path, repo: Path, run_tests: bool = False, marks: str = "core_model and cpu") -> VerifyReport:
    """Check the export in ``out`` (made from the checkout ``repo``); see the module docstring."""
    manifest = json.loads((out / "export.json").read_text(encoding="utf-8"))
    report = VerifyReport()
    wheel = fetch.wheel("vllm-omni", manifest["vllm_omni"])
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != manifest["base"]["sha256"]:
        report.problems.append(f"{wheel} is not the wheel the export was made against")
    identity = Identity("Export Check <export-check@example.invalid>")
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-verify-") as tmp:
        work = Path(tmp)
        tree = fetch.extract_package(wheel, "vllm_omni", work / "vllm-omni")
        report.problems += apply_series(tree, sorted((out / "vllm-omni").glob("*.patch")), identity)
        report.problems += _check_vllm(out, repo, manifest, identity, work)
        if report.problems:
            return report
        ruff = fetch.ruff_binary(conv.RUFF_VERSION)
        lint_report = lint.check_tree(ruff, lint.ruff_config(work / "ruff.toml"), tree, manifest["files"])
        report.problems += [f"lint: {p}" for p in lint_report.problems]
        report.lint_notes = lint_report.notes
        if run_tests:
            tests = sorted({str(Path(f).parent) for f in manifest["files"] if f.startswith("tests/")})
            code, output = run_exported_tests(tree, tests, marks, work)
            report.tests_output, report.tests_summary = output, _summary(output)
            if code != 0:
                report.problems.append(f"exported tests failed (pytest exit {code}): {report.tests_summary}")
    return report
