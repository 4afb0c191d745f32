"""The installation being patched: where it is, which lane it is, and what pip says is pristine."""

from __future__ import annotations

import base64
import binascii
import csv
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg import lanes
from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.errors import PROG, ToolError
from minicpmo_cg.patchtool.series import KNOWN_PACKAGES

__all__ = ["Installation", "WheelFile", "discover_installation"]

#: the largest METADATA / RECORD read (vLLM's are about 0.1 / 2 MiB)
MAX_METADATA_BYTES = 16 << 20
MAX_RECORD_BYTES = 64 << 20


@dataclass(frozen=True)
class WheelFile:
    """A file pip installed, as its distribution's RECORD lists it."""

    dist: str
    version: str
    sha256: str

    def reinstall_hint(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.dist}=={self.version}"


@dataclass(frozen=True)
class Installation:
    """The site-packages directory being patched."""

    site: Path
    versions: dict[str, str]
    lane: str
    _wheel: dict[str, WheelFile] | None = field(default=None, compare=False, repr=False)

    def wheel_file(self, rel: str) -> WheelFile | None:
        """What RECORD says about ``rel`` (None: not a file pip installed, or no hash recorded).

        Raises:
            ToolError: a RECORD is not a regular file, too large, not UTF-8 or malformed (exit 2).
        """
        if self._wheel is None:
            object.__setattr__(self, "_wheel", _record_entries(self.site))
        assert self._wheel is not None
        return self._wheel.get(rel)

    def wheel_has_dir(self, rel_dir: str) -> bool | None:
        """Whether RECORD lists a file below ``rel_dir`` (None when there is no RECORD at all)."""
        if self._wheel is None:
            object.__setattr__(self, "_wheel", _record_entries(self.site))
        assert self._wheel is not None
        if not self._wheel:
            return None
        prefix = rel_dir.rstrip("/") + "/"
        return any(rel.startswith(prefix) for rel in self._wheel)


def _dist_infos(dist: str, site: Path) -> list[Path]:
    """The ``*.dist-info`` directories of ``dist`` directly in ``site`` (names matched as pip does)."""
    wanted = re.sub(r"[-_.]+", "_", dist).lower()
    return sorted(
        child
        for child in site.iterdir()
        if child.name.lower().endswith(".dist-info")
        and re.sub(r"[-_.]+", "_", child.name.partition("-")[0]).lower() == wanted
        and child.is_dir()
    )


def _reinstall(dist: str) -> str:
    return f"reinstall {dist} (pip install --force-reinstall --no-deps {dist})"


def _metadata_text(path: Path, dist: str, limit: int) -> str:
    """The UTF-8 text of a dist-info file; a one-line :class:`ToolError` naming it when unusable."""
    reinstall = _reinstall(dist)
    try:
        return fsops.read_regular(path, limit=limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(f"{PROG}: {path} is not UTF-8 text ({exc}); {reinstall}") from None
    except (fsops.NotRegularFileError, fsops.TooLargeError) as exc:
        raise ToolError(f"{PROG}: {exc}; {reinstall}") from None


def _version_of(info: Path, dist: str) -> str:
    """The ``Version`` field of ``info/METADATA`` (the header block before the first blank line)."""
    path = info / "METADATA"
    try:
        text = _metadata_text(path, dist, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise ToolError(f"{PROG}: {info} has no METADATA; {_reinstall(dist)}") from None
    for line in text.splitlines():
        if not line.strip():
            break
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() == "version" and value.strip():
            return value.strip()
    raise ToolError(f"{PROG}: {path} has no Version field in its header; {_reinstall(dist)}")


def _sha256_hex(value: str) -> str | None:
    """The hex of RECORD's ``urlsafe-base64`` sha256 (unpadded), or None when it is not one."""
    try:
        raw = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


def _record_entries(site: Path) -> dict[str, WheelFile]:
    """rel -> what the RECORD files of vllm and vllm-omni say about it (files with a sha256 only).

    Raises:
        ToolError: a RECORD that is not a regular file, too large, not UTF-8, not CSV, or with a
            hash that is not a sha256 digest; the message names the file and the line.
    """
    found: dict[str, WheelFile] = {}
    packages = set(KNOWN_PACKAGES.values())
    for dist_name in KNOWN_PACKAGES:
        for info in _dist_infos(dist_name, site):
            version = _version_of(info, dist_name)
            path = info / "RECORD"
            try:
                text = _metadata_text(path, dist_name, MAX_RECORD_BYTES)
            except FileNotFoundError:
                continue
            reader = csv.reader(text.splitlines())
            try:
                for row in reader:
                    if len(row) < 2 or not row[1].startswith("sha256="):
                        continue
                    parts = row[0].split("/")
                    if parts[0] not in packages or any(p in ("", ".", "..") for p in parts):
                        continue
                    digest = _sha256_hex(row[1][len("sha256=") :])
                    if digest is None:
                        raise ToolError(
                            f"{PROG}: {path}: line {reader.line_num}: {row[1][:80]!r} is not a sha256 "
                            f"digest; {_reinstall(dist_name)}"
                        )
                    found[row[0]] = WheelFile(dist_name, version, digest)
            except csv.Error as exc:
                raise ToolError(
                    f"{PROG}: {path}: line {reader.line_num}: not a RECORD row ({exc}); {_reinstall(dist_name)}"
                ) from None
    return found


def _supported_text() -> str:
    return ", ".join(
        f"vllm {ln.vllm} + vllm-omni {ln.vllm_omni} (lane {ln.name})" for ln in lanes.all_lanes()
    )


def _dist_version(dist: str, site: Path) -> str | None:
    found = {_version_of(info, dist) for info in _dist_infos(dist, site)}
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
