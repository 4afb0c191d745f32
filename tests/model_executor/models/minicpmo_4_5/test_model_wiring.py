# SPDX-License-Identifier: Apache-2.0
"""The model file's encoder CUDA graph wiring, checked on the *installed* model file.

Tiny CPU encoders stand in for the real
ones; the graph slots hold recording callables that delegate to the captured
regions, so the tests see exactly which call sites reach an adapter and with
which tensors, and that the routed result equals the eager one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_encoders
from torch import nn

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

llm = pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm")
adapter_mod = pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph")

Model = llm.MiniCPMO45OmniLLMForConditionalGeneration

if not hasattr(Model, "_encode_images"):
    pytest.fail(
        f"{llm.__file__} lacks the encoder CUDA graph wiring (_encode_images)",
        pytrace=False,
    )


class Recorder:
    """Stands in for an adapter: records every call and delegates to the captured region."""

    def __init__(self, forward):
        self.forward = forward
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)
        return self.forward(*args)


class Forbidden:
    """An adapter that must never be called."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, *args):
        raise AssertionError(f"{self.where} must not call the encoder graph")


# ---------------------------------------------------------------------------
# Vision: one graph call per image call
# ---------------------------------------------------------------------------

PATCH = 14
SIDE = 4  # image_size 56 / patch 14
HIDDEN, EMBED_V = 64, 32


def tiny_vpm(attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = llm.SiglipVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=SIDE * PATCH,
        patch_size=PATCH,
    )
    config._attn_implementation = attn
    return llm.SiglipVisionTransformer(config).eval()


def tiny_vision_model(attn: str = "eager", vision_batch_size: int = 16) -> Model:
    """A model object holding only what get_vision_hidden_states reads (vpm, resampler, config)."""
    model = object.__new__(Model)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(vision_batch_size=vision_batch_size)
    model.vpm = tiny_vpm(attn)
    model.resampler = llm.Resampler(
        num_queries=4, embed_dim=EMBED_V, num_heads=2, kv_dim=HIDDEN, adaptive=True
    )
    return model.eval()


def vision_data(grids: list[tuple[int, int]]):
    """The get_vision_hidden_states argument: slices (3, 14, h*w*14) and tgt_sizes (B, 2)."""
    torch.manual_seed(1)
    pixels = [torch.randn(3, PATCH, h * w * PATCH) for h, w in grids]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(grids, dtype=torch.int32)}


def _eager_vision(model, data):
    saved = model.vpm._encoder_graph
    model.vpm._encoder_graph = None
    try:
        with torch.no_grad():
            return model.get_vision_hidden_states(data)
    finally:
        model.vpm._encoder_graph = saved


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "grids, padded",
    [([(SIDE, SIDE), (SIDE, SIDE)], False), ([(SIDE, SIDE), (2, 3)], True)],
    ids=["no-padding", "padding"],
)
def test_vision_call_routes_pixels_tgt_sizes_and_mask_through_one_graph_call(grids, padded, attn):
    model = tiny_vision_model(attn, vision_batch_size=1)  # SigLIP runs in two chunks
    data = vision_data(grids)
    expected = _eager_vision(model, data)
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
    expected = _eager_vision(model, data)
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


def test_encode_last_hidden_state_is_encoder_plus_post_layernorm():
    vpm = tiny_vpm()
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        expected = vpm.post_layernorm(vpm.encoder(inputs_embeds=x, attention_mask=None).last_hidden_state)
        torch.testing.assert_close(vpm._encode_last_hidden_state(x, None), expected, rtol=0, atol=0)


def test_vision_graph_slot_defaults_to_none():
    assert llm.SiglipVisionTransformer._encoder_graph is None
    assert tiny_vpm()._encoder_graph is None


# ---------------------------------------------------------------------------
# Audio
# ---------------------------------------------------------------------------

D_MODEL, EMBED, POOL = 64, 32, 2


def tiny_audio_model(**config_overrides) -> Model:
    """A model object holding only what the audio paths read (apm, projection, pooler, config)."""
    model = tiny_encoders.tiny_audio_model(
        positions=64,
        chunk_seconds=0.2,
        attn="eager",
        d_model=D_MODEL,
        embed=EMBED,
        pool=POOL,
        **config_overrides,
    )
    return model.eval()


def audio_batch(mel_lens=(40, 24), t_mel=40):
    torch.manual_seed(2)
    wav = torch.randn(len(mel_lens), 80, t_mel)
    return {"audio_features": wav, "audio_feature_lens": [torch.tensor([n]) for n in mel_lens]}


def _eager_audio(model, data):
    saved = model._audio_encoder_graph
    model._audio_encoder_graph = None
    try:
        with torch.no_grad():
            return model.get_audio_hidden_states(data)
    finally:
        model._audio_encoder_graph = saved


def test_audio_routes_through_graph_and_matches_eager():
    model = tiny_audio_model()
    data = audio_batch()
    expected = _eager_audio(model, data)
    rec = Recorder(model._encode_audio_features)
    model._audio_encoder_graph = rec
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)

    assert len(rec.calls) == 1
    wavforms, mask = rec.calls[0]
    assert wavforms is data["audio_features"]  # passed as the eager path sees it (key: dtype/device)
    t = (40 - 1) // 2 + 1
    assert mask.shape == (2, 1, t, t) and mask.dtype == model.apm.conv1.weight.dtype
    assert torch.isinf(mask).any()
    assert len(out) == len(expected) == 2
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # per-item slicing stays eager: lengths follow _get_feat_extract_output_lengths
    _, pooled = model._get_feat_extract_output_lengths(torch.tensor([40, 24]))
    assert [o.shape for o in out] == [(int(pooled[0]), EMBED), (int(pooled[1]), EMBED)]


def test_audio_graph_receives_padded_list_input():
    model = tiny_audio_model()
    torch.manual_seed(3)
    items = [torch.randn(80, 40), torch.randn(80, 30)]
    data = {"audio_features": items, "audio_feature_lens": [torch.tensor([40]), torch.tensor([30])]}
    expected = _eager_audio(model, data)
    rec = Recorder(model._encode_audio_features)
    model._audio_encoder_graph = rec
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)
    ((wavforms, _mask),) = rec.calls
    assert wavforms.shape == (2, 80, 40) and (wavforms[1, :, 30:] == 0).all()
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_encode_audio_features_shape():
    model = tiny_audio_model()
    wav = torch.randn(2, 80, 40)
    mask = torch.zeros(2, 1, 20, 20)
    with torch.no_grad():
        out = model._encode_audio_features(wav, mask)
    assert out.shape == (2, 20 // POOL, EMBED)


def test_audio_training_mode_stays_eager():
    model = tiny_audio_model()
    model.train()
    model._audio_encoder_graph = Forbidden("training")
    with torch.no_grad():
        out = model.get_audio_hidden_states(audio_batch())
    assert len(out) == 2


def test_audio_intermediate_layer_stays_eager_and_uses_that_layer():
    model = tiny_audio_model()
    model.audio_encoder_layer = 1
    data = audio_batch()
    expected = _eager_audio(model, data)
    model._audio_encoder_graph = Forbidden("audio_encoder_layer != -1")
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    model.audio_encoder_layer = -1
    final = _eager_audio(model, data)
    assert not torch.equal(final[0], out[0])  # layer 1 of 2 is not the final (layer-normed) state


def test_audio_fp16_whisper_stays_eager():
    model = tiny_audio_model()
    model.apm.half()
    calls = []

    def eager(wavforms, attention_mask):
        calls.append(attention_mask.dtype)
        return torch.zeros(wavforms.shape[0], 10, EMBED)

    # The fp16 encoder itself is not run on CPU; what matters is which path is taken.
    model._encode_audio_features = eager
    model._audio_encoder_graph = Forbidden("FP16 Whisper")
    out = model.get_audio_hidden_states(audio_batch())
    assert calls == [torch.float16] and len(out) == 2


def test_streaming_audio_never_uses_the_graph():
    model = tiny_audio_model()
    model._audio_encoder_graph = Forbidden("get_audio_embedding_streaming")
    torch.manual_seed(4)
    data = {"audio_features": torch.randn(1, 80, 20), "audio_feature_lens": [torch.tensor([20])]}
    with torch.no_grad():
        first = model.get_audio_embedding_streaming(data)
        second = model.get_audio_embedding_streaming(data)
    assert len(first) == 1 and len(first[0]) == 1 and first[0][0].shape[-1] == EMBED
    assert len(second) == 1
    assert model.audio_past_key_values is not None  # the stateful path ran (KV cache kept)


# ---------------------------------------------------------------------------
# Options and construction
# ---------------------------------------------------------------------------


def bare_model(config, *, vpm=True, apm=True) -> Model:
    model = object.__new__(Model)
    nn.Module.__init__(model)
    model.config = config
    vision = tiny_vision_model() if vpm else None
    model.vpm = vision.vpm if vpm else None
    model.resampler = vision.resampler if vpm else None
    model.apm = tiny_audio_model().apm if apm else None
    return model


@pytest.fixture(scope="module")
def vllm_configs():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return {
        "eager": standalone_vllm_config(enforce_eager=True),
        "graphs": standalone_vllm_config(enforce_eager=False),
    }


def test_init_encoder_cuda_graphs_builds_adapters(vllm_configs):
    model = bare_model(
        SimpleNamespace(encoder_cuda_graph_max_graphs=7, encoder_cuda_graph_min_capture_calls=3)
    )
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    vision, audio = model.vpm._encoder_graph, model._audio_encoder_graph
    assert isinstance(vision, adapter_mod.EncoderCudaGraph) and isinstance(
        audio, adapter_mod.EncoderCudaGraph
    )
    assert vision is not audio
    assert vision.options.max_graphs == 7 and audio.options.min_capture_calls == 3
    assert vision.forward == model._encode_images  # pixels to resampler output
    assert audio.forward == model._encode_audio_features
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
    assert audio.captured_modules == ("apm", "audio_projection_layer", "audio_avg_pooler")


def test_real_adapter_on_cpu_runs_eagerly_and_counts_ineligible(vllm_configs):
    model = tiny_audio_model(vision_batch_size=16)
    vision = tiny_vision_model()
    model.vpm, model.resampler = vision.vpm, vision.resampler
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    data = audio_batch()
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)
    expected = _eager_audio(model, data)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    stats = model._audio_encoder_graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 1 and stats["num_graphs"] == 0

    data = vision_data([(SIDE, SIDE), (2, 3)])
    with torch.no_grad():
        out = model.get_vision_hidden_states(data)
    torch.testing.assert_close(out, _eager_vision(model, data), rtol=0, atol=0)
    assert model.vpm._encoder_graph.get_cumulative_stats()["ineligible_misses"] == 1


@pytest.mark.parametrize(
    "config, vllm_key",
    [(SimpleNamespace(), "eager"), (SimpleNamespace(encoder_cuda_graph=False), "graphs")],
    ids=["enforce_eager", "encoder_cuda_graph_false"],
)
def test_disabled_graphs_are_none(config, vllm_key, vllm_configs):
    model = bare_model(config)
    model.vpm._encoder_graph = "stale"
    model._init_encoder_cuda_graphs(vllm_configs[vllm_key])
    assert model.vpm._encoder_graph is None
    assert model._audio_encoder_graph is None


def test_missing_encoders_get_no_adapters(vllm_configs):
    model = bare_model(SimpleNamespace(), vpm=False, apm=False)
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    assert model.vpm is None and model._audio_encoder_graph is None
    assert Model._audio_encoder_graph is None


@pytest.mark.parametrize(
    "key, value",
    [
        ("encoder_cuda_graph_max_graphs", True),
        ("encoder_cuda_graph", "false"),
        ("encoder_cuda_graph_min_capture_calls", 1),
        ("encoder_cuda_graph_min_free_bytes", -1),
        ("encoder_cuda_graph_share_pools", 1),
    ],
)
def test_bad_override_fails_init_encoder_cuda_graphs(key, value, vllm_configs):
    model = bare_model(SimpleNamespace(**{key: value}))
    with pytest.raises(ValueError, match=key):
        model._init_encoder_cuda_graphs(vllm_configs["graphs"])


@pytest.mark.parametrize(
    "key, value",
    [
        ("encoder_cuda_graph_max_graphs", True),
        ("encoder_cuda_graph", "false"),
        ("encoder_cuda_graph_max_graph", 8),
    ],
)
def test_bad_override_fails_model_construction_before_anything_heavy(key, value):
    vllm_config = SimpleNamespace(
        model_config=tiny_encoders.ModelConfigTripwire(SimpleNamespace(**{key: value}))
    )
    with pytest.raises(ValueError, match=key) as info:
        Model(vllm_config=vllm_config)
    assert json.dumps(value) in str(info.value)


def test_every_bad_override_is_reported_by_model_construction():
    hf_config = SimpleNamespace(encoder_cuda_graphs=False, encoder_cuda_graph_max_graphs="4")
    with pytest.raises(adapter_mod.HfOverridesError) as info:
        Model(vllm_config=SimpleNamespace(model_config=tiny_encoders.ModelConfigTripwire(hf_config)))
    assert info.value.problems == [
        'encoder_cuda_graph_max_graphs="4": got a string, expected an integer >= 0 and <= 1024',
        "encoder_cuda_graphs=false: unknown key, did you mean encoder_cuda_graph?",
    ]


# ---------------------------------------------------------------------------
# Start-up state, LoRA, hooks on the real modules
# ---------------------------------------------------------------------------


def startup_line(records):
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 encoder CUDA graphs:")]
    return line


@pytest.mark.parametrize(
    "config, vllm_key, vision, audio",
    [
        (SimpleNamespace(), "graphs", "on", "on"),
        (SimpleNamespace(encoder_cuda_graph_max_graphs=0), "graphs",
         "off (encoder_cuda_graph_max_graphs=0)", "off (encoder_cuda_graph_max_graphs=0)"),
        (SimpleNamespace(encoder_cuda_graph=False), "graphs", "off (encoder_cuda_graph=false)",
         "off (encoder_cuda_graph=false)"),
        (SimpleNamespace(), "eager", "off (--enforce-eager)", "off (--enforce-eager)"),
    ],
    ids=["default", "max_graphs_0", "disabled", "enforce_eager"],
)  # fmt: skip
def test_startup_log_states_each_encoders_effective_state(
    config, vllm_key, vision, audio, vllm_configs, log_records
):
    records = log_records(llm.encoder_graphs.logger)
    model = bare_model(config)
    model._init_encoder_cuda_graphs(vllm_configs[vllm_key])
    line = startup_line(records)
    assert line.startswith(f"MiniCPM-o 4.5 encoder CUDA graphs: vision={vision}, audio={audio}; ")
    assert line.endswith(adapter_mod.EncoderCudaGraphOptions.from_hf_config(config).describe())


def test_startup_log_without_an_encoder(vllm_configs, log_records):
    records = log_records(llm.encoder_graphs.logger)
    bare_model(SimpleNamespace(), vpm=False)._init_encoder_cuda_graphs(vllm_configs["graphs"])
    assert "vision=off (no encoder), audio=on;" in startup_line(records)


def test_lora_config_keeps_both_encoders_eager_with_one_log_line(vllm_configs, log_records):
    """vllm-omni's MiniCPM-o 4.5 class declares no get_mm_mapping(), so vLLM would hand every
    LoRA-capable layer, encoder layers included, the language model's adapters."""
    import copy

    from vllm.config import LoRAConfig

    vllm_config = copy.copy(vllm_configs["graphs"])
    object.__setattr__(vllm_config, "lora_config", LoRAConfig())
    records = log_records(llm.encoder_graphs.logger)
    model = bare_model(SimpleNamespace())
    model._init_encoder_cuda_graphs(vllm_config)
    assert model.vpm._encoder_graph is None and model._audio_encoder_graph is None
    line = startup_line(records)
    reason = (
        "off (LoRA is enabled and the model has no get_mm_mapping(), so adapters may target encoder layers"
    )
    assert f"vision={reason}" in line and f"audio={reason}" in line
    assert line.count("a replay would keep the weights live at capture") == 2
    assert not hasattr(Model, "get_mm_mapping")  # the fact the reason rests on, in this vllm-omni


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


def test_hooks_are_looked_for_in_the_real_captured_regions(vllm_configs, cpu_backend):
    model = tiny_audio_model(vision_batch_size=16)
    vision_model = tiny_vision_model()
    model.vpm, model.resampler = vision_model.vpm, vision_model.resampler
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    vision, audio = model.vpm._encoder_graph, model._audio_encoder_graph
    vision.backend, audio.backend = cpu_backend(), cpu_backend()
    # vpm and vpm.embeddings themselves are never called by the image path: harmless
    model.vpm.register_forward_hook(lambda *args: None)
    model.vpm.embeddings.register_forward_hook(lambda *args: None)
    model.vpm.encoder.layers[1].mlp.fc2.register_forward_hook(lambda *args: None)
    model.resampler.kv_proj.register_forward_pre_hook(lambda *args: None)
    model.audio_projection_layer.register_forward_pre_hook(lambda *args: None)
    pixels = vision_data([(SIDE, SIDE)])
    data = audio_batch()
    with torch.no_grad():
        for _ in range(2):
            model.get_vision_hidden_states(pixels)
            model.get_audio_hidden_states(data)
    assert vision.eager_reason == (
        f"module hooks in the captured region: {Model.__name__}.vpm.encoder.layers.1.mlp.fc2 (forward hook), "
        f"{Model.__name__}.resampler.kv_proj (forward_pre hook)"
    )
    assert audio.eager_reason == (
        f"module hooks in the captured region: {Model.__name__}.audio_projection_layer (forward_pre hook)"
    )
    assert vision.backend.captures == [] and audio.backend.captures == []
