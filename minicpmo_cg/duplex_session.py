"""One full-duplex session's streaming audio calls: a chunk's call arguments and the session's KV cache.

vllm-omni's duplex stage (``MiniCPMO45Stage0DuplexRuntime``, ``minicpmo_4_5/duplex/stage0.py`` in
vllm-omni 0.30.0) encodes a live session's audio one chunk at a time through the thinker's
``get_audio_embedding_streaming(data, use_extra_context=True, prefix_extra_frames=0 if first else 2,
suffix_extra_frames=2)``. Before each call it puts the session's Whisper KV cache into
``thinker.audio_past_key_values`` and afterwards takes the updated one back, so sessions interleave
on one model. :class:`DuplexChunk` is one such call, :class:`DuplexSession` one session's cache
swapped in and out around it, released by :meth:`DuplexSession.close`. Neither reads audio files: the caller gives the log-mel frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Context frames on each side of a chunk (the duplex stage's prefix after the first chunk, and suffix).
CONTEXT_FRAMES = 2


@dataclass(frozen=True)
class DuplexChunk:
    """One ``get_audio_embedding_streaming`` call of a duplex session.

    Attributes:
        features: log-mel frames ``(1, 80, T)`` with the context frames (T = 102 or 104 at 1 s).
        prefix_extra_frames: 0 for a session's first chunk, else :data:`CONTEXT_FRAMES`.
        suffix_extra_frames: :data:`CONTEXT_FRAMES`.
    """

    features: torch.Tensor
    prefix_extra_frames: int
    suffix_extra_frames: int = CONTEXT_FRAMES

    @property
    def data(self) -> dict[str, Any]:
        """The ``data`` argument: ``audio_features`` and ``audio_feature_lens`` (one chunk of T frames)."""
        frames = torch.tensor([self.features.shape[-1]], dtype=torch.int64, device=self.features.device)
        return {"audio_features": self.features, "audio_feature_lens": [frames]}


class DuplexSession:
    """One duplex session: its own Whisper KV cache, swapped into the model around each call.

    Attributes:
        cache: the session's ``audio_past_key_values`` between calls (None before the first).
    """

    def __init__(self) -> None:
        self.cache: Any = None

    def encode(self, model: Any, chunk: DuplexChunk) -> torch.Tensor:
        """``model.get_audio_embedding_streaming`` on ``chunk`` with this session's cache.

        The model's own ``audio_past_key_values`` is restored afterwards, also when the call raises.

        Returns:
            the chunk's embeddings, ``(positions // audio_pool_step, embed_dim)``.
        """
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
