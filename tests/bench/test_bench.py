# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the benchmark (``minicpmo_cg.bench``) and of the measurement helpers it shares with
the demo (``minicpmo_cg.measure``): arguments, statistics, the tolerance, the no-CUDA exit, the CPU
stand-in for capture and a logic dry run (--device cpu --allow-cpu) through the real adapter and
model call sites."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import patched_model_available

from minicpmo_cg.bench import (
    cli,
    context,
    offline,
    per_shape,
    session,
    streaming,
    vision_path,
)
from minicpmo_cg.bench.cpu_backend import (
    CAPTURE_FIXED_MS,
    CpuGraphBackend,
    ScriptedClock,
    adapter_clock,
    fixed_free_bytes,
)
from minicpmo_cg.measure import GRAPH_REL_TOL, graph_rel_tol, summary, within_graph_tolerance

pytestmark = [pytest.mark.core_model]

ADAPTER_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"


@pytest.mark.cpu
def test_only_accepts_commas_and_repeats_in_canonical_order() -> None:
    args = cli.parse_args(["--only", "offline,vision", "--only", "audio"])
    assert args.sections == ["vision", "audio", "offline"]
    assert cli.parse_args([]).sections == list(cli.SECTIONS)
    assert cli.parse_args(["--only", "duplex"]).sections == ["duplex"]  # the duplex audio path alone
    assert cli.parse_args(["--only", "duplex,vision_path"]).sections == ["vision_path", "duplex"]
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
    assert backend.eligible_device([torch.zeros(2), 3, object()]) == cpu  # non-tensor inputs do not count
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
    only = "vision,vision_path,streaming,duplex"
    r = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.bench", "--device", "cpu", "--allow-cpu", "--quick"]
        + ["--only", f"{only},offline", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
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
    assert padded["inputs"][2] is not None  # the call site built a patch mask: (pixels, tgt_sizes, mask)
    _check_vision_path(res["vision_path"], r.stdout)
    assert all(row["max_rel_diff"] == 0.0 and row["stats"]["num_graphs"] == 1 for row in res["vision"])
    _check_streaming(res["streaming"])
    _check_offline(res["offline"])
    _check_duplex(res["duplex"])
    assert (
        "-- duplex session: a frame and a 1 s chunk a second; audio: get_audio_embedding_streaming"
        in r.stdout
        and "bitwise vs eager: cold yes" in r.stdout
    )
    for title in ("streaming session", "offline photo mix"):
        section = r.stdout.split(f"-- {title}")[1]
        assert "admission=count " in section and "admission=cost " in section and "  target " in section


def _check_vision_path(s: dict, stdout: str) -> None:
    """Both attentions, 1, 3 and 10 slices, SDPA with and without the fused layers; one graph per row,
    bitwise equal to eager; every SDPA row has its graphed call's kernels. Whether a CPU misses a target
    depends on its speed (wall-clock time), so the check is that a row carries profiles exactly when it
    missed a target, and that rows without targets (eager attention, 3 slices, unfused) never do."""
    rows = s["rows"]
    assert [(r["attention"], r["layers"], r["slices"]) for r in rows] == [
        (a, layers, n) for a, layers in (("eager", "unfused"), ("sdpa", "fused")) for n in (1, 3, 10)
    ] + [("sdpa", "unfused", 1)]  # the dry run compares the unfused layers on its first row only
    section = stdout.split("-- vision path:")[1]
    assert "targets (sdpa attention, fused layers)" in section
    for r in rows:
        assert r["equal"] and r["finite"] and r["stats"]["num_graphs"] == 1 and r["stats"]["graph_hits"] >= 2
        assert r["graph_bytes"] > 0 and r["eager_ms"]["n"] >= 2 and r["graphed_ms"]["n"] >= 2
        assert r["missed"] == vision_path.missed_targets(r), r["name"]
        targeted = r["attention"] == "sdpa" and r["layers"] == "fused" and r["slices"] in (1, 10)
        if not targeted:
            assert not r["missed"], r["name"]
        profiled = bool(r["missed"])
        assert len(r.get("profiles", [])) == (2 if profiled else 0), r["name"]
        if profiled:
            assert f"--- profile: sdpa {r['name']}, graphed" in section, r["name"]
        kernels = r.get("kernels")
        assert (kernels is not None) == (r["attention"] == "sdpa"), r["name"]
        if kernels:
            assert kernels["unit"] == "cpu_us" and kernels["kernels"] and kernels["total_us"] > 0
    assert "--- kernels: sdpa 1 slice 4x4" in section
    assert (
        vision_path.missed_targets({**rows[3], "graphed_ms": {"median": 2.7}, "graph_bytes": 64 << 20}) == []
    )
    assert vision_path.missed_targets({**rows[6], "graphed_ms": {"median": 9.0}}) == []  # unfused: no targets


def _check_streaming(s: dict) -> None:
    """One frame shape and one chunk shape: under both rules each warms up once, is captured on its
    2nd call (the scripted timings make both launch-bound), then hits."""
    assert list(s["runs"]) == ["eager", "count", "cost"]
    for key in ("count", "cost"):
        run = s["runs"][key]
        assert run["options"]["admission"] == key and run["label"] == f"admission={key}"
        st, detail = run["stats"], run["detail"]
        assert st["vision"]["num_graphs"] == 1 and st["audio"]["num_graphs"] == 1
        assert st["vision"]["warmup_misses"] == 1 and st["vision"]["graph_hits"] == s["seconds"] - 1
        assert detail["vision"]["graphs"][0]["hits"] == s["seconds"] - 1
        # timed by the run's scripted clock: exactly the scripted capture of one item, never the wall
        for encoder in ("vision", "audio"):
            assert detail[encoder]["graphs"][0]["capture_ms"] == pytest.approx(
                CpuGraphBackend().capture_ms((1,))
            )
        assert run["hit_rate_after_warmup"] == 1.0 and run["misses"]["declined"] == 0
    hit_rate_target = s["targets"][0]  # the speed target depends on CPU timings
    assert hit_rate_target["target"].endswith("hit rate after warm-up >= 99%") and hit_rate_target["ok"]


def _check_offline(s: dict) -> None:
    """The scripted timings make "cost" decline the rare 3-slice batch that "count" captures."""
    count, cost = s["runs"]["count"], s["runs"]["cost"]
    assert count["graphs"] == 4 and count["misses"]["declined"] == 0
    assert 1 <= cost["graphs"] < count["graphs"] and cost["misses"]["declined"] >= 1
    assert cost["graph_bytes"] < count["graph_bytes"]
    # the recurring single slice is held once before its capture; count never measures
    assert cost["held_calls"] >= 1 and count["held_calls"] == 0
    assert cost["graph_bytes"] == sum(g["bytes"] for g in cost["detail"]["vision"]["graphs"])
    assert (
        cost["detail"]["vision"]["admission"] == "cost" and count["detail"]["vision"]["admission"] == "count"
    )
    assert {t["target"]: t["ok"] for t in s["targets"]}["admission=cost graph bytes < admission=count"]


def _check_duplex(dx: dict) -> None:
    """One session with a cache reset, the next one's first chunk, a warm one and two interleaved."""
    seconds, half = dx["seconds"], dx["seconds"] // 2
    assert dx["resets_before_chunks"] == [29] and seconds >= 30  # one cache reset in the session
    assert dx["bitwise"] == dict.fromkeys(
        ("cold", "warm", "interleaved_a", "interleaved_b", "frames_cold", "frames_warm"), True
    )
    layers = dx["layers"]  # fused vs unfused Whisper layers, graphed warm chunks, each bitwise vs its eager
    assert set(layers) == {"fused", "unfused"} and all(layers[k]["bitwise"] for k in layers)
    assert layers["fused"]["kernels"]["kernels"] and "kernels" not in layers["unfused"]
    assert layers["fused"]["graphed_warm"]["n"] == layers["unfused"]["graphed_warm"]["n"] == 3
    # a frame a second through get_vision_hidden_states: captured by the cost rule at its 2nd call
    vision = dx["vision"]
    assert (vision["admission"], vision["num_graphs"], vision["warmup_misses"]) == ("cost", 1, 1)
    assert vision["graph_hits"] == 2 * seconds - 1  # the cold session's later frames, the warm session's
    assert dx["frame_eager"]["n"] == dx["frame_graphed_warm"]["n"] == seconds
    total = dx["session_ms"]
    assert total["eager"] == dx["eager"]["session_ms"] + dx["frame_eager"]["session_ms"]
    assert dx["session_speedup"] == total["eager"] / total["warm"]
    # one key (bucket 1: every call is one chunk), warmed up once, then replayed; the cap is the buckets
    # of a two-session deployment (1, 2)
    assert (dx["stats"]["num_graphs"], dx["stats"]["warmup_misses"], dx["cap"]) == (1, 1, 2)
    assert dx["admission"] == "count"  # the streaming adapter counts whatever the admission option says
    calls = seconds + 1 + seconds + 2 * half  # cold session, next session's first chunk, warm, interleaved
    assert dx["stats"]["graph_hits"] == calls - 1 and dx["stats"]["ineligible_misses"] == 0
    assert (
        dx["eager"]["n"] == dx["graphed_warm"]["n"] == seconds and dx["graphed_interleaved"]["n"] == 2 * half
    )
    mem, kv = dx["memory"], 2 * 2 * 1024 * 4  # 2 layers, K and V, d_model 1024, float32
    # the K/V pages: two sessions' 94 pages of 16 positions, and 7 scratch pages for two padding rows
    assert mem["kv_bytes_per_position"] == kv and mem["pages_bytes"] == (2 * 94 + 7) * 16 * kv
    assert dx["session_cache_peak_bytes"] == {"eager": 1450 * kv, "graphed": 1450 * kv}


@pytest.mark.cpu
def test_cpu_backend_scripts_launch_bound_single_items_and_gpu_bound_batches() -> None:
    backend = CpuGraphBackend(host_ms=8.0, busy_ms_per_item=6.5)
    assert backend.scripted_ms((1, 1024, 1152)) == (8.0, 8.0, 6.5)  # the GPU idles 1.5 ms
    assert backend.scripted_ms((3, 1024, 1152)) == (8.0, 19.5, 19.5)  # GPU-bound: never idle
    assert backend.capture_ms((3, 16, 4)) == 8.0 + 19.5 + CAPTURE_FIXED_MS
    out, measurement = backend.measure_eager(torch.device("cpu"), lambda: torch.zeros(2, 5))
    sample = measurement.sample()
    assert out.shape == (2, 5) and (measurement.host_ms, sample.gpu_ms, sample.busy_ms) == (8.0, 13.0, None)
    assert measurement.peak_bytes == 0
    # held: the GPU starts after the hold and shows its work, or the host's pace once caught up
    _, held = backend.measure_eager(torch.device("cpu"), lambda: torch.zeros(1, 5), hold_ms=1.0)
    assert (held.sample().gpu_ms, held.sample().busy_ms, held.sample().hold_ms) == (None, 7.0, 1.0)
    _, held = backend.measure_eager(torch.device("cpu"), lambda: torch.zeros(1, 5), hold_ms=4.0)
    assert held.sample().busy_ms == 6.5
    with pytest.raises(ValueError, match="busy_ms_per_item=0"):
        CpuGraphBackend(busy_ms_per_item=0)


@pytest.mark.cpu
@pytest.mark.skipif(
    not patched_model_available(), reason="needs vLLM + a patched vllm-omni (minicpmo-cg-patch apply)"
)
@pytest.mark.parametrize("slowdown", [1.0, 2.0])
def test_cpu_backend_timings_drive_the_cost_rule_both_ways(slowdown: float) -> None:
    """Through the unmodified adapter: a recurring single item is captured at its 2nd call (cheap
    enough to pay even with the least saving), a 3-item batch seen every third call is declined
    (GPU-bound: its capture would need more of the host time than a held call could show). Time is
    scripted: the adapter measures the capture on the backend's clock, so the calibration of its
    capture estimate is exactly the scripted capture time over the estimate (1, or 2 for captures
    scripted to take twice what the cost model expects), whatever the load of the machine."""
    mod = importlib.import_module(ADAPTER_MODULE)
    from minicpmo_cg.vllm_config import standalone_vllm_config

    class Slower(CpuGraphBackend):
        def capture_ms(self, output_shape) -> float:
            return slowdown * super().capture_ms(output_shape)

    clock = ScriptedClock()
    backend = Slower(clock=clock)
    adapter = mod.EncoderCudaGraph(
        lambda x: x * 2, standalone_vllm_config(), min_free_bytes=0, backend=backend, name="bench-t"
    )
    one, three = torch.ones(1, 4), torch.ones(3, 4)
    with torch.no_grad(), adapter_clock(mod, clock):
        for x in (three, one, one, three):
            adapter(x)
    detail = adapter.get_detailed_stats()
    assert detail["admission"] == "cost" and detail["declined_misses"] == 1
    assert [g["inputs"][0][0] for g in detail["graphs"]] == [(1, 4)]
    assert detail["graphs"][0]["capture_ms"] == pytest.approx(slowdown * CpuGraphBackend().capture_ms((1, 4)))
    assert adapter.cost_model.capture_scale == pytest.approx(slowdown)
    assert clock.perf_counter() == pytest.approx(1000.0 + detail["graphs"][0]["capture_ms"] / 1e3)


@pytest.mark.cpu
def test_adapter_clock_puts_the_real_clock_back_and_refuses_an_adapter_it_cannot_script() -> None:
    import time
    import types

    clock = ScriptedClock(start_s=5.0)
    clock.advance_ms(250.0)
    assert clock.perf_counter() == 5.25
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_ms(-1.0)
    timed = types.ModuleType("timed_elsewhere")

    class Adapter:
        def _capture(self) -> None: ...

    Adapter._capture.__module__ = timed.__name__
    fake = types.SimpleNamespace(EncoderCudaGraph=Adapter)
    sys.modules[timed.__name__] = timed
    try:
        with pytest.raises(RuntimeError, match="no longer imports time"), adapter_clock(fake, clock):
            pass
        timed.time = time
        with adapter_clock(fake, clock):
            assert timed.time.perf_counter() == 5.25 and timed.time.monotonic is time.monotonic
        assert timed.time is time
        with adapter_clock(fake, None):
            assert timed.time is time
    finally:
        del sys.modules[timed.__name__]


def _run(label: str, ms: float, vs: float | None, **graphed) -> dict:
    run = {"label": label, "graphed": bool(graphed), "encoder_ms_total": ms, "vs_eager": vs}
    run["per_modality"] = {"vision": {"median": 1.0, "p90": 2.0}}
    if graphed:
        run.update(
            hit_rate=graphed.get("hit_rate", 0.5),
            hit_rate_after_warmup=graphed.get("late"),
            graphs=graphed.get("graphs", 1),
            graph_bytes=graphed.get("graph_bytes", 0),
            misses={k: graphed.get(k, 0) for k in session.MISS_KINDS},
            memory={"pool_bytes": None, "static_bytes": 0},
            detail={},
        )
    return run


@pytest.mark.cpu
def test_offline_targets_need_cost_at_least_eager_and_fewer_bytes_than_count() -> None:
    def verdicts(cost_vs: float, cost_bytes: int, count_bytes: int) -> list[bool]:
        runs = {
            "count": _run("admission=count", 10.0, 0.9, graph_bytes=count_bytes),
            "cost": _run("admission=cost", 9.0, cost_vs, graph_bytes=cost_bytes),
        }
        return [t["ok"] for t in offline.targets(runs)]

    assert context.TARGETS["offline_cost_vs_eager"] == 1.0
    assert verdicts(1.0, 1, 2) == [True, True]
    assert verdicts(0.999, 1, 2) == [False, True]  # never slower: 1.0 is the floor, no noise allowance
    assert verdicts(1.2, 2, 2) == [True, False]  # equal bytes are not fewer
    assert verdicts(1.2, 0, 0) == [True, False]


@pytest.mark.cpu
def test_streaming_targets_need_99_percent_after_warmup_and_count_speed() -> None:
    def verdicts(late: float | None, cost_vs: float, count_vs: float) -> list[bool]:
        runs = {
            "count": _run("admission=count", 10.0, count_vs, late=1.0),
            "cost": _run("admission=cost", 10.0, cost_vs, late=late),
        }
        return [t["ok"] for t in streaming.targets(runs)]

    assert verdicts(0.99, 1.8, 1.8) == [True, True]
    assert verdicts(0.989, 1.8, 1.8)[0] is False
    assert verdicts(None, 1.8, 1.8)[0] is False  # no calls after the warm-up: not met
    assert verdicts(1.0, 0.98 * 1.8, 1.8)[1] is True  # within the 2% noise allowance
    assert verdicts(1.0, 0.97 * 1.8, 1.8)[1] is False


@pytest.mark.cpu
def test_session_section_puts_the_runs_side_by_side_with_their_targets() -> None:
    runs = {
        "eager": _run("eager", 100.0, 1.0),
        "count": _run("admission=count", 110.0, 100 / 110, graphs=4, graph_bytes=3 << 20, warmup=4),
        "cost": _run("admission=cost", 95.0, 100 / 95, graphs=1, graph_bytes=1 << 20, declined=7, warmup=4),
    }
    s = {"runs": runs, "targets": offline.targets(runs)}
    lines = session.format_sessions("offline photo mix", "16 requests", s)
    text = "\n".join(lines)
    cost_row = next(line for line in lines if line.startswith("admission=cost "))
    assert cost_row.split()[1:8] == ["95.0", "x1.05", "50.0%", "-", "1", "1.0", "n/a"]
    assert cost_row.split()[8] == "7" and cost_row.endswith("warmup 4")
    assert next(line for line in lines if line.startswith("eager ")).split()[1:] == ["100.0", "x1.00"]
    assert "target ok   admission=cost >= x1.00 eager (capture included): x1.053" in text
    assert "target ok   admission=cost graph bytes < admission=count: 1.0 vs 3.0 MiB" in text


@pytest.mark.cpu
def test_graph_results_hit_rate_after_warmup_counts_only_later_calls() -> None:
    class Adapter:
        def __init__(self, hits: int, misses: int, declined: int, held: int = 0) -> None:
            self.hits, self.misses, self.declined, self.held = hits, misses, declined, held
            self.graphs: dict = {}

        def get_cumulative_stats(self) -> dict:
            stats = dict.fromkeys(
                ("warmup_misses", "capacity_misses", "memory_misses", "ineligible_misses"), 0
            )
            return {**stats, "graph_hits": self.hits, "graph_misses": self.misses, "num_graphs": 1}

        def get_detailed_stats(self) -> dict:
            return {
                "declined_misses": self.declined,
                "held_calls": self.held,
                "budget_misses": 0,
                "profile_misses": 0,
                "graph_bytes": 5,
            }

    at_warmup = {
        "vision": {"graph_hits": 8, "graph_misses": 2},
        "audio": {"graph_hits": 9, "graph_misses": 1},
    }
    res = session.graph_results({"vision": Adapter(98, 2, 1, 1), "audio": Adapter(108, 2, 0, 2)}, at_warmup)
    assert res["hit_rate"] == 206 / 210
    assert res["hit_rate_after_warmup"] == (206 - 17) / (210 - 20)  # one miss after the warm-up
    assert (res["graphs"], res["graph_bytes"], res["misses"]["declined"]) == (2, 10, 1)
    assert res["held_calls"] == 3
    assert session.graph_results({"vision": Adapter(1, 1, 0)}, None)["hit_rate_after_warmup"] is None


@pytest.mark.cpu
@pytest.mark.skipif(
    not patched_model_available(), reason="needs vLLM + a patched vllm-omni (minicpmo-cg-patch apply)"
)
def test_sessions_set_every_adapter_option_and_label_their_runs() -> None:
    """wire_encoder_graphs leaves keys on model.config, so a session must set them all: a ``count``
    run after a ``cost`` one would otherwise inherit its admission."""
    mod = importlib.import_module(ADAPTER_MODULE)

    class FakeCtx:
        adapter_mod = mod

    full = session._full_options(FakeCtx(), {"admission": "count"})
    names = {f.name for f in dataclasses.fields(mod.EncoderCudaGraphOptions)} - {"enabled"}
    assert set(full) == names and full["admission"] == "count"
    assert full["max_bytes"] == 0 and full["log_interval_s"] == 60.0
    assert session.run_label(None) == "eager"
    assert session.run_label({"admission": "cost", "max_graphs": 16}) == "admission=cost max_graphs=16"


@pytest.mark.cpu


@pytest.mark.cpu
def test_the_json_is_rewritten_after_each_section_so_a_stopped_run_keeps_what_it_measured(
    monkeypatch,
) -> None:
    """A section that finishes is in the JSON before the next one starts; a failing one is reported
    there too, and the later sections still run."""
    from minicpmo_cg.bench import cli

    seen: list[dict] = []

    def failing(ctx):
        raise RuntimeError("boom")

    monkeypatch.setitem(cli.SCENARIOS, "first", lambda ctx: {"figure": 1.0})
    monkeypatch.setitem(cli.SCENARIOS, "second", failing)
    monkeypatch.setitem(cli.SCENARIOS, "third", lambda ctx: {"figure": 3.0})

    ctx = SimpleNamespace(cpu=False, problems=[], adapter_mod=None)

    def after(res):
        seen.append({k: v for k, v in res.items() if k in ("first", "second", "third")})

    monkeypatch.setattr(cli, "adapter_clock", lambda mod, clock: contextlib.nullcontext())
    res: dict = {}
    complete = cli.run_scenarios(ctx, ["first", "second", "third"], res, after_section=after)
    assert not complete
    assert seen == [
        {"first": {"figure": 1.0}},
        {"first": {"figure": 1.0}},
        {"first": {"figure": 1.0}, "third": {"figure": 3.0}},
    ]
    assert ctx.problems == ["section second failed: RuntimeError: boom"]
