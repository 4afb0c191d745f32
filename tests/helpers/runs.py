# SPDX-License-Identifier: Apache-2.0
"""Running the demo and the benchmark as a user would: ``python -m ...`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: The demo's inputs at the reduced size (``--quick``, the default without CUDA), and its duplex row.
REDUCED_INPUTS = ["chelsea@224", "frame@224", "speech_1s", "speech_5s", "duplex_speech"]
TIMEOUT_S = 900


def run_module(module: str, *args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``python -m <module> <args> --json <tmp_path>/result.json``; return the process and the JSON.

    Fails the test (with the stderr tail) when no JSON was written.
    """
    out_json = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out_json)],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out_json.is_file(), f"no JSON written (rc={proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    return proc, json.loads(out_json.read_text())


def run_demo(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    return run_module("minicpmo_cg.demo", *args, tmp_path=tmp_path)


def demo_table_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of the demo's results table keyed by input name (between the dashes and the legend)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("input ") and "eager ms" in line)
    rows = {}
    for line in lines[start + 2 :]:
        if line.startswith("input shape:"):
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def patched_model_available() -> bool:
    """vLLM and a vllm-omni with the encoder CUDA graph patch set applied are importable."""
    try:
        import vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph  # noqa: F401
        from minicpmo_cg import standalone

        model_cls = standalone.model_module().MiniCPMO45OmniLLMForConditionalGeneration
        return callable(getattr(model_cls, "_init_encoder_cuda_graphs", None))
    except Exception:  # noqa: BLE001
        return False
