"""A full-duplex session's audio path outside vllm-omni's duplex stage: chunk framing, real speech, caches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from minicpmo_cg.duplex_session import CONTEXT_FRAMES, DuplexChunk, DuplexSession

__all__ = [
    "CHUNK_FRAMES",
    "CHUNK_POSITIONS",
    "CONTEXT_FRAMES",
    "DuplexChunk",
    "DuplexInput",
    "DuplexSession",
    "cache_bytes",
    "duplex_input",
    "encode_frame",
    "frame_chunks",
    "past_lengths",
    "speech_mel",
    "stage_frame_data",
]

#: Mel frames per 1 s chunk (10 ms hop).
CHUNK_FRAMES = 100
#: Whisper encoder positions per chunk once the context frames are cut (conv stride 2).
CHUNK_POSITIONS = CHUNK_FRAMES // 2


@dataclass
class DuplexInput:
    """One duplex session's chunks as one input (float32 features on the CPU)."""

    name: str
    source: str
    chunks: list[DuplexChunk]

    modality = "duplex"

    def describe(self) -> str:
        """Input shape for the table: ``chunks x mel frames of a later chunk``."""
        return f"{len(self.chunks)} ch x {self.chunks[-1].features.shape[-1]} mel"

    def on(self, device: Any, dtype: torch.dtype = torch.float32) -> list[DuplexChunk]:
        """The chunks with their features on ``device`` in ``dtype``."""
        return [
            DuplexChunk(
                c.features.to(device=device, dtype=dtype), c.prefix_extra_frames, c.suffix_extra_frames
            )
            for c in self.chunks
        ]


def duplex_input(seconds: int, name: str = "duplex_speech") -> DuplexInput:
    """A :class:`DuplexInput` of ``seconds`` chunks of :func:`speech_mel`."""
    source = f"shipped voices, {seconds} x 1 s chunks framed as the duplex stage frames them"
    return DuplexInput(name, source, frame_chunks(speech_mel(seconds), seconds))


def frame_chunks(
    mel: torch.Tensor, count: int, *, device: Any = "cpu", dtype: torch.dtype = torch.float32
) -> list[DuplexChunk]:
    """The first ``count`` duplex chunks of the log-mel stream ``mel``.

    Raises:
        ValueError: ``mel`` is too short.
    """
    need = count * CHUNK_FRAMES + CONTEXT_FRAMES
    if mel.shape[-1] < need:
        raise ValueError(f"{count} duplex chunks need {need} mel frames, got {mel.shape[-1]}")
    chunks = []
    for i in range(count):
        start = max(0, i * CHUNK_FRAMES - CONTEXT_FRAMES)
        end = (i + 1) * CHUNK_FRAMES + CONTEXT_FRAMES
        features = mel[None, :, start:end].to(device=device, dtype=dtype).contiguous()
        chunks.append(DuplexChunk(features, 0 if i == 0 else CONTEXT_FRAMES))
    return chunks


def speech_mel(seconds: int) -> torch.Tensor:
    """``(80, T)`` log-mel frames of vllm-omni's shipped voices, repeated to cover ``seconds`` chunks."""
    from minicpmo_cg import inputs

    extractor = inputs.make_feature_extractor()
    voices = [
        inputs.mel_features(extractor, inputs.load_wav_16k(inputs.voice_file(stem)))
        for stem in ("default_female", "default_male")
    ]
    stream = torch.cat(voices, dim=-1)
    need = seconds * CHUNK_FRAMES + CONTEXT_FRAMES
    return stream.repeat(1, math.ceil(need / stream.shape[-1]))[:, :need]


def past_lengths(count: int, positions: int = 1500, chunk: int = CHUNK_POSITIONS) -> list[int]:
    """KV past length at each of a session's first ``count`` chunks (the model's reset rule)."""
    lengths, past = [], 0
    for _ in range(count):
        if past + chunk >= positions:
            past = 0
        lengths.append(past)
        past += chunk
    return lengths


def cache_bytes(cache: Any) -> int:
    """Bytes of the K/V tensors a session cache holds (0 for None)."""
    if cache is None:
        return 0
    pool = getattr(cache, "pool", None)
    if pool is not None:
        return pool.positions(cache).numel() * pool.kv.element_size()
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", [])
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def stage_frame_data(
    pixel_values: list[torch.Tensor], tgt_sizes: torch.Tensor, *, device: Any, dtype: torch.dtype
) -> dict[str, Any]:
    """A camera frame's ``get_vision_hidden_states`` argument as the duplex stage builds it."""
    with torch.inference_mode(False):
        return {
            "pixel_values": [p.to(device=device, dtype=dtype) for p in pixel_values],
            "tgt_sizes": tgt_sizes.reshape(-1, 2).to(device=device, dtype=torch.int64),
        }


def encode_frame(model: Any, data: dict[str, Any]) -> torch.Tensor:
    """The duplex stage's vision call: ``get_vision_hidden_states`` under ``torch.no_grad()``."""
    with torch.inference_mode(False), torch.no_grad():
        return model.get_vision_hidden_states(data)
