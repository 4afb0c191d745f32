"""Each PR's own test run on a GPU host, read from the summary that ``stack-run`` writes.

``python3 -m minicpmo_cg.offline_gpu stack-run LANE --out OUT`` runs every PR's tests from that
PR's own tree (the release with it and the earlier PRs applied, not the whole stack) and writes
``OUT/stack-LANE.json`` (:mod:`minicpmo_cg.offline_gpu.stackrun`). ``export --gpu-results FILE``
turns each entry into a :class:`~minicpmo_cg.export.prtext.PytestRun` of that PR's Test Result.
An entry counts only for the series it ran: its series fingerprint must equal the exported
series' (:func:`~minicpmo_cg.export.gitseries.series_fingerprint`); a PR with no usable entry keeps
its "Not run" line.
"""

from __future__ import annotations

import json
from pathlib import Path

from minicpmo_cg.export.gitseries import series_fingerprint
from minicpmo_cg.export.prtext import PytestRun

__all__ = ["gpu_runs"]


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


def gpu_runs(paths: list[Path], prs: list) -> tuple[dict[str, list[PytestRun]], list[str]]:
    """The GPU runs of ``paths`` (``stack-LANE.json`` files; for a PR in several, the last one's
    entry counts) for the exported ``prs`` (folder, series).

    Returns:
        ``(runs, notes)``: folder -> its one run (only PRs with a usable entry), and one line per
        PR and what became of its entry.

    Raises:
        ValueError: a path is not such a summary.
    """
    by_folder: dict[str, tuple[dict, dict, str]] = {}
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc.get("prs"), list) or "lane" not in doc:
            raise ValueError(f"{path}: not a summary of `stack-run` (no lane / prs)")
        by_folder.update({entry["folder"]: (doc, entry, path.name) for entry in doc["prs"]})
    runs: dict[str, list[PytestRun]] = {}
    notes = []
    for pr in prs:
        if pr.folder not in by_folder:
            notes.append(f"{pr.folder}: in no summary given; its Test Result says its GPU tests were not run")
            continue
        doc, entry, name = by_folder[pr.folder]
        if entry.get("series_fingerprint") != series_fingerprint(list(pr.series)):
            notes.append(f"{pr.folder}: {name} ran another version of this series; not used")
            continue
        status = entry.get("status")
        counts = entry.get("counts") or {}
        if status == "ok" and not sum(counts.values()):
            notes.append(f"{pr.folder}: no test of -m {entry.get('marks')!r} in its files; nothing to report")
            continue
        if status in ("ok", "failed"):
            summary = entry.get("summary")
        elif status == "timeout":
            summary = f"stopped at its {entry.get('time_limit_s')} s time limit; {entry.get('summary') or 'no summary'}"
        else:
            notes.append(f"{pr.folder}: {status} in {name} ({entry.get('reason') or entry.get('problems')})")
            continue
        runs[pr.folder] = [
            PytestRun(
                entry.get("marks", ""),
                summary,
                dict(entry.get("skip_reasons") or {}),
                _where(doc, entry),
                status == "ok",
            )
        ]
        notes.append(f"{pr.folder}: run of {doc.get('date')} ({doc.get('device') or 'no GPU'}): {summary}")
    return runs, notes
