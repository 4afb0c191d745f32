"""``minicpmo-cg-patch export``: options, the run, the summary it prints."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.export import build, prtext, verify
from minicpmo_cg.export.gitseries import Identity

__all__ = ["HELP", "add_parser", "git_identity", "run"]

HELP = (
    "export the lane's change set as a stack of vllm-omni pull requests and the vLLM one "
    "(git format-patch series + PR text per PR)"
)
DEFAULT_MARKS = "core_model and cpu"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("export", help=HELP, description=HELP + ". Files written: see --out.")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("upstream-pr"),
        metavar="DIR",
        help="where the PR folders (NN-key/, vllm-key/), STACK.md and export.json go (default: upstream-pr)",
    )
    parser.add_argument(
        "--lane", default="current", help="lane whose change set is exported (default: current)"
    )
    parser.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        help="author and Signed-off-by of every commit (default: git's identity, `git var GIT_AUTHOR_IDENT`, "
        "global config included; a placeholder address such as one under .example or example.com is warned "
        "about, noted in STACK.md and a --verify problem)",
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
        help="check each PR on its own: it applies (with the PRs before it) to the release, is signed off, "
        "passes vllm-omni's lint, its imports resolve in its tree, its tree names nothing a later PR adds and "
        "each module it adds is imported in its tree",
    )
    parser.add_argument(
        "--run-tests",
        action="store_true",
        help="with --verify: also run each PR's tests from its tree, and there the earlier PRs' tests apart from "
        "its own (and the vLLM PR's tests against the installed vLLM)",
    )
    parser.add_argument(
        "--marks",
        action="append",
        metavar="EXPR",
        help=f"with --run-tests: a pytest -m expression for each PR's tests, one run per --marks (default: "
        f"'{DEFAULT_MARKS}'; on a GPU host add --marks 'core_model and cuda')",
    )
    parser.add_argument(
        "--gpu-results",
        type=Path,
        action="append",
        metavar="FILE",
        help="the summary of each PR's tests on a GPU host (`python3 -m minicpmo_cg.offline_gpu stack-run`'s "
        "stack-LANE.json, versions 1 and 2; repeatable, the last file naming a PR counts): each PR's Test Result "
        "gets its runs, its own tests and the earlier PRs' tests on its tree apart (only for the series that ran)",
    )
    parser.add_argument(
        "--vllm-checkout",
        type=Path,
        metavar="DIR",
        help="a git checkout of vllm-project/vllm (its main branch): check that each vLLM PR's series applies "
        "there (git apply --check, nothing written) and say so, with its commit, in the PR text; without it "
        "the text says this was not checked",
    )
    parser.add_argument(
        "--vllm-omni-checkout",
        type=Path,
        metavar="DIR",
        help="a git checkout of vllm-project/vllm-omni (its main branch): apply the PRs' series there in stack "
        "order (git am --3way in a scratch clone of its HEAD, nothing written in DIR) and say in each PR text "
        "whether the stack up to it applies, with the commit; without it the texts say this was not checked",
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        metavar="DIR",
        help="a vllm-omni git checkout at the pinned release: apply the stack there as one branch per PR "
        "(BRANCH-NN-key, each on the one before) with each PR's Buildkite and docs-nav edits as commits",
    )
    parser.add_argument(
        "--branch",
        default=build.DEFAULT_BRANCH,
        help="prefix of the branches made in --checkout (BRANCH-NN-key), by which the PR texts name the PRs "
        "not opened yet (default: %(default)s)",
    )
    parser.add_argument(
        "--pr-number",
        type=_pr_number,
        action="append",
        default=[],
        metavar="KEY=N",
        help="PR KEY (a key or folder of the stack: siglip-attention, 01-siglip-attention, capture-error-mode) "
        "is opened as number N: the texts name it vllm-project/vllm-omni#N (vllm-project/vllm#N for a vLLM "
        "PR); repeatable",
    )
    return parser


def _pr_number(text: str) -> tuple[str, int]:
    """``KEY=N`` of ``--pr-number`` (argparse reports the error with the option's name)."""
    key, sep, number = text.partition("=")
    if not sep or not key.strip() or not number.strip().isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=N (a PR's key or folder, then its number on GitHub, e.g. siglip-attention=1234)"
        )
    return key.strip(), int(number)


def git_identity(cwd: Path) -> Identity:
    """The identity git would commit with in ``cwd``: ``GIT_AUTHOR_*`` environment variables, then the
    repository's, the global and the system configuration (``git var GIT_AUTHOR_IDENT``); never a
    name or address git would guess from the host. An address that is no person's (``user.email =
    root``, a ``.example`` domain) is returned as it is: the export warns about it
    (:mod:`.identity`).

    Raises:
        ValueError: git has no identity configured, or one that is not ``Name <address>`` (the
            message says how to set one or pass --author).
    """
    proc = subprocess.run(
        ["git", "-c", "user.useConfigOnly=true", "var", "GIT_AUTHOR_IDENT"],
        cwd=cwd if cwd.is_dir() else None,
        env=os.environ,
        capture_output=True,
        text=True,
        check=False,
    )
    ident = re.sub(r"\s+\d+\s+[+-]\d{4}\s*$", "", proc.stdout.strip())
    if proc.returncode or not ident:
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise ValueError(
            "no --author and git has no identity to sign off with (vllm-omni's DCO check needs one): set "
            "`git config --global user.name 'Your Name'` and `git config --global user.email you@example.com`, "
            f"or pass --author 'Your Name <you@example.com>' (git: {reason})"
        )
    try:
        return Identity(ident, address_required=False)
    except ValueError:
        raise ValueError(
            f"git's identity {ident!r} is not 'Name <address>': set `git config --global user.name` and "
            "`user.email`, or pass --author 'Your Name <you@example.com>'"
        ) from None


def _identity(args: argparse.Namespace, repo: Path) -> Identity:
    return Identity(args.author) if args.author else git_identity(repo)


def _user_git(cwd: Path, *args: str, env: dict | None = None) -> str:
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
    """Apply the stack in ``--checkout``, one branch per PR, each PR's edits as commits; re-export each
    PR's series from its branch."""
    from minicpmo_cg.export import upstream_edits

    checkout = args.checkout
    start = base = _user_git(checkout, "rev-parse", "HEAD").strip()
    lines = []
    for pr in result.prs:
        branch = pr.branch or f"{args.branch}-{pr.folder}"  # the branch the texts name
        _user_git(checkout, "checkout", "-q", "-b", branch)
        _user_git(checkout, "am", "-q", "--keep-non-patch", *map(str, pr.series), env=identity.env())
        for rel, text in upstream_edits.apply_to_checkout(checkout, pr.files, pr.page).items():
            (checkout / rel).write_text(text, encoding="utf-8")
            title = upstream_edits.commit_title(rel)
            _user_git(checkout, "commit", "-q", "-s", "-m", title, "--", rel, env=identity.env())
        for old in (args.out / pr.folder).glob("*.patch"):
            old.unlink()
        listed = _user_git(
            checkout, "format-patch", "-q", "--no-signature", "-o", str(args.out / pr.folder), f"{base}..HEAD"
        )
        pr.series = sorted((args.out / pr.folder).glob("*.patch")) if not listed.split() else [
            Path(p) for p in listed.split()
        ]  # fmt: skip
        lines.append(f"branch {branch} in {checkout} (on {base[:12]}); {pr.folder} re-exported from it")
        base = _user_git(checkout, "rev-parse", "HEAD").strip()
    lines.append(f"stack of {len(result.prs)} branches on {start[:12]}")
    return lines


def _print_summary(result: build.ExportResult, report: verify.VerifyReport | None, extra: list[str]) -> None:
    print(
        f"export: {result.out} ({len(result.prs)} vllm-omni PRs, {len(result.vllm_prs)} vLLM PRs; see STACK.md)"
    )
    for pr in result.prs + result.vllm_prs:
        size = pr.size
        print(
            f"  {pr.folder}: {pr.title}  [{len(pr.commits)} commits, +{size.get('insertions', 0)}/"
            f"-{size.get('deletions', 0)}]"
        )
        for commit in pr.commits:
            print(f"    {commit['title']}")
        check = next((c for c in report.checks if c.folder == pr.folder), None) if report else None
        if check:
            for run in check.runs:
                which = "" if run.scope == prtext.OWN else " (the earlier PRs' tests on this tree)"
                marks = f" -m {run.marks!r}" if run.marks else ""
                print(f"    tests{marks}{which}: {run.summary}")
            for problem in check.problems:
                print(f"    verify: {problem}")
            for note in check.lint_notes:
                print(f"    verify note: {note}")
    for line in extra + [f"warning: {w}" for w in result.warnings]:
        print(line)
    for pr in result.prs:
        for problem in pr.lint.problems:
            print(f"lint: {pr.folder}: {problem}")


def run(args: argparse.Namespace) -> int:
    """Run ``export``; 0 when the export (and each requested check) succeeded, 1 otherwise."""
    repo = (args.repo or resources.payload_root()).resolve()
    # the checks run git in scratch trees: a relative --out would name nothing there
    args.out = args.out.resolve()
    identity = _identity(args, repo)
    from minicpmo_cg.export import vllm_main

    # a bad --vllm-checkout or --vllm-omni-checkout fails before the export
    if args.vllm_checkout is not None:
        vllm_main.checkout_commit(args.vllm_checkout)
    if args.vllm_omni_checkout is not None:
        vllm_main.checkout_commit(args.vllm_omni_checkout, vllm_main.OMNI)
    opts = build.ExportOptions(
        repo=repo,
        out=args.out,
        author=identity,
        lane=args.lane,
        site_packages=args.site_packages,
        vllm_checkout=args.vllm_checkout,
        omni_checkout=args.vllm_omni_checkout,
        pr_numbers=args.pr_number,
        branch=args.branch,
    )
    result = build.export(opts)
    extra: list[str] = []
    ok = result.ok
    report = None
    runs: dict = {}
    if args.verify or args.run_tests:
        marks = tuple(args.marks or [DEFAULT_MARKS])
        report = verify.verify(args.out, repo, run_tests=args.run_tests, marks=marks)
        extra += [f"verify: {p}" for p in report.identity + report.problems]
        extra.append(
            f"verify: {'ok' if report.ok else 'FAILED'}" + ("" if args.run_tests else " (tests not run)")
        )
        if report.prs_ok and args.run_tests:  # the runs are the PRs' own, whoever the author is
            runs = report.runs()
        ok = ok and report.ok
    if args.gpu_results:
        from minicpmo_cg.export import gpuresults

        gpu, notes = gpuresults.gpu_runs(args.gpu_results, result.prs + result.vllm_prs)
        for folder, found in gpu.items():
            runs[folder] = runs.get(folder, []) + found
        extra += [f"gpu results: {note}" for note in notes]
    if runs:
        build.rewrite_prs(result, runs)
    if args.checkout:
        extra += _to_checkout(args, result, identity)
    _print_summary(result, report, extra)
    return 0 if ok else 1
