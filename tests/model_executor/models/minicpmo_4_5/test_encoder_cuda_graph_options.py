# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the ``--hf-overrides`` registry and the adapter's options: types, ranges,
unknown and look-alike keys, one error for all problems, the factory's per-encoder state
and the LoRA rule."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

BAD_OPTIONS = [
    ("encoder_cuda_graph", "false", "JSON boolean"),
    ("encoder_cuda_graph", 1, "JSON boolean"),
    ("encoder_cuda_graph_share_pools", "true", "JSON boolean"),
    ("encoder_cuda_graph_max_graphs", True, "integer >= 0"),
    ("encoder_cuda_graph_max_graphs", -1, "integer >= 0"),
    ("encoder_cuda_graph_max_graphs", 2.0, "integer >= 0"),
    ("encoder_cuda_graph_min_capture_calls", 1, "integer >= 2"),
    ("encoder_cuda_graph_min_capture_calls", 2.5, "integer >= 2"),
    ("encoder_cuda_graph_min_free_bytes", -1, "integer >= 0"),
    ("encoder_cuda_graph_min_free_bytes", "1GiB", "integer >= 0"),
]


@pytest.mark.parametrize("key,value,allowed", BAD_OPTIONS)
def test_bad_hf_override_names_key_value_and_allowed(ecg, key, value, allowed):
    hf_config = types.SimpleNamespace(**{key: value})
    with pytest.raises(ValueError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(hf_config)
    message = str(info.value)
    assert key in message and json.dumps(value) in message and allowed in message


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("encoder_cuda_graph_max_graphs", "4", 'encoder_cuda_graph_max_graphs="4": got a string, expected an integer >= 0 and <= 1024'),
        ("encoder_cuda_graph_max_graphs", True, "encoder_cuda_graph_max_graphs=true: got a boolean, expected an integer >= 0 and <= 1024"),
        ("encoder_cuda_graph_max_graphs", 2.0, "encoder_cuda_graph_max_graphs=2.0: got a float, expected an integer >= 0 and <= 1024"),
        ("encoder_cuda_graph_max_graphs", None, "encoder_cuda_graph_max_graphs=null: got null, expected an integer >= 0 and <= 1024"),
        ("encoder_cuda_graph_min_capture_calls", 1, "encoder_cuda_graph_min_capture_calls=1: got an integer, expected an integer >= 2 and <= 10000"),
        ("encoder_cuda_graph", "false", 'encoder_cuda_graph="false": got a string, expected a JSON boolean (true or false)'),
        ("encoder_cuda_graph_share_pools", [1], "encoder_cuda_graph_share_pools=[1]: got an array, expected a JSON boolean (true or false)"),
    ],
)  # fmt: skip
def test_message_names_key_json_value_type_received_and_allowed(ecg, key, value, expected):
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(types.SimpleNamespace(**{key: value}))
    assert info.value.problems == [expected]
    assert isinstance(info.value, ValueError)


#: (key, lowest allowed, highest allowed, just below, just above, the range as the error states it)
BOUNDS = [
    ("encoder_cuda_graph_max_graphs", 0, 1024, -1, 1025, "an integer >= 0 and <= 1024"),
    ("encoder_cuda_graph_min_capture_calls", 2, 10_000, 1, 10_001, "an integer >= 2 and <= 10000"),
    ("encoder_cuda_graph_min_free_bytes", 0, 1 << 40, -1, (1 << 40) + 1,
     "an integer >= 0 and <= 1099511627776 (1 TiB)"),
    ("encoder_cuda_graph_max_bytes", 0, 1 << 40, -1, (1 << 40) + 1, "an integer >= 0 and <= 1099511627776 (1 TiB)"),
    ("encoder_cuda_graph_log_interval_s", 0, 86_400, -0.001, 86_400.001, "a number >= 0 and <= 86400"),
]  # fmt: skip


@pytest.mark.parametrize("key, low, high, below, above, allowed", BOUNDS)
def test_numeric_keys_are_bounded_on_both_sides(ecg, key, low, high, below, above, allowed):
    """Each end of the range is accepted, the value just past it is refused with the range."""
    for inside in (low, high):
        assert ecg.read_hf_overrides(types.SimpleNamespace(**{key: inside}))[key] == inside
    for outside in (below, above):
        with pytest.raises(ecg.HfOverridesError) as info:
            ecg.EncoderCudaGraphOptions.from_hf_config(types.SimpleNamespace(**{key: outside}))
        kind = "a float" if isinstance(outside, float) else "an integer"
        assert info.value.problems == [f"{key}={json.dumps(outside)}: got {kind}, expected {allowed}"]


def test_every_numeric_key_has_a_maximum(ecg):
    numeric = [spec for spec in ecg.HF_OVERRIDE_KEYS.values() if spec.kind in ("int", "number")]
    assert {spec.name for spec in numeric} == {row[0] for row in BOUNDS}
    assert all(spec.minimum <= spec.default <= spec.maximum for spec in numeric)
    with pytest.raises(ValueError, match="needs a maximum"):
        ecg.HfOverrideKey(name="encoder_cuda_graph_x", kind="int", default=1, minimum=0, doc="d")
    with pytest.raises(ValueError, match="needs a maximum"):
        ecg.HfOverrideKey(
            name="encoder_cuda_graph_x", kind="number", default=1, minimum=2, maximum=1, doc="d"
        )


@pytest.mark.parametrize(
    "key",
    [
        "encoder_cuda_graph_min_capture_calls",
        "encoder_cuda_graph_max_bytes",
        "encoder_cuda_graph_log_interval_s",
    ],
)
@pytest.mark.parametrize("value", [10**30, 10**400])
def test_huge_values_are_refused_with_the_range(ecg, key, value):
    """``10**30`` capture calls would never capture; ``10**400`` (JSON has no integer limit) does not
    fit a float: both are refused, naming the range, instead of being accepted or crashing."""
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(types.SimpleNamespace(**{key: value}))
    [problem] = info.value.problems
    assert problem.startswith(f"{key}={value}: got an integer, expected ")
    assert problem.endswith(ecg.HF_OVERRIDE_KEYS[key].allowed) and " and <= " in problem


def test_values_the_wiring_derives_may_pass_the_user_maximum(ecg, vllm_config):
    """The maximum bounds what a user writes; the streaming audio adapter's cap is ``max_graphs``
    times its past lengths (30 at the defaults), built with ``dataclasses.replace`` and passed to
    the adapter, so direct construction checks the type and the minimum only."""
    import dataclasses

    options = ecg.EncoderCudaGraphOptions.from_hf_config(
        types.SimpleNamespace(encoder_cuda_graph_max_graphs=1024)
    )
    derived = dataclasses.replace(options, max_graphs=options.max_graphs * 30, admission="count")
    assert derived.max_graphs == 30720
    adapter = ecg.EncoderCudaGraph(torch.neg, vllm_config, max_graphs=30720, admission="count")
    assert adapter.options.max_graphs == 30720 and adapter.admission.max_graphs == 30720
    with pytest.raises(ecg.HfOverridesError) as info:
        dataclasses.replace(options, max_graphs=-1)
    assert info.value.problems == [
        "encoder_cuda_graph_max_graphs=-1: got an integer, expected an integer >= 0"
    ]




def test_every_bad_key_is_reported_in_one_error(ecg):
    hf_config = types.SimpleNamespace(
        encoder_cuda_graph="false",
        encoder_cuda_graph_max_graphs="4",
        encoder_cuda_graph_min_free_bytes=-1,
        encoder_cuda_graph_max_graph=8,
        encoder_cuda_graph_min_capture_calls=3,  # valid: not reported
    )
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(hf_config)
    problems = info.value.problems
    assert len(problems) == 4
    assert [p.split("=")[0] for p in problems] == [
        "encoder_cuda_graph",
        "encoder_cuda_graph_max_graphs",
        "encoder_cuda_graph_min_free_bytes",
        "encoder_cuda_graph_max_graph",
    ]
    assert str(info.value).startswith("invalid --hf-overrides for MiniCPM-o 4.5 (4 problems):")
    assert all(p in str(info.value) for p in problems)


def test_direct_construction_reports_every_bad_field(ecg):
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions(enabled=1, max_graphs=-1)
    assert [p.split("=")[0] for p in info.value.problems] == [
        "encoder_cuda_graph",
        "encoder_cuda_graph_max_graphs",
    ]


def test_options_defaults_and_overrides(ecg):
    defaults = ecg.EncoderCudaGraphOptions.from_hf_config(object())
    assert defaults == ecg.EncoderCudaGraphOptions(True, 4, 2, 1 << 30, True, "cost", 0, 60.0)
    assert defaults.streaming_audio is True
    assert defaults.startup_capture is True
    hf_config = types.SimpleNamespace(
        encoder_cuda_graph=False,
        encoder_cuda_graph_max_graphs=0,
        encoder_cuda_graph_min_capture_calls=5,
        encoder_cuda_graph_min_free_bytes=0,
        encoder_cuda_graph_share_pools=False,
        encoder_cuda_graph_streaming_audio=False,
    )
    assert ecg.EncoderCudaGraphOptions.from_hf_config(hf_config) == ecg.EncoderCudaGraphOptions(
        enabled=False,
        max_graphs=0,
        min_capture_calls=5,
        min_free_bytes=0,
        share_pools=False,
        streaming_audio=False,
    )


def test_options_read_from_a_transformers_config(ecg):
    from transformers import PretrainedConfig

    config = PretrainedConfig(encoder_cuda_graph_max_graphs=7)
    assert ecg.EncoderCudaGraphOptions.from_hf_config(config).max_graphs == 7
    with pytest.raises(ValueError, match="encoder_cuda_graph_min_capture_calls"):
        ecg.EncoderCudaGraphOptions.from_hf_config(PretrainedConfig(encoder_cuda_graph_min_capture_calls=0))


def test_adapter_constructor_validates_like_the_options(ecg, vllm_config):
    with pytest.raises(ValueError, match="encoder_cuda_graph_max_graphs"):
        ecg.EncoderCudaGraph(torch.neg, vllm_config, max_graphs=True)
    with pytest.raises(ValueError, match="encoder_cuda_graph_share_pools"):
        ecg.EncoderCudaGraph(torch.neg, vllm_config, share_pools=0)


def test_describe_writes_the_options_as_json(ecg):
    text = ecg.EncoderCudaGraphOptions(share_pools=False, max_graphs=0).describe()
    expected = (
        "encoder_cuda_graph=true encoder_cuda_graph_max_graphs=0 encoder_cuda_graph_min_capture_calls=2 "
        "encoder_cuda_graph_min_free_bytes=1073741824 encoder_cuda_graph_share_pools=false "
        'encoder_cuda_graph_admission="cost" encoder_cuda_graph_max_bytes=0 '
        "encoder_cuda_graph_log_interval_s=60.0"
    )
    expected += " encoder_cuda_graph_streaming_audio=true"
    expected += " encoder_cuda_graph_startup_capture=true"
    assert text == expected


def test_admission_budget_and_log_interval_options(ecg, vllm_config):
    defaults = ecg.EncoderCudaGraphOptions()
    assert (defaults.admission, defaults.max_bytes, defaults.log_interval_s) == ("cost", 0, 60.0)
    hf_config = types.SimpleNamespace(
        encoder_cuda_graph_admission="count",
        encoder_cuda_graph_max_bytes=1 << 30,
        encoder_cuda_graph_log_interval_s=0,
    )
    options = ecg.EncoderCudaGraphOptions.from_hf_config(hf_config)
    assert (options.admission, options.max_bytes, options.log_interval_s) == ("count", 1 << 30, 0)
    adapter, state = ecg.make_encoder_cuda_graph(torch.neg, vllm_config, options, name="vision")
    assert state == "on"
    assert (adapter.options.admission, adapter.options.max_bytes, adapter.options.log_interval_s) == (
        "count",
        1 << 30,
        0,
    )
    bad = types.SimpleNamespace(
        encoder_cuda_graph_admission="lru",
        encoder_cuda_graph_max_bytes=-1,
        encoder_cuda_graph_log_interval_s="60",
    )
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(bad)
    assert info.value.problems == [
        'encoder_cuda_graph_admission="lru": got a string, expected one of "cost", "count"',
        "encoder_cuda_graph_max_bytes=-1: got an integer, expected an integer >= 0 and <= 1099511627776 (1 TiB)",
        'encoder_cuda_graph_log_interval_s="60": got a string, expected a number >= 0 and <= 86400',
    ]
    with pytest.raises(ValueError, match="encoder_cuda_graph_admission"):
        ecg.EncoderCudaGraph(torch.neg, vllm_config, admission="Cost")


# ---------------------------------------------------------------------------
# Unknown and look-alike keys
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ("encoder_cuda_graph_max_graph", "encoder_cuda_graph_max_graphs"),
        ("encoder_cuda_graphs", "encoder_cuda_graph"),
        ("encoder_cudagraph_max_graphs", "encoder_cuda_graph_max_graphs"),  # vLLM-style spelling
        ("encoder_cuda_grph_min_capture_calls", "encoder_cuda_graph_min_capture_calls"),  # no project prefix
        ("encoder_cuda_graph_min_free", "encoder_cuda_graph_min_free_bytes"),
        ("Encoder_Cuda_Graph_Share_Pools", "encoder_cuda_graph_share_pools"),
    ],
)
def test_misspelled_key_fails_with_the_closest_valid_key(ecg, typo, suggestion):
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(types.SimpleNamespace(**{typo: 8}))
    assert info.value.problems == [f"{typo}=8: unknown key, did you mean {suggestion}?"]


def test_names_of_the_model_config_itself_are_not_taken_for_misspellings(ecg):
    """``attn_implementation`` (transformers' key, the unprefixed tail of ``vision_attn_implementation``)
    and the attributes of the config's sub-configurations (Whisper's ``encoder_layers``, one edit from
    ``encoder_fused_layers``) are the model's, at the top level too; a look-alike of a key still fails."""
    from transformers import PretrainedConfig

    audio = PretrainedConfig(encoder_layers=24)
    config = types.SimpleNamespace(audio_config=audio, attn_implementation="sdpa", encoder_layers=24)
    assert ecg.read_hf_overrides(config)["encoder_cuda_graph"] is True
    with pytest.raises(ecg.HfOverridesError, match="did you mean encoder_cuda_graph[?]"):
        ecg.read_hf_overrides(types.SimpleNamespace(audio_config=audio, encoder_cuda_graphs=False))


def test_unknown_prefixed_key_without_a_close_match_lists_the_valid_keys(ecg):
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(types.SimpleNamespace(encoder_cuda_graph_use_the_npu_graph_instead=True))
    (problem,) = info.value.problems
    assert problem.startswith("encoder_cuda_graph_use_the_npu_graph_instead=true: unknown key, valid keys: ")
    assert all(key in problem for key in ecg.HF_OVERRIDE_KEYS)


def test_overrides_applied_the_way_vllm_applies_them_are_checked(ecg):
    """vLLM applies --hf-overrides with ``PretrainedConfig.update``: the keys become attributes."""
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.update({"encoder_cuda_graphs": False, "encoder_cuda_graph_max_graphs": "4"})
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(config)
    assert sorted(p.split(":")[0] for p in info.value.problems) == [
        'encoder_cuda_graph_max_graphs="4"',
        "encoder_cuda_graphs=false",
    ]


def test_model_config_keys_are_not_mistaken_for_overrides(ecg):
    """No false positives on the checkpoint's own keys (MiniCPMOConfig at the checkpoint's values)."""
    pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm")
    from transformers import PretrainedConfig

    from minicpmo_cg.thinker_config import model_module, thinker_config

    for config in (PretrainedConfig(), model_module().MiniCPMOConfig(), thinker_config()):
        assert ecg.read_hf_overrides(config) == {k: spec.default for k, spec in ecg.HF_OVERRIDE_KEYS.items()}


# ---------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------


#: Registered keys that the model file reads itself (``read_hf_overrides``), not the adapter.
MODEL_FILE_KEYS = {"vision_attn_implementation"}
MODEL_FILE_KEYS.add("encoder_fused_layers")


def test_options_fields_are_registry_entries(ecg):
    import dataclasses

    for f in dataclasses.fields(ecg.EncoderCudaGraphOptions):
        spec = ecg.HF_OVERRIDE_KEYS[f.metadata["hf_key"]]
        assert f.default == spec.default and spec.doc
    adapter_keys = {f.metadata["hf_key"] for f in dataclasses.fields(ecg.EncoderCudaGraphOptions)}
    assert adapter_keys | MODEL_FILE_KEYS == set(ecg.HF_OVERRIDE_KEYS)
    assert not adapter_keys & MODEL_FILE_KEYS


def test_vision_attn_implementation_is_registered_and_validated_with_the_rest(ecg):
    spec = ecg.HF_OVERRIDE_KEYS["vision_attn_implementation"]
    assert (spec.kind, spec.default, spec.choices) == (
        "choice",
        "sdpa",
        ("sdpa", "eager", "flash_attention_2"),
    )
    assert ecg.read_hf_overrides(types.SimpleNamespace())["vision_attn_implementation"] == "sdpa"
    for value in spec.choices:
        config = types.SimpleNamespace(vision_attn_implementation=value)
        assert ecg.read_hf_overrides(config)["vision_attn_implementation"] == value
    config = types.SimpleNamespace(vision_attn_implementation="SDPA", encoder_cuda_graph_max_graphs=-1)
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(config)  # the model's first check reports both
    assert info.value.problems == [
        "encoder_cuda_graph_max_graphs=-1: got an integer, expected an integer >= 0 and <= 1024",
        (
            'vision_attn_implementation="SDPA": got a string, expected one of "sdpa", "eager", '
            '"flash_attention_2"'
        ),
    ]
    assert "vision_attn_implementation" not in ecg.EncoderCudaGraphOptions().describe()


@pytest.mark.parametrize(
    "key, good, bad, expected",
    [
        ("vision_attn_implementation", "eager", "sdpa2",
         'vision_attn_implementation="sdpa2": got a string, expected one of "sdpa", "eager", "flash_attention_2"'),
        ("encoder_cuda_graph_admission", "count", 1,
         'encoder_cuda_graph_admission=1: got an integer, expected one of "cost", "count"'),
        ("encoder_cuda_graph_max_bytes", 1 << 40, 1.5,
         "encoder_cuda_graph_max_bytes=1.5: got a float, expected an integer >= 0 and <= 1099511627776 (1 TiB)"),
        ("encoder_cuda_graph_log_interval_s", 0.5, -1,
         "encoder_cuda_graph_log_interval_s=-1: got an integer, expected a number >= 0 and <= 86400"),
        ("encoder_cuda_graph_log_interval_s", 0, True,
         "encoder_cuda_graph_log_interval_s=true: got a boolean, expected a number >= 0 and <= 86400"),
        ("encoder_cuda_graph_log_interval_s", 10, math.nan,
         "encoder_cuda_graph_log_interval_s=NaN: got a float, expected a number >= 0 and <= 86400"),
        ("encoder_cuda_graph", False, "no",
         'encoder_cuda_graph="no": got a string, expected a JSON boolean (true or false)'),
    ],
)  # fmt: skip
def test_registry_kinds(ecg, key, good, bad, expected):
    assert ecg.read_hf_overrides(types.SimpleNamespace(**{key: good}))[key] == good
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(types.SimpleNamespace(**{key: bad}))
    assert info.value.problems == [expected]


@pytest.mark.parametrize(
    "typo, suggestion",
    [("vision_attn_impl", "vision_attn_implementation"), ("vision_attention_implementation", "vision_attn_implementation")],
)  # fmt: skip
def test_look_alikes_of_any_registered_key_fail(ecg, typo, suggestion):
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.read_hf_overrides(types.SimpleNamespace(**{typo: "sdpa"}))
    assert info.value.problems == [f'{typo}="sdpa": unknown key, did you mean {suggestion}?']


def test_registry_entry_with_an_invalid_default_is_refused(ecg):
    with pytest.raises(ValueError, match="default"):
        ecg.HfOverrideKey(name="encoder_cuda_graph_x", kind="int", default=-1, minimum=0, maximum=10, doc="d")
    with pytest.raises(ValueError, match="default"):
        ecg.HfOverrideKey(name="x", kind="choice", default="c", choices=("a", "b"), doc="d")


# ---------------------------------------------------------------------------
# Factory: per-encoder state, LoRA
# ---------------------------------------------------------------------------


def test_factory_builds_nothing_when_disabled_or_enforce_eager(ecg):
    from minicpmo_cg.vllm_config import standalone_vllm_config

    on = ecg.EncoderCudaGraphOptions()
    adapter, state = ecg.make_encoder_cuda_graph(torch.neg, standalone_vllm_config(), on, name="vision")
    assert isinstance(adapter, ecg.EncoderCudaGraph) and adapter.name == "vision" and state == "on"
    eager = standalone_vllm_config(enforce_eager=True)
    assert ecg.make_encoder_cuda_graph(torch.neg, eager, on, name="v") == (None, "off (--enforce-eager)")
    off = ecg.EncoderCudaGraphOptions(enabled=False)
    assert ecg.make_encoder_cuda_graph(torch.neg, standalone_vllm_config(), off, name="v") == (
        None,
        "off (encoder_cuda_graph=false)",
    )


def test_factory_state_with_zero_graphs_is_off_but_counts(ecg, vllm_config):
    adapter, state = ecg.make_encoder_cuda_graph(
        torch.neg, vllm_config, ecg.EncoderCudaGraphOptions(max_graphs=0), name="audio"
    )
    assert state == "off (encoder_cuda_graph_max_graphs=0)"
    assert adapter is not None and adapter.options.max_graphs == 0


def with_lora(vllm_config, **lora_fields):
    import copy

    from vllm.config import LoRAConfig

    config = copy.copy(vllm_config)
    object.__setattr__(config, "lora_config", LoRAConfig(**lora_fields))
    return config


class MappedModel:
    """A model that declares vLLM's multimodal module mapping, as MiniCPM-V does."""

    def get_mm_mapping(self):
        from vllm.model_executor.models.module_mapping import MultiModelKeys

        return MultiModelKeys.from_string_field(
            language_model="llm", connector="resampler", tower_model="vpm"
        )


def test_lora_rule(ecg, vllm_config):
    reach = ecg.lora_may_reach
    vision, audio = ("vpm.encoder", "vpm.post_layernorm"), ("apm", "audio_projection_layer")
    assert reach(vllm_config, object(), vision) is None  # no --enable-lora
    unmapped = with_lora(vllm_config)
    assert "get_mm_mapping" in reach(unmapped, object(), vision)
    assert "get_mm_mapping" in reach(unmapped, object(), audio)
    # with a mapping, towers are opened only by enable_tower_connector_lora, and only their prefixes
    assert reach(unmapped, MappedModel(), vision) is None
    towers = with_lora(vllm_config, enable_tower_connector_lora=True)
    assert (
        reach(towers, MappedModel(), vision) == "LoRA with enable_tower_connector_lora may target vpm.encoder"
    )
    assert reach(towers, MappedModel(), audio) is None


def test_lora_keeps_the_encoder_eager_with_the_reason(ecg, vllm_config):
    config = with_lora(vllm_config)
    reason = ecg.lora_may_reach(config, object(), ("apm",))
    adapter, state = ecg.make_encoder_cuda_graph(
        torch.neg, config, ecg.EncoderCudaGraphOptions(), name="audio", lora_reason=reason
    )
    assert adapter is None
    assert state == f"off ({reason}; a replay would keep the weights live at capture)"
