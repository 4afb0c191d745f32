"""What the commands print: a table that fits 120 columns, details on request, or one JSON object."""

from __future__ import annotations

import textwrap

from minicpmo_cg.patchtool.commands import Outcome
from minicpmo_cg.patchtool.errors import PROG
from minicpmo_cg.patchtool.journal import describe_files
from minicpmo_cg.patchtool.views import APPLIED, CONFLICT, NOT_APPLICABLE, UPSTREAM, Plan

__all__ = ["WIDTH", "render_json", "render_text"]

WIDTH = 120
_QUIET_STATES = (APPLIED, UPSTREAM, NOT_APPLICABLE, "installed")


def elide(text: str, width: int) -> str:
    """``text`` shortened in the middle with ``...`` to at most ``width`` characters."""
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    head = (width - 3 + 1) // 2
    tail = width - 3 - head
    return text[:head] + "..." + (text[-tail:] if tail else "")


def elide_path(path: str, width: int) -> str:
    """A path shortened to ``first/.../last parts`` (whole components) when it can, else :func:`elide`."""
    if len(path) <= width:
        return path
    parts = path.split("/")
    for keep in range(len(parts) - 2, 0, -1):
        candidate = "/".join([parts[0], "...", *parts[-keep:]])
        if len(candidate) <= width:
            return candidate
    return elide(path, width)


def fit_columns(
    rows: list[tuple[str, ...]], width: int = WIDTH, shrinkable: tuple[int, ...] = (0, 1)
) -> list[str]:
    """Left-aligned columns two spaces apart; the widest shrinkable column is elided until a row fits."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    while sum(widths) + 2 * (len(widths) - 1) > width:
        column = max(shrinkable, key=lambda i: widths[i])
        if widths[column] <= 12:
            break
        widths[column] -= 1
    lines = []
    for row in rows:
        cells = [
            (elide_path if "/" in cell else elide)(cell, widths[i]).ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    rows = []
    for report in plan.reports:
        for i, rel in enumerate(report.patch.file_paths):
            rows.append((report.patch.name, rel, report.state, report.detail if i == 0 else ""))
    listed = {rel for r in plan.reports for rel in r.patch.file_paths}
    for view in plan.files.values():
        if view.role == "patch" and view.rel not in listed:
            detail = (
                view.conflict
                or "changed by an earlier apply; no longer in the series: apply/revert restore it"
            )
            rows.append(("(recorded only)", view.rel, CONFLICT if view.conflict else "stale", detail))
    rows += [("owned", o.rel, o.state, o.detail) for o in plan.owned]
    return rows


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(f"{label}{text}", WIDTH, subsequent_indent="    ", break_on_hyphens=False)


def _header(command: str, plan: Plan, verbose: bool) -> list[str]:
    inst = plan.install
    first = f"{PROG} {command}: {inst.site}"
    lines = [first if verbose else elide(first, WIDTH)]
    lines.append(
        f"installed: vllm {inst.versions['vllm']}, vllm-omni {inst.versions['vllm-omni']} (lane: {inst.lane})"
    )
    if verbose:
        lines.append(f"state: {plan.store.root}; patch program: {plan.patch_program or '(not needed)'}")
    return lines


def _table(plan: Plan, verbose: bool) -> list[str]:
    rows = _rows(plan)
    if verbose:
        table = [("PATCH", "TARGET", "STATE", "DETAIL"), *rows]
        return fit_columns(table, width=10**6)
    lines = fit_columns([("PATCH", "TARGET", "STATE"), *[r[:3] for r in rows]])
    details = [(name, detail) for name, _, state, detail in rows if detail and state not in _QUIET_STATES]
    seen = set()
    for name, detail in details:
        if (name, detail) not in seen:
            seen.add((name, detail))
            lines += _wrapped(f"  {name}: ", detail)
    return lines


def render_text(command: str, plan: Plan, outcome: Outcome, verbose: bool = False) -> str:
    """The report on stdout: header, table (details of problem rows below it), notes and the result."""
    lines = _header(command, plan, verbose) + _table(plan, verbose)
    if verbose:
        lines.append("files:")
        lines += [f"  {line}" for line in describe_files(plan, plan.files)]
    for note in plan.notes:
        lines += _wrapped("note: ", note)
    for rel in outcome.changed:
        lines.append(f"{'wrote' if (plan.install.site / rel).exists() else 'removed'}: {rel}")
    for warning in outcome.warnings:
        lines += _wrapped("warning: ", warning)
    if outcome.message:
        lines += _wrapped("", outcome.message)
    lines += [f"  {line}" for line in outcome.states]
    if not verbose and any(r[3] for r in _rows(plan)):
        lines.append("(details: --verbose or --json)")
    return "\n".join(lines) + "\n"


def render_json(command: str, plan: Plan, outcome: Outcome) -> dict:
    """One JSON object: versions, lane, per-patch and per-file states, conflicts, changes."""
    adapter = plan.adapter
    owned = [
        {"path": o.rel, "state": o.state, "detail": o.detail, "source": str(o.source) if o.source else None}
        for o in plan.owned
    ]
    return {
        "command": command,
        "ok": outcome.exit_code == 0,
        "exit_code": outcome.exit_code,
        "result": outcome.result,
        "message": outcome.message,
        "site_packages": str(plan.install.site),
        "versions": dict(plan.install.versions),
        "lane": plan.install.lane,
        "patches_dir": str(plan.patches_dir),
        "state_dir": str(plan.store.root),
        "patch_program": plan.patch_program,
        "patches": [
            {
                "name": r.patch.name,
                "package": r.patch.package,
                "subject": r.patch.subject,
                "files": list(r.patch.file_paths),
                "state": r.state,
                "detail": r.detail,
            }
            for r in plan.reports
        ],
        "adapter": {
            "path": adapter.rel,
            "state": adapter.state,
            "detail": adapter.detail,
            "source": str(adapter.source),
        },
        "owned": owned,
        "files": describe_files(plan, plan.files),
        "journal": {
            "present": plan.record_present,
            "complete": plan.loaded.complete if plan.loaded else None,
        },
        "conflicts": plan.apply_conflicts() if command != "revert" else plan.revert_conflicts(),
        "notes": list(plan.notes),
        "changed": list(outcome.changed),
        "states": list(outcome.states),
        "warnings": list(outcome.warnings),
    }
