# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the per-tree call-site figures (``minicpmo_cg.bench.tree_figures``) and of the
results sections made from them (``minicpmo_cg.bench.tree_report``): the output comparison, the
table cells, and a logic check of the whole measurement on the installed tree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.runs import patched_model_available

from minicpmo_cg.bench import tree_figures, tree_report

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def test_rel_diff_is_zero_only_for_equal_tensors() -> None:
    a = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    assert tree_figures.rel_diff(a, a.clone()) == 0.0
    b = a.clone()
    b[0, 0] += 0.04
    assert tree_figures.rel_diff(a, b) == pytest.approx(0.01)
    assert tree_figures.rel_diff(a, a[:1]) is None


def test_compare_relates_each_tree_to_the_one_before(tmp_path: Path) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    torch.save({"eager/audio, 1 s": x}, tmp_path / "00-release.pt")
    torch.save({"eager/audio, 1 s": x.clone(), "graphed/audio, 1 s": x + 0.5}, tmp_path / "01-a.pt")
    # a tree that failed to measure has no outputs: the next one is related to the last measured
    torch.save({"eager/audio, 1 s": x * 2, "graphed/audio, 1 s": x * 2}, tmp_path / "03-c.pt")
    doc = tree_figures.compare(tmp_path, ["00-release", "01-a", "02-b", "03-c"])
    assert list(doc) == ["00-release", "01-a", "03-c"]
    assert doc["01-a"]["previous"] == "00-release"
    assert doc["01-a"]["vs_previous"] == {"eager/audio, 1 s": 0.0}
    assert doc["01-a"]["graphed_vs_eager"]["audio, 1 s"] == pytest.approx(0.5 / 5)
    assert doc["03-c"]["previous"] == "01-a"
    assert doc["03-c"]["graphed_vs_eager"] == {"audio, 1 s": 0.0}
    assert doc["03-c"]["vs_previous"]["eager/audio, 1 s"] == pytest.approx(5 / 5)


def _tree(eager_ms: float, graphed_ms: float | None, replayed: int = 15) -> dict:
    def row(ms: float, hits: int) -> dict:
        return {"median": ms, "p90": ms, "n": 15, "replayed": hits, "calls": 15}

    duplex = {"first_ms": eager_ms, "median": eager_ms, "worst": eager_ms * 2, "n": 10}
    eager = {call: row(eager_ms, 0) for call in tree_figures.CALLS} | {tree_figures.DUPLEX: duplex}
    if graphed_ms is None:
        return {"eager": eager, "graphed": None}
    g_duplex = {**duplex, "median": graphed_ms, "worst": graphed_ms, "replayed": 10, "calls": 10,
                "startup": {"graphs": 31, "mib": 374.0, "seconds": 1.9}}  # fmt: skip
    graphed = {call: row(graphed_ms, replayed) for call in tree_figures.CALLS} | {
        tree_figures.DUPLEX: g_duplex
    }
    return {"eager": eager, "graphed": graphed}


def _run(tmp_path: Path, trees: dict[str, dict], compare: dict) -> Path:
    (tmp_path / "figures").mkdir()
    figures = []
    for folder, doc in trees.items():
        (tmp_path / "figures" / f"{folder}.json").write_text(json.dumps(doc))
        figures.append({"folder": folder, "title": f"title of {folder}", "status": "ok"})
    figures[0]["title"] = "the vllm-omni 0.30.0 release"
    summary = {"date": "2026-12-02", "device": "GPU X", "environment": "Python 3.12", "figures": figures,
               "vllm": "0.30.0", "vllm_omni": "0.30.0", "stack_commit": "abc1234"}  # fmt: skip
    (tmp_path / "stack-current.json").write_text(json.dumps(summary))
    (tmp_path / "figures" / "compare.json").write_text(json.dumps(compare))
    return tmp_path


def test_report_sections_tag_each_pr_and_compare_default_paths(tmp_path: Path) -> None:
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    compare = {
        "01-fix": {"vs_previous": {f"eager/{c}": 0.0 for c in calls}, "graphed_vs_eager": {}},
        "02-graphs": {
            "vs_previous": {f"eager/{c}": 0.0 for c in calls},
            "graphed_vs_eager": {c: (3e-3 if c == "audio, 5 s" else 0.0) for c in calls},
        },
    }
    run = _run(tmp_path, {"00-release": _tree(10.0, None), "01-fix": _tree(8.0, None),
                          "02-graphs": _tree(8.0, 2.0, replayed=14)}, compare)  # fmt: skip
    text = tree_report.sections(run)
    assert text.count("<!-- pr: ") == 2 and text.count("<!-- /pr -->") == 2
    first, second = text.split("<!-- pr: graphs -->")
    assert "<!-- pr: fix -->" in first and "the release's tree (no PR applied)" in first
    # neither the release nor the fix has graphs: eager columns only, no default or graphed ones
    assert "Neither tree has encoder graphs" in first and "graphed vs eager" not in first
    row = next(line for line in first.splitlines() if line.startswith("| image, 1 slice |"))
    assert row.split(" | ")[1:] == ["10.00", "8.00", "1.25×", "bitwise |"]
    assert "Neither tree has encoder graphs" not in second and "| graphed vs eager |" in second
    assert "the tree before this PR (the earlier PRs of the stack applied)" in second
    row = next(line for line in second.splitlines() if line.startswith("| image, 1 slice |"))
    assert row.split(" | ")[4:] == ["2.00", "graphed, 14/15 replayed", "4.00×", "bitwise", "bitwise |"]
    # the graphed default changed the path: its output is compared through its own eager one
    row = next(line for line in second.splitlines() if line.startswith("| audio, 5 s |"))
    assert row.endswith("| 3.0e-03 | 3.0e-03 |")
    assert "Start-up capture on this tree: 31 graphs, 374.0 MiB, 1.9 s" in second
    assert "No graph replayed" not in text  # every graphed row replayed
    assert tree_report.setup_line(json.loads((run / "stack-current.json").read_text())).startswith(
        "**2026-12-02, GPU X** (Python 3.12)"
    )


def _two_prs(tmp_path: Path, first: dict, second: dict, kind: str = "eager") -> tuple[str, str]:
    """The report's sections of PRs ``a`` (tree ``first``) and ``b`` (tree ``second``) on the release,
    every output bitwise equal to the tree before's (``kind``: the path compared)."""
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    compare = {
        f: {"vs_previous": {f"{kind}/{c}": 0.0 for c in calls}, "graphed_vs_eager": {}}
        for f in ("01-a", "02-b")
    }
    text = tree_report.sections(
        _run(tmp_path, {"00-release": _tree(8.0, None), "01-a": first, "02-b": second}, compare)
    )
    a, b = text.split("<!-- pr: b -->")
    return a, b


def test_report_explains_calls_whose_graphs_the_cost_rule_declined_or_admitted(tmp_path: Path) -> None:
    declined, admitted = _tree(8.0, 8.0, replayed=0), _tree(8.0, 2.0)
    admitted["graphed"]["audio, 1 s"]["replayed"] = 0
    first, second = _two_prs(tmp_path, declined, admitted)
    text = first + second
    assert f"No graph replayed ({'; '.join(tree_figures.CALLS)}):" in first
    assert "No graph replayed (audio, 1 s):" in second
    others = [c for c in tree_figures.CALLS if c != "audio, 1 s"]
    assert f"Graphed here, no graph replayed before ({'; '.join(others)}):" in second
    assert "Graphed before, no graph replayed here" not in text  # no shape lost its graph


def test_report_explains_a_shape_the_cost_rule_admitted_before_and_declines_now(tmp_path: Path) -> None:
    admitted, declined = _tree(8.0, 2.0), _tree(8.0, 2.0)
    declined["graphed"]["image, 1 slice"]["replayed"] = 0
    first, second = _two_prs(tmp_path, admitted, declined)
    assert "Graphed before, no graph replayed here" not in first
    assert "Graphed before, no graph replayed here (image, 1 slice): the cost admission admitted" in second
    assert "No graph replayed (image, 1 slice):" in second


def test_block_medians_mark_differences_within_noise_and_state_the_spread(tmp_path: Path) -> None:
    """A run measured in rounds of blocks: a speed-up whose two trees' block medians overlap is
    marked within noise, one whose ranges are apart is not, and the spread within a process is stated."""
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    before, after = _tree(10.0, None), _tree(8.0, None)
    for tree, blocks in ((before, [10.0, 9.0, 12.0]), (after, [8.0, 7.5, 9.5])):
        for call in calls:
            tree["eager"][call]["blocks"] = blocks
    after["eager"]["image, 1 slice"]["blocks"] = [5.0, 5.5, 6.0]
    after["eager"]["image, 1 slice"]["median"] = 5.5
    compare = {"01-fix": {"vs_previous": {f"eager/{c}": 0.0 for c in calls}, "graphed_vs_eager": {}}}
    text = tree_report.sections(_run(tmp_path, {"00-release": before, "01-fix": after}, compare))
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")
    }
    # neither tree has graphs: call site | eager before | eager with this PR | speed-up | output
    assert rows["image, 1 slice"][3] == "1.82×"  # 10.0 / 5.5; blocks 9-12 against 5-6: apart
    assert rows["audio, 1 s"][3] == "1.25×, within noise"  # 9-12 against 7.5-9.5: they overlap
    # the ranges each mark was judged on are printed, so a reader can check it
    judged = text.split("each speed-up was judged on (ms, lowest–highest, before → with this PR): ", 1)[1]
    assert (
        "image, 1 slice 9.00–12.00 → 5.00–6.00; " in judged and "audio, 1 s 9.00–12.00 → 7.50–9.50" in judged
    )
    assert "3 rounds of one block of calls per tree" in text
    # 12 / 9 - 1 = 33 %, the largest of either tree's rows; no graphed rows: the default is the eager one
    assert "the block medians of a call moved: eager calls by up to 33%.\n" in text
    assert tree_report.overlap({"blocks": [1.0, 2.0]}, {"blocks": [2.0, 3.0]})
    assert not tree_report.overlap({"median": 1.0}, {"blocks": [1.0]})  # a run without blocks: no claim
    assert tree_report.spread([None, {"median": 1.0}]) is None


def test_a_call_that_replays_no_graph_on_either_tree_takes_its_noise_from_the_eager_blocks(
    tmp_path: Path,
) -> None:
    """Where neither tree replayed a graph of a call, its default call is the eager one: the eager
    rows' blocks decide "within noise", also for a duplex session timed once; where a graph replays,
    a default row without blocks gets no mark; a session after start-up capture says it is the first."""
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    before, after = _tree(10.0, 6.0, replayed=0), _tree(10.0, 5.0, replayed=0)
    after["graphed"]["image, 1 slice"]["replayed"] = 15  # a graph replays after, none before
    for tree in (before, after):
        tree["graphed"][tree_figures.DUPLEX]["replayed"] = 0
        for call in calls:
            tree["eager"][call]["blocks"] = [9.0, 10.0, 12.0]
    compare = {"01-fix": {"vs_previous": {f"eager/{c}": 0.0 for c in calls}, "graphed_vs_eager": {}}}
    text = tree_report.sections(_run(tmp_path, {"00-release": before, "01-fix": after}, compare))
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")
    }
    speed = 6  # call site | eager b | eager a | default b | default a | path | speed-up | ...
    assert (
        rows["audio, 1 s"][speed] == "1.20×, within noise"
    )  # no replay on either tree: eager blocks overlap
    assert rows[tree_figures.DUPLEX][speed] == "1.20×, within noise"  # timed once, yet eager on both trees
    assert rows["image, 1 slice"][speed] == "1.20×"  # replays after: its default rows have no blocks
    assert "the eager calls' blocks decide" in text
    # both sessions ran after start-up capture
    assert rows[tree_figures.DUPLEX][4].endswith(", the first session after start-up capture")
    # apart eager blocks: no mark, even with no replay on either tree
    after["eager"]["audio, 1 s"]["blocks"] = [4.0, 4.5, 5.0]
    (tmp_path / "again").mkdir()
    text = tree_report.sections(_run(tmp_path / "again", {"00-release": before, "01-fix": after}, compare))
    row = next(line for line in text.splitlines() if line.startswith("| audio, 1 s "))
    assert row.split(" | ")[speed] == "1.20×"


def test_speed_up_is_divided_from_the_medians_as_shown() -> None:
    """8.794 and 1.9249 show as 8.79 and 1.92: the speed-up is 8.79 / 1.92 = 4.578 -> 4.58×, not
    the unrounded 4.569 -> 4.57×, which a reader dividing the shown figures could not reproduce."""
    assert tree_report.speed_up({"median": 8.794}, {"median": 1.9249}) == "4.58×"
    assert tree_report.speed_up({"median": 8.0}, {"median": 2.0}) == "4.00×"
    assert tree_report.speed_up(None, {"median": 2.0}) == "—"
    assert tree_report.speed_up({"median": 2.0}, {"median": 0.001}) == "—"  # shows as 0.00


def _cell_ms(cell: str) -> float:
    """The median of a results cell: ``8.95`` or ``2.17 (worst 2.39); first session ...``."""
    return float(cell.strip().split(" ", 1)[0])


def test_every_speed_up_of_the_stack_results_page_agrees_with_its_shown_medians() -> None:
    """Each ``speed-up (default)`` cell of docs/results/stack.md equals the shown "default before"
    over the shown "default with this PR", to the two decimals it is given with."""
    repo = Path(__file__).resolve().parents[2]
    page = (repo / "docs/results/stack.md").read_text(encoding="utf-8")
    checked = 0
    for table in re.findall(r"^\| call site \|.*?(?=\n\n|\Z)", page, re.MULTILINE | re.DOTALL):
        header, _, *rows = table.splitlines()
        names = [c.strip() for c in header.strip("|").split("|")]
        if "default before" in names:
            before, after = names.index("default before"), names.index("default with this PR")
            speed = names.index("speed-up (default)")
        else:  # trees without graphs: the eager columns are the default ones
            before, after = names.index("eager before"), names.index("eager with this PR")
            speed = names.index("speed-up")
        for row in rows:
            cells = row.strip().strip("|").split("|")
            shown = cells[speed].strip().split(",")[0]  # "1.01×, within noise": the figure itself
            want = f"{round(_cell_ms(cells[before]), 2) / round(_cell_ms(cells[after]), 2):.2f}×"
            assert shown == want, row
            checked += 1
    assert checked >= 6, "the page has no speed-up cells"


def test_report_needs_a_run_summary(tmp_path: Path, capsys) -> None:
    assert tree_report.main([str(tmp_path)]) == 2
    assert "has no stack-LANE.json" in capsys.readouterr().err


@pytest.mark.skipif(not patched_model_available(), reason="needs the patched vllm-omni installation")
def test_measure_logic_check_on_the_installed_tree() -> None:
    """The whole measurement without CUDA, on the installed tree (every PR applied): eager and
    graphed passes (the graphed one through the CPU stand-in for capture), start-up capture first."""
    features = tree_figures.tree_features()
    assert features == {"sdpa": True, "graphs": True, "startup_capture": True, "fused_layers": True}
    figures, outputs = tree_figures.measure_tree(cpu=True)
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    assert list(figures["eager"]) == calls and list(figures["graphed"]) == calls
    assert all(figures["eager"][c]["replayed"] == 0 for c in tree_figures.CALLS)
    duplex = figures["graphed"][tree_figures.DUPLEX]
    assert duplex["startup"]["graphs"] > 0 and duplex["timed_session"] == 1
    # the start-up capture's graphs serve the first session's every chunk
    assert duplex["replayed"] == duplex["calls"] == tree_figures.DUPLEX_CHUNKS["cpu"]
    assert set(outputs) == {f"{kind}/{c}" for kind in ("eager", "graphed") for c in calls}
    for call in calls:
        assert tree_figures.rel_diff(outputs[f"eager/{call}"], outputs[f"graphed/{call}"]) == 0.0, call


def test_duplex_chunks_are_float32_as_the_duplex_stage_hands_them_over() -> None:
    """The start-up capture captures the stage's float32 chunk forms: a bf16 model must still get
    float32 chunks, or no chunk finds its graph."""
    chunks = tree_figures._duplex_chunks(3, torch.device("cpu"))
    assert [c.features.dtype for c in chunks] == [torch.float32] * 3
    assert [c.features.shape[-1] for c in chunks] == [102, 104, 104]
    assert [c.prefix_extra_frames for c in chunks] == [0, 2, 2]


def test_the_stack_results_page_holds_the_sections_of_its_recorded_run() -> None:
    """docs/results/stack.md's per-PR sections are tree_report's output for the raw run it cites:
    no figure of the PR texts is typed by hand."""
    repo = Path(__file__).resolve().parents[2]
    page = (repo / "docs/results/stack.md").read_text(encoding="utf-8")
    (run,) = set(re.findall(r"tree_report (docs/results/\S+/stack)\b", page))
    start, end = tree_report.page_span(page)
    assert page[start:end].strip() == tree_report.sections(repo / run).strip()
    summary = json.loads(next((repo / run).glob("stack-*.json")).read_text())
    setup = page.split("## Setup", 1)[1].split("## ", 1)[0]
    assert summary["date"] in setup
    for part in summary["environment"].split(", ")[:3]:  # Python, torch, transformers
        assert part in setup, part


def test_a_speed_up_of_single_measurements_says_so(tmp_path: Path) -> None:
    """A run measured in blocks whose default duplex sessions are one measurement each: the speed-up
    cell says that, rather than reading as a change beyond noise."""
    calls = [*tree_figures.CALLS, tree_figures.DUPLEX]
    before, after = _tree(10.0, 5.0), _tree(10.0, 2.5)
    for tree in (before, after):
        for call in calls:
            tree["eager"][call]["blocks"] = [9.5, 10.0, 10.5]
        for call in tree_figures.CALLS:
            tree["graphed"][call]["blocks"] = [tree["graphed"][call]["median"]] * 3
    second = _two_prs(tmp_path, before, after, kind="graphed")[1]
    duplex = next(line for line in second.splitlines() if line.startswith(f"| {tree_figures.DUPLEX} |"))
    image = next(line for line in second.splitlines() if line.startswith("| image, 1 slice |"))
    assert "2.00×, one measurement each" in duplex
    assert "| 2.00× |" in image  # blocks apart: a plain speed-up
