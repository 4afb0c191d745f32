"""Each PR's test runs on a GPU host, read from the summary that ``stack-run`` writes.

``python3 -m minicpmo_cg.offline_gpu stack-run LANE --out OUT`` runs, on every PR's own tree (the
release with it and the earlier PRs applied, not the whole stack), the PR's own tests and the
earlier PRs' tests apart, and writes ``OUT/stack-LANE.json``
(:mod:`minicpmo_cg.offline_gpu.stackrun`). ``export --gpu-results FILE`` turns each run into a
:class:`~minicpmo_cg.export.prtext.PytestRun` of that PR's Test Result, under its scope (own or
earlier PRs' tests). An entry counts only for the tree it ran on: its tree fingerprint must equal
that of the exported PR's tree (:func:`~minicpmo_cg.export.gitseries.tree_fingerprint`: the code and
tests of the vLLM PRs it needs and of the vllm-omni PRs up to it, not their authors, messages or
design pages, so a re-export with ``--author`` keeps the runs and a change to an earlier PR's code
drops them). A summary written before entries carried a tree fingerprint matches by its series'
whole-mbox fingerprint (:func:`~minicpmo_cg.export.gitseries.authored_series_fingerprint`), an
export identical to the run's;
a PR with no usable entry keeps its "Not run" line.

Summaries carry a ``version`` (:data:`READS`). Version 1 (no ``version`` field, written before the
earlier PRs' tests ran on each tree) has one run per entry, the PR's own tests; its test files are
read from the entry's command, and its warnings from its log when the log lies beside the summary.
"""

from __future__ import annotations

import json
from pathlib import Path

from minicpmo_cg.export import pytestlog
from minicpmo_cg.export.gitseries import authored_series_fingerprint, series_fingerprint, tree_fingerprint
from minicpmo_cg.export.prtext import EARLIER, OWN, PytestRun
from minicpmo_cg.export.pytestlog import Collection

__all__ = ["READS", "gpu_runs", "pr_tree_fingerprints"]

#: the summary versions this reader understands (``stack-run``'s ``SUMMARY_VERSION``)
READS = (1, 2)


def _where(doc: dict, entry: dict) -> str:
    """Where the run was: the interpreter line, the date, the GPU host (or its absence), vLLM."""
    device = doc.get("device")
    host = f"on an offline GPU host ({device})" if device else "on a machine without a GPU"
    vllm = f"vLLM {doc.get('vllm', '?')}'s Python code without its compiled kernels"
    if entry.get("kind") != "vllm":
        vllm += ", with the vLLM change this PR depends on" if entry.get("vllm_prs") else ", as released"
    return (
        f"{doc.get('environment', 'environment not recorded')}, {doc.get('date', 'no date')}, {host}; {vllm}"
    )


def _version(doc: dict, path: Path) -> int:
    version = doc.get("version", 1)
    if version not in READS:
        raise ValueError(
            f"{path}: a `stack-run` summary of version {version!r}; this export reads versions "
            f"{', '.join(map(str, READS))} (run the export from the checkout that ran stack-run)"
        )
    return version


def _v1_runs(entry: dict, folder: Path) -> list[dict]:
    """A version 1 entry as the one run it was (its own tests): files from its command, warnings
    from its log when the log lies beside the summary."""
    if "summary" not in entry:
        return []
    files = [a for a in entry.get("command") or [] if a.endswith(".py") and not a.startswith("-")]
    log = folder / entry["log"] if entry.get("log") else None
    warnings = pytestlog.warnings(log.read_text(errors="replace"), "") if log and log.is_file() else None
    run = {
        key: entry.get(key)
        for key in ("marks", "status", "summary", "counts", "skip_reasons", "time_limit_s")
    }
    return [{**run, "scope": OWN, "files": files, "warnings": warnings}]


def _ran_nothing(run: dict) -> bool:
    return run.get("status") == "ok" and not sum((run.get("counts") or {}).values())


def _pytest_run(doc: dict, entry: dict, run: dict) -> PytestRun:
    status = run.get("status")
    summary = run.get("summary")
    if status == "timeout":
        summary = f"stopped at its {run.get('time_limit_s')} s time limit; {summary or 'no summary'}"
    collection = (
        Collection(dict(run["collected"]), list(run.get("deselected") or []))
        if run.get("collected") is not None
        else None
    )
    warned = " warning" in (run.get("summary") or "")
    return PytestRun(
        run.get("marks", ""),
        summary,
        dict(run.get("skip_reasons") or {}),
        _where(doc, entry),
        status == "ok",
        dict(run.get("warnings") or {}),
        files=list(run.get("files") or []),
        scope=EARLIER if run.get("scope") == "earlier" else OWN,
        collection=collection,
        warnings_unknown=warned and run.get("warnings") is None,
        on_gpu=bool(doc.get("device")),
    )


def pr_tree_fingerprints(prs: list) -> dict[str, str]:
    """Folder -> :func:`~minicpmo_cg.export.gitseries.tree_fingerprint` of the PR's tree: the series
    of the vLLM PRs it or an earlier PR needs (``vllm``, in folder order), then those of its earlier
    PRs (``depends``, stack order) and its own; a PR without those attributes is its own tree. The
    same tree :mod:`minicpmo_cg.offline_gpu.stackbuild` records for the run."""
    by_folder = {pr.folder: pr for pr in prs}
    series = {pr.folder: series_fingerprint(list(pr.series)) for pr in prs}  # each series read once
    out = {}
    for pr in prs:
        chain = [*getattr(pr, "depends", []), pr.folder]
        vllm = sorted({v for folder in chain for v in getattr(by_folder[folder], "vllm", [])})
        out[pr.folder] = tree_fingerprint([series[f] for f in [*vllm, *chain]])
    return out


def gpu_runs(paths: list[Path], prs: list) -> tuple[dict[str, list[PytestRun]], list[str]]:
    """The GPU runs of ``paths`` (``stack-LANE.json`` files; for a PR in several, the last one's
    entry counts) for the exported ``prs`` (folder, series; ``depends`` and ``vllm`` where they have them).

    Returns:
        ``(runs, notes)``: folder -> its runs (own, then the earlier PRs' tests; only PRs with a
        usable entry), and one line per PR and what became of its entry.

    Raises:
        ValueError: a path is not such a summary, or one of a version this export does not read.
    """
    by_folder: dict[str, tuple[dict, dict, Path, list[dict]]] = {}
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc.get("prs"), list) or "lane" not in doc:
            raise ValueError(f"{path}: not a summary of `stack-run` (no lane / prs)")
        version = _version(doc, path)
        for entry in doc["prs"]:
            runs = _v1_runs(entry, path.parent) if version == 1 else list(entry.get("runs") or [])
            by_folder[entry["folder"]] = (doc, entry, path, runs)
    found: dict[str, list[PytestRun]] = {}
    notes = []
    trees = pr_tree_fingerprints(prs)
    for pr in prs:
        if pr.folder not in by_folder:
            notes.append(f"{pr.folder}: in no summary given; its Test Result says its GPU tests were not run")
            continue
        doc, entry, path, runs = by_folder[pr.folder]
        if entry.get("tree_fingerprint"):
            same = entry["tree_fingerprint"] == trees[pr.folder]
        else:
            same = entry.get("series_fingerprint") == authored_series_fingerprint(list(pr.series))
        if not same:
            notes.append(
                f"{pr.folder}: {path.name} ran another version of its tree (this PR, an earlier one or a vLLM PR it needs); not used"
            )
            continue
        if entry.get("status") == "error" or not runs:
            notes.append(
                f"{pr.folder}: {entry.get('status')} in {path.name} ({entry.get('reason') or entry.get('problems')})"
            )
            continue
        for run in runs:
            which = "its own tests" if run.get("scope") != "earlier" else "the earlier PRs' tests"
            if _ran_nothing(run):
                notes.append(f"{pr.folder}: no test of -m {run.get('marks')!r} in {which}; nothing to report")
            elif run.get("status") not in ("ok", "failed", "timeout"):
                notes.append(
                    f"{pr.folder}: {which}: {run.get('status')} in {path.name} ({run.get('reason')})"
                )
            else:
                found.setdefault(pr.folder, []).append(_pytest_run(doc, entry, run))
                notes.append(f"{pr.folder}: {which}, run of {doc.get('date')} ({doc.get('device') or 'no GPU'}): "
                             f"{run.get('summary')}")  # fmt: skip
    return found, notes
