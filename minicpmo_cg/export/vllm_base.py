"""The pinned vLLM release's files the vLLM series is diffed against, from the lane's installation.

vLLM's wheel is several hundred MB, so the base is the installed vLLM of the lane: the patch
tool's plan gives each file's pristine bytes (the stored original after ``apply``, checked
against pip's RECORD hashes of the wheel), so a patched installation serves as well.
"""

from __future__ import annotations

from pathlib import Path

from minicpmo_cg.export.changeset import ChangeSet
from minicpmo_cg.patchtool.install import discover_installation
from minicpmo_cg.patchtool.plan import build_plan

__all__ = ["pristine_files"]


def pristine_files(cs: ChangeSet, rels: list[str], site_packages: Path | None) -> dict[str, bytes]:
    """Pristine bytes of each site-relative path in ``rels`` in the lane's installation.

    Raises:
        RuntimeError: the installation is of another lane, or a file has no known pristine content.
        minicpmo_cg.patchtool.ToolError: no usable installation (the patch tool's message).
    """
    install = discover_installation(site_packages)
    if install.lane != cs.lane.name:
        raise RuntimeError(
            f"the installed pair is lane {install.lane!r}, the export is for lane {cs.lane.name!r}: run the "
            f"export with that lane's Python, or pass --site-packages of its venv"
        )
    plan = build_plan(install, cs.repo / "patches", cs.repo)
    out = {}
    for rel in rels:
        view = plan.files.get(rel)
        if view is not None:
            if view.conflict or view.pristine is None:
                raise RuntimeError(f"{install.site / rel}: no pristine content ({view.conflict or 'absent'})")
            out[rel] = view.pristine
        elif (install.site / rel).is_file():
            out[rel] = (install.site / rel).read_bytes()
        else:
            raise RuntimeError(f"{install.site / rel} does not exist")
    return out
