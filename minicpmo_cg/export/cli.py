"""``minicpmo-cg-export OUT [--verify]``: each PR of :data:`.stack.STACK` as a ``git format-patch`` series."""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from minicpmo_cg.export.stack import STACK, VLLM, Pr
from minicpmo_cg.patchtool.errors import ToolError
from minicpmo_cg.patchtool.install import discover_installation
from minicpmo_cg.patchtool.plan import build_plan
from minicpmo_cg.patchtool.series import Patch, load_series

REPO = Path(__file__).resolve().parents[2]
PROG = "minicpmo-cg-export"
AUTHOR = "MiniCPM-o 4.5 encoder CUDA graphs <minicpmo-cg@users.noreply.github.com>"
DATE = "2026-01-01T00:00:00+00:00"  # fixed: the same checkout exports the same bytes
VLLM_TESTS = "tests/vllm_patches/upstream/"


class ExportError(RuntimeError):
    """The stack cannot be exported (the message says why)."""


def folder(index: int, pr: Pr) -> str:
    return f"{index:02d}-{pr.key}"


def pr_text(name: str) -> Path:
    return REPO / "docs" / "upstream" / f"{name}.md"


def patches_of(pr: Pr, package: str) -> list[Patch]:
    """The PR's patches, found by number in ``patches/<package>/series``."""
    series = {p.name.split("/")[-1][:4]: p for p in load_series(REPO / "patches" / package)}
    missing = [n for n in pr.patches if n not in series]
    if missing:
        raise ExportError(f"{pr.key}: no patch {', '.join(missing)} in patches/{package}/series")
    return [series[n] for n in pr.patches]


def test_files(pr: Pr) -> list[str]:
    found = [p for pattern in pr.tests for p in sorted(glob.glob(pattern, root_dir=REPO))]
    if len(found) < len(pr.tests):
        raise ExportError(f"{pr.key}: a test of {pr.tests} is missing")
    return found


def git(cwd: Path, *args: str) -> str:
    name, email = AUTHOR.rsplit(" <", 1)
    env = {**os.environ, "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email.rstrip(">")}
    env.update(GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email.rstrip(">"))
    env.update(GIT_AUTHOR_DATE=DATE, GIT_COMMITTER_DATE=DATE)
    proc = subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise ExportError(f"git {' '.join(args)} in {cwd}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


def message(patch: Patch) -> str:
    subject = patch.subject.removeprefix("minicpmo_4_5: ")
    prefix = "[Model] MiniCPM-o 4.5: " if "/models/" in patch.file_paths[0] else "[Core] "
    return f"{prefix}{subject}\n\n{patch.why}\n"


def pristine(site: Path | None) -> tuple[Path, dict[str, bytes | None]]:
    """The installation's site-packages and, per file the series patches or owns, its release bytes
    (None: the release has no such file)."""
    install = discover_installation(site)
    if install.lane != "current":
        raise ExportError(f"the installed pair is lane {install.lane!r}: export from the current lane's venv")
    plan = build_plan(install, REPO / "patches", REPO)
    bad = [f"{rel}: {view.conflict}" for rel, view in plan.files.items() if view.conflict]
    if bad:
        raise ExportError("no pristine content for " + "; ".join(bad))
    return install.site, {rel: view.pristine for rel, view in plan.files.items()}


def base_repo(work: Path, files: dict[str, bytes | None], copy_from: Path | None, title: str) -> Path:
    """A repository holding the release: ``copy_from/vllm_omni`` (or nothing) with ``files`` restored."""
    work.mkdir(parents=True)
    if copy_from is not None:
        shutil.copytree(copy_from, work / copy_from.name, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, data in files.items():
        if data is None:
            (work / rel).unlink(missing_ok=True)
        else:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", title)
    return work


def upstream_patches(pr: Pr) -> list[Patch]:
    """The PR's vllm-omni patches that target the current lane's release (the one the PR is written
    on); a patch for an older lane only (a split patch's other half) stays out of the upstream PR."""
    from minicpmo_cg.lanes import get_lane

    version = get_lane("current").vllm_omni
    return [p for p in patches_of(pr, "vllm-omni") if p.targets_version(version)]


def commit_pr(repo: Path, patches: list[Patch], added: dict[str, str]) -> None:
    """One commit per patch; the first also adds ``added`` (repository path -> destination)."""
    for i, patch in enumerate(patches):
        for src, dest in (added.items() if i == 0 else ()):
            (repo / dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / src, repo / dest)
        git(repo, "apply", "-p1", str(patch.path))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", message(patch))


def write_series(repo: Path, start: str, out: Path, text: Path) -> None:
    if not text.is_file():
        raise ExportError(f"{text.relative_to(REPO)}: the PR's text is missing")
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(out), f"{start}..HEAD")
    shutil.copyfile(text, out / "PR.md")


def export(out: Path, site: Path | None, work: Path) -> list[tuple[str, str, str]]:
    """Write the stack; return per vllm-omni PR (folder, commit before it, its last commit)."""
    site_dir, files = pristine(site)
    omni_files = {rel: data for rel, data in files.items() if rel.startswith("vllm_omni/")}
    repo = base_repo(work / "vllm-omni", omni_files, site_dir / "vllm_omni", "vllm-omni release")
    built = []
    for i, pr in enumerate(STACK, 1):
        start = git(repo, "rev-parse", "HEAD")
        commit_pr(repo, upstream_patches(pr), {rel: rel for rel in pr.owned})
        write_series(repo, start, out / folder(i, pr), pr_text(folder(i, pr)))
        built.append((folder(i, pr), start, git(repo, "rev-parse", "HEAD")))
    vllm_patches = patches_of(VLLM, "vllm")
    changed = {rel for p in vllm_patches for rel in p.file_paths}
    vrepo = base_repo(work / "vllm", {rel: files[rel] for rel in changed}, None, "vLLM release")
    start = git(vrepo, "rev-parse", "HEAD")
    commit_pr(vrepo, vllm_patches, {t: t.removeprefix(VLLM_TESTS) for t in test_files(VLLM)})
    write_series(vrepo, start, out / f"vllm-{VLLM.key}", pr_text(f"vllm-{VLLM.key}"))
    return built


def verify(out: Path, work: Path, built: list[tuple[str, str, str]], tests: bool) -> list[str]:
    """What fails for each PR on its own tree (empty: every check passed)."""
    repo, failures = work / "vllm-omni", []
    for (name, start, end), pr in zip(built, STACK):
        git(repo, "checkout", "-q", "--detach", start)
        series = sorted(str(p) for p in (out / name).glob("*.patch"))
        git(repo, "am", "-q", "--keep-cr", *series)
        if git(repo, "rev-parse", "HEAD^{tree}") != git(repo, "rev-parse", f"{end}^{{tree}}"):
            failures.append(f"{name}: its series does not give the tree it was written from")
            continue
        touched = git(repo, "diff", "--name-only", start, "HEAD").split("\n")
        py = [str(repo / rel) for rel in touched if rel.endswith(".py")]
        checks = [[sys.executable, "-m", "py_compile", *py]]
        if tests and pr.tests:
            pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda"]
            checks.append([*pytest, *test_files(pr)])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(REPO)])}
        for cmd in checks:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode not in (0, 5):  # 5: every test deselected (a PR with CUDA tests only)
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                failures.append(f"{name}: {' '.join(cmd[2:5])} ... failed:\n{tail}")
        print(f"{name}: {'checked' if not failures or not failures[-1].startswith(name) else 'FAILED'}")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output folder (must not exist, or be empty)")
    ap.add_argument("--verify", action="store_true", help="check each PR on its own tree")
    ap.add_argument("--no-tests", action="store_true", help="with --verify: apply and compile only")
    ap.add_argument("--site-packages", type=Path, help="the current lane's site-packages (default: this Python's)")
    args = ap.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"{PROG}: {args.out} exists and is not an empty folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-export-") as tmp:
        try:
            built = export(args.out, args.site_packages, Path(tmp))
            print(f"{PROG}: wrote {len(built)} vllm-omni PRs and the vLLM PR to {args.out}")
            failures = verify(args.out, Path(tmp), built, not args.no_tests) if args.verify else []
        except (ExportError, ToolError, OSError) as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0
