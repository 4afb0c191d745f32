"""Why a patch does not apply, in words that point at the fix."""

from __future__ import annotations

from minicpmo_cg.patchtool.gnupatch import GnuPatch, PatchRun, summarize_failure
from minicpmo_cg.patchtool.install import Installation
from minicpmo_cg.patchtool.series import Patch
from minicpmo_cg.patchtool.state import sha256_or_none

__all__ = ["explain_failure"]


def _added_lines(patch: Patch, rels: set[str]) -> set[str]:
    added: set[str] = set()
    for change in patch.files:
        if change.path in rels:
            for hunk in change.hunks:
                added |= set(hunk.new_lines) - set(hunk.old_lines)
    return added


def _best_window(lines: list[str], old: tuple[str, ...]) -> int:
    """Start of the window of ``lines`` that agrees with ``old`` on the most lines."""
    size = len(old)
    scores = [
        (sum(a == b for a, b in zip(lines[i : i + size], old)), -i)
        for i in range(max(1, len(lines) - size + 1))
    ]
    return -max(scores)[1] if scores else 0


def _changed_by_earlier(patch: Patch, earlier: list[Patch], before: dict[str, bytes | None]) -> list[str]:
    """Earlier patches whose added lines sit where a failing hunk of ``patch`` expects other text."""
    names = []
    for other in earlier:
        added = {line for line in _added_lines(other, set(patch.file_paths)) if line.strip()}
        for change in patch.files:
            lines = (before.get(change.path) or b"").decode("utf-8", "replace").splitlines()
            for hunk in change.hunks:
                start = _best_window(lines, hunk.old_lines)
                window = lines[start : start + len(hunk.old_lines)]
                if window == list(hunk.old_lines):
                    continue
                if {have for have, want in zip(window, hunk.old_lines) if have != want} & added:
                    names.append(other.name)
                    break
            if names and names[-1] == other.name:
                break
    return names


def explain_failure(
    patch: Patch,
    before: dict[str, bytes | None],
    files: dict,
    done: list[Patch],
    gnu: GnuPatch | None,
    install: Installation,
    ambiguous: list[str],
    run: PatchRun | None,
) -> str:
    """One detail line for a patch that cannot be applied to ``before`` (its files after the earlier patches)."""
    if ambiguous:
        return (
            "context is ambiguous, refused so that no hunk lands in the wrong place: "
            + "; ".join(ambiguous)
            + "; add context lines that make each hunk unique"
        )
    assert run is not None and gnu is not None
    summary = summarize_failure(run.output)
    pristine = {rel: files[rel].pristine for rel in patch.file_paths}
    earlier = [p for p in done if set(p.file_paths) & set(patch.file_paths)]
    base_cmd = f"minicpmo-cg-patch base --before {patch.name}"
    if earlier:
        names = ", ".join(p.name for p in earlier)
        if pristine != before and gnu.run(patch.diff, pristine).ok:
            return (
                f"does not apply after the earlier patch(es) {names} that change the same file, but "
                f"applies to the pristine file: stale starting point (diffed from the pristine file); "
                f"regenerate it from `{base_cmd}`: {summary}"
            )
        changed = _changed_by_earlier(patch, earlier, before)
        if changed:
            return (
                f"does not apply after {', '.join(changed)}: where this patch expects other text, the "
                f"file has lines that patch adds, so an earlier patch changed since this one was made; "
                f"regenerate it from `{base_cmd}`: {summary}"
            )
    version = f"{patch.package} {install.versions[patch.package]}"
    for rel, data in pristine.items():
        wheel = install.wheel_file(rel)
        if wheel is not None and sha256_or_none(data) != wheel.sha256:
            return (
                f"does not apply to {version}: the installed {rel} differs from the {wheel.dist} "
                f"{wheel.version} wheel (RECORD): changed locally? reinstall it ({wheel.reinstall_hint()}): "
                f"{summary}"
            )
    return (
        f"does not apply to {version}: the file differs from what the diff expects (another version, or "
        f"upstream changed this code); refresh the patch for this version: {summary}"
    )
