"""Where the patch set's payload lives: the source tree (editable install) or ``_payload`` (wheel)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

__all__ = [
    "ADAPTER_PACKAGE_RELPATH",
    "ADAPTER_RELPATH",
    "OWNED_PACKAGE_DIR",
    "adapter_source",
    "lanes_dir",
    "owned_files",
    "owned_root",
    "patches_dir",
    "payload_root",
]

#: the adapter package beside vllm-omni's model file (relative to the payload root and to site-packages)
ADAPTER_PACKAGE_RELPATH = Path("vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph")
#: the adapter package's ``__init__.py``: the file that stands for the adapter in reports
ADAPTER_RELPATH = ADAPTER_PACKAGE_RELPATH / "__init__.py"
#: the top-level directory (relative to the payload root and to site-packages) of the owned files
OWNED_PACKAGE_DIR = "vllm_omni"
_SKIPPED_DIRS = frozenset({"__pycache__"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".minicpmo-cg-tmp")


def payload_root() -> Path:
    """Directory holding ``patches/``, ``lanes/`` and the owned ``vllm_omni/`` tree.

    Raises:
        FileNotFoundError: neither a wheel payload nor a source checkout is found.
    """
    here = Path(__file__).resolve().parent
    for root in (here / "_payload", here.parent):
        # the adapter package (a directory with its __init__.py) marks a complete payload
        if (root / "patches").is_dir() and (root / ADAPTER_RELPATH).is_file():
            return root
    raise FileNotFoundError(f"minicpmo_cg: no patch payload next to {here} (broken install?)")


def patches_dir() -> Path:
    return payload_root() / "patches"


def lanes_dir() -> Path:
    return payload_root() / "lanes"


def owned_root() -> Path:
    """The directory whose ``vllm_omni/`` subtree is installed into site-packages."""
    return payload_root()


def adapter_source() -> Path:
    """The adapter package's ``__init__.py`` in the payload (:data:`ADAPTER_RELPATH`)."""
    return payload_root() / ADAPTER_RELPATH


def owned_files(root: Path | None = None) -> dict[str, Path]:
    """Every file of ``root/vllm_omni/`` (default :func:`owned_root`), by site-relative POSIX path."""
    root = root or owned_root()
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root / OWNED_PACKAGE_DIR):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or name.endswith(_SKIPPED_SUFFIXES):
                continue
            path = Path(dirpath) / name
            found[PurePosixPath(path.relative_to(root).as_posix()).as_posix()] = path
    return dict(sorted(found.items()))
