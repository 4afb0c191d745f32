"""The plan's vocabulary: patch and file states, and the view of one file, shared by the plan's steps."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.errors import PROG, ToolError
from minicpmo_cg.patchtool.install import Installation
from minicpmo_cg.patchtool.series import Patch
from minicpmo_cg.patchtool.state import FileRecord, StateError, StateRecord, StateStore, sha256_or_none

__all__ = [
    "ADAPTER_STATES",
    "APPLIED",
    "CONFLICT",
    "NOT_APPLICABLE",
    "OWNED_STATES",
    "PATCH_STATES",
    "PENDING",
    "UPSTREAM",
    "FileView",
    "OwnedReport",
    "PatchReport",
    "Plan",
    "classify_recorded",
    "link_problem",
    "read_file",
    "short",
]

APPLIED, UPSTREAM, PENDING, CONFLICT, NOT_APPLICABLE = "applied", "upstream", "pending", "conflict", "n/a"
PATCH_STATES = (APPLIED, UPSTREAM, PENDING, CONFLICT, NOT_APPLICABLE)
#: owned-file states; "conflict" = modified after apply, "n/a" = no vllm-omni patch is active
OWNED_STATES = ("installed", "outdated", "missing", CONFLICT, NOT_APPLICABLE)
ADAPTER_STATES = OWNED_STATES

#: FileView.at: which content of its record the file holds
UNRECORDED, ORIGINAL, WRITTEN, INTERIM = "unrecorded", "original", "written", "interim"


@dataclass
class PatchReport:
    """State of one patch on this installation; ``detail`` explains non-obvious states."""

    patch: Patch
    state: str
    detail: str = ""


@dataclass
class OwnedReport:
    """State of one owned file (copied from this project into vllm-omni's tree)."""

    rel: str
    source: Path | None
    state: str
    detail: str = ""


@dataclass
class FileView:
    """One file the plan may write."""

    rel: str
    role: str
    current: bytes | None
    pristine: bytes | None = None
    at: str = UNRECORDED
    record: FileRecord | None = None
    conflict: str | None = None
    unapplied: bool = False


@dataclass
class Plan:
    """Everything ``apply``/``revert`` would do, computed without writing."""

    install: Installation
    patches_dir: Path
    store: StateStore
    patch_program: str | None
    reports: list[PatchReport]
    files: dict[str, FileView]
    owned: list[OwnedReport]
    apply_contents: dict[str, bytes | None]
    revert_contents: dict[str, bytes | None]
    new_record: StateRecord | None
    record: StateRecord | None
    record_present: bool
    loaded: StateRecord | None = None
    notes: list[str] = field(default_factory=list)
    litter: list[Path] = field(default_factory=list)
    leftover: list[Path] = field(default_factory=list)
    orphan_dirs: tuple[str, ...] = ()

    @property
    def adapter(self) -> OwnedReport:
        """The adapter's entry among :attr:`owned`."""
        rel = resources.ADAPTER_RELPATH.as_posix()
        found = [o for o in self.owned if o.rel == rel]
        return found[0] if found else OwnedReport(rel, None, NOT_APPLICABLE, "not in the owned tree")

    def file_conflicts(self) -> list[str]:
        return [f"{fv.rel}: {fv.conflict}" for fv in self.files.values() if fv.conflict]

    def apply_conflicts(self) -> list[str]:
        """Reasons ``apply`` refuses: conflicting patches, then files not covered by them."""
        out = [f"{r.patch.name}: {r.detail}" for r in self.reports if r.state == CONFLICT]
        covered = {rel for r in self.reports if r.state == CONFLICT for rel in r.patch.file_paths}
        out += [
            f"{fv.rel}: {fv.conflict}" for fv in self.files.values() if fv.conflict and fv.rel not in covered
        ]
        return out

    def revert_conflicts(self) -> list[str]:
        """Reasons ``revert`` refuses: files it cannot restore (patch context conflicts do not matter)."""
        return self.file_conflicts()


def read_file(path: Path) -> bytes | None:
    """The bytes at ``path`` (None when absent), never blocking (:func:`fsops.read_regular`).

    Raises:
        ToolError: a directory, FIFO, socket or device, or an unreadable file (exit 2).
    """
    try:
        return fsops.read_regular(path)
    except FileNotFoundError:
        return None
    except fsops.NotRegularFileError as exc:
        raise ToolError(f"{PROG}: {exc}; expected a file (move it aside and re-run)") from None
    except OSError as exc:
        raise ToolError(f"{PROG}: cannot read {path}: {exc}") from None


def short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:12]


def link_problem(site: Path, rel: str) -> str | None:
    """Why ``rel`` cannot be written by rename: it, or a directory on its way, is a symbolic link."""
    path = site
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            what = "is" if path == site / rel else f"lies in {path.relative_to(site).as_posix()}/, which is"
            return (
                f"{what} a symbolic link (to {os.readlink(path)}); the tool replaces files by rename and "
                "never writes through links: replace the link by a copy of its target "
                f'(cp --remove-destination "$(readlink -f {path})" {path}) and re-run'
            )
    return None


def classify_recorded(view: FileView, rec: FileRecord | None, store: StateStore, complete: bool) -> list[str]:
    """Set ``view.at``/``pristine``/``record``/``conflict`` from the record; return notes."""
    digest = sha256_or_none(view.current)
    if rec is None:
        view.pristine = view.current
        return []
    if digest == rec.original_sha256:
        view.at, view.pristine = ORIGINAL, view.current
        if complete and rec.written_sha256 != rec.original_sha256:
            return [f"{view.rel} is back at its pre-apply content (reinstalled?); its record is stale"]
        return []
    if not rec.allows(digest):
        what = "owned copy modified" if view.role == "owned" else "modified"
        view.conflict = (
            f"{what} after apply (sha256 {short(digest)}, apply wrote {short(rec.written_sha256)}); "
            "restore the file or reinstall the package, then re-run"
        )
        return []
    view.at = WRITTEN if digest == rec.written_sha256 else INTERIM
    view.record = rec
    try:
        view.pristine = store.load_original(view.rel, rec)
    except StateError as exc:
        view.conflict = f"{exc}; reinstall the package to get the pristine file back, then re-run apply"
    return []
