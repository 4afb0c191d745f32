# SPDX-License-Identifier: Apache-2.0
"""The call counts the results page states for the real inputs add up to the adapters' stats.

The counts are those :func:`minicpmo_cg.demo.adapter_calls` reads from the run's JSON report
(inputs, untimed and timed calls per input or session); the page's sentences and stats lines are
what that function writes from it, so a count the page states is one the report backs.
"""

from __future__ import annotations

import copy
import json

import pytest
from exportkit import REPO

from minicpmo_cg import demo
from minicpmo_cg.export import prtext

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

RESULTS = REPO / "docs/results/README.md"
REPORT = REPO / "docs/results/2026-12-01-H200/demo-current.json"
SECTION = "Real inputs"


def _section_lines() -> list[str]:
    text = prtext.section(RESULTS.read_text(encoding="utf-8"), SECTION)
    assert text, f"the results page has no section {SECTION!r}"
    return [line.split(" <!--", 1)[0].strip() for line in text.splitlines()]


def test_each_adapters_hits_and_misses_are_the_calls_its_inputs_made():
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    calls = demo.adapter_calls(report)
    assert set(calls) == set(report["stats"])
    for name, c in calls.items():
        assert c.stats["graph_hits"] + c.stats["graph_misses"] == c.calls == c.units * c.per_unit, name
        assert c.stats["num_graphs"] <= c.stats["warmup_misses"] <= c.stats["graph_misses"], name
        rows = [i for i in report["inputs"] if demo.ADAPTER_OF[i["modality"]] == name]
        assert c.inputs == len(rows) and c.timed == len(rows[0]["graphed_ms"]), name
        if c.modality != "duplex":
            assert c.timed == report["repeats"] and c.per_unit == c.warmup + c.timed, name


def test_the_page_states_the_counts_the_report_backs():
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    lines = _section_lines()
    eager_warmup = 1 if str(report["device"]).startswith("cuda") else 0
    for name, c in demo.adapter_calls(report).items():
        assert c.method(eager_warmup) in lines, name
        stats = [line for line in lines if line.startswith(f"- {name}:")]
        assert len(stats) == 1 and stats[0].startswith(f"- {c.stats_line()}"), (name, stats)
    # no count in the section that the report does not back ("20 calls each" beside 88 calls)
    assert not [line for line in lines if "calls each" in line]


def test_counts_that_do_not_add_up_are_refused_naming_the_adapter():
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    broken = copy.deepcopy(report)
    broken["stats"]["audio"]["graph_hits"] += 4
    with pytest.raises(
        ValueError, match=r"audio: graph_hits \+ graph_misses = 92, but its inputs made 4 × 22 = 88"
    ):
        demo.adapter_calls(broken)
    uneven = copy.deepcopy(report)
    next(i for i in uneven["inputs"] if i["modality"] == "image")["graphed_ms"].append(1.0)
    with pytest.raises(ValueError, match="vision: its inputs were timed with different counts"):
        demo.adapter_calls(uneven)
