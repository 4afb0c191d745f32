# SPDX-License-Identifier: Apache-2.0
"""Immediate capture (:func:`capture_now`) of a call whose shapes are known to recur, keyed as the call is."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .adapter import _BUFFER_KEYS, EncoderCudaGraph, EncoderCudaGraphCaptureFailedError
from .admission import _KeyRecord, in_memory_profiling
from .backend import ReplayableGraph
from .shapes import GraphKey, _is_static

__all__ = ["capture_now"]


def capture_now(adapter: EncoderCudaGraph, *inputs: Any) -> tuple[torch.Tensor, str]:
    """Capture ``adapter``'s graph for a call with ``inputs`` now; return what the call returns.

    Returns:
        ``(output, outcome)``: ``"captured"``, ``"present"``, or why nothing was captured:
        ``"ineligible"``, ``"profile"``, ``"capacity"``, ``"budget"`` or ``"hooks"``.

    Raises:
        EncoderCudaGraphCaptureFailedError: a capture of this adapter failed earlier.
        whatever the capture raises (the adapter is then unusable, as after any failed capture).
    """
    if adapter.capture_failed:
        raise EncoderCudaGraphCaptureFailedError(
            f"{adapter.name} encoder CUDA graph capture failed earlier; restart the worker"
        )
    device = None
    if adapter.eager_reason is None and not torch.is_grad_enabled():
        device = adapter.backend.eligible_device(inputs)
    if device is None or len(inputs) > len(_BUFFER_KEYS) or any(map(_is_static, inputs)):
        return adapter.forward(*inputs), "ineligible"
    if in_memory_profiling(adapter.vllm_config):
        return adapter.forward(*inputs), "profile"
    entries = tuple(None if x is None else (x.shape, x.dtype) for x in inputs)
    key: GraphKey = (adapter.backend.replay_stream(device), device, entries)
    manager = adapter.graphs.get(key)
    if manager is not None:
        return _replay_uncounted(adapter, manager, inputs), "present"
    if len(adapter.graphs) >= adapter.options.max_graphs:
        return adapter.forward(*inputs), "capacity"
    measurements = []
    if adapter.options.max_bytes:
        # measured, so that the budget counts the graph pool's growth (about the eager call's peak)
        # on top of the static buffers, as for a lazy capture
        out, measurement = adapter.backend.measure_eager(device, lambda: adapter.forward(*inputs))
        measurements.append(measurement)
    else:
        out = adapter.forward(*inputs)
    record = _KeyRecord(first_call=adapter._calls, output=(out.shape, out.dtype), measurements=measurements)
    if adapter.options.max_bytes and adapter._over_budget(key, record):
        return out, "budget"
    if not adapter._capture(key, record, inputs, device, log_level=logging.DEBUG):
        return out, "hooks"
    return _replay_uncounted(adapter, adapter.graphs[key], inputs), "captured"


def _replay_uncounted(
    adapter: EncoderCudaGraph, manager: ReplayableGraph, inputs: Sequence[Any]
) -> torch.Tensor:
    hits = manager.graph_hits
    out = adapter._replay(manager, inputs)
    manager.graph_hits = hits
    return out
