# SPDX-License-Identifier: Apache-2.0
"""Audio clip lengths for MiniCPM-o 4.5's Whisper call sites, kept on the host.

Cutting the encoder output at a length held in a device tensor makes the host wait for the GPU.
The stateless call gets ``audio_feature_lens`` on the CPU (:func:`host_values`, :func:`mask_lengths`,
:func:`embedding_counts`); the streaming chunk call takes its count from the output's shape
(:func:`streaming_embedding_count`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "embedding_counts",
    "host_values",
    "mask_lengths",
    "pooled_lengths",
    "streaming_embedding_count",
    "to_device",
]


def host_values(lengths: Sequence[torch.Tensor] | torch.Tensor) -> list[int] | None:
    """The mel-frame lengths as Python integers when every tensor is on the CPU, else None.

    Args:
        lengths: ``audio_feature_lens`` as the call sites take it: a tensor ``(clips, chunks)``
            or a sequence of 1-D tensors (chunks of one clip each), integer dtype.

    Returns:
        The lengths flattened in the order ``torch.hstack`` flattens them, or None when any of
        them lives on another device (reading it there would wait for the device).
    """
    parts = lengths.unbind(0) if isinstance(lengths, torch.Tensor) else lengths
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in parts):
        return None
    return [int(v) for t in parts for v in t.reshape(-1).tolist()]


def pooled_lengths(frames: Sequence[int], pool_step: int) -> list[int]:
    """Embedding counts of clips of ``frames`` mel frames, as the model's
    ``_get_feat_extract_output_lengths`` computes them, on the host."""
    return [((n - 1) // 2 + 1 - pool_step) // pool_step + 1 for n in frames]


def to_device(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``lengths`` (a CPU tensor) on ``device``, copied without making the host wait."""
    if device.type == "cpu":
        return lengths
    return lengths.pin_memory().to(device, non_blocking=True)


def mask_lengths(lengths: torch.Tensor, host: list[int] | None, device: torch.device) -> torch.Tensor:
    """``lengths`` (``torch.hstack`` of ``audio_feature_lens``) where the attention mask is built:
    on ``device`` (a queued copy, :func:`to_device`) when they came on the host (``host`` is
    :func:`host_values`' result), else where they are (the mask is built on their device).
    """
    return lengths if host is None else to_device(lengths, device)


def embedding_counts(model: Any, counts: torch.Tensor, host: list[int] | None) -> list[int] | torch.Tensor:
    """Each clip chunk's embedding count as Python integers from ``host`` (nothing is read), else
    ``counts`` (the model's ``_get_feat_extract_output_lengths``, a tensor the caller reads)."""
    if host is not None:
        return pooled_lengths(host, model.config.audio_pool_step)
    return counts


def streaming_embedding_count(
    embeds: torch.Tensor, lengths: Sequence[torch.Tensor] | torch.Tensor, pool_step: int
) -> int:
    """Embeddings of one streaming (duplex) chunk: every one the encoder produced.

    Args:
        embeds: the encoder output ``(1, n, embed_dim)``.
        lengths: the chunk's ``audio_feature_lens``; checked when on the host, else not read.
        pool_step: the model's ``audio_pool_step``.

    Raises:
        ValueError: host lengths that would cut the output, i.e. a padded chunk (its padding
            would be in the session's KV cache).
    """
    count = int(embeds.shape[1])
    host_frames = host_values(lengths)
    if host_frames is not None:
        short = [n for n in pooled_lengths(host_frames, pool_step) if n < count]
        if short:
            raise ValueError(
                f"streaming audio chunk with audio_feature_lens {host_frames} shorter than its "
                f"{count} encoder embeddings: a streaming chunk must not be padded (every frame it "
                "carries goes into the session's Whisper KV cache)"
            )
    return count
