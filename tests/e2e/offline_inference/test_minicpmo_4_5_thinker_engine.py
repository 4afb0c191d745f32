# SPDX-License-Identifier: Apache-2.0
"""End to end: MiniCPM-o 4.5's thinker stage through vLLM's engine, encoder graphs off and on.

Each engine runs in a fresh interpreter (``python -m minicpmo_cg.thinker_engine``) on a checkpoint built
offline by ``minicpmo-cg-checkpoint`` (random weights, the real parameter names and processor):
``MINICPMO_CG_E2E_CHECKPOINT`` names a built folder, else the reduced size is built on the GPU
into the session's temporary directory. Greedy answers and first-token logprobs of every prompt
(one image of 1 and of 10 slices, 1 s and 30 s of speech, image + audio) must be identical with
``--hf-overrides '{"encoder_cuda_graph": false}'`` and with graphs, and the graphed engine's
adapters must have replayed. On a duplex deployment the start-up capture must log its INFO line
and its memory must come out of the KV cache (fewer blocks than with the capture off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda]  # e2e level: not in "core_model and cuda"

ENV_CHECKPOINT = "MINICPMO_CG_E2E_CHECKPOINT"
TIMEOUT_S = int(os.environ.get("MINICPMO_CG_E2E_ENGINE_TIMEOUT", "600"))
STARTUP_LINE = "MiniCPM-o 4.5 encoder CUDA graphs captured at start-up: "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: vLLM's engine serves the thinker on it")
    folder = os.environ.get(ENV_CHECKPOINT)
    if folder:
        return folder
    from minicpmo_cg.checkpoint.build import build

    return str(build(tmp_path_factory.mktemp("checkpoint") / "reduced", "reduced", device="cuda"))


def engine(checkpoint: str, out: Path, mode: str, *extra: str) -> tuple[dict, str]:
    """One engine in a fresh interpreter: its JSON record and its log."""
    log = out.with_suffix(".log")
    argv = [sys.executable, "-m", "minicpmo_cg.thinker_engine", "--model", checkpoint, "--mode", mode, "--out", str(out), *extra]
    with open(log, "w") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False)
    text = log.read_text()
    assert proc.returncode == 0, f"{mode} engine failed (exit {proc.returncode}):\n{text[-6000:]}"
    return json.loads(out.read_text()), text


@pytest.fixture(scope="module")
def turn(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, str]]:
    root = tmp_path_factory.mktemp("thinker-turn")
    return {mode: engine(checkpoint, root / f"{mode}.json", mode) for mode in ("eager", "graphed")}


def test_graphed_answers_equal_eager(turn: dict[str, tuple[dict, str]]) -> None:
    eager, graphed = turn["eager"][0]["answers"], turn["graphed"][0]["answers"]
    assert sorted(eager) == sorted(graphed) == sorted(
        ["image_1_slice", "image_10_slices", "audio_1s", "audio_30s", "image_and_audio"]
    )
    for name in eager:
        for e, g in zip(eager[name], graphed[name], strict=True):
            assert g["token_ids"] == e["token_ids"], name
            assert g["first_logprobs"] == e["first_logprobs"], name
        assert len({tuple(a["token_ids"]) for a in graphed[name]}) == 1, f"{name}: a repeat answered otherwise"


def test_prompts_hold_a_placeholder_per_embedding(turn: dict[str, tuple[dict, str]]) -> None:
    # vLLM checks the encoders' rows against the placeholders; here the placeholders' counts:
    # 64 queries per image slice, 10 tokens per second of audio
    tokens = {name: runs[0]["prompt_tokens"] for name, runs in turn["eager"][0]["answers"].items()}
    assert tokens["audio_30s"] - tokens["audio_1s"] == 29 * 10
    assert tokens["image_10_slices"] - tokens["image_1_slice"] >= 9 * 64


def test_graphed_engine_replays_and_eager_builds_no_adapter(turn: dict[str, tuple[dict, str]]) -> None:
    eager, graphed = turn["eager"][0], turn["graphed"][0]
    assert eager["stats"] == {}, "encoder_cuda_graph=false must build no adapter"
    for name in ("vision", "audio"):
        stats = graphed["stats"][name]
        assert stats["graph_hits"] > 0 and stats["num_graphs"] > 0 and stats["capture_failures"] == 0, (name, stats)
    assert "MiniCPM-o 4.5 encoder CUDA graphs: vision=on" in turn["graphed"][1]


@pytest.fixture(scope="module")
def duplex(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, str]]:
    root = tmp_path_factory.mktemp("thinker-duplex")
    runs = {"on": (), "off": ("--no-startup-capture",)}
    return {
        key: engine(checkpoint, root / f"{key}.json", "graphed", "--session-mode", "duplex", "--only", "audio_1s", *flags)
        for key, flags in runs.items()
    }


def test_startup_capture_logs_and_is_counted_before_the_kv_cache(duplex: dict[str, tuple[dict, str]]) -> None:
    (on, on_log), (off, off_log) = duplex["on"], duplex["off"]
    assert STARTUP_LINE in on_log and STARTUP_LINE not in off_log, on_log[-3000:]
    assert "capture off (encoder_cuda_graph_startup_capture=false)" in off_log
    assert on["num_gpu_blocks"] < off["num_gpu_blocks"], (on["num_gpu_blocks"], off["num_gpu_blocks"])
