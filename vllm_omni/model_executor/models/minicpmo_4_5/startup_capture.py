# SPDX-License-Identifier: Apache-2.0
"""Start-up capture: the encoder CUDA graphs every duplex session needs, captured before serving.

:func:`capture_at_startup` allocates the streaming K/V page pool for ``duplex_max_sessions``,
captures one streaming audio graph per batch bucket in one loop over explicit padding inputs, and
one camera frame's vision graph. vllm-omni's model runner calls it from ``profile_cudagraph_memory``
(patch 0008), so the bytes it returns are counted before the KV cache is sized.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from .encoder_cuda_graph import EncoderCudaGraph, EncoderCudaGraphOptions, capture_now

logger = init_logger(__name__)

__all__ = ["StartupCapture", "capture_at_startup", "is_duplex_deployment"]

#: dtype of ``tgt_sizes`` the duplex stage passes for a camera frame.
STAGE_TGT_DTYPE = torch.int64


def is_duplex_deployment(vllm_config: Any) -> bool:
    """Whether this engine serves duplex sessions (vllm-omni's ``model_config.session_mode``)."""
    return getattr(getattr(vllm_config, "model_config", None), "session_mode", "turn") == "duplex"


@dataclass
class StartupCapture:
    """What a start-up capture did: graphs per encoder, bytes, seconds, why it stopped early."""

    graphs: dict[str, int] = field(default_factory=dict)
    graph_bytes: int = 0
    #: the streaming audio K/V page pool it allocated
    pool_bytes: int = 0
    seconds: float = 0.0
    #: why capture stopped before the end (the memory floor), or None
    stopped: str | None = None
    #: calls whose graph was not captured, by outcome (e.g. ``{"capacity": 2}``)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.graph_bytes + self.pool_bytes

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


def _buckets(thinker: Any, proxy: _CaptureNow) -> None:
    """Every batch bucket of the streaming audio forward, on padding rows (scratch pages only)."""
    encoder = thinker._streaming_audio
    for bucket in encoder.buckets:
        if proxy.report.stopped is not None:
            break
        proxy(*encoder.padding_inputs(bucket))


def capture_at_startup(
    thinker: Any, vllm_config: Any, *, clock: Callable[[], float] = time.perf_counter
) -> StartupCapture:
    """Capture the graphs a duplex session needs, before serving; one INFO line (or WARNING).

    Runs on a duplex deployment with ``encoder_cuda_graph_startup_capture`` on. Caps, the byte
    budget and hooks apply as to any capture; the free-memory floor is checked before the pool and
    before each capture, and below it the rest is left to the lazy path.

    Args:
        thinker: ``MiniCPMO45OmniLLMForConditionalGeneration`` with its adapters wired.
        vllm_config: the engine's config.
        clock: seconds, for the INFO line.

    Returns:
        What was captured; ``total_bytes`` is what the graphs and the page pool hold.

    Raises:
        whatever a capture raises (the fatal capture contract).
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
    encoder = getattr(thinker, "_streaming_audio", None)
    streaming = getattr(encoder, "graph", None)
    vpm = getattr(thinker, "vpm", None)
    vision = getattr(vpm, "_encoder_graph", None) if vpm is not None else None
    if encoder is None and vision is None:
        return report
    # the runner asks during memory profiling and again at capture_model: once per set of adapters
    adapter_ids = (id(encoder), id(streaming), id(vision))
    if getattr(thinker, "_startup_captured_for", None) == adapter_ids:
        return report
    thinker._startup_captured_for = adapter_ids
    start = clock()
    proxies = []
    if encoder is not None and encoder._pool is None:  # the K/V pages, with or without graphs
        needed, device = encoder.pool_bytes(), thinker.apm.conv1.weight.device
        backend = streaming.backend if streaming is not None else getattr(vision, "backend", None)
        free = backend.free_bytes(device) if options.min_free_bytes and backend is not None else 0
        if options.min_free_bytes and backend is not None and free - needed < options.min_free_bytes:
            report.stopped = (
                f"the streaming audio K/V pages take {needed} bytes and {free} are free on {device}, which would "
                f"leave less than encoder_cuda_graph_min_free_bytes={options.min_free_bytes}"
            )
        else:
            report.pool_bytes = encoder.pool.nbytes
    with torch.inference_mode():
        if streaming is not None and report.stopped is None:
            proxies.append(_CaptureNow(streaming, "streaming audio", report, options.min_free_bytes))
            _buckets(thinker, proxies[-1])
        if vision is not None and report.stopped is None:
            proxies.append(_CaptureNow(vision, "vision", report, options.min_free_bytes))
            _camera_frame(thinker, proxies[-1])
    report.seconds = clock() - start
    report.graph_bytes = sum(p.new_bytes() for p in proxies)
    _log(report)
    return report


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _log(report: StartupCapture) -> None:
    graphs = ", ".join(f"{name} {n}" for name, n in report.graphs.items()) or "none"
    skipped = "".join(f"; {n} not captured ({why})" for why, n in report.skipped.items())
    line = (
        "MiniCPM-o 4.5 encoder CUDA graphs captured at start-up: %d graphs (%s%s) in %.2f s, %s "
        "(%d bytes: graphs %s, streaming audio K/V pages %s)"
    )
    args = (
        report.num_graphs,
        graphs,
        skipped,
        report.seconds,
        _mib(report.total_bytes),
        report.total_bytes,
        _mib(report.graph_bytes),
        _mib(report.pool_bytes),
    )
    if report.stopped is None:
        logger.info(line, *args)
    else:
        logger.warning(
            line + "; stopped early: %s. The other graphs are captured lazily, when sessions reach them.",
            *args,
            report.stopped,
        )
