# SPDX-License-Identifier: Apache-2.0
"""Start-up capture: the encoder CUDA graphs every duplex session needs, captured before serving.

Lazily, a duplex session's chunks meet uncaptured graphs one past length after the other during
its first cache cycle (a capture per chunk, tens of ms each, on the session's critical path), and
so does every new worker. The forms are known in advance: MiniCPM-o 4.5's duplex stage sends each
session's audio as 1 s chunks (the first with no left context, the later ones with
:data:`STAGE_CONTEXT_FRAMES` on each side) whose Whisper KV past length walks ``0, n, 2n, ...``
until the position table's rows are reached and the cache resets; and a camera frame is one
448x448 slice. :func:`capture_at_startup` walks one synthetic session through the model's own
call path (``get_audio_embedding_streaming``, then ``get_vision_hidden_states`` for one frame)
with the adapters' calls turned into :func:`~.encoder_cuda_graph.capture_now`, so every graph has
exactly the key a real session's call will have (shapes, dtypes, static arguments, replay
stream), and the session's first chunks are replays.
With batched duplex steps (``duplex_batch.py``, opt-in: ``encoder_cuda_graph_duplex_batch``) the
batched forward's graphs are captured too, one per batch bucket, on padding rows that touch only
scratch K/V pages.

vllm-omni's AR model runner calls it from ``capture_model`` (the worker's warm-up, after vLLM's
memory profiling sized the KV cache), through the stage model's ``capture_graphs_at_startup``. Its
bytes are added to the bytes ``capture_model`` reports, which vLLM's start-up line about the KV
cache size (``--kv-cache-memory`` suggestion) counts; the KV cache itself was sized before, so the
graphs come out of the memory vLLM leaves free below ``--gpu-memory-utilization``: the INFO line
gives the exact bytes to subtract. Before each capture the free memory must be at least
``encoder_cuda_graph_min_free_bytes``; below it the capture stops with one WARNING and the rest is
captured lazily, as without start-up capture. ``encoder_cuda_graph_startup_capture: false`` turns
it off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from .encoder_cuda_graph import EncoderCudaGraph, EncoderCudaGraphOptions, capture_now

logger = init_logger(__name__)

__all__ = [
    "STAGE_CONTEXT_FRAMES",
    "ChunkForm",
    "StartupCapture",
    "capture_at_startup",
    "duplex_chunk_forms",
    "is_duplex_deployment",
]

#: Mel frames of context the duplex stage frames each chunk with (``prefix_extra_frames`` after a
#: session's first chunk, ``suffix_extra_frames`` always): ``MiniCPMO45Stage0DuplexRuntime``.
STAGE_CONTEXT_FRAMES = 2
#: dtype of the log-mel features the duplex stage passes (its processor's float32 output, moved to
#: the device as is; the encoder casts inside the graph).
STAGE_MEL_DTYPE = torch.float32
#: dtype of ``tgt_sizes`` the duplex stage passes for a camera frame.
STAGE_TGT_DTYPE = torch.int64


@dataclass(frozen=True)
class ChunkForm:
    """One streaming chunk call of a duplex session: its framing and the KV past length it meets.

    Attributes:
        prefix_extra_frames: 0 for a session's first chunk, else :data:`STAGE_CONTEXT_FRAMES`.
        mel_frames: log-mel frames of the chunk, context included.
        past_length: cached positions when the chunk is encoded (after a reset: 0).
    """

    prefix_extra_frames: int
    mel_frames: int
    past_length: int


def duplex_chunk_forms(positions: int, max_positions: int) -> list[ChunkForm]:
    """The chunk calls of one synthetic session that meet every graph key a duplex session has.

    A session's first chunk (no left context) at past 0, then the steady chunk at every past
    length until ``get_audio_embedding_streaming`` resets the cache (past + ``positions`` would
    reach ``max_positions``), and the steady chunk at past 0 after that reset.

    Args:
        positions: encoder positions per chunk (50 at 1 s).
        max_positions: rows of Whisper's position table (1500).

    Returns:
        ``1 + ceil((max_positions - positions) / positions)`` forms (30 at 1 s and 1500 rows).

    Raises:
        ValueError: ``positions`` not in ``[1, max_positions)``.
    """
    if not 0 < positions < max_positions:
        raise ValueError(f"chunk positions {positions} must be in [1, {max_positions})")
    frames = 2 * positions + STAGE_CONTEXT_FRAMES
    forms = [ChunkForm(0, frames, 0)]
    past = positions
    while past + positions < max_positions:
        forms.append(ChunkForm(STAGE_CONTEXT_FRAMES, frames + STAGE_CONTEXT_FRAMES, past))
        past += positions
    forms.append(ChunkForm(STAGE_CONTEXT_FRAMES, frames + STAGE_CONTEXT_FRAMES, 0))
    assert len(forms) == 1 + math.ceil((max_positions - positions) / positions)
    return forms


def is_duplex_deployment(vllm_config: Any) -> bool:
    """Whether this engine serves duplex sessions (vllm-omni's ``model_config.session_mode``)."""
    return getattr(getattr(vllm_config, "model_config", None), "session_mode", "turn") == "duplex"


@dataclass
class StartupCapture:
    """What a start-up capture did: graphs per encoder, bytes, seconds, why it stopped early."""

    graphs: dict[str, int] = field(default_factory=dict)
    graph_bytes: int = 0
    #: the streaming K/V arena and the batched path's K/V pages it allocated
    arena_bytes: int = 0
    seconds: float = 0.0
    #: why capture stopped before the end (the memory floor), or None
    stopped: str | None = None
    #: calls whose graph was not captured, by outcome (e.g. ``{"capacity": 2}``)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.graph_bytes + self.arena_bytes

    @property
    def num_graphs(self) -> int:
        return sum(self.graphs.values())


class _CaptureNow:
    """Stands in for an adapter during start-up: each call captures its key now (below the floor,
    it stops capturing and runs the forward eagerly)."""

    def __init__(self, adapter: EncoderCudaGraph, name: str, report: StartupCapture, floor: int) -> None:
        self.adapter, self.name, self.report, self.floor = adapter, name, report, floor
        self.known = set(adapter.graphs)

    def __call__(self, *inputs: Any) -> torch.Tensor:
        adapter = self.adapter
        if self.report.stopped is not None:
            return adapter.forward(*inputs)
        device = adapter.backend.eligible_device(inputs)
        if device is not None and self.floor:
            free = adapter.backend.free_bytes(device)
            if free < self.floor:
                self.report.stopped = (
                    f"{free} bytes free on {device}, below encoder_cuda_graph_min_free_bytes={self.floor}"
                )
                return adapter.forward(*inputs)
        out, outcome = capture_now(adapter, *inputs)
        if outcome == "captured":
            self.report.graphs[self.name] = self.report.graphs.get(self.name, 0) + 1
        elif outcome != "present":
            self.report.skipped[outcome] = self.report.skipped.get(outcome, 0) + 1
        return out

    def new_bytes(self) -> int:
        return sum(info.total_bytes for key, info in self.adapter.graph_info.items() if key not in self.known)


def _streaming_session(thinker: Any, proxy: _CaptureNow) -> None:
    """One synthetic duplex session through ``get_audio_embedding_streaming``: every chunk form."""
    apm = thinker.apm
    device = apm.conv1.weight.device
    positions = max(1, round(50 * getattr(thinker.config, "audio_chunk_length", 1.0)))
    forms = duplex_chunk_forms(positions, apm.embed_positions.weight.shape[0])
    saved_graph, saved_cache = thinker._streaming_audio_encoder_graph, thinker.audio_past_key_values
    thinker._streaming_audio_encoder_graph, thinker.audio_past_key_values = proxy, None
    try:
        for form in forms:
            if proxy.report.stopped is not None:
                break
            mel = torch.zeros(
                (1, apm.config.num_mel_bins, form.mel_frames), dtype=STAGE_MEL_DTYPE, device=device
            )
            lens = [torch.tensor([form.mel_frames], dtype=torch.int64, device=device)]
            thinker.get_audio_embedding_streaming(
                {"audio_features": mel, "audio_feature_lens": lens},
                use_extra_context=True,
                prefix_extra_frames=form.prefix_extra_frames,
                suffix_extra_frames=STAGE_CONTEXT_FRAMES,
            )
    finally:
        thinker._streaming_audio_encoder_graph, thinker.audio_past_key_values = saved_graph, saved_cache


def _camera_frame(thinker: Any, proxy: _CaptureNow) -> None:
    """One camera frame through ``get_vision_hidden_states``: a 448x448 frame is one slice of
    ``(image_size / patch)^2`` patches, passed as the duplex stage passes it."""
    vpm = thinker.vpm
    weight = vpm.embeddings.patch_embedding.weight
    patch = vpm.embeddings.patch_size
    side = getattr(thinker.config, "image_size", 448) // patch
    pixels = torch.zeros((3, patch, side * side * patch), dtype=weight.dtype, device=weight.device)
    tgt_sizes = torch.tensor([[side, side]], dtype=STAGE_TGT_DTYPE, device=weight.device)
    saved = vpm._encoder_graph
    vpm._encoder_graph = proxy
    try:
        thinker.get_vision_hidden_states({"pixel_values": [pixels], "tgt_sizes": tgt_sizes})
    finally:
        vpm._encoder_graph = saved


def _batch_buckets(thinker: Any, proxy: _CaptureNow) -> None:
    """Every batch bucket of the batched duplex forward, on padding rows (scratch pages only)."""
    encoder = thinker._duplex_batch
    device = thinker.apm.conv1.weight.device
    for bucket in encoder.buckets():
        if proxy.report.stopped is not None:
            break
        mel, meta, pool = encoder.inputs([], device, bucket)
        proxy(mel, meta, pool, encoder.chunk, encoder.attention(device))


def _kv_buffers(thinker: Any) -> dict[Any, torch.Tensor]:
    """The streaming K/V arenas and the batched path's page pools, by identity."""
    buffers = {id(a.kv): a.kv for a in getattr(thinker, "_streaming_audio_arenas", {}).values()}
    encoder = getattr(thinker, "_duplex_batch", None)
    if encoder is not None:
        buffers.update({id(p.kv): p.kv for p in encoder._pools.values()})
    return buffers


def _buffers_to_allocate(thinker: Any) -> int:
    """Bytes of the K/V buffers start-up capture allocates: the streaming arena and the batched
    path's page pool, where they do not exist yet."""
    apm = thinker.apm
    per_position = len(apm.layers) * 2 * apm.config.d_model * apm.conv1.weight.element_size()
    needed = 0
    if not getattr(thinker, "_streaming_audio_arenas", None):
        needed += 2 * apm.embed_positions.weight.shape[0] * per_position  # two sides
    encoder = getattr(thinker, "_duplex_batch", None)
    if encoder is not None and getattr(encoder, "graph", None) is not None and not encoder._pools:
        needed += encoder.pool_bytes()
    return needed


def _arena_bytes(thinker: Any, before: dict) -> int:
    return sum(t.numel() * t.element_size() for key, t in _kv_buffers(thinker).items() if key not in before)


def capture_at_startup(
    thinker: Any, vllm_config: Any, *, clock: Callable[[], float] = time.perf_counter
) -> StartupCapture:
    """Capture the graphs a duplex session needs, before serving; one INFO line (or WARNING).

    Runs only on a duplex deployment (:func:`is_duplex_deployment`) with
    ``encoder_cuda_graph_startup_capture`` on, for each encoder whose adapter exists:

    - the streaming audio adapter: every :func:`duplex_chunk_forms` call
    - the vision adapter: one camera frame
    - the batched duplex forward's: every batch bucket, on padding rows

    Graph caps, the byte budget and module hooks apply as to any capture; the free-memory floor is
    checked before each call.

    Args:
        thinker: ``MiniCPMO45OmniLLMForConditionalGeneration`` with its adapters wired.
        vllm_config: the engine's config.
        clock: seconds, for the INFO line.

    Returns:
        What was captured; ``total_bytes`` is what the graphs and the streaming K/V arena hold.

    Raises:
        whatever a capture raises (the fatal capture contract: restart the worker, optionally with
        ``encoder_cuda_graph_startup_capture: false``).
    """
    report = StartupCapture()
    options = EncoderCudaGraphOptions.from_hf_config(thinker.config)
    if not is_duplex_deployment(vllm_config):
        return report
    if not options.startup_capture:
        logger.info(
            "MiniCPM-o 4.5 start-up encoder CUDA graph capture off (encoder_cuda_graph_startup_capture=false): "
            "duplex sessions capture their graphs when they reach them"
        )
        return report
    streaming = getattr(thinker, "_streaming_audio_encoder_graph", None)
    vpm = getattr(thinker, "vpm", None)
    vision = getattr(vpm, "_encoder_graph", None) if vpm is not None else None
    # (the batched path's graphs exist only with the streaming ones)
    if streaming is None and vision is None:
        return report
    # the runner asks during memory profiling and again at capture_model: once per set of adapters
    batch_graph = getattr(getattr(thinker, "_duplex_batch", None), "graph", None)
    adapter_ids = (id(streaming), id(vision), id(batch_graph))
    if getattr(thinker, "_startup_captured_for", None) == adapter_ids:
        return report
    thinker._startup_captured_for = adapter_ids
    arenas_before = _kv_buffers(thinker)
    start = clock()
    proxies = []
    adapter = streaming if streaming is not None else vision
    device = next((thinker.apm if streaming is not None else vpm).parameters()).device
    needed = _buffers_to_allocate(thinker) if streaming is not None else 0
    if options.min_free_bytes and needed:
        free = adapter.backend.free_bytes(device)
        if free - needed < options.min_free_bytes:
            report.stopped = (
                f"its K/V buffers take {needed} bytes and {free} are free on {device}, which would leave less "
                f"than encoder_cuda_graph_min_free_bytes={options.min_free_bytes}"
            )
    with torch.inference_mode():
        if streaming is not None and report.stopped is None:
            proxies.append(_CaptureNow(streaming, "streaming audio", report, options.min_free_bytes))
            _streaming_session(thinker, proxies[-1])
        if vision is not None and report.stopped is None:
            proxies.append(_CaptureNow(vision, "vision", report, options.min_free_bytes))
            _camera_frame(thinker, proxies[-1])
        if batch_graph is not None and report.stopped is None:
            proxies.append(_CaptureNow(batch_graph, "duplex audio batch", report, options.min_free_bytes))
            _batch_buckets(thinker, proxies[-1])
    report.seconds = clock() - start
    report.graph_bytes = sum(p.new_bytes() for p in proxies)
    report.arena_bytes = _arena_bytes(thinker, arenas_before)
    _log(report)
    return report


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _log(report: StartupCapture) -> None:
    graphs = ", ".join(f"{name} {n}" for name, n in report.graphs.items()) or "none"
    skipped = "".join(f"; {n} not captured ({why})" for why, n in report.skipped.items())
    line = (
        "MiniCPM-o 4.5 encoder CUDA graphs captured at start-up: %d graphs (%s%s) in %.2f s, %s "
        "(%d bytes: graphs %s, streaming audio K/V arena and pages %s)"
    )
    args = (
        report.num_graphs,
        graphs,
        skipped,
        report.seconds,
        _mib(report.total_bytes),
        report.total_bytes,
        _mib(report.graph_bytes),
        _mib(report.arena_bytes),
    )
    if report.stopped is None:
        logger.info(line, *args)
    else:
        logger.warning(
            line + "; stopped early: %s. The other graphs are captured lazily, when sessions reach them.",
            *args,
            report.stopped,
        )
