# SPDX-License-Identifier: Apache-2.0
"""Exact-shape CUDA graphs for MiniCPM-o 4.5's input encoders.

MiniCPM-o 4.5 runs two stateless encoders per multimodal request: the SigLIP
vision transformer (``vpm``: 26 encoder layers + post layernorm, hidden 1152)
and the Whisper audio encoder with its projection and 5x average pooling. Both
launch hundreds of small kernels per call, so on small inputs (one 448x448
slice, a 1 s audio chunk) the host, not the GPU, sets their latency. This
module replays such calls from CUDA graphs keyed by the exact shapes of their
inputs; nothing is padded or bucketed, so a replay computes exactly what the
eager call computes.

Capture and replay are vLLM's: every captured shape is one
:class:`vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager` with a single
token budget, fed through a one-item :class:`_ExactShapeEncoder` that implements
vLLM's ``SupportsEncoderCudaGraph`` protocol. This module only decides *when* to
capture (admission), *whether* there is room (graph cap, free-memory floor) and
*where* (graph pool and capture stream), and keeps the counters.

Layout (policy kept apart from CUDA plumbing so it is testable on CPU):

- :class:`EncoderCudaGraphOptions`: the five ``--hf-overrides`` keys, validated.
- :class:`CaptureAdmission`: admission history, graph cap and miss accounting;
  pure Python.
- :class:`EncoderCudaGraph`: the callable adapter; eligibility, keys, memory
  floor, graph pools, capture and replay through vLLM's manager, stats and the
  fatal capture-failure contract.
- :func:`make_encoder_cuda_graph`: the factory the model file calls.

The user-facing contract is ``docs/design/minicpmo_encoder_cuda_graph.md``.
"""

from __future__ import annotations

import copy
import enum
import inspect
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph
from vllm.v1.worker.encoder_cudagraph_defs import (
    EncoderCudaGraphCaptureInputs,
    EncoderCudaGraphConfig,
    EncoderCudaGraphReplayBuffers,
    EncoderItemSpec,
)

logger = init_logger(__name__)

__all__ = [
    "CaptureAdmission",
    "EncoderCudaGraph",
    "EncoderCudaGraphCaptureFailedError",
    "EncoderCudaGraphOptions",
    "STATS_KEYS",
    "make_encoder_cuda_graph",
]

#: Keys of :meth:`EncoderCudaGraph.get_cumulative_stats`, in order.
STATS_KEYS = (
    "graph_hits",
    "graph_misses",
    "hit_rate",
    "num_graphs",
    "ineligible_misses",
    "capacity_misses",
    "warmup_misses",
    "memory_misses",
    "capture_failures",
)

GraphKey = tuple[Hashable, ...]
"""``(replay stream handle, per-input (shape, dtype, device) or None)``."""

#: cudaStreamCaptureMode of every capture. Captures happen while the worker serves, when other
#: threads of the process may run CUDA work (e.g. vLLM's async output copy thread); "thread_local"
#: checks only the capturing thread, so their calls neither fail nor invalidate the capture (design
#: doc, "Capturing inside a live worker"). Needs patches/vllm/0007 (checked at construction).
CAPTURE_ERROR_MODE = "thread_local"


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderCudaGraphOptions:
    """Encoder CUDA graph settings, read from ``--hf-overrides``.

    One instance configures both encoders; each encoder gets its own adapter,
    so caps and counters are per encoder.

    Attributes:
        enabled: ``encoder_cuda_graph`` (bool, default True). False builds no
            adapters and every call runs eagerly.
        max_graphs: ``encoder_cuda_graph_max_graphs`` (int >= 0, default 4).
            Graphs retained per encoder; 0 disables capture. Never evicted.
        min_capture_calls: ``encoder_cuda_graph_min_capture_calls`` (int >= 2,
            default 2). Calls with the same key, the capturing call included,
            before a shape is captured.
        min_free_bytes: ``encoder_cuda_graph_min_free_bytes`` (int >= 0, bytes,
            default 1 GiB). A capture is deferred while the device's free
            memory is below it; 0 disables the check.
        share_pools: ``encoder_cuda_graph_share_pools`` (bool, default True).
            One graph pool and capture stream per (encoder, device, replay
            stream); False gives each graph its own (for A/B comparison).

    Raises:
        ValueError: a value of the wrong type or out of range, naming the
            ``--hf-overrides`` key, the value and what is allowed. ``True`` is
            not accepted as an int and the string ``"false"`` not as a bool.
    """

    enabled: bool = True
    max_graphs: int = 4
    min_capture_calls: int = 2
    min_free_bytes: int = 1 << 30
    share_pools: bool = True

    #: attribute -> ``--hf-overrides`` key
    HF_KEYS: ClassVar[dict[str, str]] = {
        "enabled": "encoder_cuda_graph",
        "max_graphs": "encoder_cuda_graph_max_graphs",
        "min_capture_calls": "encoder_cuda_graph_min_capture_calls",
        "min_free_bytes": "encoder_cuda_graph_min_free_bytes",
        "share_pools": "encoder_cuda_graph_share_pools",
    }
    #: attribute -> (kind, minimum); kind is "bool" or "int"
    _RULES: ClassVar[dict[str, tuple[str, int]]] = {
        "enabled": ("bool", 0),
        "max_graphs": ("int", 0),
        "min_capture_calls": ("int", 2),
        "min_free_bytes": ("int", 0),
        "share_pools": ("bool", 0),
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind, minimum = self._RULES[f.name]
            key = self.HF_KEYS[f.name]
            if kind == "bool":
                if not isinstance(value, bool):
                    raise ValueError(
                        f"--hf-overrides {key}={value!r} is invalid: expected a JSON boolean "
                        f"(true or false), got {type(value).__name__}"
                    )
            elif isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"--hf-overrides {key}={value!r} is invalid: expected an integer >= {minimum}"
                )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EncoderCudaGraphOptions:
        """Read the options from a model's HF config (``--hf-overrides`` lands there).

        Args:
            hf_config: any object; missing attributes take the defaults.

        Raises:
            ValueError: see the class docstring.
        """
        values = {}
        for attr, key in cls.HF_KEYS.items():
            if hasattr(hf_config, key):
                values[attr] = getattr(hf_config, key)
        return cls(**values)


# ---------------------------------------------------------------------------
# Admission policy (pure Python)
# ---------------------------------------------------------------------------


class Admission(enum.Enum):
    """What :meth:`CaptureAdmission.admit` decided for one eligible call."""

    REPLAY = "replay"  # a graph exists for the key
    CAPACITY = "capacity"  # the cap is reached; run eagerly (never evicts)
    WARMUP = "warmup"  # not seen often enough yet; run eagerly
    CAPTURE = "capture"  # capture now (subject to the memory floor)


class CaptureAdmission:
    """Admission, graph cap and miss accounting for one encoder.

    Pure bookkeeping, no CUDA: the adapter asks :meth:`admit` per eligible call
    and reports back what happened. Order per call:

    1. a captured key replays;
    2. with ``len(captured) >= max_graphs`` the call is a capacity miss (so with
       ``max_graphs == 0`` nothing is ever recorded in the history);
    3. a key's calls are counted in a history of at most ``4 * max_graphs``
       keys, FIFO by first sighting (re-sightings do not reorder); a key pushed
       out starts again from one call;
    4. below ``min_capture_calls`` calls the call is a warmup miss; at the
       threshold the count saturates and the adapter captures, unless the
       memory floor defers it (:meth:`record_memory_miss`), in which case the
       next call with that key tries again.

    Args:
        max_graphs: graph cap, int >= 0.
        min_capture_calls: calls needed to capture, int >= 2.
    """

    HISTORY_FACTOR = 4

    def __init__(self, max_graphs: int, min_capture_calls: int) -> None:
        self.max_graphs = max_graphs
        self.min_capture_calls = min_capture_calls
        self.history_limit = self.HISTORY_FACTOR * max_graphs
        # key -> calls seen (saturating at min_capture_calls); insertion order = first sighting
        self.history: OrderedDict[Hashable, int] = OrderedDict()
        self.captured: set[Hashable] = set()
        self.misses: Counter[str] = Counter()

    def admit(self, key: Hashable) -> Admission:
        """Count one eligible call with ``key`` and decide how to serve it."""
        if key in self.captured:
            return Admission.REPLAY
        if len(self.captured) >= self.max_graphs:
            self.misses["capacity"] += 1
            return Admission.CAPACITY
        calls = self.history.get(key)
        if calls is None:
            if len(self.history) >= self.history_limit:
                self.history.popitem(last=False)
            calls = 0
        calls = min(calls + 1, self.min_capture_calls)
        self.history[key] = calls
        if calls < self.min_capture_calls:
            self.misses["warmup"] += 1
            return Admission.WARMUP
        return Admission.CAPTURE

    def record_ineligible(self) -> None:
        self.misses["ineligible"] += 1

    def record_memory_miss(self) -> None:
        """The memory floor deferred a capture; the key stays saturated."""
        self.misses["memory"] += 1

    def record_captured(self, key: Hashable) -> None:
        self.history.pop(key, None)
        self.captured.add(key)

    def record_failure(self) -> None:
        """Capture failed: forget the history (the adapter is unusable from now on)."""
        self.history.clear()

    def total_misses(self) -> int:
        return sum(self.misses.values())


# ---------------------------------------------------------------------------
# vLLM protocol adapter for one exact shape
# ---------------------------------------------------------------------------


def _copy_exact(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Replay padding logic: copy in place. Shapes are equal by construction of the key."""
    dst.copy_(src)


class _ExactShapeEncoder(SupportsEncoderCudaGraph):
    """One captured shape as a ``SupportsEncoderCudaGraph`` model.

    A call's already-packed inputs are one indivisible manager item whose token
    count is the product of the output's leading dims; the manager is built with
    exactly that one token budget and a batch of one, so its packing always
    picks the single captured graph and nothing is padded.

    Buffer keys are ``"0"``, ``"1"``, ... for the positional inputs that are not
    None; a None input stays None in the forward call.
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor | None],
        output_shape: torch.Size,
    ) -> None:
        self._forward = forward
        self.arity = len(inputs)
        self.templates = [None if x is None else (x.shape, x.dtype, x.device) for x in inputs]
        self.keys = [str(i) for i, x in enumerate(inputs) if x is not None]
        self.output_shape = torch.Size(output_shape)
        self.tokens = max(1, math.prod(self.output_shape[:-1]))

    def _call(self, values: dict[str, Any]) -> torch.Tensor:
        return self._forward(*(values.get(str(i)) for i in range(self.arity)))

    # -- SupportsEncoderCudaGraph -------------------------------------------------
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            modalities=["image", "audio"],
            buffer_keys=list(self.keys),
            out_hidden_size=int(self.output_shape[-1]),
            padding_logics=dict.fromkeys(self.keys, _copy_exact),
        )

    def get_input_modality(self, mm_kwargs: dict[str, Any]) -> str:
        return "image"

    def get_max_frames_per_video(self) -> int:
        return 1

    def get_encoder_cudagraph_budget_range(self, vllm_config: Any) -> tuple[int, int]:
        return self.tokens, self.tokens

    def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict[str, Any]) -> list[EncoderItemSpec]:
        return [EncoderItemSpec(input_size=self.tokens, output_tokens=self.tokens)]

    def select_encoder_cudagraph_items(self, mm_kwargs: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        if list(indices) != [0]:
            raise AssertionError(f"exact-shape encoder graphs hold one item, got indices {indices}")
        return dict(mm_kwargs)

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget: int,
        max_batch_size: int,
        max_frames_per_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        path: str = "default",
        axis_keys: tuple[Hashable, ...] | None = None,
    ) -> EncoderCudaGraphCaptureInputs:
        # Static inputs: allocated here, outside the graph; each keeps its own dtype/device.
        values = {
            str(i): torch.zeros(shape, dtype=t_dtype, device=t_device)
            for i, tmpl in enumerate(self.templates)
            if tmpl is not None
            for shape, t_dtype, t_device in (tmpl,)
        }
        return EncoderCudaGraphCaptureInputs(values=values)

    def prepare_encoder_cudagraph_replay_buffers(
        self, mm_kwargs: dict[str, Any], max_batch_size: int, max_frames_per_batch: int, path: str = "default"
    ) -> EncoderCudaGraphReplayBuffers:
        return EncoderCudaGraphReplayBuffers(values=dict(mm_kwargs))

    def encoder_cudagraph_forward(self, inputs: dict[str, torch.Tensor], path: str = "default") -> torch.Tensor:
        return self._call(inputs)

    def encoder_eager_forward(self, mm_kwargs: dict[str, Any], path: str = "default") -> torch.Tensor:
        return self._call(mm_kwargs)

    def postprocess_encoder_output(
        self,
        outputs: dict[str, torch.Tensor],
        indices: list[int],
        per_item_out_tokens: list[int],
        dest: dict[int, torch.Tensor],
        clone: bool = False,
        batch_mm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        out = outputs["default"]
        dest[indices[0]] = out.clone() if clone else out


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------


class EncoderCudaGraphCaptureFailedError(RuntimeError):
    """Raised by every call after a capture failed (the fatal contract)."""


def _default_free_memory(device: torch.device) -> int:
    """Free bytes on ``device`` as the driver reports them (``cudaMemGetInfo``)."""
    return torch.cuda.mem_get_info(device)[0]


class EncoderCudaGraph:
    """Replay an encoder call from a CUDA graph captured for its exact input shapes.

    ``adapter(*inputs)`` returns what ``forward(*inputs)`` returns: a fresh
    tensor (replayed outputs are clones, so a returned tensor survives later
    replays). Inputs are positional tensors or None; the graph key is the
    current CUDA stream plus each input's ``(shape, dtype, device)`` (None
    stays None, so "mask given" and "no mask" are different graphs). Strides
    and values are not part of the key; replays read the live input values.

    A call runs ``forward`` eagerly, without touching any graph, when it is
    *ineligible*: no tensor inputs, a CPU (non-CUDA) tensor, tensors on more
    than one device, autograd enabled, CUDA autocast enabled, or the current
    stream being captured by someone else. Eligible calls follow
    :class:`CaptureAdmission`, then the free-memory floor.

    Capture uses vLLM's ``EncoderCudaGraphManager.capture(graph_pool=...)`` on a
    capture stream that first waits for the replay stream (so a late capture
    into a shared pool starts after earlier replays and their output clones)
    and that the replay stream then waits for.

    Fatal contract: if a capture raises, the original exception propagates,
    nothing is registered, and every later call raises
    :class:`EncoderCudaGraphCaptureFailedError` without capturing or running any
    CUDA work (a failed capture can leave the CUDA context unusable). Restart
    the worker, optionally with ``--hf-overrides '{"encoder_cuda_graph": false}'``.

    Args:
        forward: the eager encoder, ``forward(*inputs) -> Tensor``; must be
            capturable (no host syncs, no data-dependent shapes).
        vllm_config: the engine's ``VllmConfig``; copied per capture, never
            mutated (the manager needs ``model_config.multimodal_config``).
        max_graphs, min_capture_calls, min_free_bytes, share_pools: see
            :class:`EncoderCudaGraphOptions` (validated the same way).
        name: encoder name for logs (``"vision"``, ``"audio"``).
        free_memory_fn: ``fn(device) -> free bytes``; defaults to
            ``torch.cuda.mem_get_info``. Tests inject a reading here.

    Raises:
        ValueError: invalid option values (see :class:`EncoderCudaGraphOptions`).
        RuntimeError: vLLM's ``EncoderCudaGraphManager`` cannot capture in
            :data:`CAPTURE_ERROR_MODE` (``patches/vllm/0007`` not applied).
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        vllm_config: Any,
        *,
        max_graphs: int = 4,
        min_capture_calls: int = 2,
        min_free_bytes: int = 1 << 30,
        share_pools: bool = True,
        name: str = "encoder",
        free_memory_fn: Callable[[torch.device], int] | None = None,
    ) -> None:
        _require_capture_error_mode()
        self.options = EncoderCudaGraphOptions(
            max_graphs=max_graphs,
            min_capture_calls=min_capture_calls,
            min_free_bytes=min_free_bytes,
            share_pools=share_pools,
        )
        self.forward = forward
        self.vllm_config = vllm_config
        self.name = name
        self.free_memory_fn = free_memory_fn or _default_free_memory
        self.admission = CaptureAdmission(max_graphs, min_capture_calls)
        # key -> vLLM manager holding the key's single graph
        self.graphs: dict[GraphKey, Any] = {}
        # key -> output shape recorded by the eager call of its first sighting
        self._output_shapes: dict[GraphKey, torch.Size] = {}
        # (device, replay stream handle) -> (graph pool handle, capture stream), with share_pools
        self._capture_pools: dict[tuple[torch.device, int], tuple[Any, torch.cuda.Stream]] = {}
        self._failure: BaseException | None = None
        self._cap_logged = False

    # -- public --------------------------------------------------------------------
    @property
    def capture_failed(self) -> bool:
        return self._failure is not None

    def __call__(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        if self._failure is not None:
            raise EncoderCudaGraphCaptureFailedError(
                f"{self.name} encoder CUDA graph capture failed earlier "
                f"({type(self._failure).__name__}: {self._failure}); this adapter is unusable. "
                "Restart the worker, optionally with --hf-overrides "
                "'{\"encoder_cuda_graph\": false}' to run the encoders eagerly."
            )
        device = self._eligible_device(inputs)
        if device is None:
            self.admission.record_ineligible()
            return self.forward(*inputs)

        stream = self._replay_stream(device)
        key: GraphKey = (
            stream.cuda_stream,
            tuple(None if x is None else (tuple(x.shape), x.dtype, x.device) for x in inputs),
        )
        manager = self.graphs.get(key)
        if manager is not None:  # hit: the common case, kept to one lookup
            return self._replay(manager, inputs)
        decision = self.admission.admit(key)
        if decision is Admission.CAPTURE:
            if self.options.min_free_bytes:
                free = self.free_memory_fn(device)
                if free < self.options.min_free_bytes:
                    self.admission.record_memory_miss()
                    logger.debug(
                        "%s encoder CUDA graph capture deferred: %d bytes free on %s < floor %d",
                        self.name, free, device, self.options.min_free_bytes,
                    )
                    return self.forward(*inputs)
            self._capture(key, inputs, device, stream)
            # the capturing call is served by the new graph's first replay
            return self._replay(self.graphs[key], inputs)

        out = self.forward(*inputs)
        if decision is Admission.WARMUP:
            self._output_shapes[key] = out.shape
            # keep shapes only for keys still in the admission history
            if len(self._output_shapes) > len(self.admission.history):
                for stale in [k for k in self._output_shapes if k not in self.admission.history]:
                    del self._output_shapes[stale]
        elif decision is Admission.CAPACITY and not self._cap_logged:
            self._cap_logged = True
            if self.options.max_graphs == 0:
                logger.info("%s encoder CUDA graphs disabled (encoder_cuda_graph_max_graphs=0)", self.name)
            else:
                logger.warning(
                    "%s encoder CUDA graph cap reached (%d graphs); new shapes run eagerly for the "
                    "lifetime of the model (raise encoder_cuda_graph_max_graphs to capture more)",
                    self.name, self.options.max_graphs,
                )
        return out

    def get_cumulative_stats(self) -> dict[str, Any]:
        """Counters since construction (never reset), per adapter.

        Returns:
            dict with exactly :data:`STATS_KEYS`: ``graph_hits`` (calls served by
            a replay, the capturing call included), ``graph_misses`` (all eager
            calls: the four miss kinds plus any counted by vLLM's managers),
            ``hit_rate`` (hits / (hits + misses), 0.0 before any call),
            ``num_graphs``, ``ineligible_misses``, ``capacity_misses``,
            ``warmup_misses``, ``memory_misses`` and ``capture_failures`` (0 or 1).
        """
        hits = sum(m.graph_hits for m in self.graphs.values())
        misses = self.admission.total_misses() + sum(m.graph_misses for m in self.graphs.values())
        total = hits + misses
        m = self.admission.misses
        return {
            "graph_hits": hits,
            "graph_misses": misses,
            "hit_rate": hits / total if total else 0.0,
            "num_graphs": len(self.graphs),
            "ineligible_misses": m["ineligible"],
            "capacity_misses": m["capacity"],
            "warmup_misses": m["warmup"],
            "memory_misses": m["memory"],
            "capture_failures": int(self._failure is not None),
        }

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _eligible_device(inputs: Sequence[Any]) -> torch.device | None:
        """The single CUDA device of ``inputs``, or None when the call must stay eager."""
        devices = set()
        for x in inputs:
            if x is None:
                continue
            if not isinstance(x, torch.Tensor) or not x.is_cuda:
                return None
            devices.add(x.device)
        if len(devices) != 1:
            return None
        if (
            torch.is_grad_enabled()
            or torch.is_autocast_enabled("cuda")
            or torch.cuda.is_current_stream_capturing()
        ):
            return None
        return devices.pop()

    @staticmethod
    def _replay(manager: Any, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Replay through vLLM's manager; it copies ``inputs`` into the static buffers and clones the output."""
        return manager.execute({str(i): x for i, x in enumerate(inputs) if x is not None})[0]

    @staticmethod
    def _replay_stream(device: torch.device) -> torch.cuda.Stream:
        """The stream this call runs (and a graph would replay) on."""
        return torch.cuda.current_stream(device)

    def _pool_and_stream(self, device: torch.device, replay_stream: torch.cuda.Stream) -> tuple[Any, Any]:
        pool_key = (device, replay_stream.cuda_stream)
        if self.options.share_pools and pool_key in self._capture_pools:
            return self._capture_pools[pool_key]
        with torch.cuda.device(device):
            entry = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        if self.options.share_pools:
            self._capture_pools[pool_key] = entry
        return entry

    def _manager_config(self, tokens: int) -> Any:
        """A shallow copy of the engine config for a one-budget, batch-of-one manager."""
        config = copy.copy(self.vllm_config)
        compilation = copy.copy(config.compilation_config)
        compilation.encoder_cudagraph_token_budgets = [tokens]
        compilation.encoder_cudagraph_max_vision_items_per_batch = 1
        compilation.encoder_cudagraph_max_frames_per_batch = 0
        parallel = copy.copy(config.parallel_config)
        parallel.tensor_parallel_size = 1  # no manager-side DP sharding of a single item
        object.__setattr__(config, "compilation_config", compilation)
        object.__setattr__(config, "parallel_config", parallel)
        return config

    def _capture(
        self,
        key: GraphKey,
        inputs: Sequence[torch.Tensor | None],
        device: torch.device,
        replay_stream: torch.cuda.Stream,
    ) -> None:
        """Capture ``key`` and register it, or make the adapter unusable (fatal contract)."""
        start = time.perf_counter()
        try:
            manager = self._capture_graph(self._output_shapes.pop(key), inputs, device, replay_stream)
        except BaseException as exc:
            self._failure = exc
            self.admission.record_failure()
            self._output_shapes.clear()
            logger.error(
                "%s encoder CUDA graph capture failed for input shapes %s; the adapter is now "
                "unusable and later calls raise. Restart the worker, optionally with "
                "--hf-overrides '{\"encoder_cuda_graph\": false}'.",
                self.name, _describe(key),
            )
            raise
        # Registered only after a complete capture: a failure leaves no half-registered graph.
        self.graphs[key] = manager
        self.admission.record_captured(key)
        logger.info(
            "Captured %s encoder CUDA graph %d/%d for inputs %s in %.1f ms",
            self.name, len(self.graphs), self.options.max_graphs, _describe(key),
            (time.perf_counter() - start) * 1e3,
        )

    def _capture_graph(
        self,
        output_shape: torch.Size,
        inputs: Sequence[torch.Tensor | None],
        device: torch.device,
        replay_stream: torch.cuda.Stream,
    ) -> Any:
        """CUDA plumbing: one vLLM manager with one captured graph for these exact inputs."""
        from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

        model = _ExactShapeEncoder(self.forward, inputs, output_shape)
        first = next(x for x in inputs if x is not None)
        manager = EncoderCudaGraphManager(
            self._manager_config(model.tokens),
            device,
            first.dtype,
            model,
            capture_error_mode=CAPTURE_ERROR_MODE,
        )
        pool, capture_stream = self._pool_and_stream(device, replay_stream)
        # A late capture into a shared pool starts after earlier replays and output clones.
        capture_stream.wait_stream(replay_stream)
        with torch.cuda.device(device), torch.cuda.stream(capture_stream):
            manager.capture(graph_pool=pool)
        replay_stream.wait_stream(capture_stream)
        return manager


def _require_capture_error_mode() -> None:
    """Raise unless vLLM's manager takes ``capture_error_mode``: never capture in global mode."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    if "capture_error_mode" not in inspect.signature(EncoderCudaGraphManager).parameters:
        raise RuntimeError(
            "vLLM's EncoderCudaGraphManager takes no capture_error_mode, so encoder CUDA graphs "
            "would be captured in global mode, which a CUDA call of any other thread breaks: apply "
            "patches/vllm/0007-encoder-cudagraph-capture-error-mode.patch (minicpmo-cg-patch apply), "
            "or run the encoders eagerly with --hf-overrides '{\"encoder_cuda_graph\": false}'."
        )


def _describe(key: GraphKey) -> list[Any]:
    """Readable input shapes of a key for logs: ``[(shape, dtype) | None, ...]``."""
    return [None if t is None else (t[0], str(t[1]).replace("torch.", "")) for t in key[1]]


def make_encoder_cuda_graph(
    forward: Callable[..., torch.Tensor],
    vllm_config: Any,
    options: EncoderCudaGraphOptions,
    *,
    name: str,
) -> EncoderCudaGraph | None:
    """Build the adapter for one encoder, or None when encoder graphs are off.

    Off means ``options.enabled`` is False (``encoder_cuda_graph: false``) or the
    engine runs with ``--enforce-eager`` (``model_config.enforce_eager``).
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not options.enabled or getattr(model_config, "enforce_eager", False):
        return None
    return EncoderCudaGraph(
        forward,
        vllm_config,
        max_graphs=options.max_graphs,
        min_capture_calls=options.min_capture_calls,
        min_free_bytes=options.min_free_bytes,
        share_pools=options.share_pools,
        name=name,
    )
