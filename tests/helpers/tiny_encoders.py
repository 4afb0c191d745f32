# SPDX-License-Identifier: Apache-2.0
"""Tiny MiniCPM-o 4.5 encoder pieces for CPU tests, and per-module copy counts from a profile."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn


def tiny_audio_model(
    *,
    positions: int,
    chunk_seconds: float,
    attn: str = "sdpa",
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    embed: int = 32,
    pool: int = 2,
    llm=None,
    **config,
) -> nn.Module:
    """A ``MiniCPMO45OmniLLMForConditionalGeneration`` holding only what the audio paths read.

    Whisper (``layers`` x ``d_model``, ``heads`` heads, ``positions`` rows of position table,
    80 mel bins, attention ``attn``), the projection to ``embed`` and the ``pool``-step average
    pooler; ``config`` carries ``audio_chunk_length=chunk_seconds``, ``audio_pool_step=pool`` and
    ``config``. Weights come from ``torch.manual_seed(0)``, float32 on the CPU, training mode:
    the caller moves, casts and sets the mode. ``llm`` is the model module to take the classes
    from (default: the installed one; a test may pass another version of the module).
    """
    if llm is None:
        from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm

    torch.manual_seed(0)
    whisper = llm.WhisperConfig(
        d_model=d_model,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=4 * d_model,
        num_mel_bins=80,
        max_source_positions=positions,
    )
    whisper._attn_implementation = attn
    model = object.__new__(llm.MiniCPMO45OmniLLMForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(audio_chunk_length=chunk_seconds, audio_pool_step=pool, **config)
    model.vpm = None
    model.apm = llm.MiniCPMWhisperEncoder(whisper)
    model.audio_projection_layer = llm.MultiModalProjector(in_dim=whisper.encoder_ffn_dim // 4, out_dim=embed)
    model.audio_avg_pooler = nn.AvgPool1d(pool, stride=pool)
    model.audio_encoder_layer = -1
    model.audio_past_key_values = None
    return model


def copies_per_region(prof: torch.profiler.profile, regions: Iterable[str], width: int) -> dict[str, int]:
    """``aten::clone`` of a 3-D ``(B, N, width)`` tensor (what ``.contiguous()`` of a strided
    hidden state makes, e.g. in front of LayerNorm) under each ``record_function("region:NAME")``
    range of a CPU profile recorded with ``record_shapes=True``, per ``NAME`` of ``regions``."""
    counts = dict.fromkeys(regions, 0)
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("region:"):
            parent = parent.cpu_parent
        shape = event.input_shapes[0] if event.input_shapes else []
        if parent is not None and event.name == "aten::clone" and len(shape) == 3 and shape[-1] == width:
            counts[parent.name.removeprefix("region:")] += 1
    return counts


def tiny_siglip_config(llm, attn: str, *, hidden=64, heads=4, layers=2, intermediate=128, side=70, patch=14):
    """``llm.SiglipVisionConfig`` at tiny widths with attention ``attn``; ``side`` patches of
    ``patch`` pixels per image side (70 x 14 = 980: the checkpoint's position-bucket grid).
    ``llm`` is the model module to take the class from (default: the installed one)."""
    config = llm.SiglipVisionConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=side * patch,
        patch_size=patch,
    )
    config._attn_implementation = attn
    return config


class ModelConfigTripwire:
    """A ``model_config`` whose only readable attribute is ``hf_config``: model construction that
    reads anything else fails, which shows it went past option validation."""

    def __init__(self, hf_config):
        self.hf_config = hf_config

    def __getattr__(self, name):
        raise AssertionError(f"construction went past option validation: read model_config.{name}")
