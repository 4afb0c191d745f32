"""The supported vLLM / vllm-omni version pairs ("lanes"), read from ``lanes/*.txt``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Lane", "LaneError", "all_lanes", "get_lane", "lane_for_versions", "lanes_dir"]

_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][0-9A-Za-z.+!-]*)$")


class LaneError(ValueError):
    """An unknown lane name, or a lane file that is not a list of exact pins (names the file)."""


@dataclass(frozen=True)
class Lane:
    """One supported pair and the pins that come with it."""

    name: str
    pins: tuple[str, ...]
    vllm: str
    vllm_omni: str

    @property
    def pair(self) -> tuple[str, str]:
        """``(vllm, vllm_omni)``."""
        return (self.vllm, self.vllm_omni)

    def requirement(self, package: str) -> str:
        """The pin of ``package`` (any spelling, e.g. ``vllm_omni``) as ``package==version``.

        Raises:
            KeyError: the lane does not pin ``package``.
        """
        wanted = _canonical(package)
        for pin in self.pins:
            if pin.split("==", 1)[0] == wanted:
                return pin
        raise KeyError(f"lane {self.name} does not pin {package}")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str):
    """A comparable form of ``version`` without its local label; ValueError when unparsable."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - every lane venv has packaging
        match = re.fullmatch(r"(\d+(?:\.\d+)*)(?:\+[A-Za-z0-9.]+)?", version.strip())
        if not match:
            raise ValueError(f"not a plain release version: {version!r}") from None
        parts = [int(p) for p in match.group(1).split(".")]
        while len(parts) > 1 and parts[-1] == 0:
            parts.pop()
        return tuple(parts)
    try:
        return Version(Version(version).public)
    except InvalidVersion as exc:
        raise ValueError(f"not a version: {version!r}") from exc


def lanes_dir() -> Path:
    """The ``lanes/`` directory of this checkout or of the installed wheel's payload.

    Raises:
        FileNotFoundError: neither exists (a broken install).
    """
    from minicpmo_cg import resources

    return resources.lanes_dir()


def _parse_lane_file(path: Path) -> Lane:
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN_RE.match(line)
        if not match:
            raise LaneError(f"{path}: line {lineno}: {line!r} is not an exact pin 'package==version'")
        package, version = _canonical(match.group(1)), match.group(2)
        if package in pins:
            raise LaneError(f"{path}: line {lineno}: {package} is pinned twice")
        try:
            _public(version)
        except ValueError as exc:
            raise LaneError(f"{path}: line {lineno}: {exc}") from None
        pins[package] = version
    missing = [p for p in ("vllm", "vllm-omni") if p not in pins]
    if missing:
        raise LaneError(f"{path}: a lane file must pin vllm and vllm-omni; missing: {', '.join(missing)}")
    return Lane(
        name=path.stem,
        pins=tuple(f"{p}=={v}" for p, v in pins.items()),
        vllm=pins["vllm"],
        vllm_omni=pins["vllm-omni"],
    )


@functools.lru_cache(maxsize=8)
def _load(directory: Path) -> tuple[Lane, ...]:
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise LaneError(f"{directory}: no lane files (*.txt)")
    lanes = [_parse_lane_file(path) for path in files]
    seen: dict[tuple, str] = {}
    for lane in lanes:
        key = (_public(lane.vllm), _public(lane.vllm_omni))
        if key in seen:
            raise LaneError(
                f"{directory}: lanes {seen[key]} and {lane.name} pin the same vllm/vllm-omni pair"
            )
        seen[key] = lane.name
    newest_first = sorted(lanes, key=lambda lane: lane.name)
    newest_first.sort(key=lambda lane: (_public(lane.vllm), _public(lane.vllm_omni)), reverse=True)
    return tuple(newest_first)


def all_lanes(directory: Path | None = None) -> tuple[Lane, ...]:
    """Every lane, newest vLLM first (then newest vllm-omni, then by name).

    Raises:
        LaneError: a malformed lane file, no lane file, or two lanes with one pair.
    """
    return _load(Path(directory if directory is not None else lanes_dir()).resolve())


def get_lane(name: str, directory: Path | None = None) -> Lane:
    """The lane called ``name``.

    Raises:
        LaneError: no such lane (the message lists the known ones).
    """
    lanes = all_lanes(directory)
    for lane in lanes:
        if lane.name == name:
            return lane
    raise LaneError(f"unknown lane {name!r} (known: {', '.join(lane.name for lane in lanes)})")


def lane_for_versions(vllm: str, vllm_omni: str, directory: Path | None = None) -> Lane | None:
    """The lane pinning exactly this installed pair, or None (also for an unparsable version)."""
    try:
        wanted = (_public(vllm), _public(vllm_omni))
    except ValueError:
        return None
    for lane in all_lanes(directory):
        if (_public(lane.vllm), _public(lane.vllm_omni)) == wanted:
            return lane
    return None
