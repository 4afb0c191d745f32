# SPDX-License-Identifier: Apache-2.0
"""CUDA tests: vllm-omni's own MiniCPM-o 4.5 SigLIP and Whisper encoders at checkpoint dimensions,
graphed against eager through the model file's call sites (``get_vision_hidden_states``,
``get_audio_hidden_states``): one replay per call, padded and unpadded slices, calls that change
only the values of a captured shape, a frame captured under ``torch.inference_mode`` replayed under
``torch.no_grad``.

Tolerance: a replay runs the kernels the eager call ran, on the same shapes and values, so the
results are expected to be bitwise equal. The assertion allows one bf16 rounding step of the
output's largest magnitude (``2**-8 * max|eager|``) as a margin for a library choosing a different
kernel variant while a stream is being captured; the measured maximum difference is printed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"),
]


def assert_graphed_equals_eager(graphed: torch.Tensor, eager: torch.Tensor, what: str) -> float:
    assert graphed.shape == eager.shape and graphed.dtype == eager.dtype
    diff = (graphed.float() - eager.float()).abs().max().item()
    bound = 2.0**-8 * eager.float().abs().max().item()
    print(f"{what}: max |graphed - eager| = {diff:.3g} (bound {bound:.3g})")
    assert torch.isfinite(eager).all()
    assert diff <= bound, f"{what}: {diff} > {bound}"
    return diff


@pytest.fixture(scope="module")
def model():
    from minicpmo_cg.standalone import build_thinker_encoders, wire_encoder_graphs
    from minicpmo_cg.vllm_config import standalone_vllm_config

    m = build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=False, seed=1, vision_attn="sdpa")
    wire_encoder_graphs(m, standalone_vllm_config(), enabled=True, max_graphs=8, admission="count")
    assert len(m.vpm.encoder.layers) == 26 and len(m.apm.layers) == 24
    return m


def vision_data(tgt_sizes, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pixels = [torch.randn(3, 14, h * w * 14, generator=g).to("cuda", torch.bfloat16) for h, w in tgt_sizes]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(tgt_sizes, dtype=torch.int32, device="cuda")}


def eager(model, fn):
    """Run ``fn`` with both adapters detached (the eager path, as without graphs)."""
    vision, audio = model.vpm._encoder_graph, model._audio_encoder_graph
    model.vpm._encoder_graph, model._audio_encoder_graph = None, None
    try:
        return fn()
    finally:
        model.vpm._encoder_graph, model._audio_encoder_graph = vision, audio


@torch.inference_mode()
def test_vision_padded_masks_and_changed_tgt_sizes_match_eager(model):
    graph = model.vpm._encoder_graph
    first = vision_data([(32, 32), (28, 36), (21, 48)], seed=0)  # 1024, 1008, 1008 patches: padded mask
    for _ in range(2):
        model.get_vision_hidden_states(first)  # warmup, capture
    assert graph.get_cumulative_stats()["num_graphs"] == 1
    out = model.get_vision_hidden_states(first)
    assert out.shape == (3, 64, 4096)
    assert_graphed_equals_eager(out, eager(model, lambda: model.get_vision_hidden_states(first)), "vision")
    # same padded shape (3 x 1024 patches), new tgt_sizes, mask and pixels: the same graph must follow
    second = vision_data([(30, 34), (32, 32), (16, 60)], seed=1)
    out2 = model.get_vision_hidden_states(second)
    assert_graphed_equals_eager(
        out2, eager(model, lambda: model.get_vision_hidden_states(second)), "vision 2"
    )
    assert not torch.equal(out, out2)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 1 and stats["graph_hits"] == 3


@torch.inference_mode()
def test_vision_full_slices_use_a_maskless_graph(model):
    graph = model.vpm._encoder_graph
    before = graph.get_cumulative_stats()["num_graphs"]
    data = vision_data([(32, 32)] * 2, seed=2)  # nothing padded: the patch mask input is None
    for _ in range(3):
        out = model.get_vision_hidden_states(data)
    assert_graphed_equals_eager(
        out, eager(model, lambda: model.get_vision_hidden_states(data)), "vision full"
    )
    assert graph.get_cumulative_stats()["num_graphs"] == before + 1
    assert any(g["inputs"][-1] is None for g in graph.get_detailed_stats()["graphs"])  # the mask comes last


def test_duplex_frame_captured_under_inference_mode_replays_under_no_grad(model):
    """vllm-omni's duplex stage encodes frames under ``torch.no_grad()`` only, while the
    engine's own calls run under ``torch.inference_mode()``: a 1-slice frame captured by the
    latter must replay for the former (not raise "Inplace update to inference tensor
    outside InferenceMode") and match eager in both modes."""
    graph = model.vpm._encoder_graph
    frame = vision_data([(32, 32)], seed=7)
    graphs = graph.get_cumulative_stats()["num_graphs"]
    with torch.inference_mode():
        for _ in range(2):
            model.get_vision_hidden_states(frame)
    assert graph.get_cumulative_stats()["num_graphs"] == graphs + 1  # the frame's graph
    hits = graph.get_cumulative_stats()["graph_hits"]
    for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            data = vision_data([(32, 32)], seed=8)
            out = model.get_vision_hidden_states(data)
            ref = eager(model, lambda data=data: model.get_vision_hidden_states(data))
        assert out.is_inference() == ref.is_inference()
        assert_graphed_equals_eager(out, ref, f"duplex frame under {mode.__name__}")
    assert graph.get_cumulative_stats()["graph_hits"] == hits + 3  # one replay per call


def audio_data(lengths, frames, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    feats = torch.randn(len(lengths), 80, frames, generator=g).to("cuda")
    for i, n in enumerate(lengths):
        feats[i, :, n:] = 0
    return {
        "audio_features": feats,
        "audio_feature_lens": [torch.tensor([n], device="cuda") for n in lengths],
    }


@torch.inference_mode()
def test_audio_changed_lengths_same_padded_shape_match_eager(model):
    graph = model._audio_encoder_graph
    first = audio_data([1000, 640], frames=1000, seed=3)  # 10 s and 6.4 s in one padded batch
    for _ in range(2):
        model.get_audio_hidden_states(first)
    out = model.get_audio_hidden_states(first)
    ref = eager(model, lambda: model.get_audio_hidden_states(first))
    assert [t.shape[0] for t in out] == [100, 64]
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_graphed_equals_eager(o, r, f"audio item {i}")
    second = audio_data([720, 1000], frames=1000, seed=4)  # same padded shape, other mask
    out2 = model.get_audio_hidden_states(second)
    ref2 = eager(model, lambda: model.get_audio_hidden_states(second))
    assert [t.shape[0] for t in out2] == [72, 100]
    for i, (o, r) in enumerate(zip(out2, ref2)):
        assert_graphed_equals_eager(o, r, f"audio 2 item {i}")
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 1 and stats["graph_hits"] == 3


@torch.inference_mode()
def test_audio_one_second_chunk_matches_eager(model):
    chunk = audio_data([100], frames=100, seed=5)
    for _ in range(3):
        out = model.get_audio_hidden_states(chunk)
    assert out[0].shape == (10, 4096)
    assert_graphed_equals_eager(
        out[0], eager(model, lambda: model.get_audio_hidden_states(chunk))[0], "audio 1 s"
    )
