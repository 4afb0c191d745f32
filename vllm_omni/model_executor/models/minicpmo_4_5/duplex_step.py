# SPDX-License-Identifier: Apache-2.0
"""A step's duplex audio appends, encoded together in vllm-omni's ``preprocess_batch`` pre-pass.

vllm-omni's model runner calls ``model.preprocess_batch(req_ids, model_intermediate_buffer,
device)`` once per step before each request's ``preprocess``. :func:`preprocess_batch` collects
the appends its sessions have not prepared, plans each append's chunks as the stage would cut
them, encodes the chunks wave by wave in one :meth:`StreamingAudioEncoder.encode` call each, and
hands each session its ``planned_audio_chunks`` (patch 0011) and cache. A request it leaves alone
(a session's first append, a chunk the forward does not cover) is encoded in its own
``preprocess`` through the same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from .streaming_audio import CONTEXT_FRAMES, StreamingAudioChunk, release_cache

logger = init_logger(__name__)

__all__ = ["PlannedAppend", "collect_appends", "plan_chunks", "preprocess_batch", "release_session"]


@dataclass
class PlannedAppend:
    """One append's chunks: the session state, the processor's features and their chunks."""

    state: Any
    features: list[Any] = field(default_factory=list)
    chunks: list[StreamingAudioChunk] = field(default_factory=list)


def _append_identity(duplex: dict[str, Any]) -> tuple[int | None, int] | None:
    """``(epoch, seq)`` as the stage's ``preprocess`` reads them, or None without a ``seq``."""
    try:
        seq = int(duplex["seq"]) if duplex.get("seq") is not None else None
        epoch = int(duplex["epoch"]) if duplex.get("epoch") is not None else None
    except (TypeError, ValueError):
        return None
    return None if seq is None else (epoch, seq)


def _session(sessions: dict[Any, Any], duplex: dict[str, Any]) -> Any:
    """The stage's session state of ``duplex``: keyed by its id (vllm-omni 0.30) or by id and
    incarnation (0.28); None for a session not created yet."""
    session_id = str(duplex.get("session_id") or "")
    state = sessions.get(session_id)
    if state is None:
        try:
            state = sessions.get((session_id, int(duplex.get("incarnation", 0) or 0)))
        except (TypeError, ValueError):
            return None
    return state


def collect_appends(
    helper: Any, req_ids: Sequence[str], buffer: dict[str, dict[str, Any]]
) -> list[tuple[Any, Any]]:
    """``(state, audio waveform)`` of each scheduled request whose append the pre-pass encodes.

    Args:
        helper: the stage's ``MiniCPMO45Stage0DuplexRuntime``.
        req_ids: the step's requests, in the runner's order.
        buffer: the runner's ``model_intermediate_buffer`` (request id -> its ``req_infos``).
    """
    found = []
    for req_id in req_ids:
        duplex = (buffer.get(req_id) or {}).get("duplex")
        if not isinstance(duplex, dict) or duplex.get("data_plane") is not True:
            continue
        payload, identity = duplex.get("payload"), _append_identity(duplex)
        state = _session(helper.sessions, duplex)
        if state is None or identity is None or not isinstance(payload, dict) or payload.get("video_frames"):
            continue
        if state.prepared_append_identity == identity or state.audio_chunk_idx == 0:
            continue
        try:
            waveform = helper._decode_audio_payload(payload)
        except ValueError:
            continue  # the request's own preprocess reports it
        found.append((state, waveform))
    return found


def plan_chunks(helper: Any, state: Any, waveform: np.ndarray) -> PlannedAppend:
    """The chunks the stage's loop will cut from ``state``'s buffer plus ``waveform``, each turned
    into log-mel frames by the session's streaming processor (which advances, as the stage's own
    call would advance it); the buffer is not changed."""
    processor = helper._configure_streaming_processor(state)
    audio = np.concatenate([state.audio_buffer, np.asarray(waveform, dtype=np.float32)])
    planned, index, start = PlannedAppend(state), state.audio_chunk_idx, 0
    size = helper._streaming_chunk_size(processor)
    while len(audio) - start >= size:
        feature = helper._process_streaming_audio(audio[start : start + size], index, processor=processor)
        mel = feature["audio_features"]
        mel = mel[0] if isinstance(mel, list) else mel
        planned.features.append(feature)
        planned.chunks.append(
            StreamingAudioChunk(torch.as_tensor(mel).reshape(1, *mel.shape[-2:]), CONTEXT_FRAMES)
        )
        start += helper._consumed_audio_samples(index, size, processor=processor)
        index += 1
        size = helper._streaming_chunk_size(processor)
    return planned


def preprocess_batch(
    stage: Any, req_ids: Sequence[str], buffer: dict[str, dict[str, Any]], device: Any
) -> None:
    """The stage model's ``preprocess_batch``: encode the step's duplex appends together (module docstring).

    Raises:
        whatever the encoder raises; nothing was handed out then, and each request's own
        ``preprocess`` encodes its append.
    """
    thinker = getattr(stage, "thinker", None)
    encoder = getattr(thinker, "_streaming_audio", None)
    if getattr(stage, "model_stage", None) != "llm" or encoder is None:
        return
    helper = getattr(stage, "_minicpmo45_duplex_data_plane_helper", None)
    if helper is None:
        return
    appends = collect_appends(helper, req_ids, buffer)
    planned: list[PlannedAppend] = []
    for state, waveform in appends:
        if getattr(state, "planned_audio_chunks", None):
            logger.warning(
                "MiniCPM-o 4.5 duplex session %s: dropping chunks a stage call left unused", state.session_id
            )
            state.planned_audio_chunks.clear()
        planned.append(plan_chunks(helper, state, waveform))
    embeds: list[list[torch.Tensor]] = [[] for _ in planned]
    caches = [p.state.audio_past_key_values for p in planned]
    wave = 0
    with torch.inference_mode():
        while todo := [i for i, p in enumerate(planned) if len(p.chunks) > wave]:
            for i in todo:
                planned[i].chunks[wave].cache = caches[i]
            for i, (out, cache) in zip(
                todo, encoder.encode([planned[i].chunks[wave] for i in todo]), strict=True
            ):
                embeds[i].append(out[0])
                caches[i] = cache
            wave += 1
    for p, out, cache in zip(planned, embeds, caches, strict=True):
        p.state.audio_past_key_values = cache
        p.state.planned_audio_chunks.extend(zip(p.features, out, strict=True))


def release_session(state: Any) -> None:
    """Return a closed session's K/V pages (its ``audio_past_key_values``) to the pool."""
    if state is not None:
        release_cache(getattr(state, "audio_past_key_values", None))
        state.audio_past_key_values = None
