# SPDX-License-Identifier: Apache-2.0
"""``vision_attn_implementation`` among the encoder CUDA graph ``--hf-overrides`` keys.

The adapter's option registry validates SigLIP's key together with its own: a bad value is reported
exactly as ``siglip_attention`` reports it alone, and model construction lists it with the other bad
keys in one error, before anything heavy is built.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.tiny_encoders import ModelConfigTripwire

from vllm_omni.model_executor.models.minicpmo_4_5 import encoder_cuda_graph as adapter_mod
from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm
from vllm_omni.model_executor.models.minicpmo_4_5 import siglip_attention as sa

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.mark.parametrize("value", ["SDPA", "flash_attention_3", "flex_attention", "", None, True, 1])
def test_the_registry_reports_a_bad_value_as_siglip_attention_does(value):
    # the registry takes the key's definition from siglip_attention.py
    entry = adapter_mod.HF_OVERRIDE_KEYS[sa.VISION_ATTN_KEY]
    assert (entry.choices, entry.default, entry.doc) == (
        sa.VISION_ATTN_CHOICES,
        sa.VISION_ATTN_DEFAULT,
        sa.VISION_ATTN_DOC,
    )
    with pytest.raises(adapter_mod.HfOverridesError) as combined:
        adapter_mod.read_hf_overrides(SimpleNamespace(vision_attn_implementation=value))
    assert combined.value.problems == [sa.vision_attn_problem(value)]


def test_bad_value_fails_construction_with_the_other_bad_keys():
    hf_config = SimpleNamespace(vision_attn_implementation="sdpa2", encoder_cuda_graph="false")
    with pytest.raises(adapter_mod.HfOverridesError) as info:
        llm.MiniCPMO45OmniLLMForConditionalGeneration(
            vllm_config=SimpleNamespace(model_config=ModelConfigTripwire(hf_config))
        )
    assert [p.split("=")[0] for p in info.value.problems] == [
        "encoder_cuda_graph",
        "vision_attn_implementation",
    ]
