"""``minicpmo-cg-patch``: install the MiniCPM-o 4.5 encoder CUDA graph patch set into vllm-omni / vLLM.

Usage::

    minicpmo-cg-patch {apply,check,status,revert} [--site-packages DIR] [--patches-dir DIR] [--json]
    python -m minicpmo_cg.patchtool ...            # same

Commands (exit codes: 0 ok, 1 conflict/refused, 2 usage/environment/format error):

- ``status``  table of every patch (state per target file), the adapter copy,
  installed versions and lane; always exits 0 unless the environment is unusable.
- ``check``   the same table as a dry run of ``apply``: 0 when every patch is
  applied/upstream/pending/n/a and the adapter is installable, 1 on any conflict.
- ``apply``   all-or-nothing: every new file content is computed in temporary
  directories first; only when all targeted patches apply are the files written
  (atomically, rolled back on a write error). A second apply changes nothing.
- ``revert``  restores every file apply changed, byte-identical, removes the
  adapter copy and the state directory; refuses (exit 1, nothing written) when
  a file was modified after apply.

The installation is the site-packages directory holding the importable
``vllm`` and ``vllm_omni`` (found with :func:`importlib.util.find_spec`, without
importing them), or ``--site-packages``. Only the pinned pairs of
:data:`SUPPORTED_PAIRS` are accepted. The series format, the states and the
algorithm are described in ``patches/README.md``; state is kept in
``<site-packages>/minicpmo_cg_patch_state/`` (see :mod:`minicpmo_cg.patchstate`).

The tool prints reports (stdout) and errors (stderr); it does not import vLLM
(whose import takes ~10 s), so it has no vLLM logger.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.gnupatch import GnuPatch, PatchToolMissingError, summarize_failure
from minicpmo_cg.patchseries import (
    KNOWN_PACKAGES,
    Patch,
    PatchFormatError,
    load_all_series,
    version_equal,
)
from minicpmo_cg.patchstate import (
    FileRecord,
    StateError,
    StateRecord,
    StateStore,
    locked,
    sha256_or_none,
    write_contents,
)

__all__ = [
    "ADAPTER_STATES",
    "PATCH_STATES",
    "SUPPORTED_PAIRS",
    "Installation",
    "Plan",
    "ToolError",
    "build_plan",
    "discover_installation",
    "main",
]

#: (vllm version, vllm-omni version) -> lane name
SUPPORTED_PAIRS: dict[tuple[str, str], str] = {
    ("0.30.0", "0.30.0"): "current",
    ("0.28.0", "0.28.0"): "legacy",
}

APPLIED, UPSTREAM, PENDING, CONFLICT, NOT_APPLICABLE = "applied", "upstream", "pending", "conflict", "n/a"
PATCH_STATES = (APPLIED, UPSTREAM, PENDING, CONFLICT, NOT_APPLICABLE)
#: adapter copy states; "conflict" = modified after apply, "n/a" = no vllm-omni patch is active
ADAPTER_STATES = ("installed", "outdated", "missing", CONFLICT, NOT_APPLICABLE)

PROG = "minicpmo-cg-patch"


class ToolError(Exception):
    """An error that ends the command with a one-paragraph message (no traceback).

    Attributes:
        exit_code: process exit status (2: usage, environment or patch format).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------------
# Installation discovery
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Installation:
    """The site-packages directory being patched.

    Attributes:
        site: the directory holding ``vllm/``, ``vllm_omni/`` and their dist-info.
        versions: canonical distribution name -> installed version.
        lane: ``current`` or ``legacy``.
    """

    site: Path
    versions: dict[str, str]
    lane: str


def _supported_text() -> str:
    return ", ".join(f"vllm {v} + vllm-omni {o} (lane {lane})" for (v, o), lane in SUPPORTED_PAIRS.items())


def _dist_version(dist: str, site: Path) -> str | None:
    found = {d.version for d in importlib.metadata.distributions(name=dist, path=[str(site)]) if d.version}
    if len(found) > 1:
        raise ToolError(
            f"{PROG}: {site} holds several {dist} distributions ({', '.join(sorted(found))}); "
            f"remove the stale *.dist-info directories (pip uninstall {dist}, then reinstall one version)."
        )
    return found.pop() if found else None


def _find_site_of(import_name: str) -> Path | None:
    spec = importlib.util.find_spec(import_name)  # top-level name: nothing is imported
    if spec is None or spec.origin is None or not spec.origin.endswith("__init__.py"):
        return None
    return Path(spec.origin).resolve().parent.parent


def discover_installation(site_packages: Path | None = None) -> Installation:
    """Locate the installation and check that it is a supported pair.

    Args:
        site_packages: explicit directory (``--site-packages``); default: where
            the running interpreter would import ``vllm`` and ``vllm_omni`` from.

    Raises:
        ToolError: a package is missing, the two live in different directories,
            or the version pair is not one of :data:`SUPPORTED_PAIRS` (exit 2).
    """
    if site_packages is not None:
        site = site_packages.resolve()
        if not site.is_dir():
            raise ToolError(f"{PROG}: --site-packages {site_packages}: not a directory")
    else:
        sites = {name: _find_site_of(imp) for name, imp in KNOWN_PACKAGES.items()}
        located = {s for s in sites.values() if s is not None}
        if len(located) > 1:
            where = ", ".join(f"{name} in {s}" for name, s in sites.items())
            raise ToolError(
                f"{PROG}: vllm and vllm_omni are importable from different directories ({where}); "
                f"pass --site-packages to choose the installation to patch."
            )
        if not located:
            raise ToolError(
                f"{PROG}: neither vllm nor vllm-omni is importable by {sys.executable}. "
                f"Supported pairs: {_supported_text()}. Run the tool with the lane venv's Python "
                f"or pass --site-packages."
            )
        site = located.pop()

    versions = {name: _dist_version(name, site) for name in ("vllm", "vllm-omni")}
    pair = (versions["vllm"], versions["vllm-omni"])
    lane = None
    if None not in pair:
        for (want_vllm, want_omni), name in SUPPORTED_PAIRS.items():
            try:
                if version_equal(pair[0], want_vllm) and version_equal(pair[1], want_omni):
                    lane = name
            except ValueError:  # an unparsable installed version is simply not a supported one
                pass
    if lane is None:
        shown = ", ".join(f"{n} {v if v else '(not installed)'}" for n, v in versions.items())
        raise ToolError(
            f"{PROG}: unsupported vLLM/vllm-omni installation in {site}: found {shown}. "
            f"Supported pairs: {_supported_text()}. Install one supported pair with both pins "
            f'(e.g. pip install "vllm==0.30.0" "vllm-omni==0.30.0") or point --site-packages at an '
            f"environment that has one; nothing was changed."
        )
    return Installation(site, {k: v for k, v in versions.items() if v}, lane)


# ---------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------


@dataclass
class PatchReport:
    """State of one patch on this installation; ``detail`` explains non-obvious states."""

    patch: Patch
    state: str
    detail: str = ""


@dataclass
class FileView:
    """One file the plan may write.

    Attributes:
        rel: site-relative POSIX path.
        role: ``patch`` (edited by diffs) or ``adapter`` (copied).
        current: bytes on disk now (None = absent).
        pristine: bytes before any apply (None = absent); unknown when ``conflict``.
        record: the state record entry when it matches the file on disk.
        conflict: why the file cannot be written safely, or None.
    """

    rel: str
    role: str
    current: bytes | None
    pristine: bytes | None = None
    record: FileRecord | None = None
    conflict: str | None = None


@dataclass
class Plan:
    """Everything ``apply``/``revert`` would do, computed without writing.

    Attributes:
        apply_contents / revert_contents: relpath -> bytes (None = absent) each
            command would leave; only files without a conflict appear.
        new_record: the state record after ``apply`` (None: nothing to record).
        record: the loaded record when it belongs to these versions.
        record_present: a ``state.json`` exists (possibly stale).
    """

    install: Installation
    patches_dir: Path
    store: StateStore
    patch_program: str | None
    reports: list[PatchReport]
    files: dict[str, FileView]
    adapter_rel: str
    adapter_source: Path
    adapter_state: str
    adapter_detail: str
    apply_contents: dict[str, bytes | None]
    revert_contents: dict[str, bytes | None]
    new_record: StateRecord | None
    record: StateRecord | None
    record_present: bool
    notes: list[str] = field(default_factory=list)

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
        """Reasons ``revert`` refuses: files modified after apply (patch conflicts do not matter)."""
        return self.file_conflicts()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ToolError(f"{PROG}: {path} is a directory, expected a file") from None


def _short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:12]


def build_plan(
    install: Installation, patches_dir: Path | None = None, adapter_source: Path | None = None
) -> Plan:
    """Classify every patch and compute the contents ``apply`` and ``revert`` would write.

    Nothing is written. See ``patches/README.md`` for the decision rules.

    Raises:
        ToolError: a series/patch format error, a damaged state directory or a
            missing GNU patch (exit 2).
    """
    patches_dir = patches_dir or resources.patches_dir()
    adapter_source = adapter_source or resources.adapter_source()
    site = install.site
    try:
        series = load_all_series(patches_dir)
    except PatchFormatError as exc:
        raise ToolError(f"{PROG}: bad patch series: {exc}") from None

    store = StateStore(site)
    notes: list[str] = []
    try:
        loaded = store.load()
    except StateError as exc:
        raise ToolError(f"{PROG}: {exc}") from None
    record = loaded
    if loaded is not None and loaded.versions != install.versions:
        notes.append(
            f"state in {store.root} was recorded for {loaded.versions}, installed is {install.versions}: "
            "ignored (the packages were reinstalled); apply/revert replace it"
        )
        record = None
    recorded_files = record.files if record else {}
    recorded_patches = record.patches if record else {}

    reports: dict[str, PatchReport] = {}
    active: list[Patch] = []
    for patch in series:
        since = patch.upstream_since
        if (
            since is not None
            and since.package in install.versions
            and since.reached(install.versions[since.package])
        ):
            if patch.upstream_probe is None:
                reports[patch.name] = PatchReport(patch, UPSTREAM, f"shipped upstream since {since}")
                continue
            matched, missing = [], []
            for rel in patch.file_paths:
                data = _read(site / rel)
                if data is None:
                    missing.append(rel)
                elif patch.upstream_probe.search(data.decode("utf-8", "replace")):
                    matched.append(rel)
            if matched:
                reports[patch.name] = PatchReport(
                    patch, UPSTREAM, f"shipped upstream since {since}; probe matches {', '.join(matched)}"
                )
            else:
                reports[patch.name] = PatchReport(
                    patch,
                    CONFLICT,
                    f"Upstream-Since {since} holds but Upstream-Probe /{patch.upstream_probe.pattern}/ matches none "
                    f"of {', '.join(patch.file_paths)}"
                    + (f" ({', '.join(missing)} missing)" if missing else "")
                    + ": upstream changed differently than expected; update the patch",
                )
            continue
        installed = install.versions.get(patch.package)
        if installed is None or not patch.targets_version(installed):
            reports[patch.name] = PatchReport(
                patch,
                NOT_APPLICABLE,
                f"targets {', '.join(map(str, patch.targets))}; installed {patch.package} {installed}",
            )
            continue
        active.append(patch)

    gnu: GnuPatch | None = None
    if active:
        try:
            gnu = GnuPatch()
        except PatchToolMissingError as exc:
            raise ToolError(f"{PROG}: {exc}") from None

    # --- files: current bytes, pre-apply bytes, record validity -------------------------------------
    adapter_rel = resources.ADAPTER_RELPATH.as_posix()
    rels: list[str] = []
    for patch in active:
        rels += [rel for rel in patch.file_paths if rel not in rels]
    rels += [rel for rel, r in recorded_files.items() if r.role == "patch" and rel not in rels]
    files: dict[str, FileView] = {}
    try:
        for rel in rels:
            view = FileView(rel, "patch", _read(site / rel))
            rec = recorded_files.get(rel)
            digest = sha256_or_none(view.current)
            if rec is None:
                view.pristine = view.current
            elif digest == rec.written_sha256:
                view.pristine, view.record = store.load_original(rel, rec), rec
            elif digest == rec.original_sha256:
                view.pristine = view.current
                notes.append(f"{rel} is back at its pre-apply content (reinstalled?); its record is stale")
            else:
                view.conflict = (
                    f"modified after apply (sha256 {_short(digest)}, apply wrote {_short(rec.written_sha256)}); "
                    "restore the file or reinstall the package, then re-run"
                )
            files[rel] = view
    except StateError as exc:
        raise ToolError(f"{PROG}: {exc}") from None

    # --- patches applied without a record (lost state dir, hand-applied): un-apply them in memory -----
    found_unrecorded: set[str] = set()
    assert gnu is not None or not active
    for patch in reversed(active):
        views = [files[rel] for rel in patch.file_paths]
        if any(v.record is not None or v.conflict for v in views):
            continue
        contents = {v.rel: v.pristine for v in views}
        if gnu.run(patch.diff, contents).ok:
            continue
        back = gnu.run(patch.diff, contents, reverse=True)
        if back.ok:
            assert back.contents is not None
            for rel, data in back.contents.items():
                files[rel].pristine = data
            found_unrecorded.add(patch.name)

    # --- simulate the series on the pre-apply contents ---------------------------------------------
    work = {rel: v.pristine for rel, v in files.items() if not v.conflict}
    for patch in active:
        bad = [rel for rel in patch.file_paths if files[rel].conflict]
        if bad:
            reports[patch.name] = PatchReport(
                patch, CONFLICT, f"target {', '.join(bad)} was modified after apply; nothing will be written"
            )
            continue
        run = gnu.run(patch.diff, {rel: work[rel] for rel in patch.file_paths})
        if not run.ok:
            reports[patch.name] = PatchReport(
                patch,
                CONFLICT,
                f"does not apply to {patch.package} {install.versions[patch.package]}: {summarize_failure(run.output)}",
            )
            continue
        assert run.contents is not None
        work.update(run.contents)
        if patch.name in found_unrecorded:
            reports[patch.name] = PatchReport(
                patch,
                APPLIED,
                "applied without a state record (hand-applied or state lost); revert un-applies the diff",
            )
        elif recorded_patches.get(patch.name) == patch.sha256 and all(
            files[rel].record is not None for rel in patch.file_paths
        ):
            reports[patch.name] = PatchReport(patch, APPLIED)
        elif patch.name in recorded_patches and all(
            files[rel].record is not None for rel in patch.file_paths
        ):
            reports[patch.name] = PatchReport(
                patch,
                PENDING,
                "installed from an older revision of this patch; apply re-applies it from the originals",
            )
        else:
            reports[patch.name] = PatchReport(patch, PENDING)

    active_rels = {rel for patch in active for rel in patch.file_paths}
    apply_contents = {
        rel: (work[rel] if rel in active_rels else v.pristine) for rel, v in files.items() if not v.conflict
    }
    revert_contents = {rel: v.pristine for rel, v in files.items() if not v.conflict}

    # --- the adapter copy -------------------------------------------------------------------------
    try:
        source = adapter_source.read_bytes()
    except OSError as exc:
        raise ToolError(f"{PROG}: cannot read the adapter source {adapter_source}: {exc}") from None
    needed = any(p.package == "vllm-omni" for p in active)
    view = FileView(adapter_rel, "adapter", _read(site / adapter_rel))
    rec = recorded_files.get(adapter_rel)
    digest, source_digest = sha256_or_none(view.current), sha256_or_none(source)
    try:
        if rec is not None and digest in (rec.written_sha256, source_digest):
            view.pristine, view.record = store.load_original(adapter_rel, rec), rec
        elif rec is not None and digest == rec.original_sha256:
            view.pristine = view.current
        elif rec is not None:
            view.conflict = (
                f"adapter copy modified after apply (sha256 {_short(digest)}, apply wrote {_short(rec.written_sha256)}); "
                "restore it or delete it, then re-run"
            )
        else:
            # An unrecorded byte-identical copy is ours (state lost); anything else is someone else's file.
            view.pristine = None if digest in (None, source_digest) else view.current
    except StateError as exc:
        raise ToolError(f"{PROG}: {exc}") from None
    if view.conflict:
        adapter_state, adapter_detail = CONFLICT, view.conflict
    elif not needed:
        adapter_state = NOT_APPLICABLE
        adapter_detail = "no vllm-omni patch is active here"
        if view.current is not None and view.record is not None:
            adapter_detail += "; apply/revert remove the copy"
    elif digest == source_digest:
        adapter_state, adapter_detail = "installed", ""
    elif view.current is None:
        adapter_state, adapter_detail = "missing", "apply copies it"
    elif view.record is not None:
        adapter_state, adapter_detail = (
            "outdated",
            "the adapter source changed since apply; apply re-copies it",
        )
    else:
        adapter_state = "outdated"
        adapter_detail = "a different file is at this path; apply replaces it, revert restores it"
    files[adapter_rel] = view
    if not view.conflict:
        apply_contents[adapter_rel] = source if needed else view.pristine
        revert_contents[adapter_rel] = view.pristine

    # --- the record apply would leave ---------------------------------------------------------------
    new_files = {
        rel: FileRecord(sha256_or_none(files[rel].pristine), sha256_or_none(data), files[rel].role)
        for rel, data in apply_contents.items()
        if data != files[rel].pristine
    }
    new_record = None
    if new_files:
        new_record = StateRecord(dict(install.versions), {p.name: p.sha256 for p in active}, new_files)

    return Plan(
        install=install,
        patches_dir=patches_dir,
        store=store,
        patch_program=gnu.version if gnu else None,
        reports=[reports[p.name] for p in series],
        files=files,
        adapter_rel=adapter_rel,
        adapter_source=adapter_source,
        adapter_state=adapter_state,
        adapter_detail=adapter_detail,
        apply_contents=apply_contents,
        revert_contents=revert_contents,
        new_record=new_record,
        record=record,
        record_present=loaded is not None,
        notes=notes,
    )


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a command did: ``result`` word, written files and the exit code."""

    result: str
    exit_code: int
    changed: list[str] = field(default_factory=list)
    message: str = ""


def _changes(plan: Plan, target: dict[str, bytes | None]) -> dict[str, bytes | None]:
    return {rel: data for rel, data in target.items() if data != plan.files[rel].current}


def _write(plan: Plan, changes: dict[str, bytes | None], record: StateRecord | None) -> None:
    """Write target files, then the state; roll the files back if the state cannot be written."""
    previous = {rel: plan.files[rel].current for rel in changes}
    write_contents(plan.install.site, changes, previous)
    try:
        if record is None:
            plan.store.remove()
        else:
            plan.store.save(record, {rel: plan.files[rel].pristine for rel in record.files})
    except BaseException:
        write_contents(plan.install.site, previous, {rel: changes[rel] for rel in changes})
        raise


def cmd_check(plan: Plan) -> Outcome:
    conflicts = plan.apply_conflicts()
    if conflicts:
        return Outcome("conflict", 1, message=f"check: {len(conflicts)} conflict(s); apply would be refused")
    pending = [r for r in plan.reports if r.state == PENDING]
    extra = " and copy the adapter" if plan.adapter_state in ("missing", "outdated") else ""
    if pending or extra:
        return Outcome("ok", 0, message=f"check: apply would apply {len(pending)} patch(es){extra}")
    return Outcome("ok", 0, message="check: nothing to apply")


def cmd_apply(plan: Plan) -> Outcome:
    conflicts = plan.apply_conflicts()
    if conflicts:
        return Outcome(
            "conflict", 1, message=f"apply refused: {len(conflicts)} conflict(s); no file was changed"
        )
    changes = _changes(plan, plan.apply_contents)
    old = plan.record.to_json() if plan.record else None
    new = plan.new_record.to_json() if plan.new_record else None
    if not changes and old == new and (new is not None or not plan.record_present):
        return Outcome("unchanged", 0, message="apply: nothing to do, everything is already applied")
    try:
        _write(plan, changes, plan.new_record)
    except OSError as exc:
        raise ToolError(f"{PROG}: apply failed while writing ({exc}); every file was restored") from None
    if not changes:
        return Outcome("applied", 0, message="apply: files already in place; state record updated")
    return Outcome("applied", 0, sorted(changes), f"apply: wrote {len(changes)} file(s)")


def cmd_revert(plan: Plan) -> Outcome:
    conflicts = plan.revert_conflicts()
    if conflicts:
        return Outcome(
            "conflict", 1, message=f"revert refused: {len(conflicts)} conflict(s); no file was changed"
        )
    changes = _changes(plan, plan.revert_contents)
    if not changes and not plan.record_present:
        return Outcome("unchanged", 0, message="revert: nothing to revert")
    try:
        _write(plan, changes, None)
    except OSError as exc:
        raise ToolError(f"{PROG}: revert failed while writing ({exc}); every file was restored") from None
    return Outcome("reverted", 0, sorted(changes), f"revert: restored {len(changes)} file(s)")


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    rows = []
    for report in plan.reports:
        for i, rel in enumerate(report.patch.file_paths):
            rows.append((report.patch.name, rel, report.state, report.detail if i == 0 else ""))
    listed = {rel for r in plan.reports for rel in r.patch.file_paths}
    for fv in plan.files.values():
        if fv.role == "patch" and fv.rel not in listed:
            rows.append(
                (
                    "(recorded only)",
                    fv.rel,
                    CONFLICT if fv.conflict else "stale",
                    fv.conflict
                    or "changed by an earlier apply; no longer in the series: apply/revert restore it",
                )
            )
    rows.append(("adapter", plan.adapter_rel, plan.adapter_state, plan.adapter_detail))
    return rows


def _report_json(command: str, plan: Plan, outcome: Outcome) -> dict:
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
            "path": plan.adapter_rel,
            "state": plan.adapter_state,
            "detail": plan.adapter_detail,
            "source": str(plan.adapter_source),
        },
        "conflicts": plan.apply_conflicts() if command != "revert" else plan.revert_conflicts(),
        "notes": list(plan.notes),
        "changed": list(outcome.changed),
    }


def _print_text(command: str, plan: Plan, outcome: Outcome) -> None:
    inst = plan.install
    print(f"{PROG} {command}: {inst.site}")
    print(
        f"installed: vllm {inst.versions['vllm']}, vllm-omni {inst.versions['vllm-omni']} (lane: {inst.lane})"
    )
    rows = [("PATCH", "TARGET", "STATE", "DETAIL"), *_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}".rstrip())
    for note in plan.notes:
        print(f"note: {note}")
    for rel in outcome.changed:
        print(f"{'wrote' if (inst.site / rel).exists() else 'removed'}: {rel}")
    if outcome.message:
        print(outcome.message)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--site-packages",
        type=Path,
        metavar="DIR",
        help="site-packages directory to patch (default: where this Python imports vllm and vllm_omni from)",
    )
    common.add_argument(
        "--patches-dir",
        type=Path,
        metavar="DIR",
        help="patch series root holding vllm/ and vllm-omni/ (default: the one shipped with minicpmo_cg)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} {{apply,check,status,revert}} [--site-packages DIR] [--patches-dir DIR] [--json]",
        description="Install the MiniCPM-o 4.5 encoder CUDA graph patch set into vllm-omni / vLLM.",
        epilog="exit codes: 0 ok, 1 conflict (nothing written), 2 usage/environment/format error",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{apply,check,status,revert}")
    for name, text in (
        ("apply", "apply every pending patch and copy the adapter (all-or-nothing, idempotent)"),
        ("check", "dry run of apply: exit 0 when it would succeed, 1 on conflict"),
        ("status", "show every patch's state, the adapter copy, versions and lane"),
        ("revert", "restore every file apply changed, byte-identical (all-or-nothing)"),
    ):
        sub.add_parser(name, parents=[common], help=text, description=text)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code instead of exiting (tests call this)."""
    args = _parser().parse_args(argv)
    command: str = args.command
    try:
        install = discover_installation(args.site_packages)
        with locked(install.site, exclusive=command in ("apply", "revert")):
            plan = build_plan(install, args.patches_dir)
            if command == "status":
                outcome = Outcome("ok", 0)
            elif command == "check":
                outcome = cmd_check(plan)
            elif command == "apply":
                outcome = cmd_apply(plan)
            else:
                outcome = cmd_revert(plan)
            final = (
                build_plan(install, args.patches_dir)
                if outcome.changed or outcome.result in ("applied", "reverted")
                else plan
            )
    except ToolError as exc:
        print(str(exc), file=sys.stderr)
        if args.json:
            print(
                json.dumps({"command": command, "ok": False, "exit_code": exc.exit_code, "error": str(exc)})
            )
        return exc.exit_code
    if args.json:
        print(json.dumps(_report_json(command, final, outcome), indent=2))
    else:
        _print_text(command, final, outcome)
    if outcome.exit_code and outcome.message:
        print(f"{PROG}: {outcome.message}", file=sys.stderr)
        for conflict in plan.apply_conflicts() if command != "revert" else plan.revert_conflicts():
            print(f"  conflict: {conflict}", file=sys.stderr)
    return outcome.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``minicpmo-cg-patch``)."""
    try:
        code = run(argv)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: the report was not wanted in full
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
