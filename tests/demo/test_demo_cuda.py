# SPDX-License-Identifier: Apache-2.0
"""The demo on CUDA: the reduced size with encoder graphs must match eager (kept apart from
``test_demo.py`` so that ``-m "core_model and cpu"`` never selects it)."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import REDUCED_INPUTS, demo_table_rows, run_demo

from minicpmo_cg.demo import DUPLEX_CHUNKS
from minicpmo_cg.measure import GRAPH_REL_TOL

pytestmark = [pytest.mark.core_model]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device")
def test_quick_demo_on_cuda_graphs_match_eager(tmp_path):
    proc, report = run_demo("--quick", "--device", "cuda", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT: OK" in proc.stdout and "need a CUDA device" not in proc.stdout
    assert report["cuda_graphs"] is True and report["dtype"] == "bfloat16"
    rel_tol = report["tolerance"]["rel_tol"]
    assert rel_tol == GRAPH_REL_TOL["bfloat16"]
    rows = demo_table_rows(proc.stdout)
    assert sorted(rows) == sorted(REDUCED_INPUTS)
    for r in report["inputs"]:
        assert r["finite"] and r["graphed_ms_median"] > 0 and r["eager_ms_median"] > 0, r["name"]
        if r["modality"] == "image":  # SigLIP's default attention, one graph replay per image call
            assert r["attention"] == "sdpa" and r["encoder_calls_per_call"] == 1, r
        assert r["max_abs_diff"] <= rel_tol * r["output_max_abs"], r
        if r["modality"] == "duplex":  # one timed session, every chunk a replay, bitwise
            assert r["replays"] == r["expected_replays"] == DUPLEX_CHUNKS["cuda"] == len(r["graphed_ms"]), r
            assert r["max_abs_diff"] == 0.0, r
        else:
            assert r["replays"] == r["expected_replays"] == report["repeats"] * r["encoder_calls_per_call"], r
    for encoder in ("vision", "audio", "streaming audio"):
        stats = report["stats"][encoder]
        assert stats["num_graphs"] >= 1 and stats["capture_failures"] == 0, (encoder, stats)
        assert stats["graph_hits"] >= report["repeats"], (encoder, stats)
    # a whole cache cycle and its reset: the first-chunk form and 29 past lengths
    assert report["stats"]["streaming audio"]["num_graphs"] == 30
