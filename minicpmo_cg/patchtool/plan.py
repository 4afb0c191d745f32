"""The plan: every patch's state and the bytes ``apply`` and ``revert`` would leave, computed without writing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool import fsops, owned
from minicpmo_cg.patchtool.errors import PROG, ToolError
from minicpmo_cg.patchtool.explain import explain_failure
from minicpmo_cg.patchtool.gnupatch import GnuPatch, PatchToolMissingError, ambiguous_hunks
from minicpmo_cg.patchtool.install import Installation
from minicpmo_cg.patchtool.series import Patch, PatchFormatError, load_all_series
from minicpmo_cg.patchtool.state import FileRecord, StateError, StateRecord, StateStore, sha256_or_none
from minicpmo_cg.patchtool.views import (
    APPLIED,
    CONFLICT,
    INTERIM,
    NOT_APPLICABLE,
    PENDING,
    UNRECORDED,
    UPSTREAM,
    WRITTEN,
    FileView,
    PatchReport,
    Plan,
    classify_recorded,
    link_problem,
    read_file,
    short,
)

__all__ = [
    "SeriesRun",
    "build_plan",
    "check_against_wheel",
    "classify_patches",
    "scan_patch_files",
    "simulate_series",
    "unapply_unrecorded",
]

# 1. patches


def _probe_report(patch: Patch, site: Path) -> PatchReport:
    since = patch.upstream_since
    if patch.upstream_probe is None:
        return PatchReport(patch, UPSTREAM, f"shipped upstream since {since}")
    matched, missing = [], []
    for rel in patch.file_paths:
        data = read_file(site / rel)
        if data is None:
            missing.append(rel)
        elif patch.upstream_probe.search(data.decode("utf-8", "replace")):
            matched.append(rel)
    if matched:
        return PatchReport(
            patch, UPSTREAM, f"shipped upstream since {since}; probe matches {', '.join(matched)}"
        )
    return PatchReport(
        patch,
        CONFLICT,
        f"Upstream-Since {since} holds but Upstream-Probe /{patch.upstream_probe.pattern}/ matches none "
        f"of {', '.join(patch.file_paths)}"
        + (f" ({', '.join(missing)} missing)" if missing else "")
        + ": upstream changed differently than expected; update the patch",
    )


def classify_patches(
    series: list[Patch], install: Installation
) -> tuple[dict[str, PatchReport], list[Patch]]:
    """Reports for ``upstream`` / ``n/a`` patches (and probe conflicts); the active patches in order."""
    reports: dict[str, PatchReport] = {}
    active: list[Patch] = []
    for patch in series:
        since = patch.upstream_since
        if (
            since is not None
            and since.package in install.versions
            and since.reached(install.versions[since.package])
        ):
            reports[patch.name] = _probe_report(patch, install.site)
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
    return reports, active


# 2. files


def scan_patch_files(
    install: Installation, store: StateStore, active: list[Patch], record: StateRecord | None
) -> tuple[dict[str, FileView], list[str]]:
    """A view per file of an active patch and per recorded patch file."""
    recorded = record.files if record else {}
    rels: list[str] = []
    for patch in active:
        rels += [rel for rel in patch.file_paths if rel not in rels]
    rels += [rel for rel, r in recorded.items() if r.role == "patch" and rel not in rels]
    files: dict[str, FileView] = {}
    notes: list[str] = []
    for rel in rels:
        view = FileView(rel, "patch", read_file(install.site / rel))
        view.conflict = link_problem(install.site, rel)
        if not view.conflict:
            notes += classify_recorded(view, recorded.get(rel), store, record.complete if record else True)
        files[rel] = view
    return files, notes


def _matches_wheel(install: Installation, rel: str, data: bytes | None) -> bool:
    wheel = install.wheel_file(rel)
    return wheel is not None and sha256_or_none(data) == wheel.sha256


def unapply_unrecorded(
    files: dict[str, FileView], active: list[Patch], gnu: GnuPatch | None, install: Installation
) -> set[str]:
    """Find patches applied without a record (hand-applied, state lost), last first; un-apply them in memory."""
    found: set[str] = set()
    for patch in reversed(active):
        views = [files[rel] for rel in patch.file_paths]
        if any(v.at != UNRECORDED or v.conflict for v in views):
            continue
        if all(_matches_wheel(install, v.rel, v.pristine) for v in views):
            continue
        assert gnu is not None
        contents = {v.rel: v.pristine for v in views}
        if gnu.run(patch.diff, contents).ok and not ambiguous_hunks(patch.files, contents):
            continue
        back = gnu.run(patch.diff, contents, reverse=True)
        if back.ok and not ambiguous_hunks(patch.files, contents, reverse=True):
            assert back.contents is not None
            for rel, data in back.contents.items():
                files[rel].pristine, files[rel].unapplied = data, True
            found.add(patch.name)
    return found


def check_against_wheel(
    files: dict[str, FileView], reports: dict[str, PatchReport], install: Installation
) -> list[str]:
    """Compare unrecorded pre-apply contents with RECORD; return notes."""
    notes = []
    for view in files.values():
        wheel = install.wheel_file(view.rel)
        if view.at != UNRECORDED or view.conflict or wheel is None:
            continue
        if sha256_or_none(view.pristine) == wheel.sha256:
            continue
        failing = [
            r.patch.name for r in reports.values() if r.state == CONFLICT and view.rel in r.patch.file_paths
        ]
        if not failing:
            notes.append(
                f"{view.rel} differs from the {wheel.dist} {wheel.version} wheel (RECORD) before apply; "
                "revert restores that content, not the wheel's"
            )
            continue
        view.conflict = (
            f"differs from the {wheel.dist} {wheel.version} wheel (RECORD sha256 {short(wheel.sha256)}) and "
            f"{', '.join(failing)} neither applies to it nor un-applies from it (changed by hand, or written "
            f"by another revision of the patch set); reinstall it ({wheel.reinstall_hint()}), then re-run"
        )
    return notes


# 3. the series


def _applied_report(
    patch: Patch, files: dict[str, FileView], record: StateRecord | None, found: set[str]
) -> PatchReport:
    if patch.name in found:
        return PatchReport(
            patch,
            APPLIED,
            "applied without a state record (hand-applied or state lost); revert un-applies the diff",
        )
    recorded = (record.patches if record else {}).get(patch.name)
    where = {files[rel].at for rel in patch.file_paths}
    if recorded == patch.sha256 and where == {WRITTEN}:
        return PatchReport(patch, APPLIED)
    if len(where) > 1 and WRITTEN in where:
        return PatchReport(
            patch, PENDING, "partly applied (an apply or revert was interrupted); apply or revert finishes it"
        )
    if recorded is not None and where <= {WRITTEN, INTERIM}:
        if recorded != patch.sha256:
            return PatchReport(
                patch,
                PENDING,
                "installed from an older revision of this patch; apply re-applies it from the originals",
            )
        return PatchReport(
            patch, PENDING, "an apply was interrupted before this patch was written; apply finishes it"
        )
    return PatchReport(patch, PENDING)


@dataclass
class SeriesRun:
    """What :func:`simulate_series` needs besides the files, and the reports it fills in."""

    install: Installation
    record: StateRecord | None
    found: set[str]
    reports: dict[str, PatchReport]


def simulate_series(
    files: dict[str, FileView], active: list[Patch], gnu: GnuPatch | None, run: SeriesRun
) -> dict[str, bytes | None]:
    """Apply ``active`` in order to the pre-apply contents; fill ``run.reports``; return the result."""
    work = {rel: v.pristine for rel, v in files.items() if not v.conflict}
    done: list[Patch] = []
    for patch in active:
        bad = [rel for rel in patch.file_paths if files[rel].conflict]
        if bad:
            detail = f"target {bad[0]}: {files[bad[0]].conflict}; nothing will be written"
            run.reports[patch.name] = PatchReport(patch, CONFLICT, detail)
            continue
        before = {rel: work[rel] for rel in patch.file_paths}
        ambiguous = ambiguous_hunks(patch.files, before)
        result = None if ambiguous else gnu.run(patch.diff, before)  # type: ignore[union-attr]
        if result is None or not result.ok:
            detail = explain_failure(patch, before, files, done, gnu, run.install, ambiguous, result)
            run.reports[patch.name] = PatchReport(patch, CONFLICT, detail)
            continue
        assert result.contents is not None
        work.update(result.contents)
        done.append(patch)
        run.reports[patch.name] = _applied_report(patch, files, run.record, run.found)
    return work


# the whole plan


def _load_record(
    store: StateStore, install: Installation
) -> tuple[StateRecord | None, StateRecord | None, list[str]]:
    try:
        loaded = store.load()
    except StateError as exc:
        raise ToolError(f"{PROG}: {exc}") from None
    if loaded is not None and loaded.versions != install.versions:
        note = (
            f"state in {store.root} was recorded for {loaded.versions}, installed is {install.versions}: "
            "ignored (the packages were reinstalled); apply/revert replace it"
        )
        return None, loaded, [note]
    if loaded is not None:
        _check_against_wheels(loaded, store, install)
    notes = []
    if loaded is not None and not loaded.complete:
        notes.append(
            "an apply or revert was interrupted (the journal is not committed): run apply to finish it "
            "or revert to undo it"
        )
    return loaded, loaded, notes


def _check_against_wheels(record: StateRecord, store: StateStore, install: Installation) -> None:
    """Refuse a record that claims apply created what pip installed (revert would delete it).

    Raises:
        ToolError: a file recorded as absent before apply that a wheel's RECORD lists, or a
            directory recorded as created by apply that holds files RECORD lists (exit 2).
    """
    for rel, entry in sorted(record.files.items()):
        wheel = install.wheel_file(rel)
        if entry.original_sha256 is None and wheel is not None:
            what = (
                f"{rel} is recorded as absent before apply, but the {wheel.dist} {wheel.version} "
                "wheel installs it"
            )
            raise ToolError(f"{PROG}: {store.damaged(what)}")
    for rel in record.created_dirs:
        if install.wheel_has_dir(rel):
            what = f"{rel}/ is recorded as created by apply, but the installed wheels have files in it"
            raise ToolError(f"{PROG}: {store.damaged(what)}")


def _new_record(plan: Plan, active: list[Patch]) -> StateRecord | None:
    site = plan.install.site
    new_files = {
        rel: FileRecord(sha256_or_none(plan.files[rel].pristine), sha256_or_none(data), plan.files[rel].role)
        for rel, data in plan.apply_contents.items()
        if data != plan.files[rel].pristine
    }
    if not new_files:
        return None
    parents = {
        p
        for rel, data in plan.apply_contents.items()
        if rel in new_files and data is not None
        for p in Path(rel).parents
    }
    earlier = set(plan.record.created_dirs if plan.record else ()) | set(plan.orphan_dirs)
    created = {
        p.as_posix()
        for p in parents
        if p != Path(".") and (p.as_posix() in earlier or not (site / p).exists())
    }
    return StateRecord(
        dict(plan.install.versions),
        {p.name: p.sha256 for p in active},
        new_files,
        True,
        tuple(sorted(created)),
    )


def _housekeeping(plan: Plan) -> None:
    site = plan.install.site
    dirs = {(site / rel).parent for rel in plan.files if not link_problem(site, str(Path(rel).parent))}
    plan.litter = fsops.find_litter([d for d in dirs if d.is_dir()] + plan.store.directories())
    plan.leftover = (
        plan.store.garbage(plan.record if plan.record else None) if plan.store.root.is_dir() else []
    )
    if plan.record is None and plan.record_present:
        plan.leftover = []  # a stale record's files are replaced by the next apply/revert anyway
    if plan.litter:
        plan.notes.append(
            f"{len(plan.litter)} temporary file(s) left by an interrupted run; apply/revert remove them"
        )
    if plan.leftover:
        plan.notes.append(
            f"{len(plan.leftover)} file(s) in {plan.store.root} that no record needs (left by an interrupted "
            "or failed run); apply/revert remove them"
        )


def build_plan(
    install: Installation, patches_dir: Path | None = None, owned_root: Path | None = None
) -> Plan:
    """Classify every patch and owned file and compute the contents ``apply`` and ``revert`` would write.

    Raises:
        ToolError: a series/patch format error, a damaged ``state.json``, an owned file that
            a patch also edits, or a missing GNU patch (exit 2).
    """
    patches_dir = patches_dir or resources.patches_dir()
    try:
        series = load_all_series(patches_dir)
    except PatchFormatError as exc:
        raise ToolError(f"{PROG}: bad patch series: {exc}") from None
    store = StateStore(install.site)
    record, loaded, notes = _load_record(store, install)
    reports, active = classify_patches(series, install)
    sources, owned_notes = owned.load_sources(owned_root, series)
    try:
        gnu = GnuPatch() if active else None
    except PatchToolMissingError as exc:
        raise ToolError(f"{PROG}: {exc}") from None
    files, file_notes = scan_patch_files(install, store, active, record)
    found = unapply_unrecorded(files, active, gnu, install)
    work = simulate_series(files, active, gnu, SeriesRun(install, record, found, reports))
    file_notes += check_against_wheel(files, reports, install)
    active_rels = {rel for patch in active for rel in patch.file_paths}
    plan = Plan(
        install=install,
        patches_dir=patches_dir,
        store=store,
        patch_program=gnu.version if gnu else None,
        reports=[reports[p.name] for p in series],
        files=files,
        owned=[],
        apply_contents={
            rel: (work[rel] if rel in active_rels else v.pristine)
            for rel, v in files.items()
            if not v.conflict
        },
        revert_contents={rel: v.pristine for rel, v in files.items() if not v.conflict},
        new_record=None,
        record=record,
        record_present=loaded is not None,
        loaded=loaded,
        notes=notes + file_notes + owned_notes,
    )
    needed = any(p.package == "vllm-omni" for p in active)
    owned.add_owned(plan, sources, needed)
    plan.new_record = _new_record(plan, active)
    _housekeeping(plan)
    return plan
