# SPDX-License-Identifier: Apache-2.0
"""Tiny MiniCPM-o 4.5 models for the tests of the model file's encoder CUDA graph wiring, and
stand-ins for the adapters that show which call sites reach them.

The models hold only what the encoder call sites read (SigLIP and the resampler, Whisper with its
projection and pooler, the config), built on the CPU from the model file's classes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from helpers import tiny_encoders

PATCH = 14
SIDE = 4  # image_size 56 / patch 14
HIDDEN, EMBED_V = 64, 32
D_MODEL, EMBED, POOL = 64, 32, 2


def model_module():
    """The model file (``minicpmo_4_5_omni_llm``)."""
    from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm

    return minicpmo_4_5_omni_llm


def wired_model(hook: str):
    """``(model file, adapter package, thinker class)``, for a test module.

    Fails it, naming the model file, when the thinker class lacks ``hook`` (the wiring the module
    tests, e.g. ``"_init_encoder_cuda_graphs"``): a vllm-omni without the change.
    """
    from vllm_omni.model_executor.models.minicpmo_4_5 import encoder_cuda_graph as adapter
    from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm

    model = llm.MiniCPMO45OmniLLMForConditionalGeneration
    if not hasattr(model, hook):
        import pytest

        pytest.fail(f"{llm.__file__} lacks the encoder CUDA graph wiring ({hook})", pytrace=False)
    return llm, adapter, model


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


def tiny_vpm(attn: str = "eager") -> nn.Module:
    """SigLIP at tiny widths (2 layers, 4x4 patches of 14 pixels), eval mode, weights of seed 0."""
    llm = model_module()
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


def tiny_vision_model(attn: str = "eager", vision_batch_size: int = 16) -> nn.Module:
    """A model object holding only what get_vision_hidden_states reads (vpm, resampler, config)."""
    llm = model_module()
    model = object.__new__(llm.MiniCPMO45OmniLLMForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(vision_batch_size=vision_batch_size)
    model.vpm = tiny_vpm(attn)
    model.resampler = llm.Resampler(
        num_queries=4, embed_dim=EMBED_V, num_heads=2, kv_dim=HIDDEN, adaptive=True
    )
    return model.eval()


def vision_data(grids: list[tuple[int, int]]) -> dict:
    """The get_vision_hidden_states argument: slices (3, 14, h*w*14) and tgt_sizes (B, 2)."""
    torch.manual_seed(1)
    pixels = [torch.randn(3, PATCH, h * w * PATCH) for h, w in grids]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(grids, dtype=torch.int32)}


def eager_vision(model, data):
    """``get_vision_hidden_states(data)`` with the vision adapter detached (the eager path)."""
    saved = model.vpm._encoder_graph
    model.vpm._encoder_graph = None
    try:
        with torch.no_grad():
            return model.get_vision_hidden_states(data)
    finally:
        model.vpm._encoder_graph = saved


def tiny_audio_model(**config_overrides) -> nn.Module:
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


def audio_batch(mel_lens=(40, 24), t_mel=40) -> dict:
    """The get_audio_hidden_states argument: ``(B, 80, t_mel)`` features and one length per clip."""
    torch.manual_seed(2)
    wav = torch.randn(len(mel_lens), 80, t_mel)
    return {"audio_features": wav, "audio_feature_lens": [torch.tensor([n]) for n in mel_lens]}


def eager_audio(model, data):
    """``get_audio_hidden_states(data)`` with the stateless audio adapter detached (the eager path)."""
    saved = model._audio_encoder_graph
    model._audio_encoder_graph = None
    try:
        with torch.no_grad():
            return model.get_audio_hidden_states(data)
    finally:
        model._audio_encoder_graph = saved


def bare_model(config, *, vpm: bool = True, apm: bool = True) -> nn.Module:
    """A model object with ``config`` and the tiny encoders asked for (None for the others), not wired."""
    llm = model_module()
    model = object.__new__(llm.MiniCPMO45OmniLLMForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = config
    vision = tiny_vision_model() if vpm else None
    model.vpm = vision.vpm if vpm else None
    model.resampler = vision.resampler if vpm else None
    model.apm = tiny_audio_model().apm if apm else None
    return model


def startup_line(records) -> str:
    """The one start-up line of the encoder graphs among ``records`` (``helpers.logs.LogRecords``)."""
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 encoder CUDA graphs:")]
    return line
