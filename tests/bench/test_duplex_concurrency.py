# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ``duplex_concurrency`` scenario: the JSON schema the issue asks for, the targets'
verdicts, and a CPU dry run through the real call paths (start-up capture, the streaming audio
encoder's steps, the eager forward and the floor interleaved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import patched_model_available

from minicpmo_cg.bench import cli, duplex_concurrency

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def _result(step_1=1.5, step_8=2.9, step_32=5.9, floor=5.0, host=0.2, first=2.0):
    sessions = {
        n: {"step_ms": {"eager": 30.0, "paged": step, "floor": min(floor, step)}, "host_ms": host}
        for n, step in (("1", step_1), ("8", step_8), ("32", step_32))
    }
    return {"sessions": sessions, "first_chunk_ms": first}


def test_the_scenario_is_a_section_of_the_benchmark():
    assert cli.SCENARIOS["duplex_concurrency"] is duplex_concurrency.run
    assert cli.parse_args(["--only", "duplex_concurrency"]).sections == ["duplex_concurrency"]
    assert duplex_concurrency.SESSIONS["full"] == (1, 2, 4, 8, 16, 32)


def test_targets_are_the_issues():
    assert duplex_concurrency.missed_targets(_result()) == []
    result = _result(step_1=1.7, step_8=3.1, step_32=6.5, host=0.4, first=2.6)
    result["sessions"]["8"]["step_ms"]["floor"] = 2.0  # 3.1 ms > 1.3 x 2.0 ms
    assert duplex_concurrency.missed_targets(result) == [
        "1 sessions 1.70 ms per step > 1.6 ms",
        "8 sessions 3.10 ms per step > 3 ms",
        "32 sessions 6.50 ms per step > 6 ms",
        "1 sessions host 0.400 ms per step > 0.3 ms",
        "8 sessions 3.10 ms > 1.3 x floor 2.00 ms",
        "8 sessions host 0.400 ms per step > 0.3 ms",
        "32 sessions host 0.400 ms per step > 0.3 ms",
        "first chunk after start-up 2.60 ms > 2.5 ms",
    ]


@pytest.mark.skipif(not patched_model_available(), reason="the patched model file is not installed")
def test_cpu_dry_run_writes_the_schema(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.bench", "--device", "cpu", "--allow-cpu", "--quick"]
        + ["--only", "duplex_concurrency", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["problems"] == [], res["problems"]  # the graphed steps bitwise equal to the eager forward
    s = res["duplex_concurrency"]
    assert set(s) == {"sessions", "first_chunk_ms", "startup", "detail"}
    assert list(s["sessions"]) == ["1", "2"]
    for row in s["sessions"].values():
        assert set(row) == {"step_ms", "host_ms"} and set(row["step_ms"]) == {"eager", "paged", "floor"}
        assert all(isinstance(v, float) and v > 0 for v in row["step_ms"].values()) and row["host_ms"] > 0
    assert all(row["bitwise"] for row in s["detail"]["rows"].values())
    startup = s["startup"]  # one graph per bucket of a 32-session deployment, and the camera frame's
    assert (
        startup["graphs"] == {"streaming audio": 6, "vision": 1}
        and startup["bytes"] > startup["pool_bytes"] > 0
    )
    assert s["first_chunk_ms"] > 0 and s["detail"]["graph_stats"]["graph_misses"] == 0
    section = r.stdout.split("-- duplex concurrency")[1]
    assert "start-up capture:" in section and "targets: " in section
