"""What of the upstream wheels goes into an offline GPU bundle, and what is dropped (and why)."""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from collections import Counter
from pathlib import Path

from minicpmo_cg.offline_gpu.native import CARRIED

#: Native code: built against torch's unstable C++ ABI, or kernels MiniCPM-o 4.5 does not use.
NATIVE_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".a", ".o", ".lib")
#: C/C++/CUDA sources and headers (inputs of kernel builds; nothing imports them).
SOURCE_SUFFIXES = (".h", ".hpp", ".hh", ".cuh", ".inl", ".cu", ".cpp", ".cc", ".cxx", ".c")
#: Web UI assets of vLLM's OpenAI server (its docs page); only served over HTTP.
WEB_SUFFIXES = (".js", ".css", ".map")
#: Prose documentation; never read by code.
DOC_SUFFIXES = (".md", ".rst")
#: Pictures inside ``vllm`` are documentation figures. vllm-omni's media (voice ``.wav``, ``.npy``
#: speaker prompts) are model assets and are kept: the demo uses them as real inputs.
VLLM_DOC_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".svg")
#: dist-info files kept: METADATA (``importlib.metadata.version()``, the patch tool's lane check),
#: entry points, top_level, WHEEL and licenses. RECORD would list the dropped files: dropped.
DIST_INFO_KEEP = re.compile(
    r"\.dist-info/(METADATA|WHEEL|entry_points\.txt|top_level\.txt|licenses/.*|LICENSE.*)$"
)
ELF_MAGIC = b"\x7fELF"
KEEP = "keep"


def classify(name: str, head: bytes = b"") -> tuple[bool, str]:
    """Decide whether wheel member ``name`` goes into the bundle."""
    base = name.rsplit("/", 1)[-1]
    lower = base.lower()
    if name.endswith("/"):
        return False, "directory entry"
    if ".dist-info/" in name:
        return (True, KEEP) if DIST_INFO_KEEP.search(name) else (False, "dist-info RECORD/misc")
    if "/__pycache__/" in f"/{name}" or lower.endswith((".pyc", ".pyo")):
        return False, "bytecode cache"
    if name in CARRIED:
        return True, KEEP
    if lower.endswith(NATIVE_SUFFIXES) or re.search(r"\.so\.\d", lower):
        return False, "native extension (not carried)"
    if head[:4] == ELF_MAGIC:
        return False, "native executable"
    if lower.endswith(SOURCE_SUFFIXES) or "/csrc/" in f"/{name}":
        return False, "C/C++/CUDA source or header"
    if lower.endswith(WEB_SUFFIXES):
        return False, "web UI asset"
    if lower.endswith(DOC_SUFFIXES) or base in ("Makefile", "README"):
        return False, "documentation"
    if name.split("/", 1)[0] == "vllm" and lower.endswith(VLLM_DOC_IMAGE_SUFFIXES):
        return False, "documentation figure"
    return True, KEEP


def _head(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """First bytes of members without an extension (where an executable may hide)."""
    if info.is_dir() or "." in info.filename.rsplit("/", 1)[-1]:
        return b""
    with zf.open(info) as fh:
        return fh.read(4)


def extract_wheel(wheel: str | os.PathLike, site: str | os.PathLike) -> dict:
    """Unpack ``wheel`` into the directory ``site`` through :func:`classify`.

    Raises:
        ValueError: a member would land outside ``site``.
    """
    site = Path(site).resolve()
    dropped: dict[str, list[int]] = {}
    kept_files = kept_bytes = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            keep, rule = classify(info.filename, _head(zf, info))
            if not keep:
                entry = dropped.setdefault(rule, [0, 0])
                entry[0] += 1
                entry[1] += info.file_size
                continue
            dest = (site / info.filename).resolve()
            if not dest.is_relative_to(site):
                raise ValueError(f"{wheel}: member escapes the site directory: {info.filename}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode | 0o600)
            kept_files += 1
            kept_bytes += info.file_size
    return {
        "wheel": os.path.basename(wheel),
        "kept_files": kept_files,
        "kept_bytes": kept_bytes,
        "dropped": dropped,
    }


#: Top-level trees left to :func:`classify` alone (a ``tests`` package there may be imported).
UPSTREAM_TOPS = {"vllm", "vllm_omni"}
_DEP_DROP_SUFFIXES = (".pyc", ".h", ".hpp", ".cuh")


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def strip_site(site: str | os.PathLike) -> dict[str, int]:
    """Drop bytecode caches, ``bin/`` scripts, RECORD files and C headers of the installed dependencies."""
    removed: Counter[str] = Counter()
    for top in sorted(Path(site).iterdir()):
        if top.name in UPSTREAM_TOPS or not top.is_dir():
            continue
        if top.name == "bin":  # console scripts of the dependencies: never run from the bundle
            removed["bin"] += _tree_bytes(top)
            shutil.rmtree(top)
            continue
        for cache in sorted(top.rglob("__pycache__"), reverse=True):
            removed["__pycache__"] += _tree_bytes(cache)
            shutil.rmtree(cache)
        for f in top.rglob("*"):
            if f.is_file() and (
                f.name.endswith(_DEP_DROP_SUFFIXES) or (f.name == "RECORD" and top.suffix == ".dist-info")
            ):
                removed["files"] += f.stat().st_size
                f.unlink()
    return dict(removed)


def remove_bytecode(site: str | os.PathLike) -> None:
    """Remove every ``__pycache__`` below ``site`` (the host compiles on first import)."""
    for cache in sorted(Path(site).rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache, ignore_errors=True)
