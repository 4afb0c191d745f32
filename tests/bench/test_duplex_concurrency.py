# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ``duplex_concurrency`` scenario: the JSON schema the issue asks for, the targets'
verdicts, and a CPU dry run through the real call paths (batched steps, set explicitly since they
are opt-in, and start-up capture on the default per-session path)."""

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


def _result(batched_8=3.0, batched_32=5.0, single=2.5, first_max=4.0):
    rows = {n: {"chunk_ms": {"per_session": {"median": single}}} for n in ("1", "8", "32")}
    sessions = {
        n: {"step_ms": {"eager": 30.0, "per_session": 20.0, "batched": b}}
        for n, b in (("1", single), ("8", batched_8), ("32", batched_32))
    }
    return {
        "sessions": sessions,
        "first_session": {"max_ms": first_max, "p90_ms": 3.0},
        "detail": {"rows": rows, "host_ms": {"audio_1s_call": 0.2, "duplex_chunk": 0.25}},
    }


def test_the_scenario_is_a_section_of_the_benchmark():
    assert cli.SCENARIOS["duplex_concurrency"] is duplex_concurrency.run
    assert cli.parse_args(["--only", "duplex_concurrency"]).sections == ["duplex_concurrency"]
    assert duplex_concurrency.SESSIONS["full"] == (1, 2, 4, 8, 16, 32)


def test_targets_are_the_issues():
    assert duplex_concurrency.missed_targets(_result()) == []
    result = _result(batched_8=3.6, batched_32=6.1, single=3.2, first_max=5.5)
    result["detail"]["host_ms"]["duplex_chunk"] = 2.2  # a call that waits for the GPU
    assert duplex_concurrency.missed_targets(result) == [
        "8 sessions batched 3.60 ms > 3.5 ms",
        "32 sessions batched 6.10 ms > 6 ms",
        "1 session 3.20 ms per chunk > 3 ms",
        "duplex_chunk host time 2.200 ms > 0.3 ms",
        "first session worst chunk 5.50 ms > 5 ms",
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
    assert res["problems"] == [], res["problems"]  # parity: per-session bitwise, batched within tolerance
    s = res["duplex_concurrency"]
    assert set(s) == {"sessions", "first_session", "detail"}
    assert list(s["sessions"]) == ["1", "2"]
    for row in s["sessions"].values():
        assert set(row) == {"step_ms"} and set(row["step_ms"]) == {"eager", "per_session", "batched"}
        assert all(isinstance(v, float) and v > 0 for v in row["step_ms"].values())
    assert set(s["first_session"]) == {"max_ms", "p90_ms"} and s["first_session"]["max_ms"] > 0
    for row in s["detail"]["rows"].values():
        assert row["parity"]["per_session_bitwise"] and row["parity"]["batched_worst_rel"] <= 1e-4
        assert row["batch_stats"]["batched_rows"] > 0 and row["batch_stats"]["single_rows"] == 0
        assert row["batch_stats"]["attention"] == {"cpu": "reference"}
    attention = s["detail"]["attention"]
    assert attention["name"] == "reference" and attention["reason"].startswith("a cpu device")
    assert set(s["detail"]["host_ms"]) == {"audio_1s_call", "duplex_chunk", "batched_step_4"}
    # first_session is the default path's, per-session replays (batched steps are opt-in): its
    # start-up capture has no batch buckets, and the key's figures are that run's
    first = s["detail"]["first_session"]
    assert list(first) == ["per_session", "per_session_lazy"]  # the dry run leaves the batched one out
    assert (s["first_session"]["max_ms"], s["first_session"]["p90_ms"]) == (
        first["per_session"]["max_ms"],
        first["per_session"]["p90_ms"],
    )
    startup = first["per_session"]["startup"]
    assert startup["graphs"] == {"streaming audio": 30, "vision": 1} and startup["bytes"] > 0
    assert "startup" not in first["per_session_lazy"]
    section = r.stdout.split("-- duplex concurrency")[1]
    assert "first session after start-up (per_session): worst chunk" in section and "targets: " in section
    assert f"batched steps' attention: reference ({attention['reason']})" in section
