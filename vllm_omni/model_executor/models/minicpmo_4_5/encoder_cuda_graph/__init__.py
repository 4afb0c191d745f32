# SPDX-License-Identifier: Apache-2.0
"""Exact-shape CUDA graphs for MiniCPM-o 4.5's input encoders.

MiniCPM-o 4.5 runs two stateless encoders per multimodal request: the SigLIP
vision transformer (``vpm``: 26 encoder layers + post layernorm, hidden 1152)
and the Whisper audio encoder with its projection and 5x average pooling. Both
launch hundreds of small kernels per call, so on small inputs (one 448x448
slice, a 1 s audio chunk) the host, not the GPU, sets their latency. This
package replays such calls from CUDA graphs keyed by the exact shapes of their
inputs; nothing is padded or bucketed, so a replay computes exactly what the
eager call computes.

Capture and replay are vLLM's: every captured shape is one
:class:`vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager` with a single
token budget, fed through a one-item :class:`ExactShapeEncoder` that implements
vLLM's ``SupportsEncoderCudaGraph`` protocol. This package only decides *when*
to capture (admission: recurrence, and whether the measured saving pays for the
capture and the memory), *whether* there is room (graph cap, byte budget,
free-memory floor) and *where* (graph pool and capture stream), and keeps the
counters and byte accounts. A replay re-runs the recorded GPU work and nothing
else, so the captured forwards must be free of Python side effects (module
hooks are checked at capture, see :class:`EncoderCudaGraph`).

Layout, one module per concern (policy apart from CUDA plumbing, so it is
testable on CPU; each module imports only those above it):

- :mod:`.options`: the ``--hf-overrides`` registry :data:`HF_OVERRIDE_KEYS`,
  :func:`read_hf_overrides` and :class:`EncoderCudaGraphOptions`; no torch.
- :mod:`.admission`: :class:`CaptureAdmission` (recurrence, graph cap, miss
  accounting), the ``"cost"`` rule :class:`CaptureCostModel` on measured eager
  calls, the stats vocabulary and :func:`in_memory_profiling`; no torch.
- :mod:`.shapes`: graph keys and :class:`ExactShapeEncoder`, one shape as a
  vLLM ``SupportsEncoderCudaGraph`` model.
- :mod:`.backend`: the seam :class:`EncoderGraphBackend` and the CUDA backend
  :class:`CudaGraphBackend` (graph pools, capture streams, eager-call
  measurement, cleanup after a failed capture).
- :mod:`.adapter`: :class:`EncoderCudaGraph`, the callable adapter (profiling
  guard, byte budget, memory floor, hooks check, stats, the fatal contract).
- :mod:`.factory`: :func:`make_encoder_cuda_graph`, which the model file calls,
  and :func:`lora_may_reach`.
- :mod:`.immediate`: :func:`capture_now`, a call's graph captured at once,
  keyed as the call is (start-up capture).

Every public name is importable from this package. The user-facing contract is
``docs/design/minicpmo_encoder_cuda_graph.md`` and its topic pages in
``docs/design/minicpmo_encoder_cuda_graph/``.
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
