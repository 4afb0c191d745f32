"""Checks of an export against what a vllm-omni (or vLLM) maintainer would run, PR by PR.

For each vllm-omni PR of the stack, in merge order, on one vllm-omni tree made from the pinned
release wheel (the one whose sha256 the manifest names):

- its series applies with ``git am`` on top of the PRs before it, every commit signed off by its
  author and titled with a ``[Prefix]``;
- its files pass vllm-omni's lint (:mod:`.lint`) as the tree stands after it;
- every import of a ``vllm_omni`` module or of a module beside a test, in the files the stack has
  touched so far, resolves in that tree (a PR's tests import only what it or an earlier PR holds);
- once every PR applied, each PR's tree names no file and no name a later PR adds, and each module
  a PR adds has a user in its tree (:mod:`.forward`);
- optionally, its tests pass with pytest run from that tree (its ``vllm_omni`` first on
  ``sys.path``, vLLM from the lane), with this project's ``minicpmo_cg`` made unimportable, under
  vllm-omni's registered markers and ``--strict-markers``, once per ``-m`` expression; and so do
  the earlier PRs' tests on that tree (the test files of the PRs before it that it leaves as they
  are, :func:`.pytestlog.earlier_test_files`), run apart from its own, since a later PR can break
  what an earlier one tested. A failure of either is a problem of this PR. Each run records the
  test files it named, what it collected with their marks and what ``-m`` deselected
  (:mod:`.pytestlog`), so that the PR text accounts for every collected test.

Each vLLM PR's series applies with ``git am`` to the lane's pristine vLLM files, and optionally
its tests (in vLLM's layout) pass against the installed vLLM once that carries the change.

Across the series, the author of every commit (its ``From:``) must have an address a person can
have: a placeholder (no ``@``, a domain reserved by RFC 2606 / RFC 6761, :mod:`.identity`) is a
problem of the report (:attr:`VerifyReport.identity`), since vllm-omni's DCO check would accept its
sign-off and a maintainer would not.
"""

from __future__ import annotations

import ast
import email.parser
import email.policy
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import fetch, forward, lint, pytestlog
from minicpmo_cg.export.changeset import read_change_set
from minicpmo_cg.export.gitseries import Identity, git
from minicpmo_cg.export.identity import placeholder_problem
from minicpmo_cg.export.prtext import EARLIER, OWN, PytestRun

__all__ = [
    "PrCheck",
    "VerifyReport",
    "apply_series",
    "run_exported_tests",
    "unresolved_imports",
    "verify",
]

#: As in vllm-omni's tree, where this project's package is not installed (``importorskip`` skips).
_BLOCKER = 'raise ModuleNotFoundError("the exported tests must not import minicpmo_cg (this patch set\'s package)")\n'


@dataclass
class PrCheck:
    """What the checks found for one PR (``problems`` empty: it passed) and its test runs."""

    folder: str
    problems: list[str] = field(default_factory=list)
    lint_notes: list[str] = field(default_factory=list)
    runs: list[PytestRun] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    """Per PR, in export order (vllm-omni PRs, then vLLM PRs); ``problems`` not tied to one PR;
    ``identity``: one problem per placeholder author of the series (:func:`series_authors`)."""

    checks: list[PrCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    identity: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.identity and self.prs_ok

    @property
    def prs_ok(self) -> bool:
        """Every PR applies, lints and passes its tests (whoever the author is)."""
        return not self.problems and all(not c.problems for c in self.checks)

    def all_problems(self) -> list[str]:
        return self.identity + self.problems + [f"{c.folder}: {p}" for c in self.checks for p in c.problems]

    def runs(self) -> dict[str, list[PytestRun]]:
        return {c.folder: c.runs for c in self.checks if c.runs}

    def check(self, folder: str) -> PrCheck:
        return next(c for c in self.checks if c.folder == folder)


def _init_base(tree: Path, committer: Identity) -> str:
    git(tree, "init", "-q", "-b", "verify")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--allow-empty", "--no-verify", "-m", "base", env=committer.env())
    return git(tree, "rev-parse", "HEAD").strip()


def series_authors(patches: list[Path]) -> dict[str, list[str]]:
    """``Name <address>`` of each ``From:`` of the ``git format-patch`` files ``patches`` -> the
    names of the files it authors (in the order given)."""
    parser = email.parser.BytesHeaderParser(policy=email.policy.default)
    found: dict[str, list[str]] = {}
    for patch in patches:
        header = parser.parsebytes(patch.read_bytes())["From"]
        addresses = getattr(header, "addresses", ()) if header is not None else ()
        author = (
            f"{addresses[0].display_name} <{addresses[0].addr_spec}>"
            if addresses
            else str(header or "").strip()
        )
        found.setdefault(author, []).append(patch.name)
    return found


def identity_problems(out: Path, manifest: dict) -> list[str]:
    """One problem per placeholder author (:func:`.identity.placeholder_problem`) of the series the
    manifest names (vllm-omni PRs and vLLM PRs), with how many of their commits it authors."""
    patches = [out / s for pr in manifest["prs"] + manifest["vllm_prs"] for s in pr["series"]]
    problems = []
    for author, names in series_authors(patches).items():
        problem = placeholder_problem(author)
        if problem:
            problems.append(f"{len(names)} of the {len(patches)} commits: {problem}")
    return problems


def _am(tree: Path, patches: list[Path], identity: Identity) -> list[str]:
    """``git am`` ``patches`` onto ``tree``'s HEAD; the problems of the commits it made."""
    before = git(tree, "rev-parse", "HEAD").strip()
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
        git(tree, "am", "--abort", check=False)
        return [f"the series does not apply: {exc}"]
    problems = []
    log = git(tree, "log", "--reverse", "--format=%H%x00%an <%ae>%x00%s%x00%b%x01", f"{before}..HEAD")
    entries = [e for e in log.split("\x01") if e.strip()]
    for entry in entries:
        sha, author, subject, body = entry.strip().split("\x00")
        if f"Signed-off-by: {author}" not in body:
            problems.append(f"{sha[:10]} {subject!r}: no Signed-off-by of its author {author}")
        if not re.match(r"^\[[A-Z][\w/.-]*\]", subject):
            problems.append(f"{sha[:10]} {subject!r}: the title has no [Prefix]")
    if len(entries) != len(patches):
        problems.append(f"{len(patches)} patches gave {len(entries)} commits")
    return problems


def apply_series(tree: Path, patches: list[Path], identity: Identity) -> list[str]:
    """``git am`` ``patches`` onto ``tree`` (committed as the base first); return the problems."""
    _init_base(tree, identity)
    return [f"{tree.name}: {p}" for p in _am(tree, patches, identity)]


def _pytest_ini(path: Path) -> Path:
    lines = ["[pytest]", "addopts = --strict-markers -p no:cacheprovider", "markers ="]
    lines += [f"    {name}: registered by vllm-omni" for name in conv.UPSTREAM_MARKERS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_exported_tests(
    tree: Path, tests: list[str], marks: str, work: Path
) -> tuple[int, str, pytestlog.Collection | None]:
    """pytest on ``tests`` from ``tree`` with ``-m marks`` (all tests when empty);
    ``(exit code, output, what it collected)``."""
    blocker = work / "blocker" / "minicpmo_cg"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(_BLOCKER, encoding="utf-8")
    plugin = pytestlog.write_collect_plugin(blocker.parent)
    collected = work / "collected.json"
    collected.unlink(missing_ok=True)
    ini = _pytest_ini(work / "pytest.ini")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "PYTHONDONTWRITEBYTECODE": "1",
           pytestlog.COLLECT_OUT: str(collected)}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(tree), "-q", "-rs", "-p", plugin]
    cmd += ["-m", marks] if marks else []
    proc = subprocess.run([*cmd, *tests], cwd=tree, env=env, capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout + proc.stderr, pytestlog.read_collection(collected)


def gpu_available() -> bool:
    """Whether CUDA has a device here (a run's CUDA tests can run, rather than skip)."""
    import torch

    return torch.cuda.is_available()


def environment() -> str:
    """Where the tests run: Python, torch and transformers versions, and the GPU or its absence."""
    parts = [f"Python {platform.python_version()}"]
    for dist in ("torch", "transformers"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch

    parts.append(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
    return ", ".join(parts)


def _run(tree: Path, tests: list[str], marks: str, work: Path, check: PrCheck, env: str,
         scope: str = OWN) -> None:  # fmt: skip
    code, output, collection = run_exported_tests(tree, tests, marks, work)
    summary = pytestlog.summary(output)
    ok = code in (0, 5)  # 5: no test of these marks in the files
    run = PytestRun(marks, summary or "no tests ran", pytestlog.skip_reasons(output), env, ok,
                    pytestlog.warnings(output, tree), files=list(tests), scope=scope, collection=collection)  # fmt: skip
    check.runs.append(run)
    check.outputs.append(output)
    if ok:
        return
    expression = f" (-m {marks!r})" if marks else ""
    if scope == EARLIER:
        check.problems.append(
            f"the earlier PRs' tests{expression} failed on this PR's tree, pytest exit {code}: {summary} "
            f"({', '.join(tests)})"
        )
    else:
        check.problems.append(f"tests{expression} failed, pytest exit {code}: {summary}")


# -- imports ---------------------------------------------------------------------------------------


def _module_file(tree: Path, dotted: str) -> Path | None:
    base = tree / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str] | None:
    """Names a module defines at its top level; None when it can hand out others (``*``, ``__getattr__``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:
        return None
    names: set[str] = set()

    def visit(body) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == "__getattr__":
                    return False
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        return False
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                blocks += [h.body for h in getattr(node, "handlers", [])]
                if not all(visit(b) for b in blocks):
                    return False
        return True

    return names if visit(tree.body) else None


def unresolved_imports(tree: Path, files: list[str], beside_tests: set[str]) -> list[str]:
    """Imports in ``files`` (relative to ``tree``) of a module or name the tree does not have.

    Checked: ``vllm_omni`` modules (absolute, or relative from a file under ``vllm_omni/``, or
    through ``pytest.importorskip``) and the names imported from them, and top-level modules that
    some PR of the stack puts beside a test (``beside_tests``: their repo-relative paths), which must
    be beside the importing file.
    """
    problems = []
    for rel in files:
        if not rel.endswith(".py") or not (tree / rel).is_file():
            continue
        folder = PurePosixPath(rel).parent
        try:
            parsed = ast.parse((tree / rel).read_text(encoding="utf-8"), filename=rel)
        except SyntaxError as exc:
            problems.append(f"{rel}: does not parse ({exc})")
            continue
        for node in ast.walk(parsed):
            for module, names in _imported(node, rel):
                if module.split(".")[0] == "vllm_omni":
                    path = _module_file(tree, module)
                elif f"{folder}/{module.split('.')[0]}.py" in beside_tests:
                    path = tree / folder / f"{module.split('.')[0]}.py"
                    path = path if path.is_file() else None
                else:
                    continue
                if path is None:
                    problems.append(f"{rel}:{node.lineno}: imports {module}, which this tree does not have")
                    continue
                defined = _top_level_names(path) if names else set()
                for name in names if defined is not None else []:
                    if name not in defined and not _module_file(tree, f"{module}.{name}"):
                        problems.append(
                            f"{rel}:{node.lineno}: imports {name} from {module}, which does not define it"
                        )
    return problems


def _importorskip(node: ast.AST) -> str | None:
    """The module of a ``pytest.importorskip("module")`` call (a test module that imports a later PR's
    module this way would skip in this PR's tree, silently but for its skip reason)."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return node.args[0].value if name == "importorskip" and isinstance(node.args[0].value, str) else None


def _imported(node: ast.AST, rel: str) -> list[tuple[str, list[str]]]:
    if (module := _importorskip(node)) is not None:
        return [(module, [])]
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    names = [alias.name for alias in node.names if alias.name != "*"]
    if node.level:
        if not rel.startswith("vllm_omni/"):
            return []
        package = PurePosixPath(rel).parent.parts[: len(PurePosixPath(rel).parent.parts) - node.level + 1]
        module = ".".join([*package, *([node.module] if node.module else [])])
        return [(module, names)] if node.module else [(f"{module}.{n}", []) for n in names]
    return [(node.module, names)] if node.module else []


# -- the checks ------------------------------------------------------------------------------------


def _check_vllm(pr: dict, out: Path, repo: Path, lane: str, identity: Identity, work: Path, run_tests: bool,
                env: str) -> PrCheck:  # fmt: skip
    from minicpmo_cg.export.vllm_base import pristine_files
    from minicpmo_cg.patchtool import build_plan, discover_installation

    check = PrCheck(pr["folder"])
    cs = read_change_set(repo, lane)
    patches = [p for p in cs.vllm_patches if any(p.subject in c["title"] for c in pr["commits"])]
    rels = sorted({rel for patch in patches for rel in patch.file_paths})
    tree = work / pr["folder"]
    for rel, data in pristine_files(cs, rels, None).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    _init_base(tree, identity)
    check.problems += _am(tree, [out / s for s in pr["series"]], identity)
    tests = [t for t in pr["tests"] if PurePosixPath(t).name.startswith("test_")]
    if check.problems or not run_tests or not tests:
        return check
    plan = build_plan(discover_installation(None), repo / "patches", repo)
    states = {r.patch.name: r.state for r in plan.reports}
    missing = [p.name for p in patches if states.get(p.name) != "applied"]
    if missing:
        check.problems.append(
            f"its tests run against the installed vLLM, which lacks the change ({', '.join(missing)}: "
            f"{', '.join(states.get(m, '?') for m in missing)}); apply it (`minicpmo-cg-patch apply`) and re-run"
        )
        return check
    # from a folder holding only the tests: vLLM itself is the installed one
    tests_root = work / f"{pr['folder']}-tests"
    for rel in pr["tests"]:
        (tests_root / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests_root / rel).write_bytes((tree / rel).read_bytes())
    _run(tests_root, tests, "", work / f"{pr['folder']}-pytest", check, env)
    return check


def verify(
    out: Path, repo: Path, run_tests: bool = False, marks: tuple[str, ...] = ("core_model and cpu",)
) -> VerifyReport:
    """Check the export in ``out`` (made from the checkout ``repo``) PR by PR; see the module docstring.

    ``marks``: the ``-m`` expressions the vllm-omni PRs' tests run with (one run each).
    """
    manifest = json.loads((out / "export.json").read_text(encoding="utf-8"))
    report = VerifyReport(identity=identity_problems(out, manifest))
    wheel = fetch.wheel("vllm-omni", manifest["vllm_omni"])
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != manifest["base"]["sha256"]:
        report.problems.append(f"{wheel} is not the wheel the export was made against")
        return report
    committer = Identity("Export Check <export-check@example.invalid>")  # git am keeps the series' authors
    env = environment() if run_tests else ""
    beside_tests = {f for pr in manifest["prs"] for f in pr["files"] if f.startswith("tests/")}
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-verify-") as tmp:
        work = Path(tmp)
        tree = fetch.extract_package(wheel, "vllm_omni", work / "vllm-omni")
        release = forward.ReleaseIndex.read(tree, {f for pr in manifest["prs"] for f in pr["files"]})
        snapshots: list[forward.Snapshot] = []
        _init_base(tree, committer)
        ruff = fetch.ruff_binary(conv.RUFF_VERSION)
        config = lint.ruff_config(work / "ruff.toml")
        touched: list[str] = []
        broken = None
        for pr in manifest["prs"]:
            check = PrCheck(pr["folder"])
            report.checks.append(check)
            if broken:
                check.problems.append(
                    f"not checked: {broken} does not apply, and this PR applies on top of it"
                )
                continue
            check.problems += _am(tree, [out / s for s in pr["series"]], committer)
            if check.problems:
                broken = pr["folder"]
                continue
            lint_report = lint.check_tree(ruff, config, tree, pr["files"])
            check.problems += [f"lint: {p}" for p in lint_report.problems]
            check.lint_notes = lint_report.notes
            touched = sorted(set(touched) | set(pr["files"]))
            check.problems += [f"imports: {p}" for p in unresolved_imports(tree, touched, beside_tests)]
            snapshots.append(forward.Snapshot.read(tree, pr["folder"], touched))
            tests = [t for t in pr["tests"] if PurePosixPath(t).name.startswith("test_")]
            earlier = pytestlog.earlier_test_files(manifest["prs"], manifest["prs"].index(pr))
            for expression in marks if run_tests else ():
                if tests:
                    _run(tree, tests, expression, work / f"{pr['folder']}-pytest", check, env)
                if earlier:
                    _run(tree, earlier, expression, work / f"{pr['folder']}-pytest", check, env, EARLIER)
        if not broken:
            for folder, found in forward.problems(release, snapshots).items():
                report.check(folder).problems += [f"stack order: {p}" for p in found]
        for pr in manifest["vllm_prs"]:
            report.checks.append(
                _check_vllm(pr, out, repo, manifest["lane"], committer, work, run_tests, env)
            )
    on_gpu = run_tests and gpu_available()
    for check in report.checks:
        for run in check.runs:
            run.on_gpu = on_gpu
    return report
