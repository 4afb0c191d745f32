# SPDX-License-Identifier: Apache-2.0
"""``minicpmo_cg.lanes``: the supported pairs, read from ``lanes/*.txt``, and what uses them."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from minicpmo_cg import lanes, resources

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name] = version
    return out


def test_shipped_lanes_are_the_lane_files():
    files = sorted((REPO / "lanes").glob("*.txt"))
    found = lanes.all_lanes()
    assert sorted(lane.name for lane in found) == [f.stem for f in files]
    for path in files:
        lane = lanes.get_lane(path.stem)
        pins = _pins(path)
        assert lane.pair == (pins["vllm"], pins["vllm-omni"]) == (lane.vllm, lane.vllm_omni)
        assert lane.pins == tuple(f"{k}=={v}" for k, v in pins.items())
        assert lane.requirement("vllm_omni") == f"vllm-omni=={pins['vllm-omni']}"
    assert found[0].name == "current" and lanes.get_lane("legacy").vllm == "0.28.0"
    assert resources.lanes_dir() == lanes.lanes_dir() == REPO / "lanes"


def test_lane_for_versions_ignores_local_labels_and_trailing_zeros():
    current = lanes.get_lane("current")
    assert lanes.lane_for_versions(current.vllm + "+cu130", current.vllm_omni) == current
    assert lanes.lane_for_versions(current.vllm.removesuffix(".0"), current.vllm_omni) == current
    assert lanes.lane_for_versions(current.vllm, lanes.get_lane("legacy").vllm_omni) is None
    assert lanes.lane_for_versions("banana", current.vllm_omni) is None
    assert lanes.lane_for_versions("99.0", "99.0") is None


def test_unknown_lane_names_the_known_ones():
    with pytest.raises(lanes.LaneError, match=r"unknown lane 'nightly' \(known: current, legacy\)"):
        lanes.get_lane("nightly")
    with pytest.raises(KeyError, match="does not pin torch"):
        lanes.get_lane("current").requirement("torch")


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.txt": "vllm==1.0\n"}, "a.txt: a lane file must pin vllm and vllm-omni; missing: vllm-omni"),
        ({"a.txt": "vllm>=1.0\nvllm-omni==1.0\n"}, "a.txt: line 1: 'vllm>=1.0' is not an exact pin"),
        ({"a.txt": "vllm==1.0\nvllm-omni==1.0\nvllm==2.0\n"}, "a.txt: line 3: vllm is pinned twice"),
        (
            {"a.txt": "vllm==1.0\nvllm_omni==1.0\n", "b.txt": "vllm==1.0.0\nvllm-omni==1\n"},
            "lanes a and b pin",
        ),
        ({}, "no lane files"),
    ],
)
def test_malformed_lane_files_are_rejected_with_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(lanes.LaneError) as info:
        lanes.all_lanes(tmp_path)
    assert message in str(info.value)


def test_order_is_newest_first(tmp_path):
    (tmp_path / "old.txt").write_text("# comment\nvllm==0.9.0  # trailing\nvllm-omni==0.9.0\npytest==9.2.0\n")
    (tmp_path / "new.txt").write_text("vllm==0.10.0\nvllm-omni==0.10.0\n")
    found = lanes.all_lanes(tmp_path)
    assert [lane.name for lane in found] == ["new", "old"]
    assert found[1].pins == ("vllm==0.9.0", "vllm-omni==0.9.0", "pytest==9.2.0")
    assert lanes.lane_for_versions("0.9", "0.9.0", tmp_path).name == "old"


def test_setup_extras_are_the_lanes():
    """setup.py builds one extra per lane from lanes.py (the installed metadata says what it built)."""
    meta = importlib.metadata.metadata("minicpmo-encoder-cuda-graphs")
    requires = meta.get_all("Requires-Dist") or []
    extras = meta.get_all("Provides-Extra") or []
    for lane in lanes.all_lanes():
        assert lane.name in extras
        for pin in (lane.requirement("vllm"), lane.requirement("vllm-omni")):
            assert f'{pin}; extra == "{lane.name}"' in requires, (pin, requires)
