# SPDX-License-Identifier: Apache-2.0
"""The benchmark on CUDA at the reduced size (2+2 layers): the streaming session's runs report the
adapters' byte accounts, which must agree with the allocator's view (kept apart from ``test_bench.py``
so that ``-m "core_model and cpu"`` never selects it)."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import run_module

pytestmark = [pytest.mark.core_model]

MIB = 1 << 20


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device")
def test_reduced_bench_accounts_graph_bytes(tmp_path):
    proc, res = run_module(
        "minicpmo_cg.bench",
        *("--quick", "--reduced", "--device", "cuda", "--only", "streaming"),
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["problems"] == [] and res["meta"]["mode"] == "quick"
    runs = res["streaming"]["runs"]
    assert list(runs) == ["eager", "count", "cost"]
    count = runs["count"]
    # count captures the frame and the chunk at their 2nd call; every later call replays
    assert count["graphs"] == 2 and count["hit_rate_after_warmup"] == 1.0
    graphs = [g for d in count["detail"].values() for g in d["graphs"]]
    assert all(g["bytes"] == g["pool_bytes"] + g["static_bytes"] > 0 for g in graphs)
    assert count["graph_bytes"] == sum(g["bytes"] for g in graphs)
    mem = count["memory"]
    if mem["pool_bytes"] is not None:  # the allocator names the pools of its segments
        allocator = mem["pool_bytes"] + mem["static_bytes"]
        assert abs(allocator - count["graph_bytes"]) <= 2 * MIB, (allocator, count["graph_bytes"])
    assert {t["target"].split(" >= ")[0] for t in res["streaming"]["targets"]} == {
        "admission=cost hit rate after warm-up",
        "admission=cost speedup",
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device")
def test_reduced_bench_vision_path_and_duplex_match_eager_with_a_chunk_breakdown(tmp_path):
    proc, res = run_module(
        "minicpmo_cg.bench",
        *("--quick", "--reduced", "--device", "cuda", "--only", "vision_path,duplex"),
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["problems"] == []
    rows = {(r["attention"], r["slices"]): r for r in res["vision_path"]["rows"]}
    assert sorted(rows) == [(a, n) for a in ("eager", "sdpa") for n in (1, 3, 10)]
    for key, r in rows.items():
        assert r["equal"] and r["finite"] and r["stats"]["num_graphs"] == 1, (key, r["stats"])
        assert r["graph_bytes"] > 0 and r["graphed_ms"]["median"] > 0, key
    # SDPA materialises neither the (B, 16, N, N) scores nor their float32 softmax
    assert rows[("sdpa", 1)]["graph_bytes"] < rows[("eager", 1)]["graph_bytes"]
    dx = res["duplex"]
    assert all(dx["bitwise"].values()), dx["bitwise"]  # frames and chunks, graphed == eager
    vision = dx["vision"]
    assert vision["num_graphs"] <= 1 and vision["capture_failures"] == 0
    assert vision["graph_hits"] + vision["graph_misses"] == 2 * dx["seconds"]  # cold and warm sessions
    # where a graphed chunk's time goes (one more warm session, CUDA events; attention alone)
    phases = dx["breakdown"]["phases"]
    assert phases["chunks"] == dx["seconds"]  # every chunk of the extra warm session replayed
    assert all(phases[p]["median"] >= 0 for p in ("prep", "adapter", "output", "after"))
    assert phases["replay"]["median"] > 0
    # the phases tile the call: their sum is a chunk's latency, as the timed warm session saw it
    assert 0.5 < phases["total"]["median"] / dx["graphed_warm"]["median"] < 2.0
    fit = phases["replay_vs_past"]
    assert set(fit["at_past"]) == {"0", "700", "1400"} and fit["intercept_ms"] > 0
    rows = dx["breakdown"]["attention"]["rows"]
    assert [r["total"] for r in rows] == [50, 750, 1450]
    assert all(r["masked_ms"] > 0 and r["graph_ms"] > 0 and r["concat_ms"] > 0 for r in rows)
    assert "breakdown per graphed chunk" in proc.stdout and "attention alone" in proc.stdout
