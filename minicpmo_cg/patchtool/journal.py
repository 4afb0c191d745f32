"""The crash-safe write protocol shared by ``apply`` and ``revert``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.errors import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK
from minicpmo_cg.patchtool.state import FileRecord, StateRecord, sha256_or_none
from minicpmo_cg.patchtool.views import Plan, link_problem, read_file

__all__ = ["WriteResult", "describe_files", "execute"]


@dataclass
class WriteResult:
    """What :func:`execute` did."""

    exit_code: int
    changed: list[str] = field(default_factory=list)
    error: str | None = None
    states: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _journal(plan: Plan, targets: dict[str, bytes | None], final: StateRecord | None) -> StateRecord:
    """The record that explains every content a touched file can hold until the command ends."""
    old = plan.record
    rels = set(targets) | set(final.files if final else ())
    files = {}
    for rel in sorted(rels):
        view = plan.files[rel]
        original = sha256_or_none(view.pristine)
        current = sha256_or_none(view.current)
        if final is not None and rel in final.files:
            written = final.files[rel].written_sha256
        else:
            written = current  # the file goes back to its original: it holds this until then
        interim = () if current in (original, written) else (current,)
        files[rel] = FileRecord(original, written, view.role, interim)
    patches = final.patches if final else (old.patches if old else {})
    dirs = (
        set(final.created_dirs if final else ())
        | set(old.created_dirs if old else ())
        | set(plan.orphan_dirs)
    )
    return StateRecord(dict(plan.install.versions), dict(patches), files, False, tuple(sorted(dirs)))


def _put(site: Path, rel: str, data: bytes | None) -> None:
    path = site / rel
    if data is None:
        fsops.remove_file(path)
    else:
        fsops.make_dirs(path.parent, site)
        fsops.write_file(path, data)


def _order(plan: Plan, rels: list[str], reverting: bool) -> list[str]:
    """Owned files first when installing, last when removing."""
    owned_first = sorted(rels, key=lambda rel: (plan.files[rel].role != "owned", rel))
    return list(reversed(owned_first)) if reverting else owned_first


def _remove_dirs(site: Path, rels: list[str]) -> list[str]:
    """Remove directories the tool created (deepest first) with their bytecode caches."""
    kept = []
    for rel in sorted(rels, key=lambda r: r.count("/"), reverse=True):
        if link_problem(site, rel):
            kept.append(f"{rel}/: a symbolic link leads to it, and nothing is deleted through a link")
            continue
        directory = site / rel
        cache = directory / "__pycache__"
        if cache.is_dir() and not cache.is_symlink():
            for pyc in sorted(cache.glob("*.pyc")):
                fsops.remove_file(pyc)
            fsops.remove_dir(cache)
        if not fsops.remove_dir(directory):
            kept.append(f"{rel}/: it holds files this tool did not create")
    return kept


def describe_files(plan: Plan, rels) -> list[str]:
    """``"<rel>: <state>"`` for each file, read back from disk (applied / pristine / as before / other)."""
    lines = []
    for rel in sorted(rels):
        now = sha256_or_none(read_file(plan.install.site / rel))
        view = plan.files[rel]
        names = []
        if rel in plan.apply_contents and now == sha256_or_none(plan.apply_contents[rel]):
            names.append("applied")
        if now == sha256_or_none(view.pristine):
            names.append("pristine")
        if not names:
            names.append(
                "as before this run" if now == sha256_or_none(view.current) else f"sha256 {str(now)[:12]}"
            )
        lines.append(f"{rel}: {' = '.join(names)}" + (" (absent)" if now is None else ""))
    return lines


def _undo(plan: Plan, journal: StateRecord, done: list[str], exc: OSError) -> WriteResult:
    """Put back what this run changed and the record it found; exit 2, or 3 when that fails too."""
    site = plan.install.site
    try:
        for rel in reversed(done):
            _put(site, rel, plan.files[rel].current)
        before = set(plan.record.created_dirs) if plan.record else set()
        _remove_dirs(site, [d for d in journal.created_dirs if d not in before])
        if plan.loaded is not None:
            plan.store.save(plan.loaded)
        else:
            plan.store.remove_record()
        plan.store.collect_garbage(plan.loaded)
    except OSError as second:
        states = describe_files(plan, journal.files)
        return WriteResult(EXIT_INCOMPLETE, [], f"{exc}; rolling back failed too: {second}", states)
    return WriteResult(EXIT_ERROR, [], str(exc), describe_files(plan, journal.files))


def _cleanup(plan: Plan, final: StateRecord | None) -> list[str]:
    """Step 6; failures are returned as warnings (the command's files are already committed)."""
    try:
        plan.store.collect_garbage(final)
    except OSError as exc:
        return [f"could not remove files of {plan.store.root} that no record needs ({exc})"]
    return []


def execute(
    plan: Plan, targets: dict[str, bytes | None], final: StateRecord | None, *, reverting: bool
) -> WriteResult:
    """Bring every file of ``targets`` to its bytes and commit ``final`` (None: no record).

    Raises:
        fsops.SimulatedKill: from a test hook; nothing else runs afterwards, as after a kill.
    """
    site = plan.install.site
    changes = {rel: data for rel, data in targets.items() if data != plan.files[rel].current}
    journal = _journal(plan, changes, final)
    try:
        for path in plan.litter:
            fsops.remove_file(path)
        plan.store.store_originals(journal, {rel: plan.files[rel].pristine for rel in journal.files})
        plan.store.save(journal)
    except OSError as exc:  # the installation's files are untouched: drop what was stored
        _cleanup(plan, plan.loaded)
        return WriteResult(EXIT_ERROR, [], str(exc), describe_files(plan, changes))
    done: list[str] = []
    try:
        for rel in _order(plan, list(changes), reverting):
            _put(site, rel, changes[rel])
            done.append(rel)
        keep = set(final.created_dirs) if final else set()
        kept = _remove_dirs(site, [d for d in journal.created_dirs if d not in keep])
        if final is None:
            plan.store.remove_record()
        else:
            plan.store.save(final.committed())
    except OSError as exc:
        return _undo(plan, journal, done, exc)
    warnings = [f"kept {why}" for why in kept]
    warnings += _cleanup(plan, final)
    code = EXIT_INCOMPLETE if final is None and plan.store.root.exists() else EXIT_OK
    return WriteResult(code, sorted(changes), None, [], warnings)
