"""The released vllm-omni source the export is made against, and vllm-omni's ruff, from PyPI.

Both are downloaded once with pip and kept under ``${MINICPMO_CG_CACHE:-~/.cache/minicpmo-cg}/upstream/``
beside the lane venvs. vllm-omni publishes no sdist after 0.20.0, so the source is the pinned
release wheel (``vllm_omni-X-py3-none-any.whl``): pure Python, its ``vllm_omni/`` tree is the
repository's at the release, without ``tests/``, ``docs/`` or ``.buildkite/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["FetchError", "cache_dir", "extract_package", "release_commit", "ruff_binary", "wheel"]


class FetchError(RuntimeError):
    """A download failed or a cached file is unusable (the message says which and why)."""


def cache_dir() -> Path:
    root = os.environ.get("MINICPMO_CG_CACHE") or str(Path.home() / ".cache" / "minicpmo-cg")
    return Path(root) / "upstream"


def _pip(*args: str) -> None:
    # The env prefix keeps a machine-wide pip configuration (a CPU torch via find-links) out.
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--progress-bar", "off"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise FetchError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}")


def wheel(distribution: str, version: str) -> Path:
    """The cached ``distribution==version`` wheel (downloaded on first use).

    Raises:
        FetchError: pip could not download it (no network, or no wheel of that version).
    """
    folder = cache_dir() / "wheels"
    stem = f"{distribution.replace('-', '_')}-{version}-"
    found = sorted(p for p in folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        _pip(
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            str(folder),
            f"{distribution}=={version}",
        )
        found = sorted(folder.glob(f"{stem}*.whl"))
    if not found:
        raise FetchError(f"pip downloaded no {distribution}=={version} wheel into {folder}")
    return found[0]


def extract_package(wheel_path: Path, package: str, dest: Path) -> Path:
    """Unpack the ``package/`` tree of ``wheel_path`` into ``dest`` (no dist-info); return ``dest``."""
    prefix = f"{package}/"
    with zipfile.ZipFile(wheel_path) as archive:
        for info in archive.infolist():
            if info.filename.startswith(prefix) and not info.is_dir():
                archive.extract(info, dest)
    if not (dest / package).is_dir():
        raise FetchError(f"{wheel_path.name} has no {package}/ tree")
    return dest


def release_commit(tree: Path, package: str) -> str | None:
    """The ``commit_id`` recorded in ``package/_version.py`` of an unpacked wheel (None when absent)."""
    path = tree / package / "_version.py"
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("__commit_id__") and "=" in line:
            value = line.rsplit("=", 1)[1].strip()
            return None if value == "None" else value.strip("'\"")
    return None


def ruff_binary(version: str) -> Path:
    """The ``ruff`` executable of ``ruff==version``, installed once into the cache.

    Raises:
        FetchError: pip could not install it.
    """
    target = cache_dir() / f"ruff-{version}"
    binary = target / "bin" / "ruff"
    if not binary.is_file():
        _pip("install", "--no-deps", "--only-binary", ":all:", "--target", str(target), f"ruff=={version}")
    if not binary.is_file():
        raise FetchError(f"ruff=={version} installed into {target} but {binary} is missing")
    return binary
