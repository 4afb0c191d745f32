"""The supported vLLM / vllm-omni pairs ("lanes"), read from ``lanes/<name>.txt``.

Each lane file is a pip requirements file with exact pins, one ``name==version`` a line
(``#`` comments allowed); it must pin ``vllm`` and ``vllm-omni``. The file name is the lane name.
Standard library only: the offline GPU runner imports this on a host without vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: ``lanes/`` of the source checkout.
LANES_DIR = Path(__file__).resolve().parent.parent / "lanes"

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*(?:#.*)?$")


def _normalize(name: str) -> str:
    """PEP 503 project name normalisation (``vllm_omni`` -> ``vllm-omni``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Lane:
    """One supported pair and the rest of its pins.

    Attributes:
        name: lane name, the file name without ``.txt`` (e.g. ``"current"``).
        pins: every pin of the file, normalised project name -> version, in file order.
        vllm: the pinned vLLM version.
        vllm_omni: the pinned vllm-omni version.
    """

    name: str
    pins: dict[str, str]
    vllm: str
    vllm_omni: str

    def requirement(self, project: str) -> str:
        """``"project==version"`` for a pinned project (KeyError if not pinned)."""
        return f"{project}=={self.pins[_normalize(project)]}"


def read_lane(path: Path) -> Lane:
    """Parse one lane file.

    Raises:
        ValueError: a line is neither a comment nor an exact pin, or vllm / vllm-omni is missing.
    """
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.split("#", 1)[0].strip():
            continue
        match = _PIN.match(raw)
        if not match:
            raise ValueError(f"{path}:{lineno}: expected an exact pin 'name==version', got {raw.strip()!r}")
        pins[_normalize(match.group(1))] = match.group(2)
    missing = [p for p in ("vllm", "vllm-omni") if p not in pins]
    if missing:
        raise ValueError(f"{path}: lane file does not pin {', '.join(missing)}")
    return Lane(name=path.stem, pins=pins, vllm=pins["vllm"], vllm_omni=pins["vllm-omni"])


def all_lanes(lanes_dir: Path = LANES_DIR) -> list[Lane]:
    """Every lane of ``lanes_dir``, sorted by name."""
    return [read_lane(p) for p in sorted(lanes_dir.glob("*.txt"))]


def get_lane(name: str, lanes_dir: Path = LANES_DIR) -> Lane:
    """The lane called ``name``.

    Raises:
        ValueError: no ``lanes_dir/<name>.txt``; the message lists the known lanes.
    """
    path = lanes_dir / f"{name}.txt"
    if not name or "/" in name or not path.is_file():
        known = ", ".join(lane.name for lane in all_lanes(lanes_dir)) or "none"
        raise ValueError(f"unknown lane {name!r} (known lanes: {known})")
    return read_lane(path)


def lane_for_versions(vllm: str, vllm_omni: str, lanes_dir: Path = LANES_DIR) -> Lane | None:
    """The lane pinning exactly this vLLM / vllm-omni pair, or None."""
    for lane in all_lanes(lanes_dir):
        if (lane.vllm, lane.vllm_omni) == (vllm, vllm_omni):
            return lane
    return None
