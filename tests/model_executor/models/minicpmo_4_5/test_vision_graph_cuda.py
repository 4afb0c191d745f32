# SPDX-License-Identifier: Apache-2.0
"""CUDA tests of the image path: one graph per image call, from pixels to resampler output, with
SigLIP's eager and SDPA attention.

The thinker's encoders at the checkpoint's dimensions (26 SigLIP layers, resampler of width 4096),
bf16, random weights from the tests' builder (:func:`minicpmo_cg.standalone.build_thinker_encoders`,
the same weights for both attentions), wired by the model's ``_init_encoder_cuda_graphs``; real
photos (scikit-image's bundled samples) through MiniCPM-o's own image processor and slicer (448 px,
up to 9 slices, :mod:`minicpmo_cg.inputs`).

A replay runs the kernels the eager call ran on the same shapes and values, so graphed and eager
outputs must be bitwise equal, also when a replay gets other ``tgt_sizes`` values than the capture
(everything that depends on them is computed on the device). ``torch.cuda.set_sync_debug_mode``
checks that neither the graphed nor the eager call makes the host wait for the device.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"),
]

ATTENTIONS = ("eager", "sdpa")
#: call -> photos through the slicer: chelsea 1 slice (26x39), astronaut 3 (1024, 1035, 1035 patches:
#: padded), hubble_deep_field 5 (30x34), coins 1 (28x36); 10 slices in all.
CALLS = {
    "1 slice": ["chelsea"],
    "3 slices, padded": ["astronaut"],
    "10 slices, padded": ["hubble_deep_field", "astronaut", "chelsea", "coins"],
}
COUNT = {"enabled": True, "max_graphs": 16, "min_capture_calls": 2, "admission": "count"}


@pytest.fixture(scope="module")
def vllm_config():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return standalone_vllm_config()


@pytest.fixture(scope="module")
def models(vllm_config):
    from minicpmo_cg.standalone import build_thinker_encoders, wire_encoder_graphs

    built = {}
    for attn in ATTENTIONS:
        model = build_thinker_encoders(device="cuda", dtype=torch.bfloat16, vision_attn=attn, seed=0)
        wire_encoder_graphs(model, vllm_config, **COUNT)
        assert len(model.vpm.encoder.layers) == 26 and model.vpm._encoder_graph is not None
        assert model.build_info.vision_attn == attn
        built[attn] = model
    return built


@pytest.fixture(scope="module")
def photo_inputs():
    """photo name -> :class:`minicpmo_cg.inputs.VisionInput` (checkpoint slicing)."""
    pytest.importorskip("skimage.data")
    from minicpmo_cg import inputs

    processor = inputs.make_image_processor()
    names = {n for photos in CALLS.values() for n in photos}
    return {n: inputs.vision_input(processor, n, [n]) for n in names}


def call_data(photo_inputs, names, order=None):
    pixels = [p for n in names for p in photo_inputs[n].pixel_values]
    tgt_sizes = torch.cat([photo_inputs[n].tgt_sizes for n in names])
    order = list(range(len(pixels))) if order is None else order
    return {
        "pixel_values": [pixels[i].to("cuda", torch.bfloat16) for i in order],
        "tgt_sizes": tgt_sizes[order].to("cuda"),
    }


def eager(model, data):
    graph = model.vpm._encoder_graph
    model.vpm._encoder_graph = None
    try:
        return model.get_vision_hidden_states(data)
    finally:
        model.vpm._encoder_graph = graph


@pytest.mark.cuda
def test_same_weights_for_both_attentions(models):
    eager_model, sdpa_model = models["eager"], models["sdpa"]
    for (name, a), (_, b) in zip(eager_model.named_parameters(), sdpa_model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("attn", ATTENTIONS)
@torch.inference_mode()
def test_graph_equals_eager_bitwise_on_real_photos(models, photo_inputs, attn, call):
    model = models[attn]
    graph = model.vpm._encoder_graph
    data = call_data(photo_inputs, CALLS[call])
    before = graph.get_cumulative_stats()
    for _ in range(2):  # warmup miss, then capture (served by the first replay)
        model.get_vision_hidden_states(data)
    out = model.get_vision_hidden_states(data)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == before["num_graphs"] + 1
    assert stats["graph_hits"] == before["graph_hits"] + 2  # one replay per image call
    want = eager(model, data)
    assert out.shape == (len(data["pixel_values"]), 64, 4096) and out.dtype == torch.bfloat16
    assert torch.isfinite(want).all()
    assert torch.equal(out, want), f"max |graphed - eager| = {(out.float() - want.float()).abs().max()}"

    # Same shapes, other tgt_sizes values (slices reordered, one grid read transposed): the same
    # graph replays them, since positions and masks come from tgt_sizes on the device.
    order = list(range(len(data["pixel_values"])))[::-1]
    moved = call_data(photo_inputs, CALLS[call], order)
    moved["tgt_sizes"][0] = moved["tgt_sizes"][0].flip(0)
    out2 = model.get_vision_hidden_states(moved)
    assert graph.get_cumulative_stats()["num_graphs"] == stats["num_graphs"]
    assert torch.equal(out2, eager(model, moved))
    assert not torch.equal(out2, out)


@pytest.mark.cuda
def test_sdpa_is_closer_than_eager_attention_to_a_float32_reference(models, photo_inputs):
    """The whole image call in bf16 against a float32 model holding the same (bf16-rounded) weights,
    on the same bf16 pixels (3 padded slices)."""
    from minicpmo_cg.standalone import build_thinker_encoders

    data = call_data(photo_inputs, CALLS["3 slices, padded"])
    reference = build_thinker_encoders(device="cuda", dtype=torch.float32, vision_attn="eager", seed=0)
    for param in reference.parameters():
        param.data = param.data.bfloat16().float()
    with torch.inference_mode():
        outs = {attn: eager(models[attn], data).float() for attn in ATTENTIONS}
        want = reference.get_vision_hidden_states(
            {**data, "pixel_values": [p.float() for p in data["pixel_values"]]}
        )
    del reference
    errors = {attn: float((out - want).abs().mean()) for attn, out in outs.items()}
    print("mean |bf16 - float32 reference|:", errors)
    assert errors["sdpa"] <= errors["eager"]


@pytest.mark.cuda
@pytest.mark.parametrize("attn", ATTENTIONS)
@torch.inference_mode()
def test_image_call_makes_the_host_wait_for_nothing(models, photo_inputs, attn):
    model = models[attn]
    data = call_data(photo_inputs, CALLS["3 slices, padded"])
    for _ in range(3):  # tables built, graph captured
        model.get_vision_hidden_states(data)
    torch.accelerator.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed = model.get_vision_hidden_states(data)  # replay: copies in, replay, output clone
        eager_out = eager(model, data)  # the same call site without a graph
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(graphed, eager_out)


@pytest.mark.cuda
@torch.inference_mode()
def test_vpm_forward_never_touches_the_graph(models):
    """The image path's graph starts at the pixels (get_vision_hidden_states); vpm.forward is eager."""
    model = models["sdpa"]
    graph = model.vpm._encoder_graph
    before = graph.get_cumulative_stats()
    pixels = torch.randn(1, 3, 14, 1024 * 14, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1024, dtype=torch.bool, device="cuda")
    tgt = torch.tensor([[32, 32]], dtype=torch.int32, device="cuda")
    out = model.vpm(pixels, patch_attention_mask=mask, tgt_sizes=tgt, output_hidden_states=True)
    assert len(out.hidden_states) == 27
    model.vpm(pixels, patch_attention_mask=mask, tgt_sizes=tgt)
    assert graph.get_cumulative_stats() == before


@pytest.mark.cuda
@torch.inference_mode()
def test_lookup_tables_are_never_built_inside_a_capture(models):
    from vllm_omni.model_executor.models.minicpmo_4_5 import vision_path

    embeddings = models["sdpa"].vpm.embeddings
    device = torch.device("cuda", torch.accelerator.current_device_index())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"), torch.cuda.graph(graph):
        vision_path.position_bucket_table(embeddings, 8192, device)
    torch.accelerator.synchronize()


@pytest.mark.cuda
def test_cost_admission_captures_a_duplex_frame_and_no_grad_replays_it(models, vllm_config):
    """The default admission rule ("cost") on the duplex stage's call: one 448x448 frame a second
    under torch.no_grad, after the engine's calls under torch.inference_mode. The launch-bound
    frame must be captured within a few calls and replayed bitwise in both autograd modes."""
    from minicpmo_cg import inputs
    from minicpmo_cg.standalone import wire_encoder_graphs

    model = models["sdpa"]
    processor = inputs.make_image_processor()
    frame = inputs.vision_input(processor, "duplex_frame", ["coffee"], frame=True)
    assert frame.tgt_sizes.tolist() == [[32, 32]]
    data = frame.data("cuda", torch.bfloat16)
    wire_encoder_graphs(model, vllm_config, **{**COUNT, "admission": "cost"})
    graph = model.vpm._encoder_graph
    try:
        with torch.inference_mode():
            for _ in range(6):
                model.get_vision_hidden_states(data)
                if graph.get_cumulative_stats()["num_graphs"]:
                    break
        detail = graph.get_detailed_stats()
        assert detail["admission"] == "cost" and len(detail["graphs"]) == 1, detail
        hits = graph.get_cumulative_stats()["graph_hits"]
        for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
            with mode():
                out = model.get_vision_hidden_states(data)
                ref = eager(model, data)
            assert out.is_inference() == ref.is_inference() == (mode is torch.inference_mode)
            assert torch.equal(out, ref), mode.__name__
        assert graph.get_cumulative_stats()["graph_hits"] == hits + 3
        print("duplex frame graph:", detail["graphs"][0])
    finally:
        wire_encoder_graphs(model, vllm_config, **COUNT)
