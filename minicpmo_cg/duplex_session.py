"""One full-duplex session's streaming audio calls: a chunk's call arguments and the session's KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Context frames on each side of a chunk (the duplex stage's prefix after the first chunk, and suffix).
CONTEXT_FRAMES = 2


@dataclass(frozen=True)
class DuplexChunk:
    """One ``get_audio_embedding_streaming`` call of a duplex session."""

    features: torch.Tensor
    prefix_extra_frames: int
    suffix_extra_frames: int = CONTEXT_FRAMES

    @property
    def data(self) -> dict[str, Any]:
        """The ``data`` argument: ``audio_features`` and ``audio_feature_lens`` (one chunk of T frames)."""
        frames = torch.tensor([self.features.shape[-1]], dtype=torch.int64, device=self.features.device)
        return {"audio_features": self.features, "audio_feature_lens": [frames]}


class DuplexSession:
    """One duplex session: its own Whisper KV cache, swapped into the model around each call."""

    def __init__(self) -> None:
        self.cache: Any = None

    def encode(self, model: Any, chunk: DuplexChunk) -> torch.Tensor:
        """``model.get_audio_embedding_streaming`` on ``chunk`` with this session's cache."""
        previous = model.audio_past_key_values
        model.audio_past_key_values = self.cache
        try:
            out = model.get_audio_embedding_streaming(
                chunk.data,
                use_extra_context=True,
                prefix_extra_frames=chunk.prefix_extra_frames,
                suffix_extra_frames=chunk.suffix_extra_frames,
            )
            self.cache = model.audio_past_key_values
        finally:
            model.audio_past_key_values = previous
        ((embeds,),) = out
        return embeds

    def close(self) -> None:
        """End the session: its cache's K/V pages go back to their pool (the paged path's cache;
        the duplex stage does the same when a session's request finishes)."""
        pool = getattr(self.cache, "pool", None)
        if pool is not None:
            pool.release(self.cache)
        self.cache = None
