"""Whether an installation holds the patch set, from the state record alone: cheap, read-only, no GNU patch.
"""

from __future__ import annotations

from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool.install import Installation
from minicpmo_cg.patchtool.owned import read_source, select_sources
from minicpmo_cg.patchtool.plan import classify_patches
from minicpmo_cg.patchtool.series import load_all_series
from minicpmo_cg.patchtool.state import StateStore, sha256_or_none
from minicpmo_cg.patchtool.views import CONFLICT, read_file

__all__ = ["missing_pieces"]


def _record_problems(install: Installation, active: list) -> list[str]:
    """What the record says is not in place (empty: every active patch recorded and on disk)."""
    record = StateStore(install.site).load()
    if record is None:
        return [f"no state record in {install.site} (minicpmo-cg-patch apply was not run there)"]
    if record.versions != install.versions:
        return [f"the state record was made for {record.versions}; installed is {install.versions}"]
    problems = [] if record.complete else ["an apply or revert was interrupted"]
    problems += [
        f"{p.name} is not applied" + (" (an older revision is)" if p.name in record.patches else "")
        for p in active
        if record.patches.get(p.name) != p.sha256
    ]
    for rel, entry in sorted(record.files.items()):
        if sha256_or_none(read_file(install.site / rel)) != entry.written_sha256:
            problems.append(f"{rel} is not what apply wrote")
    return problems


def missing_pieces(
    install: Installation, patches_dir: Path | None = None, owned_root: Path | None = None
) -> list[str]:
    """Why the installation does not hold the vllm-omni side of the patch set; empty when it does.

    Raises:
        ToolError, StateError, PatchFormatError, OSError: the series, the record or a file cannot
            be read; callers that must not fail catch them.
    """
    series = load_all_series(patches_dir or resources.patches_dir())
    reports, active = classify_patches(series, install)
    omni = {p.name for p in active if p.package == "vllm-omni"}
    problems = [f"{r.patch.name} is a conflict" for r in reports.values() if r.state == CONFLICT]
    if not omni:
        return problems
    problems += _record_problems(install, active)
    for rel, source in select_sources(owned_root)[0].items():
        if read_file(install.site / rel) != read_source(owned_root, source):
            problems.append(f"the owned file {rel} is missing or outdated")
    return problems
