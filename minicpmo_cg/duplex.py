"""A full-duplex session's audio path outside vllm-omni's duplex stage: chunk framing, real speech, caches.

vllm-omni's duplex stage (``MiniCPMO45Stage0DuplexRuntime``, ``minicpmo_4_5/duplex/stage0.py`` in
vllm-omni 0.30.0) encodes a live session's audio one 1 s chunk at a time through the thinker's
``get_audio_embedding_streaming``, with the session's Whisper KV cache swapped into the model around
each call. The call and the swap (:class:`DuplexChunk`, :class:`DuplexSession`, :data:`CONTEXT_FRAMES`)
are :mod:`minicpmo_cg.duplex_session`'s, re-exported here; this module adds, for standalone runs and
the tests:

- :func:`frame_chunks` cuts a log-mel stream into the stage's chunks: chunk ``i`` covers frames
  ``[100 i, 100 i + 100)`` plus :data:`CONTEXT_FRAMES` frames of context on each side (none before
  the first chunk), so a chunk is 102 (first) or 104 mel frames, 50 encoder positions after the
  context is cut, 10 embeddings after pooling. (The checkpoint's streaming mel processor computes
  the frames incrementally; the shapes, and so the encoder's work, are the same.)
- :func:`speech_mel` is such a stream from the speech files vllm-omni ships.
- :func:`cache_bytes` is what a session's cache holds.
- :func:`encode_frame` is the stage's vision call for a camera frame (``_encode_processed_vision``):
  ``get_vision_hidden_states`` under ``torch.no_grad()``.
- :func:`stage_frame_data` is that call's argument: the processed frame's slices in the model dtype,
  ``tgt_sizes`` as int64.

A session's cache resets when past + new positions would reach the position table's 1500 rows:
before its 30th chunk (:func:`past_lengths`).
"""

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
    """One duplex session's chunks as one input (float32 features on the CPU).

    Attributes:
        name: table label.
        source: where the audio comes from.
        chunks: the session's chunks, in order.
    """

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

    Args:
        mel: ``(n_mels, T)`` frames, ``T >= count * CHUNK_FRAMES + CONTEXT_FRAMES``.
        count: chunks (seconds).
        device, dtype: of the chunks' features.

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
    """``(80, T)`` log-mel frames of vllm-omni's shipped voices, repeated to cover ``seconds`` chunks.

    Each voice file (``default_female``, ``default_male``) goes through Whisper's feature extractor
    as MiniCPM-o's processor runs it (:func:`minicpmo_cg.inputs.mel_features`); the streams are
    concatenated and repeated until ``seconds`` chunks and their trailing context fit.
    """
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
    """KV past length at each of a session's first ``count`` chunks (the model's reset rule).

    ``get_audio_embedding_streaming`` drops a cache whose length plus the chunk's positions
    reaches ``positions`` (the position table's rows): 0, 50, ..., 1400, then 0 again.
    """
    lengths, past = [], 0
    for _ in range(count):
        if past + chunk >= positions:
            past = 0
        lengths.append(past)
        past += chunk
    return lengths


def cache_bytes(cache: Any) -> int:
    """Bytes of the K/V tensors a session cache holds (0 for None).

    Reads the paged path's ``streaming_audio.SessionAudioCache`` (its positions in its pool) and the
    eager path's ``EncoderDecoderCache`` (the self-attention ``DynamicCache``'s layers).
    """
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
    """A camera frame's ``get_vision_hidden_states`` argument as the duplex stage builds it.

    ``MiniCPMO45Stage0DuplexRuntime._encode_processed_vision`` moves the processed frame's slices to
    the vision tower's device and dtype and ``tgt_sizes`` to int64; the tensors are normal (not
    inference) tensors, made outside ``torch.inference_mode``.

    Args:
        pixel_values: the frame's slices ``(3, 14, 14 * h_i * w_i)`` (one for a 448x448 frame).
        tgt_sizes: ``(slices, 2)`` patch grids.
        device, dtype: the vision tower's.
    """
    with torch.inference_mode(False):
        return {
            "pixel_values": [p.to(device=device, dtype=dtype) for p in pixel_values],
            "tgt_sizes": tgt_sizes.reshape(-1, 2).to(device=device, dtype=torch.int64),
        }


def encode_frame(model: Any, data: dict[str, Any]) -> torch.Tensor:
    """The duplex stage's vision call: ``get_vision_hidden_states`` under ``torch.no_grad()``.

    The stage runs it outside ``torch.inference_mode``, so this leaves any enclosing inference mode
    first. Returns ``(slices, query_num, hidden_size)``.
    """
    with torch.inference_mode(False), torch.no_grad():
        return model.get_vision_hidden_states(data)
