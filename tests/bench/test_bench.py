# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the benchmark (``minicpmo_cg.bench``) and of the measurement helpers it shares with
the demo (``minicpmo_cg.measure``): arguments, statistics, the tolerance, the no-CUDA exit, the CPU
stand-in for capture and a logic dry run (--device cpu --allow-cpu) through the real adapter and
model call sites."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import patched_model_available

from minicpmo_cg.bench import cli, context, per_shape
from minicpmo_cg.bench.cpu_backend import CpuGraphBackend, fixed_free_bytes
from minicpmo_cg.measure import GRAPH_REL_TOL, graph_rel_tol, summary, within_graph_tolerance

pytestmark = [pytest.mark.core_model]

ADAPTER_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"


@pytest.mark.cpu
def test_only_accepts_commas_and_repeats_in_canonical_order() -> None:
    args = cli.parse_args(["--only", "pools,vision", "--only", "audio"])
    assert args.sections == ["vision", "audio", "pools"]
    assert cli.parse_args([]).sections == list(cli.SECTIONS)
    assert cli.parse_args(["--only", "duplex"]).sections == ["duplex"]  # the duplex audio path alone
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "gpu"])


@pytest.mark.cpu
def test_summary_median_p90() -> None:
    s = summary([float(i) for i in range(1, 11)])
    assert s["median"] == 5.5 and s["p90"] == 9.0 and s["min"] == 1.0 and s["n"] == 10
    assert summary([])["n"] == 0


@pytest.mark.cpu
def test_profile_sizes_runs_from_the_call_cost() -> None:
    p = context.PROFILES["full"]
    assert p.runs_for(0.5) == p.max_runs  # cheap calls: capped
    assert p.runs_for(1000.0) == p.min_runs  # expensive calls: at least the minimum
    assert p.min_runs <= p.runs_for(50.0) <= p.max_runs


@pytest.mark.cpu
def test_shapes_match_the_brief() -> None:
    shapes = per_shape.VISION_SHAPES
    assert [len(grids) for _, grids in shapes[:4]] == [1, 2, 4, 10]  # 9 slices + source
    assert all(h * w == 1024 for name, grids in shapes[:4] for h, w in grids)
    padded = [grids for name, grids in shapes if "padded" in name]
    assert padded and all(len({h * w for h, w in g}) > 1 for g in padded)  # really padded
    assert [f for _, f in per_shape.AUDIO_SHAPES] == [100, 500, 3000]


@pytest.mark.cpu
def test_graph_tolerance_is_one_bf16_step() -> None:
    assert GRAPH_REL_TOL["bfloat16"] == graph_rel_tol(torch.bfloat16) == graph_rel_tol("bfloat16") == 2.0**-8
    assert graph_rel_tol(torch.float32) == 1e-4
    with pytest.raises(KeyError, match="float16"):
        graph_rel_tol(torch.float16)
    eager = torch.tensor([4.0, -2.0])
    assert within_graph_tolerance(eager, eager + torch.tensor([4.0 * 2**-8, 0.0]), "bfloat16") == (
        True,
        2.0**-8,
    )
    ok, rel = within_graph_tolerance(eager, eager + torch.tensor([0.0, 4.0 * 2**-7]), "bfloat16")
    assert not ok and rel == 2.0**-7
    assert not within_graph_tolerance(eager, torch.tensor([math.nan, 0.0]), "bfloat16")[0]
    with pytest.raises(RuntimeError, match="shape"):
        within_graph_tolerance(eager, eager[:1], "bfloat16")


@pytest.mark.cpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit path of a machine without CUDA")
def test_without_cuda_exits_2_with_a_hint(capsys) -> None:
    assert cli.main(["--quick"]) == 2
    assert "--allow-cpu" in capsys.readouterr().err


@pytest.mark.cpu
@pytest.mark.skipif(
    not patched_model_available(), reason="needs vLLM + a patched vllm-omni (minicpmo-cg-patch apply)"
)
def test_cpu_backend_drives_the_unmodified_adapter_through_its_seam() -> None:
    mod = importlib.import_module(ADAPTER_MODULE)
    from minicpmo_cg.vllm_config import standalone_vllm_config

    cpu = torch.device("cpu")
    backend = CpuGraphBackend()
    assert backend.eligible_device([torch.zeros(2), None]) == cpu
    assert backend.eligible_device([None]) is None
    assert backend.eligible_device([torch.zeros(2), 3, object()]) == cpu  # static arguments do not count
    assert backend.eligible_device([3]) is None
    assert backend.eligible_device([torch.zeros(2), torch.zeros(2, device="meta")]) is None
    config = standalone_vllm_config()
    adapter = mod.EncoderCudaGraph(
        lambda x: x * 2, config, min_free_bytes=1, admission="count", backend=backend, name="bench-t"
    )
    x = torch.arange(6.0).reshape(2, 3)
    with torch.no_grad():
        outs = [adapter(x) for _ in range(3)]
    assert all(torch.equal(o, x * 2) for o in outs)
    stats = adapter.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (1, 2, 1)
    # the adapter itself is untouched: a fresh one still gets the CUDA backend
    assert isinstance(mod.EncoderCudaGraph(lambda t: t, config).backend, mod.CudaGraphBackend)
    low = fixed_free_bytes(backend, 0)
    assert isinstance(low, CpuGraphBackend) and low.free_bytes(cpu) == 0 and backend.free_bytes(cpu) > 0
    starved = mod.EncoderCudaGraph(
        lambda t: t, config, min_free_bytes=1, admission="count", backend=low, name="bench-t0"
    )
    with torch.no_grad():
        starved(x), starved(x)
    assert starved.get_cumulative_stats()["memory_misses"] == 1


@pytest.mark.cpu
@pytest.mark.skipif(
    not patched_model_available(), reason="needs vLLM + a patched vllm-omni (minicpmo-cg-patch apply)"
)
def test_cpu_dry_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    only = "vision,bookkeeping,streaming,duplex"
    r = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.bench", "--device", "cpu", "--allow-cpu", "--quick"]
        + ["--only", only, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "=== RESULTS" in r.stdout and "CPU DRY RUN" in r.stdout
    assert r.stdout.startswith("=== RESULTS") and "[bench]" not in r.stdout and "[bench]" in r.stderr
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "cpu" and res["problems"] == []
    assert {row["name"] for row in res["vision"]} == {n for n, _ in per_shape.CPU_VISION_SHAPES}
    padded = next(row for row in res["vision"] if "padded" in row["name"])
    assert padded["inputs"][1] is not None  # the call site built a padding mask
    assert all(row["max_rel_diff"] == 0.0 and row["stats"]["num_graphs"] == 1 for row in res["vision"])
    kinds = set(res["bookkeeping"]["misses"])
    assert {"warmup", "capacity", "memory (injected reading)", "ineligible (autograd on)"} <= kinds
    st = res["streaming"]["graphed"]["stats"]
    # one frame shape and one chunk shape: each warms up once, captures on its 2nd call, then hits
    assert st["vision"]["num_graphs"] == 1 and st["audio"]["num_graphs"] == 1
    assert (
        st["vision"]["warmup_misses"] == 1 and st["vision"]["graph_hits"] == res["streaming"]["seconds"] - 1
    )
    dx = res["duplex"]
    seconds, half = dx["seconds"], dx["seconds"] // 2
    assert dx["resets_before_chunks"] == [29] and seconds >= 30  # one cache reset in the session
    assert dx["bitwise"] == dict.fromkeys(("cold", "warm", "interleaved_a", "interleaved_b"), True)
    # 30 keys per session (first-chunk form + 29 past lengths), each warmed up once, then replayed
    assert (dx["stats"]["num_graphs"], dx["stats"]["warmup_misses"], dx["cap"]) == (30, 30, 120)
    assert dx["admission"] == "count"  # the streaming adapter counts whatever the admission option says
    calls = seconds + 1 + seconds + 2 * half  # cold session, next session's first chunk, warm, interleaved
    assert dx["stats"]["graph_hits"] == calls - 30 and dx["stats"]["ineligible_misses"] == 0
    assert (
        dx["eager"]["n"] == dx["graphed_warm"]["n"] == seconds and dx["graphed_interleaved"]["n"] == 2 * half
    )
    mem, kv = dx["memory"], 2 * 2 * 1024 * 4  # 2 layers, K and V, d_model 1024, float32
    assert mem["kv_bytes_per_position"] == kv and mem["arena_bytes"] == 1500 * kv
    assert dx["session_cache_peak_bytes"] == {"eager": 1450 * kv, "graphed": 1450 * kv}
    assert (
        "-- duplex audio: get_audio_embedding_streaming" in r.stdout
        and "bitwise vs eager: cold yes" in r.stdout
    )
