"""The installation being patched: where it is, which lane it is, and what pip says is pristine.

Nothing here imports vLLM or vllm-omni (their import takes ~10 s): the directory comes from
:func:`importlib.util.find_spec` on the top-level names, the versions and the RECORD hashes
from the ``*.dist-info`` metadata (:mod:`importlib.metadata`).
"""

from __future__ import annotations

import base64
import csv
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg import lanes
from minicpmo_cg.patchtool.errors import PROG, ToolError
from minicpmo_cg.patchtool.series import KNOWN_PACKAGES

__all__ = ["Installation", "WheelFile", "discover_installation"]


@dataclass(frozen=True)
class WheelFile:
    """A file pip installed, as its distribution's RECORD lists it.

    Attributes:
        dist: canonical distribution name (``vllm-omni``).
        version: the installed version.
        sha256: hex digest RECORD gives for the file.
    """

    dist: str
    version: str
    sha256: str

    def reinstall_hint(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.dist}=={self.version}"


@dataclass(frozen=True)
class Installation:
    """The site-packages directory being patched.

    Attributes:
        site: the directory holding ``vllm/``, ``vllm_omni/`` and their dist-info.
        versions: canonical distribution name -> installed version.
        lane: the lane name (``current``, ``legacy``; see :mod:`minicpmo_cg.lanes`).
    """

    site: Path
    versions: dict[str, str]
    lane: str
    _wheel: dict[str, tuple[str, str, str]] | None = field(default=None, compare=False, repr=False)

    def wheel_file(self, rel: str) -> WheelFile | None:
        """What RECORD says about ``rel`` (None: not a file pip installed, or no hash recorded)."""
        if self._wheel is None:
            object.__setattr__(self, "_wheel", _record_entries(self.site))
        assert self._wheel is not None
        entry = self._wheel.get(rel)
        if entry is None:
            return None
        dist, version, value = entry
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        return WheelFile(dist, version, raw.hex())

    def wheel_has_dir(self, rel_dir: str) -> bool | None:
        """Whether RECORD lists a file below ``rel_dir`` (None when there is no RECORD at all)."""
        if self._wheel is None:
            object.__setattr__(self, "_wheel", _record_entries(self.site))
        assert self._wheel is not None
        if not self._wheel:
            return None
        prefix = rel_dir.rstrip("/") + "/"
        return any(rel.startswith(prefix) for rel in self._wheel)


def _record_entries(site: Path) -> dict[str, tuple[str, str, str]]:
    """rel -> (distribution, version, urlsafe-base64 sha256) from the RECORD files of vllm and vllm-omni.

    A distribution without RECORD (or with entries without hashes) contributes nothing;
    the tool then relies on its own state record alone.
    """
    found: dict[str, tuple[str, str, str]] = {}
    for dist_name in KNOWN_PACKAGES:
        for dist in importlib.metadata.distributions(name=dist_name, path=[str(site)]):
            version, text = dist.version, dist.read_text("RECORD") or ""
            for row in csv.reader(text.splitlines()):
                if len(row) >= 2 and row[1].startswith("sha256=") and ".." not in row[0].split("/"):
                    found[row[0]] = (dist_name, version, row[1][len("sha256=") :])
    return found


def _supported_text() -> str:
    return ", ".join(
        f"vllm {ln.vllm} + vllm-omni {ln.vllm_omni} (lane {ln.name})" for ln in lanes.all_lanes()
    )


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


def _locate_site(site_packages: Path | None) -> Path:
    if site_packages is not None:
        site = site_packages.resolve()
        if not site.is_dir():
            raise ToolError(f"{PROG}: --site-packages {site_packages}: not a directory")
        return site
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
    return located.pop()


def discover_installation(site_packages: Path | None = None) -> Installation:
    """Locate the installation and check that it is a supported pair (a lane).

    Args:
        site_packages: explicit directory (``--site-packages``); default: where
            the running interpreter would import ``vllm`` and ``vllm_omni`` from.

    Raises:
        ToolError: a package is missing, the two live in different directories,
            or the version pair is not one of :func:`minicpmo_cg.lanes.all_lanes` (exit 2).
    """
    site = _locate_site(site_packages)
    versions = {name: _dist_version(name, site) for name in ("vllm", "vllm-omni")}
    lane = None
    if None not in versions.values():
        lane = lanes.lane_for_versions(versions["vllm"], versions["vllm-omni"])
    if lane is None:
        shown = ", ".join(f"{n} {v if v else '(not installed)'}" for n, v in versions.items())
        newest = lanes.all_lanes()[0]
        raise ToolError(
            f"{PROG}: unsupported vLLM/vllm-omni installation in {site}: found {shown}. "
            f"Supported pairs: {_supported_text()}. Install one supported pair with both pins "
            f'(e.g. pip install "vllm=={newest.vllm}" "vllm-omni=={newest.vllm_omni}") or point '
            f"--site-packages at an environment that has one; nothing was changed."
        )
    return Installation(site, {k: v for k, v in versions.items() if v}, lane.name)
