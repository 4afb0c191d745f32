"""Owned files: this project's modules installed into vllm-omni's tree."""

from __future__ import annotations

import fnmatch
from dataclasses import replace
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.errors import PROG, ToolError
from minicpmo_cg.patchtool.series import Patch, package_relpath_problem
from minicpmo_cg.patchtool.state import sha256_or_none
from minicpmo_cg.patchtool.views import (
    CONFLICT,
    NOT_APPLICABLE,
    FileView,
    OwnedReport,
    Plan,
    classify_recorded,
    link_problem,
    read_file,
)

__all__ = ["PACKAGE_DATA", "add_owned", "load_sources", "read_source", "select_sources"]

#: owned files other than modules that the packages install (``fnmatch`` globs of site-relative
#: paths, e.g. ``vllm_omni/model_executor/models/minicpmo_4_5/*.json``); none so far
PACKAGE_DATA: tuple[str, ...] = ()


def select_sources(owned_root: Path | None) -> tuple[dict[str, Path], list[str]]:
    """The owned files to install (rel -> source path) and one note per module left out for its name."""
    selected, notes = {}, []
    for rel, path in resources.owned_files(owned_root).items():
        if not (rel.endswith(".py") or any(fnmatch.fnmatchcase(rel, glob) for glob in PACKAGE_DATA)):
            continue  # an editor backup, a stray file: not part of the package
        problem = package_relpath_problem(rel, (resources.OWNED_PACKAGE_DIR,))
        if problem:
            notes.append(f"owned file {path} is not installed: its path {problem}; rename it")
            continue
        selected[rel] = path
    return selected, notes


def read_source(owned_root: Path | None, path: Path) -> bytes:
    """The bytes of the owned file at ``path``, a regular file inside the owned tree.

    Raises:
        ToolError: it resolves outside the tree (a symbolic link), is not a regular file (a FIFO
            would block every command) or cannot be read (exit 2).
    """
    tree = (owned_root or resources.owned_root()) / resources.OWNED_PACKAGE_DIR
    outside = fsops.resolves_outside(tree, path)
    if outside is not None:
        raise ToolError(
            f"{PROG}: the owned file {path} resolves to {outside}, outside the owned tree {tree}; "
            "replace the link by the file"
        )
    try:
        return fsops.read_regular(path)
    except fsops.NotRegularFileError as exc:
        raise ToolError(f"{PROG}: owned file {exc}; move it out of the owned tree") from None
    except OSError as exc:
        raise ToolError(f"{PROG}: cannot read the owned file {path}: {exc}") from None


def load_sources(
    owned_root: Path | None, series: list[Patch]
) -> tuple[dict[str, tuple[Path, bytes]], list[str]]:
    """rel -> (source path, bytes) of every owned file to install, and notes on modules left out.

    Raises:
        ToolError: an owned file is unreadable, not a regular file inside the owned tree, or also a
            target of a patch (exit 2).
    """
    patched = {rel: patch.name for patch in series for rel in patch.file_paths}
    selected, notes = select_sources(owned_root)
    sources = {}
    for rel, path in selected.items():
        if rel in patched:
            raise ToolError(
                f"{PROG}: {rel} is both an owned file ({path}) and a target of {patched[rel]}; "
                "a file is either copied or patched, not both"
            )
        sources[rel] = (path, read_source(owned_root, path))
    return sources, notes


def _unrecorded_pristine(plan: Plan, view: FileView, source: bytes | None) -> None:
    """Without a record: a byte-identical copy is ours (state lost); anything else belongs to someone else."""
    wheel = plan.install.wheel_file(view.rel)
    digest = sha256_or_none(view.current)
    if wheel is not None and digest == wheel.sha256:
        view.pristine = view.current  # the installed package ships a file at this path
    elif view.current is None or (source is not None and digest == sha256_or_none(source)):
        view.pristine = None
    else:
        view.pristine = view.current


def _classify(plan: Plan, view: FileView, source: bytes | None) -> None:
    rec = plan.record.files.get(view.rel) if plan.record else None
    if rec is None:
        _unrecorded_pristine(plan, view, source)
        return
    source_digest = sha256_or_none(source)
    if source is not None and not rec.allows(source_digest):
        rec = replace(rec, interim_sha256=(*rec.interim_sha256, source_digest))  # a copy of ours is ours
    assert plan.record is not None
    plan.notes.extend(classify_recorded(view, rec, plan.store, plan.record.complete))


def _state(view: FileView, source: bytes | None, needed: bool) -> tuple[str, str]:
    if view.conflict:
        return CONFLICT, view.conflict
    if source is None:
        return "outdated", "no longer part of this project's tree; apply/revert restore what was at this path"
    if not needed:
        detail = "no vllm-omni patch is active here"
        if view.current is not None and view.record is not None:
            detail += "; apply/revert remove the copy"
        return NOT_APPLICABLE, detail
    if view.current == source:
        return "installed", ""
    if view.current is None:
        return "missing", "apply copies it"
    if view.record is not None:
        return "outdated", "the source changed since apply; apply re-copies it"
    return "outdated", "a different file is at this path; apply replaces it, revert restores it"


def add_owned(plan: Plan, sources: dict[str, tuple[Path, bytes]], needed: bool) -> None:
    """Add a view, a report and the apply/revert contents of every owned file to ``plan``."""
    recorded = plan.record.files if plan.record else {}
    rels = list(sources) + sorted(
        rel for rel, r in recorded.items() if r.role == "owned" and rel not in sources
    )
    for rel in rels:
        path, source = sources.get(rel, (None, None))
        view = FileView(rel, "owned", read_file(plan.install.site / rel))
        view.conflict = link_problem(plan.install.site, rel)
        if not view.conflict:
            _classify(plan, view, source)
        state, detail = _state(view, source, needed)
        plan.owned.append(OwnedReport(rel, path, state, detail))
        plan.files[rel] = view
        if not view.conflict:
            plan.apply_contents[rel] = source if needed and source is not None else view.pristine
            plan.revert_contents[rel] = view.pristine
    plan.orphan_dirs = _orphan_dirs(plan)


def _orphan_dirs(plan: Plan) -> tuple[str, ...]:
    """Directories of owned copies that did not exist before apply and that pip did not install."""
    candidates = {
        parent.as_posix()
        for view in plan.files.values()
        if view.role == "owned" and view.pristine is None and view.current is not None and not view.conflict
        for parent in Path(view.rel).parents
        if parent != Path(".")
    }
    return tuple(sorted(d for d in candidates if plan.install.wheel_has_dir(d) is False))
