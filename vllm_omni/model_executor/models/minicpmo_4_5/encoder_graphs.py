# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's encoders wired to the exact-shape CUDA graph adapter, called from the model file's hooks.

A replay re-runs only the GPU work recorded at capture, so the captured regions
(:func:`encode_last_hidden_state`, :func:`encode_audio_features`) must be free of Python side effects;
the adapter refuses to capture when it finds hooks on their modules.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import supports_encoder_cudagraph

from . import fused_layers
from .encoder_cuda_graph import EncoderCudaGraphOptions, lora_may_reach, make_encoder_cuda_graph

logger = init_logger(__name__)

#: The modules the audio regions call, relative to the model.
AUDIO_CAPTURED_MODULES = ("apm", "audio_projection_layer", "audio_avg_pooler")


@dataclass(frozen=True)
class VisionGraphRegion:
    """The part of the image path the vision adapter captures (the model class's ``_vision_graph_region``).

    Attributes:
        forward: dotted attribute of the model naming the bound method the adapter replays.
        captured_modules: the modules that method calls, relative to the module owning it
            (checked for hooks before a capture).
        lora_prefixes: the same modules relative to the model, for :func:`lora_may_reach`.
        needs: further model attributes that must be set (not None) for the adapter to be built.
    """

    forward: str
    captured_modules: tuple[str, ...]
    lora_prefixes: tuple[str, ...]
    needs: tuple[str, ...] = ()




def validate_hf_overrides(hf_config: Any) -> EncoderCudaGraphOptions:
    """The encoder graph options of ``hf_config``, after checking every project key.

    Raises:
        HfOverridesError: (a ``ValueError``) every bad or unknown look-alike key of
            ``--hf-overrides`` (``vision_attn_implementation`` included), at once.
    """
    return EncoderCudaGraphOptions.from_hf_config(hf_config)


def init_encoder_cuda_graphs(model: nn.Module, vllm_config: Any) -> EncoderCudaGraphOptions:
    """Attach the exact-shape CUDA graph adapters to the vision and audio encoders of ``model``.

    Returns:
        The validated options.

    Raises:
        HfOverridesError: (a ``ValueError``) every bad or unknown ``encoder_cuda_graph*`` key in
            ``--hf-overrides``, at once.
    """
    options = EncoderCudaGraphOptions.from_hf_config(model.config)
    vpm = getattr(model, "vpm", None)
    apm = getattr(model, "apm", None)
    region: VisionGraphRegion = model._vision_graph_region
    vision_state = audio_state = "off (no encoder)"
    needed = (getattr(model, name, None) for name in region.needs)
    if vpm is not None and all(x is not None for x in needed):
        vpm._encoder_graph, vision_state = make_encoder_cuda_graph(
            operator.attrgetter(region.forward)(model),
            vllm_config,
            options,
            name="vision",
            captured_modules=region.captured_modules,
            lora_reason=lora_may_reach(vllm_config, model, region.lora_prefixes),
        )
    model._audio_encoder_graph = None
    if apm is not None:
        model._audio_encoder_graph, audio_state = make_encoder_cuda_graph(
            model._encode_audio_features,
            vllm_config,
            options,
            name="audio",
            captured_modules=AUDIO_CAPTURED_MODULES,
            lora_reason=lora_may_reach(vllm_config, model, AUDIO_CAPTURED_MODULES),
        )
    logger.info(
        "MiniCPM-o 4.5 encoder CUDA graphs: vision=%s, audio=%s; %s",
        vision_state,
        audio_state,
        options.describe(),
    )
    ignored = runner_encoder_graph_settings(model, vllm_config)
    if ignored:
        logger.warning(
            "--compilation-config sets %s, which configures vLLM's runner-managed encoder CUDA graphs; "
            "MiniCPM-o 4.5 does not implement SupportsEncoderCudaGraph, so vLLM's model runner builds "
            "none for it and these settings have no effect. Its encoder graphs are the exact-shape "
            'adapters this model builds itself (its "MiniCPM-o 4.5 encoder CUDA graphs" INFO line), set '
            "through --hf-overrides (encoder_cuda_graph*).",
            ", ".join(ignored),
        )
    return options


#: vLLM's ``CompilationConfig`` fields of the runner-managed encoder CUDA graphs, with their defaults.
RUNNER_ENCODER_GRAPH_FIELDS: dict[str, Any] = {
    "cudagraph_mm_encoder": False,
    "encoder_cudagraph_token_budgets": [],
    "encoder_cudagraph_max_vision_items_per_batch": 0,
    "encoder_cudagraph_max_frames_per_batch": None,
}


def runner_encoder_graph_settings(model: nn.Module, vllm_config: Any) -> list[str]:
    """The runner-managed encoder graph settings the user changed that cannot reach ``model``.

    Returns:
        ``["cudagraph_mm_encoder=true", "encoder_cudagraph_token_budgets=[1024]", ...]``: each
        field of :data:`RUNNER_ENCODER_GRAPH_FIELDS` set away from its default, in that order;
        empty when none is, or when ``model`` implements the protocol.
    """
    if supports_encoder_cudagraph(model):
        return []
    compilation_config = getattr(vllm_config, "compilation_config", None)
    changed = []
    for name, default in RUNNER_ENCODER_GRAPH_FIELDS.items():
        value = getattr(compilation_config, name, default)
        if value != default:
            changed.append(f"{name}={json.dumps(value, default=str)}")
    return changed


def encode_last_hidden_state(
    vpm: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """SigLIP's encoder layers + post layernorm (``SiglipVisionTransformer._encode_last_hidden_state``).

    Args:
        vpm: the ``SiglipVisionTransformer``.
        hidden_states: patch embeddings ``(B, N, hidden)`` in the model dtype.
        attention_mask: None (every patch valid), the additive key-padding mask ``(B, 1, 1, N)``
            (eager/sdpa) or the bool mask ``(B, N)`` (FA2).

    Returns:
        ``(B, N, hidden)`` last hidden state, same dtype/device as the input.
    """
    # the fused layers where they apply (fused_layers.siglip_fused_applies)
    if fused_layers.siglip_fused_applies(vpm, hidden_states, attention_mask):
        return fused_layers.siglip_encode(vpm, hidden_states, attention_mask)
    encoder_outputs = vpm.encoder(
        inputs_embeds=hidden_states,
        attention_mask=attention_mask,
        output_attentions=False,
        output_hidden_states=False,
        return_dict=True,
    )
    return vpm.post_layernorm(encoder_outputs.last_hidden_state)




def encode_audio_features(
    model: nn.Module, wavforms: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Whisper encoder -> projection -> average pooling (the model's ``_encode_audio_features``).

    Args:
        model: the MiniCPM-o 4.5 thinker (``apm``, ``audio_projection_layer``,
            ``audio_avg_pooler``, ``audio_encoder_layer``).
        wavforms: log-mel features ``(B, n_mels, T_mel)``.
        attention_mask: additive float mask ``(B, 1, T, T)`` in the encoder's dtype,
            ``T = (T_mel - 1) // 2 + 1``, ``-inf`` where masked.

    Returns:
        ``(B, T // audio_pool_step, embed_dim)`` audio embeddings, before the per-item length
        slicing.
    """
    selects_final_layer = model.audio_encoder_layer == -1
    audio_outputs = model.apm(
        wavforms,
        attention_mask=attention_mask,
        output_hidden_states=not selects_final_layer,
    )
    if selects_final_layer:
        audio_states = audio_outputs.last_hidden_state
    else:
        # Whisper follows the Hugging Face hidden-state ordering: the
        # embedding output, followed by each encoder layer output.
        assert audio_outputs.hidden_states is not None
        audio_states = audio_outputs.hidden_states[model.audio_encoder_layer]
    audio_embeds = model.audio_projection_layer(audio_states)

    audio_embeds = audio_embeds.transpose(1, 2)
    audio_embeds = model.audio_avg_pooler(audio_embeds)
    return audio_embeds.transpose(1, 2)


def encode_audio(model: nn.Module, wavforms: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The stateless audio call of ``get_audio_hidden_states``: ``model._audio_encoder_graph`` or,
    where a graph cannot replay it, ``model._encode_audio_features`` (same arguments and result).
    """
    if (
        model._audio_encoder_graph is not None
        and not model.training
        and model.audio_encoder_layer == -1
        and model.apm.conv1.weight.dtype != torch.float16
    ):
        return model._audio_encoder_graph(wavforms, attention_mask)
    return model._encode_audio_features(wavforms, attention_mask)
