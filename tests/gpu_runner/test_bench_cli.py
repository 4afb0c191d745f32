"""CPU checks of benchmarks/encoder_cuda_graph_bench.py: arguments, statistics, the no-CUDA exit
and a logic dry run (--device cpu --allow-cpu) through the real adapter and model call sites."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "encoder_cuda_graph_bench.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("encoder_cuda_graph_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


def test_only_accepts_commas_and_repeats_in_canonical_order() -> None:
    args = bench.parse_args(["--only", "pools,vision", "--only", "audio"])
    assert args.sections == ["vision", "audio", "pools"]
    assert bench.parse_args([]).sections == list(bench.SECTIONS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "gpu"])


def test_summary_median_p90() -> None:
    s = bench.summary([float(i) for i in range(1, 11)])
    assert s["median"] == 5.5 and s["p90"] == 9.0 and s["min"] == 1.0 and s["n"] == 10
    assert bench.summary([])["n"] == 0


def test_profile_sizes_runs_from_the_call_cost() -> None:
    p = bench.PROFILES["full"]
    assert p.runs_for(0.5) == p.max_runs  # cheap calls: capped
    assert p.runs_for(1000.0) == p.min_runs  # expensive calls: at least the minimum
    assert p.min_runs <= p.runs_for(50.0) <= p.max_runs


def test_shapes_match_the_brief() -> None:
    assert [len(grids) for _, grids in bench.VISION_SHAPES[:4]] == [1, 2, 4, 10]  # 9 slices + source
    assert all(h * w == 1024 for name, grids in bench.VISION_SHAPES[:4] for h, w in grids)
    padded = [grids for name, grids in bench.VISION_SHAPES if "padded" in name]
    assert padded and all(len({h * w for h, w in g}) > 1 for g in padded)  # really padded
    assert [f for _, f in bench.AUDIO_SHAPES] == [100, 500, 3000]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the exit path of a machine without CUDA"
)
def test_without_cuda_exits_2_with_a_hint(capsys) -> None:
    assert bench.main(["--quick"]) == 2
    assert "--allow-cpu" in capsys.readouterr().err


def _patched_model_available() -> bool:
    try:
        import vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph  # noqa: F401
        from minicpmo_cg import standalone

        return callable(
            getattr(
                standalone.model_module().MiniCPMO45OmniLLMForConditionalGeneration,
                "_init_encoder_cuda_graphs",
                None,
            )
        )
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(
    not _patched_model_available(), reason="needs vLLM + a patched vllm-omni (minicpmo-cg-patch apply)"
)
def test_cpu_dry_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--allow-cpu",
            "--quick",
            "--only",
            "vision,bookkeeping,streaming",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "=== RESULTS" in r.stdout and "CPU DRY RUN" in r.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "cpu" and res["problems"] == []
    assert {row["name"] for row in res["vision"]} == {n for n, _ in bench.CPU_VISION_SHAPES}
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
