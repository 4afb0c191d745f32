# SPDX-License-Identifier: Apache-2.0
"""The model file's wiring of the vision graph over the whole image call.

``get_vision_hidden_states`` hands the adapter the stacked pixels, ``tgt_sizes`` and the valid-patch
mask (None when no slice is padded) in one call, from pixels to resampler output
(``_encode_images``); ``SiglipVisionTransformer.forward`` itself never reaches the graph, FA2 with
padding stays eager, and the adapter's captured region (and so its hooks check and LoRA rule) covers
the embeddings and the resampler. Tiny CPU encoders stand in for the real ones; the graph slots hold
recording callables that delegate to the captured region, so the tests see which call sites reach an
adapter, with which tensors, and that the routed result equals the eager one. The wiring every
encoder shares is ``test_encoder_cuda_graph_wiring.py``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.wiring import (
    EMBED_V,
    PATCH,
    SIDE,
    Forbidden,
    Recorder,
    bare_model,
    eager_vision,
    startup_line,
    tiny_vision_model,
    tiny_vpm,
    vision_data,
    wired_model,
)
from torch import nn

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

llm, adapter_mod, Model = wired_model("_encode_images")


@pytest.fixture(scope="module")
def vllm_configs():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return {"graphs": standalone_vllm_config(enforce_eager=False)}


# ---------------------------------------------------------------------------
# Vision: one graph call per image call
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "grids, padded",
    [([(SIDE, SIDE), (SIDE, SIDE)], False), ([(SIDE, SIDE), (2, 3)], True)],
    ids=["no-padding", "padding"],
)
def test_vision_call_routes_pixels_tgt_sizes_and_mask_through_one_graph_call(grids, padded, attn):
    model = tiny_vision_model(attn, vision_batch_size=1)  # SigLIP runs in two chunks
    data = vision_data(grids)
    expected = eager_vision(model, data)
    rec = Recorder(model._encode_images)
    model.vpm._encoder_graph = rec
    with torch.no_grad():
        out = model.get_vision_hidden_states(data)

    assert len(rec.calls) == 1  # one graph call per image call: both SigLIP chunks and the resampler
    pixels, tgt_sizes, patch_valid = rec.calls[0]
    n_max = max(h * w for h, w in grids)
    assert pixels.shape == (len(grids), 3, PATCH, n_max * PATCH) and pixels.is_contiguous()
    for i, item in enumerate(data["pixel_values"]):
        assert torch.equal(pixels[i, ..., : item.shape[-1]], item)
        assert not pixels[i, ..., item.shape[-1] :].any()
    assert torch.equal(tgt_sizes, data["tgt_sizes"])
    if padded:
        assert patch_valid.dtype == torch.bool and patch_valid.shape == (len(grids), n_max)
        assert torch.equal(patch_valid.sum(-1), torch.tensor([h * w for h, w in grids]))
        assert patch_valid[1, :6].all() and not patch_valid[1, 6:].any()
    else:
        assert patch_valid is None  # decided from the slice lengths, nothing read on the host
    assert out.shape == (len(grids), 4, EMBED_V)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_vision_graph_output_is_what_the_call_returns():
    model = tiny_vision_model()
    sentinel = torch.full((1, 4, EMBED_V), 7.0)
    model.vpm._encoder_graph = lambda pixels, tgt_sizes, patch_valid: sentinel
    with torch.no_grad():
        out = model.get_vision_hidden_states(vision_data([(SIDE, SIDE)]))
    assert out is sentinel


def test_vision_accepts_a_stacked_tensor_and_int64_tgt_sizes():
    model = tiny_vision_model()
    data = vision_data([(SIDE, SIDE)] * 3)
    expected = eager_vision(model, data)
    stacked = {"pixel_values": torch.stack(data["pixel_values"]), "tgt_sizes": data["tgt_sizes"].long()}
    rec = Recorder(model._encode_images)
    model.vpm._encoder_graph = rec
    with torch.no_grad():
        out = model.get_vision_hidden_states(stacked)
    ((pixels, tgt_sizes, patch_valid),) = rec.calls
    assert pixels.shape == (3, 3, PATCH, SIDE * SIDE * PATCH) and patch_valid is None
    assert tgt_sizes.dtype == torch.int64
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"output_hidden_states": True}, {"output_attentions": True}, {"return_dict": False}],
    ids=["plain", "output_hidden_states", "output_attentions", "return_dict_false"],
)
def test_vpm_forward_never_uses_the_graph(kwargs):
    vpm = tiny_vpm()
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, PATCH, SIDE * SIDE * PATCH)
    mask = torch.ones(2, 1, SIDE * SIDE, dtype=torch.bool)
    mask[1, 0, 6:] = False
    tgt = torch.tensor([[SIDE, SIDE], [2, 3]], dtype=torch.int32)
    with torch.no_grad():
        expected = vpm(pixels, patch_attention_mask=mask, tgt_sizes=tgt, **kwargs)
        vpm._encoder_graph = Forbidden(f"vpm(..., {kwargs})")
        out = vpm(pixels, patch_attention_mask=mask, tgt_sizes=tgt, **kwargs)
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)
    if kwargs.get("output_hidden_states"):
        assert out.hidden_states is not None and len(out.hidden_states) == 3  # embeddings + 2 layers
    if kwargs.get("output_attentions"):
        assert out.attentions is not None and len(out.attentions) == 2


class _StubEncoder(nn.Module):
    """Replaces the SigLIP stack where FA2 kernels would be needed; records the mask it gets."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def forward(
        self,
        inputs_embeds,
        attention_mask=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
    ):
        self.masks.append(attention_mask)
        return llm.BaseModelOutput(last_hidden_state=inputs_embeds)


def test_vision_flash_attention_2_with_padding_stays_eager():
    model = tiny_vision_model()
    model.vpm._use_flash_attention_2 = True  # as built with _attn_implementation="flash_attention_2"
    model.vpm.encoder = _StubEncoder()
    model.vpm._encoder_graph = Forbidden("FA2 with padding")
    with torch.no_grad():
        model.get_vision_hidden_states(vision_data([(SIDE, SIDE), (2, 3)]))
    (fa2_mask,) = model.vpm.encoder.masks
    assert fa2_mask.dtype == torch.bool and fa2_mask.shape == (2, SIDE * SIDE)
    assert fa2_mask[1, :6].all() and not fa2_mask[1, 6:].any()

    # Without padding FA2 gets no mask, so nothing is read on the host: the graph is used.
    rec = Recorder(model._encode_images)
    model.vpm._encoder_graph = rec
    with torch.no_grad():
        model.get_vision_hidden_states(vision_data([(SIDE, SIDE)]))
    assert len(rec.calls) == 1 and rec.calls[0][2] is None
    assert model.vpm.encoder.masks[-1] is None


# ---------------------------------------------------------------------------
# The captured region: LoRA and hooks
# ---------------------------------------------------------------------------


def test_the_vision_adapter_replays_the_whole_image_call(vllm_configs):
    model = bare_model(
        SimpleNamespace(encoder_cuda_graph_max_graphs=7, encoder_cuda_graph_min_capture_calls=3)
    )
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    vision = model.vpm._encoder_graph
    assert isinstance(vision, adapter_mod.EncoderCudaGraph) and vision.options.max_graphs == 7
    assert vision.forward == model._encode_images  # pixels to resampler output
    assert (
        vision.captured_modules
        == llm.vision_path.VISION_CAPTURED_MODULES
        == (
            "vpm.embeddings.patch_embedding",
            "vpm.embeddings.position_embedding",
            "vpm.encoder",
            "vpm.post_layernorm",
            "resampler",
        )
    )


def test_no_vision_adapter_without_the_resampler_the_image_call_needs(vllm_configs, log_records):
    """The whole image call ends in the resampler (the region's ``needs``): a model without one gets
    no vision adapter, and the audio adapter is built as usual."""
    assert llm.vision_path.IMAGE_CALL.needs == ("resampler",)
    model = bare_model(SimpleNamespace())
    model.resampler = None
    records = log_records(llm.encoder_graphs.logger)
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    assert getattr(model.vpm, "_encoder_graph", None) is None
    assert isinstance(model._audio_encoder_graph, adapter_mod.EncoderCudaGraph)
    assert "vision=off (no encoder), audio=on;" in startup_line(records)


def test_connector_lora_keeps_the_vision_graph_eager(vllm_configs, log_records):
    """The resampler (vLLM's "connector" of a MiniCPM-V mapping) is inside the vision graph now, so
    LoRA that may reach it keeps vision eager even when the SigLIP tower itself is not opened."""
    import copy

    from vllm.config import LoRAConfig
    from vllm.model_executor.models.module_mapping import MultiModelKeys

    class ConnectorMapped(Model):
        def get_mm_mapping(self):
            return MultiModelKeys.from_string_field(
                language_model="llm", connector="resampler", tower_model=[]
            )

    vllm_config = copy.copy(vllm_configs["graphs"])
    object.__setattr__(vllm_config, "lora_config", LoRAConfig(enable_tower_connector_lora=True))
    model = bare_model(SimpleNamespace())
    model.__class__ = ConnectorMapped
    records = log_records(llm.encoder_graphs.logger)
    model._init_encoder_cuda_graphs(vllm_config)
    assert model.vpm._encoder_graph is None and model._audio_encoder_graph is not None
    assert "vision=off (LoRA with enable_tower_connector_lora may target resampler;" in startup_line(records)


def test_hooks_are_looked_for_in_the_whole_image_call(vllm_configs, cpu_backend):
    """The region runs from the patch and position embeddings to the resampler: a hook there keeps
    vision eager, while vpm and vpm.embeddings themselves, which the image path never calls, are
    harmless."""
    model = tiny_vision_model()
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    vision = model.vpm._encoder_graph
    vision.backend = cpu_backend()
    model.vpm.register_forward_hook(lambda *args: None)
    model.vpm.embeddings.register_forward_hook(lambda *args: None)
    model.vpm.encoder.layers[1].mlp.fc2.register_forward_hook(lambda *args: None)
    model.resampler.kv_proj.register_forward_pre_hook(lambda *args: None)
    pixels = vision_data([(SIDE, SIDE)])
    with torch.no_grad():
        for _ in range(2):
            model.get_vision_hidden_states(pixels)
    assert vision.eager_reason == (
        f"module hooks in the captured region: {Model.__name__}.vpm.encoder.layers.1.mlp.fc2 (forward hook), "
        f"{Model.__name__}.resampler.kv_proj (forward_pre hook)"
    )
    assert vision.backend.captures == []
