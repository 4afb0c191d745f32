"""``stack-run LANE [PR...]``: each exported PR's tests from its own tree, on the GPU host.

For each PR of ``<bundle dir>/stack-LANE/STACK.json`` (:mod:`.stackbuild`): a copy of the unpacked
bundle's ``vllm_omni`` package (and, for a PR that needs no vLLM PR, of ``vllm``) made of hard
links, with the PR's overlay written over it; a check that every file of the copied package is the
PR tree's (the overlay's bytes, else the release wheel's); the PR tree's ``tests/``; then, from that
tree, two pytest processes: one on the PR's own test files, and one on the earlier PRs' test files
that the PR leaves as they are (:func:`minicpmo_cg.export.pytestlog.earlier_test_files`, the same
split as the export's checks: a later PR can break what an earlier one tested), each ``-m`` the
PR's marks, ``PYTHONPATH`` = a folder that makes ``minicpmo_cg`` unimportable, the copies, the
bundle's site (never the checkout), each under its time limit. ``--jobs N`` runs up to N of these
pytest processes at once (on one GPU; the trees are separate folders, so only the device is
shared). Output folder, flat: ``stack-LANE.json`` (the summary, :data:`SUMMARY_VERSION`),
``stack-LANE.log`` (everything printed), and per PR ``tests-PR.log``, ``junit-PR.xml`` and, for
the earlier PRs' tests, ``tests-PR-earlier.log``, ``junit-PR-earlier.xml``.

Each run's record says which test files it named, what pytest collected (node id -> marks) and
deselected, and which warnings it counted (category, where raised, how many: the log's warnings
summary), so that the export's PR texts can state and account for them (:mod:`minicpmo_cg.export.gpuresults`).

With ``--figures`` (``--no-tests`` for figures alone) the release's tree and each vllm-omni PR's
tree then get their call-site figures (:mod:`minicpmo_cg.bench.tree_figures`), every tree's process
alive at once and taking turns block by block (:mod:`.figuresrun`), with the same packages as the
PR's tests but this project's package importable (the measuring code is not part of any PR): ``figures/<folder>.json`` and ``figures-<folder>.log`` per tree, and
``figures/compare.json`` relating each tree's outputs to the tree before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minicpmo_cg.export import pytestlog
from minicpmo_cg.offline_gpu import figuresrun, hostenv, payload, runner

STACK_FILE = "STACK.json"
BLOBS = "blobs.tar.xz"
#: The format of ``stack-LANE.json``: 2 gives each PR entry its ``runs`` (own and earlier PRs'
#: tests, each with files, collection and warnings); version 1 (no ``version`` field) had one run
#: per PR in the entry itself. The export's reader checks it.
SUMMARY_VERSION = 2
#: :attr:`StackPlan` scopes of a PR's runs, as the summary names them
OWN, EARLIER = "own", "earlier"
DEFAULT_PR_TIMEOUT_S = 150
#: the time limit of one tree's run of the earlier PRs' tests (they are several PRs' tests)
DEFAULT_EARLIER_TIMEOUT_S = 300
DEFAULT_JOBS = 1
DEFAULT_FIGURES_TIMEOUT_S = 150
FIGURES = "figures"
#: the CPU core each tree's figures process runs on once built (where the host has it)
FIGURES_CORE = 2
#: blocks of each tree per pass (:mod:`.figuresrun`): eager rounds, then as many graphed ones
FIGURES_ROUNDS = 3
DEFAULT_BUDGET_S = 540
_BLOCKER = 'raise ModuleNotFoundError("the exported tests must not import minicpmo_cg (this patch set\'s package)")\n'
_ENV_SNIPPET = (
    "import platform, importlib.metadata as m\n"
    "parts = [f'Python {platform.python_version()}']\n"
    "for d in ('torch', 'transformers', 'triton'):\n"
    "    try:\n"
    "        parts.append(f'{d} {m.version(d)}')\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "import torch\n"
    "if torch.version.cuda:\n"
    "    parts.append(f'CUDA {torch.version.cuda}')\n"
    "if torch.backends.cudnn.is_available():\n"
    "    parts.append(f'cuDNN {torch.backends.cudnn.version()}')\n"
    "parts.append(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')\n"
    "print(', '.join(parts))\n"
)


def stack_dir(bundle_dir: Path, lane: str) -> Path:
    return bundle_dir / f"stack-{lane}"


def read_stack(folder: Path) -> dict:
    return json.loads((folder / STACK_FILE).read_text(encoding="utf-8"))


@dataclass
class StackPlan:
    """What ``stack-run`` does (also what ``stack-run --dry-run`` prints)."""

    lane: str
    prs: list[str]
    python: str
    out: Path
    budget_s: int = DEFAULT_BUDGET_S
    pr_timeout_s: int = DEFAULT_PR_TIMEOUT_S
    #: replaces each PR's own marks when set
    markers: str | None = None
    extra: list[str] = field(default_factory=list)
    #: run each PR's tests; measure the trees' call-site figures
    tests: bool = True
    figures: bool = False
    figures_timeout_s: int = DEFAULT_FIGURES_TIMEOUT_S
    #: the figures' CPU logic check (``tree_figures --allow-cpu``), for a machine without CUDA
    figures_cpu: bool = False
    #: on each tree, also the earlier PRs' tests (apart from its own); their time limit
    earlier: bool = True
    earlier_timeout_s: int = DEFAULT_EARLIER_TIMEOUT_S
    #: how many pytest processes run at once
    jobs: int = DEFAULT_JOBS


def select(stack: dict, wanted: list[str]) -> list[str]:
    """The folders of ``wanted`` (folder names or their leading number / key), all when empty.

    Raises:
        ValueError: a name matches no PR of the stack, or several.
    """
    folders = [pr["folder"] for pr in stack["prs"]]
    if not wanted:
        return folders
    out = []
    for name in wanted:
        hits = [f for f in folders if f == name or f.split("-", 1)[0] == name or f.endswith(f"-{name}")]
        if len(hits) != 1:
            raise ValueError(f"PR {name!r} {'matches ' + ', '.join(hits) if hits else 'is not in the stack'} "
                             f"(PRs: {', '.join(folders)})")  # fmt: skip
        out.append(hits[0])
    return list(dict.fromkeys(out))


def earlier_files(stack: dict, folder: str) -> list[str]:
    """The earlier PRs' test files that PR ``folder`` leaves as they are (none for a vLLM PR)."""
    omni = [pr for pr in stack["prs"] if pr["kind"] == "vllm-omni"]
    at = next((i for i, pr in enumerate(omni) if pr["folder"] == folder), None)
    return [] if at is None else pytestlog.earlier_test_files(omni, at, key="run")


def units(plan: StackPlan, stack: dict, folder: str) -> list[tuple[str, list[str]]]:
    """``(scope, test files)`` of the pytest processes of one PR's tree: its own tests, then (unless
    ``--own-only``) the earlier PRs' ones."""
    pr = next(p for p in stack["prs"] if p["folder"] == folder)
    out = [(OWN, list(pr["run"]))] if pr["run"] else []
    earlier = earlier_files(stack, folder) if plan.earlier else []
    return out + ([(EARLIER, earlier)] if earlier else [])


def unit_name(folder: str, scope: str) -> str:
    """The stem of a run's files: ``PR`` for its own tests, ``PR-earlier`` for the earlier PRs'."""
    return folder if scope == OWN else f"{folder}-earlier"


def pytest_command(plan: StackPlan, pr: dict, ini: Path, tree: Path, scope: str = OWN,
                   files: list[str] | None = None) -> list[str]:  # fmt: skip
    marks = pr["marks"] if plan.markers is None else plan.markers
    argv = [plan.python, "-m", "pytest", "-c", str(ini), "--rootdir", str(tree), "-q", "-rs"]
    argv += ["-p", pytestlog.COLLECT_PLUGIN]
    argv += ["-m", marks] if marks else []
    junit = plan.out / f"junit-{unit_name(pr['folder'], scope)}.xml"
    argv += [f"--junitxml={junit}", *plan.extra, *(pr["run"] if files is None else files)]
    return argv


def _pytest_ini(path: Path, markers: list[str]) -> Path:
    """A pytest.ini as the export's checks write: vllm-omni's registered markers, strict."""
    lines = ["[pytest]", "addopts = --strict-markers -p no:cacheprovider", "markers ="]
    lines += [f"    {name}: registered by vllm-omni" for name in markers]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _package_files(root: Path, package: str) -> set[str]:
    base = root / package
    return {
        p.relative_to(root).as_posix()
        for p in base.rglob("*")
        if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts
    }


def overlay_packages(site: Path, pr: dict, blobs: Path, dest: Path) -> list[str]:
    """Copy (hard links) each top-level package the PR's overlay names from ``site`` to ``dest``
    and write the overlay over the copy: a path with a digest gets ``blobs/<digest>``, a path with
    null is removed. Returns the packages copied."""
    packages = sorted({rel.split("/", 1)[0] for rel in pr["overlay"]})
    for package in packages:
        target = dest / package
        shutil.rmtree(target, ignore_errors=True)
        try:
            shutil.copytree(site / package, target, copy_function=os.link,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        except OSError:  # another file system: plain copies
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(site / package, target, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, digest in pr["overlay"].items():
        path = dest / rel
        if path.exists() or path.is_symlink():
            path.unlink()  # never write through a hard link into the site
        if digest is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(blobs / digest, path)
    return packages


def check_package(stack: dict, pr: dict, site: Path, dest: Path) -> tuple[list[str], int]:
    """Compare the overlaid ``vllm_omni`` copy in ``dest`` with the PR's tree.

    Each file must have the overlay's bytes where the overlay names it, else the release wheel's;
    a wheel file that the bundle's site lacks too (dropped by the strip rules) may be absent.

    Returns:
        ``(problems, stripped)``: one line per differing, missing or extra file (the first 20);
        how many wheel files the strip rules left out.
    """
    if not (dest / "vllm_omni").is_dir():
        return [], 0
    overlay = {rel: d for rel, d in pr["overlay"].items() if rel.startswith("vllm_omni/")}
    expected = {**stack["base_files"], **overlay}
    expected = {rel: d for rel, d in expected.items() if d is not None}
    have = _package_files(dest, "vllm_omni")
    problems, stripped = [], 0
    for rel in sorted(set(expected) | have):
        if rel not in have:
            if rel not in overlay and not (site / rel).exists():
                stripped += 1
            else:
                problems.append(f"{rel}: missing")
        elif rel not in expected:
            problems.append(f"{rel}: not in the PR's tree")
        elif _sha_file(dest / rel) != expected[rel]:
            problems.append(f"{rel}: differs from the PR's tree")
    return problems[:20] + ([f"... {len(problems) - 20} more"] if len(problems) > 20 else []), stripped


def write_tree(pr: dict, blobs: Path, tree: Path) -> None:
    """The PR tree's ``tests/`` (every test file present at that PR) below ``tree``."""
    shutil.rmtree(tree, ignore_errors=True)
    for rel, digest in pr["tests"].items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blobs / digest, tree / rel)


def junit_counts(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """``({passed, failed, errors, skipped, xfailed}, {skip reason: count})`` of a pytest junit xml.

    pytest writes a ``<failure>`` per failed test, an ``<error>`` per error (a test whose setup or
    teardown failed gets one as well), ``<skipped type="pytest.xfail">`` per expected failure and
    ``<skipped>`` with the reason as ``message`` per skip; a test case with none of them passed.
    """
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped", "xfailed"), 0)
    reasons: dict[str, int] = {}
    if not path.is_file():
        return counts, reasons
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            counts["failed"] += 1
        elif "error" in tags:
            counts["errors"] += 1
        elif "skipped" in tags:
            skipped = tags["skipped"]
            if skipped.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
            else:
                counts["skipped"] += 1
                reason = (skipped.get("message") or "").strip()
                reason = re.sub(r"^Skipped: ", "", reason) or "no reason given"
                reasons[reason] = reasons.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return counts, reasons


def pytest_summary(log: Path) -> str | None:
    """pytest's last summary line without its duration (``12 passed, 3 skipped, 40 deselected``)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    pattern = r"\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran"
    lines = [line.strip("= ").strip() for line in text.splitlines() if re.search(pattern, line)]
    return re.sub(r"\s+in [\d.]+s.*$", "", lines[-1]) if lines else None


def _capture(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    try:
        proc = subprocess.run(
            argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=180, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return (
        lines[-1]
        if proc.returncode == 0 and lines
        else f"unknown ({(proc.stderr or proc.stdout).strip()[-300:]})"
    )


def host_facts(python: str, site: Path, work: Path) -> dict:
    """Date (UTC), device (``nvidia-smi`` name, memory, driver per GPU) and the software line."""
    env = {**os.environ, **hostenv.FIXED_ENV, "PYTHONPATH": str(site)}
    smi = _capture(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                   env, work)  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        #: None when nvidia-smi gave nothing (no GPU, no driver)
        "device": None if smi.startswith("unknown") else smi.replace("\n", "; "),
        "nvidia_smi": smi,
        "environment": _capture([python, "-c", _ENV_SNIPPET], env, work),
    }


def describe(plan: StackPlan, stack: dict, site: Path) -> str:
    """The plan as text: unpack step, then per PR its overlay and its pytest command."""
    earlier = (
        f", the earlier PRs' tests {plan.earlier_timeout_s} s per tree"
        if plan.earlier
        else ", own tests only"
    )
    lines = [
        f"# per-PR runs: lane {plan.lane}, PRs {' '.join(plan.prs)}, budget {plan.budget_s} s, "
        f"{plan.pr_timeout_s} s per PR's own tests{earlier}, {plan.jobs} pytest process(es) at once",
        f"install: unpack the lane's site.tar.xz into {site}; blobs.tar.xz into a temporary folder",
    ]
    by_folder = {pr["folder"]: pr for pr in stack["prs"]}
    files = []
    for folder in plan.prs:
        pr = by_folder[folder]
        vllm = (
            "pristine vLLM files" if any(r.startswith("vllm/") for r in pr["overlay"]) else "vLLM as bundled"
        )
        lines.append(f"[{folder}] overlay {len(pr['overlay'])} files ({vllm}), {len(pr['tests'])} test files")
        for scope, tests in units(plan, stack, folder):
            name = unit_name(folder, scope)
            argv = pytest_command(plan, pr, Path("TREE/pytest.ini"), Path("TREE"), scope, tests)
            lines.append(f"  {scope}: {' '.join(argv)} > {plan.out}/tests-{name}.log")
            files.append(f"tests-{name}.log junit-{name}.xml")
    if not plan.tests:
        lines = lines[:2] + ["tests: not run (--no-tests)"]
        files = []
    if plan.figures:
        trees = figure_trees(plan, stack)
        lines.append(
            f"figures: {' '.join(trees)}, all at once, each {' '.join(figures_command(plan, 'TREE', Path('OUT')))} "
            f"({plan.figures_timeout_s} s to build), {FIGURES_ROUNDS} eager then {FIGURES_ROUNDS} graphed rounds "
            f"of one block per tree (rotating order), then {FIGURES}/compare.json"
        )
        files += [f"{FIGURES}/{t}.json figures-{t}.log" for t in trees] + [f"{FIGURES}/compare.json"]
    lines.append(f"# files in {plan.out}: stack-{plan.lane}.json stack-{plan.lane}.log " + " ".join(files))
    return "\n".join(lines)


def figure_trees(plan: StackPlan, stack: dict) -> list[str]:
    """The trees ``--figures`` measures, in stack order: the release, then the selected vllm-omni PRs."""
    omni = [pr["folder"] for pr in stack["prs"] if pr["kind"] == "vllm-omni" and pr["folder"] in plan.prs]
    return [stack["release"]["folder"], *omni] if "release" in stack else omni


def figures_command(plan: StackPlan, label: str, out: Path) -> list[str]:
    """One tree's ``tree_figures measure --serve`` command (:mod:`.figuresrun` feeds it blocks)."""
    argv = [plan.python, "-m", "minicpmo_cg.bench.tree_figures", "measure", "--serve", "--label", label,
            "--out", str(out)]  # fmt: skip
    if plan.figures_cpu:
        return [*argv, "--allow-cpu"]
    # eager calls are bound by how fast the host launches kernels: once built, every tree's process
    # runs on the same core (only one of them computes at a time), so that no tree looks slower for
    # the core the scheduler gave it
    if (os.cpu_count() or 1) > FIGURES_CORE:
        return [*argv, "--pin-core", str(FIGURES_CORE)]
    return argv


def prepare_figures(plan: StackPlan, stack: dict, entry: dict, site: Path, blobs: Path, work: Path,
                    repo: Path) -> figuresrun.ServedTree | dict:  # fmt: skip
    """One tree's figures process, not started (``entry``: a PR of ``STACK.json`` or its
    ``release``), or its ``error`` result when the overlaid package is not the tree."""
    folder = entry["folder"]
    dest = work / f"figures-{folder}" / "pkgs"
    overlay_packages(site, entry, blobs, dest)
    problems, _ = check_package(stack, entry, site, dest)
    if problems:
        return _result(folder, entry["title"], "error", problems=problems)
    # this project's package alone (the checkout's own vllm_omni/ must not shadow the tree's)
    project = work / f"figures-{folder}" / "project"
    project.mkdir(parents=True, exist_ok=True)
    (project / "minicpmo_cg").symlink_to(repo / "minicpmo_cg", target_is_directory=True)
    env = {**os.environ, **hostenv.FIXED_ENV, "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(dest), str(project), str(site)])
    out = plan.out / FIGURES
    out.mkdir(parents=True, exist_ok=True)
    return figuresrun.ServedTree(folder, figures_command(plan, folder, out), env, work,
                                 plan.out / f"figures-{folder}.log")  # fmt: skip


def _figures(plan: StackPlan, stack: dict, site: Path, blobs: Path, work: Path, repo: Path, started: float,
             say: Any) -> list[dict]:  # fmt: skip
    entries = {pr["folder"]: pr for pr in stack["prs"]}
    if "release" in stack:
        entries[stack["release"]["folder"]] = stack["release"]
    say("=" * 100)
    results: dict[str, dict] = {}
    served: list[figuresrun.ServedTree] = []
    for folder in figure_trees(plan, stack):
        prepared = prepare_figures(plan, stack, entries[folder], site, blobs, work, repo)
        if isinstance(prepared, dict):
            say(
                f"[figures {folder}] ERROR: the overlaid package is not the tree:\n  "
                + "\n  ".join(prepared["problems"])
            )
            results[folder] = prepared
        else:
            served.append(prepared)
    deadline = started + plan.budget_s
    left = deadline - time.monotonic()
    if served and left < runner.MIN_PART_S:
        say(f"[figures] SKIPPED: only {left:.0f} s of the {plan.budget_s} s budget left")
        served, skipped = [], served
        for tree in skipped:
            results[tree.label] = _result(
                tree.label, entries[tree.label]["title"], "skipped", reason="budget spent"
            )
    t0 = time.monotonic()
    codes = figuresrun.interleave(served, rounds=FIGURES_ROUNDS, ready_s=min(plan.figures_timeout_s, left),
                                  deadline=deadline, say=say) if served else {}  # fmt: skip
    out = plan.out / FIGURES
    for tree in served:
        rc = codes.get(tree.label)
        ok = rc == 0 and not tree.error and (out / f"{tree.label}.json").is_file()
        status = "ok" if ok else ("timeout" if tree.timed_out else "failed")
        results[tree.label] = _result(tree.label, entries[tree.label]["title"], status, returncode=rc,
                                      seconds=round(time.monotonic() - t0, 1), log=tree.log.name,
                                      command=tree.argv, blocks=tree.blocks,
                                      **({"error": tree.error} if tree.error else {}))  # fmt: skip
        say(runner.log_excerpt(tree.log, 4))
        say(
            f"[figures {tree.label}] {status}"
            + (f": {tree.error}" if tree.error else f", {len(tree.blocks)} blocks")
        )
    done = [results[f] for f in figure_trees(plan, stack)]
    measured = [e["folder"] for e in done if e["status"] == "ok"]
    if measured:
        argv = [plan.python, "-m", "minicpmo_cg.bench.tree_figures", "compare", "--out", str(out), *measured]
        env = {**os.environ, **hostenv.FIXED_ENV, "PYTHONPATH": os.pathsep.join([str(repo), str(site)])}
        rc, _ = runner.run_limited(argv, plan.out / "figures-compare.log", env, work, 120)
        say(f"[figures] compare: exit {rc}")
        for pt in out.glob("*.pt"):  # the outputs are inputs of the comparison only
            pt.unlink()
    return done


def _result(folder: str, title: str, status: str, **extra) -> dict:
    return {"folder": folder, "title": title, "status": status, **extra}


@dataclass
class Tree:
    """One PR's tree, ready for its pytest processes (:func:`prepare_pr`)."""

    pr: dict
    tree: Path
    ini: Path
    env: dict[str, str]
    #: the entry fields of the summary that do not depend on a run
    base: dict


def prepare_pr(plan: StackPlan, stack: dict, pr: dict, site: Path, blobs: Path, work: Path) -> Tree | dict:
    """Overlay, check and write one PR's tree; its :class:`Tree`, or its summary entry with status
    ``error`` when the overlaid package is not the PR's tree."""
    dest, tree = work / pr["folder"] / "pkgs", work / pr["folder"] / "tree"
    packages = overlay_packages(site, pr, blobs, dest)
    problems, stripped = check_package(stack, pr, site, dest)
    base = {"kind": pr["kind"], "vllm_prs": pr["vllm_prs"], "series_fingerprint": pr.get("series_fingerprint"),
            "tree_fingerprint": pr.get("tree_fingerprint"), "packages_overlaid": packages, "stripped_files": stripped,
            "marks": pr["marks"] if plan.markers is None else plan.markers}  # fmt: skip
    if problems:
        return _result(pr["folder"], pr["title"], "error", problems=problems, **base)
    write_tree(pr, blobs, tree)
    # the tree is a source checkout of the PR: its package is the overlaid copy (tests that compare
    # the installed modules with the checkout's, or read the checkout's files, find the PR's own)
    (tree / "vllm_omni").symlink_to(dest / "vllm_omni", target_is_directory=True)
    blocker = work / pr["folder"] / "blocker"
    (blocker / "minicpmo_cg").mkdir(parents=True, exist_ok=True)
    (blocker / "minicpmo_cg" / "__init__.py").write_text(_BLOCKER, encoding="utf-8")
    pytestlog.write_collect_plugin(blocker)
    ini = _pytest_ini(work / pr["folder"] / "pytest.ini", stack["markers"])
    env = {**os.environ, **hostenv.FIXED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(dest), str(site)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return Tree(pr, tree, ini, env, base)


def run_unit(plan: StackPlan, ready: Tree, scope: str, files: list[str], limit: int) -> dict:
    """One pytest process of a prepared tree (its own tests, or the earlier PRs'); its record."""
    name = unit_name(ready.pr["folder"], scope)
    argv = pytest_command(plan, ready.pr, ready.ini, ready.tree, scope, files)
    log, junit = plan.out / f"tests-{name}.log", plan.out / f"junit-{name}.xml"
    collected = ready.ini.parent / f"collected-{scope}.json"
    junit.unlink(missing_ok=True)
    collected.unlink(missing_ok=True)
    env = {**ready.env, pytestlog.COLLECT_OUT: str(collected)}
    t0 = time.monotonic()
    rc, timed_out = runner.run_limited(argv, log, env, ready.tree, limit)
    seconds = round(time.monotonic() - t0, 1)
    counts, reasons = junit_counts(junit)
    output = log.read_text(errors="replace") if log.is_file() else ""
    collection = pytestlog.read_collection(collected)
    return {
        "scope": scope, "files": files, "marks": ready.base["marks"],
        "status": "timeout" if timed_out else ("ok" if rc in (0, 5) else "failed"),
        "returncode": rc, "seconds": seconds, "time_limit_s": limit, "summary": pytest_summary(log),
        "counts": counts, "skip_reasons": reasons, "warnings": pytestlog.warnings(output, ready.tree),
        "collected": collection.tests if collection else None,
        "deselected": collection.deselected if collection else None,
        "junit": junit.name, "log": log.name, "command": argv,
    }  # fmt: skip


#: how a PR's entry reads when its runs differ: the first of these that one of its runs has
_WORST = ("failed", "timeout", "skipped")


def pr_entry(ready: Tree, runs: list[dict]) -> dict:
    """A PR's summary entry from its runs: the worst run's status, the own run's summary."""
    statuses = {run["status"] for run in runs}
    status = next((s for s in _WORST if s in statuses), "ok")
    own = next((run for run in runs if run["scope"] == OWN), runs[0] if runs else {})
    return _result(ready.pr["folder"], ready.pr["title"], status, summary=own.get("summary"), runs=runs,
                   **ready.base)  # fmt: skip


def _tests(plan: StackPlan, stack: dict, site: Path, blobs: Path, work: Path, started: float,
           say: Any) -> list[dict]:  # fmt: skip
    """Prepare each PR's tree in stack order, then run the pytest processes of every tree, up to
    ``plan.jobs`` at once, each under its time limit and what the budget has left when it starts;
    the summary entries in stack order."""
    by_folder = {pr["folder"]: pr for pr in stack["prs"]}
    lock = threading.Lock()

    def tell(text: str) -> None:
        with lock:
            say(text)

    trees: dict[str, Tree | dict] = {}
    for folder in plan.prs:
        ready = prepare_pr(plan, stack, by_folder[folder], site, blobs, work)
        trees[folder] = ready
        if isinstance(ready, dict):
            tell(
                f"[{folder}] ERROR: the overlaid package is not the PR's tree:\n  "
                + "\n  ".join(ready["problems"])
            )

    def one(folder: str, scope: str, files: list[str]) -> dict:
        ready = trees[folder]
        left = plan.budget_s - (time.monotonic() - started)
        timeout = plan.pr_timeout_s if scope == OWN else plan.earlier_timeout_s
        name = f"{folder} {scope}"
        if left < min(runner.MIN_PART_S, timeout):
            tell(f"[{name}] SKIPPED: only {left:.0f} s of the {plan.budget_s} s budget left")
            return {"scope": scope, "files": files, "marks": ready.base["marks"], "status": "skipped",
                    "reason": "budget spent"}  # fmt: skip
        run = run_unit(plan, ready, scope, files, int(min(timeout, left)))
        tell("=" * 100 + f"\n[{name}] {' '.join(run['command'])}   (time limit {run['time_limit_s']} s)")
        tell(runner.log_excerpt(plan.out / run["log"], 8))
        tell(
            f"[{name}] {run['status']} (exit {run['returncode']}) in {run['seconds']:.0f} s: {run['summary']}"
        )
        return run

    jobs = [(folder, scope, files) for folder in plan.prs if not isinstance(trees[folder], dict)
            for scope, files in units(plan, stack, folder)]  # fmt: skip
    with ThreadPoolExecutor(max_workers=max(1, plan.jobs)) as pool:
        done = list(pool.map(lambda job: one(*job), jobs))
    entries = []
    for folder in plan.prs:
        ready = trees[folder]
        if isinstance(ready, dict):
            entries.append(ready)
            continue
        entries.append(pr_entry(ready, [run for job, run in zip(jobs, done) if job[0] == folder]))
    return entries


def execute(plan: StackPlan, stack_folder: Path, lane_dir: Path, site: Path, repo: Path,
            installed_site: bool = False) -> int:  # fmt: skip
    """Unpack the bundle (unless ``installed_site``: ``site`` is a ready site-packages), run the PRs.

    Returns:
        0 when every PR's tests passed, 1 when one failed, timed out, was skipped or its package
        check failed, 3 when the bundle is not the one the overlays were built against, 4 when the
        bundle or the overlays are missing.
    """
    started = time.monotonic()
    plan.out.mkdir(parents=True, exist_ok=True)
    say = runner.Console(plan.out / f"stack-{plan.lane}.log")
    stack = read_stack(stack_folder)
    summary_path = plan.out / f"stack-{plan.lane}.json"
    doc = {"version": SUMMARY_VERSION, "lane": plan.lane, "budget_s": plan.budget_s,
           "pr_timeout_s": plan.pr_timeout_s, "jobs": plan.jobs,
           "earlier_timeout_s": plan.earlier_timeout_s if plan.earlier else None,
           "stack_built_at": stack.get("built_at"), "stack_commit": stack.get("commit"),
           "vllm": stack.get("vllm"), "vllm_omni": stack.get("vllm_omni"), "site": str(site), "prs": []}  # fmt: skip
    try:
        say(
            f"per-PR runs, lane {plan.lane}: {' '.join(plan.prs)} | budget {plan.budget_s} s | out {plan.out}"
        )
        if installed_site:
            say(f"install: using the installed site-packages {site} (not the bundle)")
            doc["bundle"] = "installed site-packages (not the bundle)"
        else:
            installed = hostenv.install(lane_dir, site, repo, plan.python)
            say(installed.message)
            doc["bundle"] = installed.status.message
            if installed.code:
                summary_path.write_text(json.dumps({**doc, "install_failed": True}, indent=2) + "\n")
                return installed.code
            want = stack["bundle"]["archive_sha256"]
            if installed.status.manifest.get("archive_sha256") != want:
                say(f"FATAL: the overlays in {stack_folder} were built against bundle archive {want}, "
                    f"this bundle is {installed.status.manifest.get('archive_sha256')}: run `stack` again")  # fmt: skip
                summary_path.write_text(json.dumps({**doc, "install_failed": True}, indent=2) + "\n")
                return payload.STALE
        work = Path(tempfile.mkdtemp(prefix=f"minicpmo-cg-stack-{plan.lane}-"))
        with tarfile.open(stack_folder / BLOBS) as tf:
            tf.extractall(work, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(work)
        blobs = work / "blobs"
        doc.update(host_facts(plan.python, site, work))
        say(f"device: {doc['device']}\nsoftware: {doc['environment']}")
        if plan.tests:
            doc["prs"] = _tests(plan, stack, site, blobs, work, started, say)
        if plan.figures:
            doc["figures"] = _figures(plan, stack, site, blobs, work, repo, started, say)
        shutil.rmtree(work, ignore_errors=True)
        say("=" * 100)
        say(f"SUMMARY per-PR runs {plan.lane} (total {time.monotonic() - started:.0f} s):")
        for entry in doc["prs"]:
            say(f"  {entry['folder']:26s} {entry['status']:8s} {entry.get('summary') or ''}")
            for run in entry.get("runs", []):
                if run["scope"] == EARLIER:
                    say(f"  {'  earlier PRs tests':26s} {run['status']:8s} {run.get('summary') or ''}")
        for entry in doc.get("figures", []):
            say(f"  figures {entry['folder']:18s} {entry['status']:8s}")
        runs = doc["prs"] + doc.get("figures", [])
        doc["ok"] = bool(runs) and all(e["status"] == "ok" for e in runs)
        summary_path.write_text(json.dumps(doc, indent=2) + "\n")
        say(f"  summary: {summary_path}")
        return 0 if doc["ok"] else 1
    finally:
        say.close()
