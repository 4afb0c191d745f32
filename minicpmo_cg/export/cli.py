"""``minicpmo-cg-patch export``: options, the run, the summary it prints."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.export import build, verify
from minicpmo_cg.export.gitseries import Identity, git

__all__ = ["HELP", "add_parser", "run"]

HELP = "export the lane's change set as a vllm-omni pull request (git format-patch series + PR text)"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("export", help=HELP, description=HELP + ". Files written: see --out.")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("upstream-pr"),
        metavar="DIR",
        help="where the series, PR.md, UPSTREAM-EDITS.md and export.json go (default: upstream-pr)",
    )
    parser.add_argument(
        "--lane", default="current", help="lane whose change set is exported (default: current)"
    )
    parser.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        help="author and Signed-off-by of every commit (default: git config user.name/user.email of --repo)",
    )
    parser.add_argument(
        "--repo", type=Path, metavar="DIR", help="checkout of this patch set (default: the one installed)"
    )
    parser.add_argument(
        "--site-packages", type=Path, metavar="DIR", help="the lane's site-packages (the vLLM series' base)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check that the series applies to the release, is signed off and passes vllm-omni's lint",
    )
    parser.add_argument(
        "--run-tests",
        action="store_true",
        help="with --verify: also run the exported CPU tests from the resulting vllm-omni tree",
    )
    parser.add_argument(
        "--marks",
        default="core_model and cpu",
        help="with --run-tests: pytest -m expression for the exported tests (default: 'core_model and cpu'; "
        "on a GPU host: 'core_model and cuda')",
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        metavar="DIR",
        help="a vllm-omni git checkout at the pinned release: apply the series on a new branch there and "
        "make the Buildkite and docs-nav edits (UPSTREAM-EDITS.md) as commits",
    )
    parser.add_argument(
        "--branch", default="minicpmo45-encoder-cuda-graphs", help="branch made in --checkout"
    )
    return parser


def _identity(args: argparse.Namespace, repo: Path) -> Identity:
    if args.author:
        return Identity(args.author)
    name = git(repo, "config", "user.name", check=False).strip() if (repo / ".git").exists() else ""
    email = git(repo, "config", "user.email", check=False).strip() if name else ""
    if not (name and email):
        raise ValueError(
            "no --author and no git user.name/user.email: vllm-omni's DCO check needs a sign-off"
        )
    return Identity(f"{name} <{email}>")


def _user_git(cwd: Path, *args: str, env: dict | None = None) -> str:
    import os

    proc = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} in {cwd}: {proc.stderr.strip()}")
    return proc.stdout


def _to_checkout(args: argparse.Namespace, result: build.ExportResult, identity: Identity) -> list[str]:
    from minicpmo_cg.export import upstream_edits

    checkout = args.checkout
    base = _user_git(checkout, "rev-parse", "HEAD").strip()
    _user_git(checkout, "checkout", "-q", "-b", args.branch)
    _user_git(checkout, "am", "-q", "--keep-non-patch", *map(str, result.omni_series), env=identity.env())
    design = next(f for f in result.files if f.startswith("docs/design/"))
    for rel, text in upstream_edits.apply_to_checkout(checkout, result.files, design).items():
        (checkout / rel).write_text(text, encoding="utf-8")
        prefix = "[CI/Build]" if rel.startswith(".buildkite/") else "[Doc]"
        what = (
            "eager vs graphed encoder CUDA graph e2e step"
            if prefix == "[CI/Build]"
            else "list the design page"
        )
        _user_git(
            checkout,
            "commit",
            "-q",
            "-s",
            "-m",
            f"{prefix} MiniCPM-o 4.5: {what}",
            "--",
            rel,
            env=identity.env(),
        )
    for old in (args.out / "vllm-omni").glob("*.patch"):
        old.unlink()
    _user_git(
        checkout, "format-patch", "-q", "--no-signature", "-o", str(args.out / "vllm-omni"), f"{base}..HEAD"
    )
    return [f"branch {args.branch} in {checkout} (from {base[:12]}); series re-exported from it"]


def _print_summary(result: build.ExportResult, extra: list[str]) -> None:
    print(f"export: {result.out}  title: {result.title}")
    for commit in result.commits:
        print(f"  {commit['title']}")
        for f in commit["files"]:
            print(f"      {f}")
    for path in result.vllm_series:
        print(f"  vLLM series: {path.name}")
    for line in (
        extra + [f"warning: {w}" for w in result.warnings] + [f"lint: {p}" for p in result.lint.problems]
    ):
        print(line)


def run(args: argparse.Namespace) -> int:
    """Run ``export``; 0 when the export (and each requested check) succeeded, 1 otherwise."""
    repo = (args.repo or resources.payload_root()).resolve()
    identity = _identity(args, repo)
    opts = build.ExportOptions(
        repo=repo, out=args.out, author=identity, lane=args.lane, site_packages=args.site_packages
    )
    result = build.export(opts)
    extra: list[str] = []
    ok = result.lint.ok
    if args.verify or args.run_tests:
        report = verify.verify(args.out, repo, run_tests=args.run_tests, marks=args.marks)
        extra += [f"verify: {p}" for p in report.problems] + [f"verify note: {n}" for n in report.lint_notes]
        extra.append(
            f"verify: {'ok' if report.ok else 'FAILED'}; exported tests (-m {args.marks!r}): "
            f"{report.tests_summary or 'not run'}"
        )
        if report.tests_summary and report.ok:
            build.rewrite_pr(args.out, result, verify.result_line(args.marks, report.tests_summary))
        ok = ok and report.ok
    if args.checkout:
        extra += _to_checkout(args, result, identity)
    _print_summary(result, extra)
    return 0 if ok else 1
