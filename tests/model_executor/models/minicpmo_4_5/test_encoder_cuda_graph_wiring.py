# SPDX-License-Identifier: Apache-2.0
"""The model file's encoder CUDA graph wiring.

``_init_encoder_cuda_graphs`` builds one adapter per encoder from the validated ``--hf-overrides``
(none with ``encoder_cuda_graph`` false, under ``--enforce-eager``, without the encoder, or where
vLLM's LoRA may reach its modules), logs one start-up line with each encoder's state, and bad keys
fail model construction before anything heavy is built. The stateless audio call runs through its
adapter, except in training, for an intermediate layer and for FP16 Whisper; an adapter refuses to
capture a region with module hooks on it. Tiny CPU encoders stand in for the real ones; the graph
slots hold recording callables that delegate to the captured regions, so the tests see which call
sites reach an adapter, with which tensors, and that the routed result equals the eager one.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_encoders
from helpers.wiring import (
    EMBED,
    HIDDEN,
    POOL,
    Forbidden,
    Recorder,
    audio_batch,
    bare_model,
    eager_audio,
    eager_vision,
    startup_line,
    tiny_audio_model,
    tiny_vision_model,
    tiny_vpm,
    vision_data,
    wired_model,
)

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

llm, adapter_mod, Model = wired_model("_init_encoder_cuda_graphs")

AUDIO_MODULES = ("apm", "audio_projection_layer", "audio_avg_pooler")
SIDE = 4  # the tiny SigLIP's patches per side


# ---------------------------------------------------------------------------
# Vision: the slot and SigLIP's stack
# ---------------------------------------------------------------------------


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
# Audio: the stateless call and where it stays eager
# ---------------------------------------------------------------------------


def test_audio_routes_through_graph_and_matches_eager():
    model = tiny_audio_model()
    data = audio_batch()
    expected = eager_audio(model, data)
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
    expected = eager_audio(model, data)
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
    expected = eager_audio(model, data)
    model._audio_encoder_graph = Forbidden("audio_encoder_layer != -1")
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    model.audio_encoder_layer = -1
    final = eager_audio(model, data)
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


def test_streaming_audio_never_uses_the_stateless_graph():
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


@pytest.fixture(scope="module")
def vllm_configs():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return {
        "eager": standalone_vllm_config(enforce_eager=True),
        "graphs": standalone_vllm_config(enforce_eager=False),
    }


def test_init_encoder_cuda_graphs_builds_an_adapter_per_encoder(vllm_configs):
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
    assert vision.name == "vision" and audio.name == "audio"
    assert audio.forward == model._encode_audio_features
    assert audio.captured_modules == AUDIO_MODULES


def test_real_adapter_on_cpu_runs_eagerly_and_counts_ineligible(vllm_configs):
    model = tiny_audio_model(vision_batch_size=16)
    vision = tiny_vision_model()
    model.vpm, model.resampler = vision.vpm, vision.resampler
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    data = audio_batch()
    with torch.no_grad():
        out = model.get_audio_hidden_states(data)
    expected = eager_audio(model, data)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    stats = model._audio_encoder_graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 1 and stats["num_graphs"] == 0

    data = vision_data([(SIDE, SIDE), (2, 3)])
    with torch.no_grad():
        out = model.get_vision_hidden_states(data)
    torch.testing.assert_close(out, eager_vision(model, data), rtol=0, atol=0)
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


def test_tower_lora_keeps_the_vision_graph_eager_and_the_audio_one_graphed(vllm_configs, log_records):
    """With a mapping whose tower is SigLIP and ``enable_tower_connector_lora``, LoRA may reach the
    vision graph's modules and none of Whisper's."""
    import copy

    from vllm.config import LoRAConfig
    from vllm.model_executor.models.module_mapping import MultiModelKeys

    class TowerMapped(Model):
        def get_mm_mapping(self):
            return MultiModelKeys.from_string_field(language_model="llm", connector=[], tower_model="vpm")

    vllm_config = copy.copy(vllm_configs["graphs"])
    object.__setattr__(vllm_config, "lora_config", LoRAConfig(enable_tower_connector_lora=True))
    model = bare_model(SimpleNamespace())
    model.__class__ = TowerMapped
    records = log_records(llm.encoder_graphs.logger)
    model._init_encoder_cuda_graphs(vllm_config)
    assert model.vpm._encoder_graph is None and model._audio_encoder_graph is not None
    line = startup_line(records)
    assert "vision=off (LoRA with enable_tower_connector_lora may target vpm" in line and "audio=on;" in line


def test_hooks_in_a_captured_region_keep_that_encoder_eager(vllm_configs, cpu_backend):
    """A hook on a module the graph would replay keeps that encoder eager, named in its reason; a
    hook on a module outside the captured regions is harmless."""
    model = tiny_audio_model(vision_batch_size=16)
    vision_model = tiny_vision_model()
    model.vpm, model.resampler = vision_model.vpm, vision_model.resampler
    model._init_encoder_cuda_graphs(vllm_configs["graphs"])
    vision, audio = model.vpm._encoder_graph, model._audio_encoder_graph
    vision.backend, audio.backend = cpu_backend(), cpu_backend()
    model.vpm.embeddings.register_forward_hook(lambda *args: None)  # never the region's own module
    model.vpm.encoder.layers[1].mlp.fc2.register_forward_hook(lambda *args: None)
    model.audio_projection_layer.register_forward_pre_hook(lambda *args: None)
    pixels = vision_data([(SIDE, SIDE)])
    data = audio_batch()
    with torch.no_grad():
        for _ in range(2):
            model.get_vision_hidden_states(pixels)
            model.get_audio_hidden_states(data)
    assert vision.eager_reason.startswith("module hooks in the captured region: ")
    assert vision.eager_reason.endswith(".encoder.layers.1.mlp.fc2 (forward hook)")
    assert audio.eager_reason == (
        f"module hooks in the captured region: {Model.__name__}.audio_projection_layer (forward_pre hook)"
    )
    assert vision.backend.captures == [] and audio.backend.captures == []


# ---------------------------------------------------------------------------
# vLLM's runner-managed encoder graphs (--compilation-config) do not reach this model
# ---------------------------------------------------------------------------


def _with_compilation(vllm_config, **fields):
    import copy

    vllm_config = copy.copy(vllm_config)
    compilation_config = copy.copy(vllm_config.compilation_config)
    for name, value in fields.items():
        object.__setattr__(compilation_config, name, value)
    object.__setattr__(vllm_config, "compilation_config", compilation_config)
    return vllm_config


def test_runner_managed_encoder_graphs_are_not_implemented_by_either_model_class():
    """The fact the warning rests on: vLLM's runner builds its manager only for a model with
    ``supports_encoder_cudagraph``, and neither MiniCPM-o 4.5 class (thinker, serving wrapper) has it."""
    from vllm.model_executor.models.interfaces import supports_encoder_cudagraph

    omni = pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni")
    for cls in (Model, omni.MiniCPMO45OmniForConditionalGeneration):
        assert not getattr(cls, "supports_encoder_cudagraph", False)
        assert not supports_encoder_cudagraph(cls)


def test_cudagraph_mm_encoder_warns_that_it_does_not_apply(vllm_configs, log_records):
    vllm_config = _with_compilation(
        vllm_configs["graphs"], cudagraph_mm_encoder=True, encoder_cudagraph_token_budgets=[1024, 2048]
    )
    records = log_records(llm.encoder_graphs.logger)
    model = bare_model(SimpleNamespace())
    model._init_encoder_cuda_graphs(vllm_config)
    assert isinstance(model.vpm._encoder_graph, adapter_mod.EncoderCudaGraph)  # the adapters still build
    warnings = records.messages(logging.WARNING)
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "--compilation-config sets cudagraph_mm_encoder=true, encoder_cudagraph_token_budgets=[1024, 2048], "
    )
    assert "does not implement SupportsEncoderCudaGraph" in warnings[0]
    assert "--hf-overrides (encoder_cuda_graph*)" in warnings[0]


def test_default_compilation_config_gives_no_warning(vllm_configs, log_records):
    records = log_records(llm.encoder_graphs.logger)
    bare_model(SimpleNamespace())._init_encoder_cuda_graphs(vllm_configs["graphs"])
    assert records.messages(logging.WARNING) == []
    assert llm.encoder_graphs.runner_encoder_graph_settings(Model, vllm_configs["graphs"]) == []


def test_runner_settings_are_not_reported_for_a_model_that_implements_the_protocol(vllm_configs):
    vllm_config = _with_compilation(vllm_configs["graphs"], cudagraph_mm_encoder=True)

    from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph

    class Implements(torch.nn.Module, SupportsEncoderCudaGraph):
        pass

    settings = llm.encoder_graphs.runner_encoder_graph_settings
    assert settings(Implements(), vllm_config) == []
    assert settings(torch.nn.Module(), vllm_config) == ["cudagraph_mm_encoder=true"]
