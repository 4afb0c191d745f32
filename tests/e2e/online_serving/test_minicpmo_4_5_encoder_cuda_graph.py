# SPDX-License-Identifier: Apache-2.0
"""End to end: ``vllm serve openbmb/MiniCPM-o-4_5 --omni`` answers alike with and without encoder graphs,
with each SigLIP attention.

Starts the server four times on this machine's GPU, one after the other: eager
(``--hf-overrides '{"encoder_cuda_graph": false}'``) and graphed (defaults), each with
``vision_attn_implementation`` ``"sdpa"`` (the default) and ``"eager"`` (merged into the
``--hf-overrides``). Sends the fixed image, audio and image+audio prompts of
``tests/helpers/serve_smoke.py`` greedily and requires identical answers from the eager and the
graphed server of one attention (the attention changes the numerics, so answers across attentions
may differ). Within each server, a repeated input must get its first answer again (in the graphed
server the first answer is eager warmup and the repeat a graph replay), the graphed server's log
must show captures of both encoders and the eager server's none, and each log must name the
SigLIP attention it was asked for.

Each test is marked ``cuda`` and the module has no ``core_model`` mark: it needs a GPU that holds the whole
three-stage deploy (an 80 GB H100 class device) and a checkpoint, so it is not
part of ``-m "core_model and cuda"``. Skipped unless ``MINICPMO_CG_E2E_MODEL``
points to a local checkpoint, ``MINICPMO_CG_E2E_HUB=1`` allows the hub download,
or the hub snapshot is already cached. ``MINICPMO_CG_E2E_ENFORCE_EAGER=1`` adds an
``--enforce-eager`` server. Run it where the vLLM and vllm-omni under test are installed::

    MINICPMO_CG_E2E_MODEL=/models/MiniCPM-o-4_5 python -m pytest -m cuda \\
        tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import serve_smoke as smoke


@pytest.fixture(scope="module")
def model() -> str:
    import torch

    try:
        resolved, why = smoke.resolve_model()
    except ValueError as exc:
        pytest.fail(str(exc))
    reasons = [] if resolved is not None else [why]
    if not torch.cuda.is_available():
        reasons.insert(0, "needs a CUDA GPU that holds MiniCPM-o 4.5's three-stage deploy (80 GB class)")
    if reasons:
        pytest.skip("; ".join(reasons))
    return resolved


#: (mode, SigLIP attention) of every server, in start order
RUNS = [(mode, attn) for attn in smoke.VISION_ATTNS for mode in ("eager", "graphed")]


@pytest.fixture(scope="module")
def recordings(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    root = tmp_path_factory.mktemp("serve-eager-vs-graphed")
    # Sequential on one GPU: each server's process group is gone before the next starts.
    return {
        (mode, attn): smoke.run_mode(model, mode, root / f"{mode}-{attn}", vision_attn=attn)
        for mode, attn in RUNS
    }


@pytest.mark.cuda
def test_each_server_runs_in_its_mode_and_is_self_consistent(recordings: dict[tuple[str, str], dict]) -> None:
    problems = [p for key in RUNS for p in smoke.check_run(recordings[key])]
    assert not problems, "\n".join(problems)
    assert {key: recordings[key]["siglip_attention"] for key in RUNS} == {key: key[1] for key in RUNS}


@pytest.mark.cuda
@pytest.mark.parametrize("attn", smoke.VISION_ATTNS)
def test_graphed_answers_equal_eager(recordings: dict[tuple[str, str], dict], attn: str) -> None:
    assert len(recordings[("graphed", attn)]["answers"]) == len(smoke.PROMPTS)
    problems = smoke.compare(recordings[("eager", attn)], recordings[("graphed", attn)])
    assert not problems, "\n".join(problems)


@pytest.mark.cuda
@pytest.mark.skipif(
    os.environ.get("MINICPMO_CG_E2E_ENFORCE_EAGER") != "1",
    reason="set MINICPMO_CG_E2E_ENFORCE_EAGER=1 to also start an --enforce-eager server "
    "(one more model load)",
)
def test_enforce_eager_serves_without_encoder_graphs(model: str, tmp_path: Path) -> None:
    # --enforce-eager also turns off the Thinker's decode graphs, so only self-consistency
    # and the absence of encoder captures are required, not equality with the graphed answers.
    record = smoke.run_mode(model, "enforce-eager", tmp_path)
    problems = smoke.check_run(record)
    assert not problems, "\n".join(problems)
