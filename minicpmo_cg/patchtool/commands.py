"""``check``, ``apply``, ``revert`` and ``base``: what each does with a plan."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.patchtool import fsops, journal
from minicpmo_cg.patchtool.errors import EXIT_CONFLICT, EXIT_ERROR, EXIT_OK, PROG, ToolError
from minicpmo_cg.patchtool.gnupatch import GnuPatch, PatchToolMissingError, ambiguous_hunks, summarize_failure
from minicpmo_cg.patchtool.series import Patch, package_relpath_problem
from minicpmo_cg.patchtool.state import StateRecord
from minicpmo_cg.patchtool.views import (
    CONFLICT,
    NOT_APPLICABLE,
    PENDING,
    UPSTREAM,
    Plan,
    link_problem,
    read_file,
)

__all__ = ["Outcome", "cmd_apply", "cmd_base", "cmd_check", "cmd_revert"]


@dataclass
class Outcome:
    """What a command did: ``result`` word, written files, the exit code and the lines to show."""

    result: str
    exit_code: int
    changed: list[str] = field(default_factory=list)
    message: str = ""
    states: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _changes(plan: Plan, target: dict[str, bytes | None]) -> dict[str, bytes | None]:
    return {rel: data for rel, data in target.items() if data != plan.files[rel].current}


def _same(a: StateRecord | None, b: StateRecord | None) -> bool:
    return (a.to_json() if a else None) == (b.to_json() if b else None)


def cmd_check(plan: Plan) -> Outcome:
    conflicts = plan.apply_conflicts()
    if conflicts:
        return Outcome(
            "conflict", EXIT_CONFLICT, message=f"check: {len(conflicts)} conflict(s); apply would be refused"
        )
    pending = [r for r in plan.reports if r.state == PENDING]
    extra = " and copy the owned files" if any(o.state in ("missing", "outdated") for o in plan.owned) else ""
    if pending or extra:
        return Outcome("ok", EXIT_OK, message=f"check: apply would apply {len(pending)} patch(es){extra}")
    return Outcome("ok", EXIT_OK, message="check: nothing to apply")


def _finish(command: str, plan: Plan, result: journal.WriteResult, done_message: str) -> Outcome:
    root = plan.store.root
    if result.exit_code == EXIT_ERROR:
        message = f"{command} failed ({result.error}); rolled back: no file was changed"
        return Outcome("failed", EXIT_ERROR, message=message, states=result.states)
    if result.error is not None:
        message = (
            f"{command} stopped part-way ({result.error}); the journal in {root} records every file, "
            "so apply finishes and revert undoes it; the files now hold:"
        )
        return Outcome("incomplete", result.exit_code, message=message, states=result.states)
    outcome = Outcome(
        {"apply": "applied", "revert": "reverted"}[command], result.exit_code, result.changed, done_message
    )
    outcome.warnings = result.warnings
    if result.exit_code != EXIT_OK:
        outcome.result = "incomplete"
        outcome.message = f"{done_message}, but {root} could not be removed; re-run revert"
    return outcome


def cmd_apply(plan: Plan) -> Outcome:
    conflicts = plan.apply_conflicts()
    if conflicts:
        return Outcome(
            "conflict",
            EXIT_CONFLICT,
            message=f"apply refused: {len(conflicts)} conflict(s); no file was changed",
        )
    changes = _changes(plan, plan.apply_contents)
    if not changes and _same(plan.loaded, plan.new_record) and not plan.litter and not plan.leftover:
        return Outcome("unchanged", EXIT_OK, message="apply: nothing to do, everything is already applied")
    result = journal.execute(plan, plan.apply_contents, plan.new_record, reverting=False)
    if changes:
        done = f"apply: wrote {len(changes)} file(s)"
    else:
        done = "apply: files already in place; state record updated"
    return _finish("apply", plan, result, done)


def cmd_revert(plan: Plan) -> Outcome:
    conflicts = plan.revert_conflicts()
    if conflicts:
        return Outcome(
            "conflict",
            EXIT_CONFLICT,
            message=f"revert refused: {len(conflicts)} conflict(s); no file was changed",
        )
    changes = _changes(plan, plan.revert_contents)
    if not changes and not plan.store.root.exists() and not plan.litter:
        return Outcome("unchanged", EXIT_OK, message="revert: nothing to revert")
    result = journal.execute(plan, plan.revert_contents, None, reverting=True)
    return _finish("revert", plan, result, f"revert: restored {len(changes)} file(s)")


# base: the starting file of a new or refreshed patch


def _find_patch(plan: Plan, name: str) -> Patch:
    patches = [r.patch for r in plan.reports]
    exact = [p for p in patches if p.name == name or p.name == name.removeprefix("patches/")]
    by_file = [p for p in patches if p.path.name == name]
    found = exact or by_file
    if len(found) != 1:
        known = ", ".join(p.name for p in patches)
        what = "is ambiguous" if found else "is not in the series"
        raise ToolError(f"{PROG}: base --before {name}: {what} (patches: {known})")
    return found[0]


def _base_contents(
    plan: Plan, rels: list[str], before: Patch | None
) -> tuple[dict[str, bytes | None], list[str]]:
    """Pre-apply content of ``rels`` with every active patch of the series before ``before`` applied."""
    contents: dict[str, bytes | None] = {}
    for rel in rels:
        view = plan.files.get(rel)
        if view is not None and view.conflict:
            raise ToolError(f"{PROG}: base: {rel}: {view.conflict}")
        problem = link_problem(plan.install.site, rel)
        if view is None and problem:
            raise ToolError(f"{PROG}: base: {rel} {problem}")
        contents[rel] = view.pristine if view is not None else read_file(plan.install.site / rel)
    used: list[str] = []
    for report in plan.reports:
        if before is not None and report.patch.name == before.name:
            break
        patch = report.patch
        if not set(patch.file_paths) & set(rels) or report.state in (UPSTREAM, NOT_APPLICABLE):
            continue
        if report.state == CONFLICT:
            raise ToolError(
                f"{PROG}: base: earlier patch {patch.name} is a conflict ({report.detail}); fix it first"
            )
        if not set(patch.file_paths) <= set(rels):
            contents.update(
                {rel: plan.files[rel].pristine for rel in patch.file_paths if rel not in contents}
            )
        try:
            run = GnuPatch().run(patch.diff, {rel: contents[rel] for rel in patch.file_paths})
        except PatchToolMissingError as exc:
            raise ToolError(f"{PROG}: {exc}") from None
        if not run.ok or ambiguous_hunks(patch.files, {rel: contents[rel] for rel in patch.file_paths}):
            raise ToolError(
                f"{PROG}: base: earlier patch {patch.name} does not apply: {summarize_failure(run.output)}"
            )
        assert run.contents is not None
        contents.update(run.contents)
        used.append(patch.name)
    return {rel: contents[rel] for rel in rels}, used


def _write_base(path: Path, data: bytes) -> None:
    if os.path.lexists(path) and fsops.read_regular(path) != data:
        raise ToolError(f"{PROG}: base: {path} exists with other content; remove it or pick another --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def cmd_base(plan: Plan, rels: list[str], before_name: str | None, out: Path) -> Outcome:
    """Write ``out/a/<rel>`` and ``out/b/<rel>``: the file a new (or refreshed) patch is diffed from.

    Raises:
        ToolError: no file named, a file outside ``vllm/`` and ``vllm_omni/`` (absolute, with
            ``..``), an unknown patch, an earlier patch that does not apply, an output file
            that exists with other content, or an output that cannot be written (exit 2).
    """
    before = _find_patch(plan, before_name) if before_name else None
    rels = list(rels) or (list(before.file_paths) if before else [])
    if not rels:
        raise ToolError(
            f"{PROG}: base: name the file(s) (site-relative, e.g. vllm_omni/...) or pass --before PATCH"
        )
    for rel in rels:  # a patch can only change files there, and out/a/<rel> must stay inside out/a
        problem = package_relpath_problem(rel)
        if problem:
            raise ToolError(f"{PROG}: base: {rel!r} {problem}; name it relative to site-packages")
    if os.path.lexists(out) and not out.is_dir():
        raise ToolError(f"{PROG}: base: --out {out} exists and is not a directory; pick another --out")
    contents, used = _base_contents(plan, rels, before)
    written = []
    for rel, data in contents.items():
        for side in ("a", "b"):
            path = out / side / rel
            try:
                _write_base(path, data or b"")
            except OSError as exc:
                raise ToolError(f"{PROG}: base: cannot write {path}: {exc.strerror or exc}") from None
            written.append(str(path))
    upto = f"before {before.name}" if before else "at the end of the series"
    applied = ", ".join(used) if used else "none"
    message = (
        f"base: the starting point for a patch {upto}: pre-apply content + earlier patches ({applied}). "
        f"Edit {out}/b/..., then: (cd {out} && diff -u a/<path> b/<path>), strip the timestamps and put "
        "the header on top"
    )
    return Outcome("base", EXIT_OK, written, message)
