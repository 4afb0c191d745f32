# SPDX-License-Identifier: Apache-2.0
"""Exact-shape CUDA graphs for MiniCPM-o 4.5's input encoders.

Capture and replay are vLLM's ``EncoderCudaGraphManager``, one per captured shape, fed through a
one-item :class:`ExactShapeEncoder`; nothing is padded, so a replay computes what the eager call
computes. This package decides when to capture (:mod:`.admission`), whether there is room (graph cap,
byte budget, free-memory floor) and where (graph pool, capture stream; :mod:`.backend`), and keeps
counters. :mod:`.options` and :mod:`.admission` import no torch. Design:
``docs/design/minicpmo_encoder_cuda_graph.md``.
"""

from .adapter import EncoderCudaGraph, EncoderCudaGraphCaptureFailedError, GraphInfo
from .admission import (
    MISS_KINDS,
    STATS_KEYS,
    Admission,
    CaptureAdmission,
    CaptureCostModel,
    CostVerdict,
    EagerCallSample,
    in_memory_profiling,
)
from .backend import (
    CAPTURE_ERROR_MODE,
    CapturedGraph,
    CudaGraphBackend,
    EagerMeasurement,
    EncoderGraphBackend,
    ReplayableGraph,
)
from .factory import EncoderCudaGraphSetup, lora_may_reach, make_encoder_cuda_graph
from .immediate import capture_now
from .options import (
    HF_OVERRIDE_KEYS,
    EncoderCudaGraphOptions,
    HfOverrideKey,
    HfOverridesError,
    read_hf_overrides,
)
from .shapes import ExactShapeEncoder, GraphKey

# isort: split


__all__ = [
    "CAPTURE_ERROR_MODE",
    "HF_OVERRIDE_KEYS",
    "MISS_KINDS",
    "STATS_KEYS",
    "Admission",
    "CaptureAdmission",
    "CaptureCostModel",
    "CapturedGraph",
    "CostVerdict",
    "CudaGraphBackend",
    "EagerCallSample",
    "EagerMeasurement",
    "EncoderCudaGraph",
    "EncoderCudaGraphCaptureFailedError",
    "EncoderCudaGraphOptions",
    "EncoderCudaGraphSetup",
    "EncoderGraphBackend",
    "ExactShapeEncoder",
    "GraphInfo",
    "GraphKey",
    "HfOverrideKey",
    "HfOverridesError",
    "ReplayableGraph",
    "capture_now",
    "in_memory_profiling",
    "lora_may_reach",
    "make_encoder_cuda_graph",
    "read_hf_overrides",
]
