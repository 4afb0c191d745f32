# SPDX-License-Identifier: Apache-2.0
"""Exact-shape CUDA graphs for MiniCPM-o 4.5's input encoders.

MiniCPM-o 4.5 runs two stateless encoders per multimodal request: the SigLIP
vision transformer (``vpm``: 26 encoder layers + post layernorm, hidden 1152)
and the Whisper audio encoder with its projection and 5x average pooling. Both
launch hundreds of small kernels per call, so on small inputs (one 448x448
slice, a 1 s audio chunk) the host, not the GPU, sets their latency. This
module replays such calls from CUDA graphs keyed by the exact shapes of their
inputs; nothing is padded or bucketed, so a replay computes exactly what the
eager call computes. The same adapter, built with static arguments (non-tensor
inputs keyed by value), replays the streaming Whisper chunks of full-duplex
sessions at each KV past length.

Capture and replay are vLLM's: every captured shape is one
:class:`vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager` with a single
token budget, fed through a one-item :class:`ExactShapeEncoder` that implements
vLLM's ``SupportsEncoderCudaGraph`` protocol. This module only decides *when* to
capture (admission: recurrence, and whether the measured saving pays for the
capture and the memory), *whether* there is room (graph cap, byte budget,
free-memory floor) and *where* (graph pool and capture stream), and keeps the
counters and byte accounts.

A replay re-runs the GPU work recorded at capture and nothing else: Python side
effects of the captured forward (attribute writes, counters, logging, module
hooks) happen during the eager warmup calls and the capture, never on replay.
The captured forwards must therefore be free of them; module hooks are checked
at capture (see :class:`EncoderCudaGraph`).

Layout (policy kept apart from CUDA plumbing so it is testable on CPU):

- :data:`HF_OVERRIDE_KEYS`: this project's ``--hf-overrides`` keys, one
  :class:`HfOverrideKey` entry each; :func:`read_hf_overrides` validates them
  all (and rejects unknown look-alikes) in one error.
- :class:`EncoderCudaGraphOptions`: the adapter's keys, validated.
- :class:`CaptureAdmission`: admission history, graph cap and miss accounting;
  pure Python.
- :class:`CaptureCostModel`: the ``"cost"`` admission rule (does a graph pay?),
  pure arithmetic on measured eager calls (:class:`EagerCallSample`).
- :class:`EncoderGraphBackend`: the seam between policy and CUDA (eligible
  device, replay stream id, free bytes, eager-call measurement, capture with
  its bytes); :class:`CudaGraphBackend` is the real one.
- :class:`EncoderCudaGraph`: the callable adapter; profiling guard, keys,
  per-key measurements, byte budget, memory floor, graph pools, hooks check,
  stats, the periodic stats line and the fatal capture-failure contract.
- :func:`make_encoder_cuda_graph`: the factory the model file calls, with
  :func:`lora_may_reach` deciding when LoRA keeps an encoder eager.

The user-facing contract is ``docs/design/minicpmo_encoder_cuda_graph.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import logging
import math
import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import torch
import vllm_omni.platforms as omni_platforms
from torch import nn
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
    "HF_OVERRIDE_KEYS",
    "MISS_KINDS",
    "STATIC_ARG",
    "STATS_KEYS",
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
    "HfOverrideKey",
    "HfOverridesError",
    "ReplayableGraph",
    "in_memory_profiling",
    "lora_may_reach",
    "make_encoder_cuda_graph",
    "read_hf_overrides",
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

#: Miss kinds counted by :class:`CaptureAdmission`; all are part of ``graph_misses``.
#: The first four have their own key in :data:`STATS_KEYS`; the others are in
#: :meth:`EncoderCudaGraph.get_detailed_stats`.
MISS_KINDS = ("ineligible", "capacity", "warmup", "memory", "declined", "budget", "profile")

GraphKey = tuple[Hashable, ...]
"""``(replay stream id, device, per input: (shape, dtype), None, or (STATIC_ARG, value))``."""

#: Tags a static argument's entry in a graph key: ``(STATIC_ARG, value)`` never equals a tensor's
#: ``(shape, dtype)`` entry, whose first item is a ``torch.Size``.
STATIC_ARG = "static"


def _is_static(x: Any) -> bool:
    """A positional input that is neither a tensor nor None (see :class:`EncoderCudaGraph`)."""
    return x is not None and not isinstance(x, torch.Tensor)


def _key_entry(x: Any) -> Hashable:
    """One input's entry in a graph key of an adapter with static arguments."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype)
    return None if x is None else (STATIC_ARG, x)


#: cudaStreamCaptureMode of every capture. Captures happen while the worker serves, when other
#: threads of the process may run CUDA work (e.g. vLLM's async output copy thread); "thread_local"
#: checks only the capturing thread, so their calls neither fail nor invalidate the capture (design
#: doc, "Capturing inside a live worker"). Needs vLLM's capture_error_mode (checked at construction).
CAPTURE_ERROR_MODE = "thread_local"


# ---------------------------------------------------------------------------
# --hf-overrides keys: one registry entry per key
# ---------------------------------------------------------------------------

OptionKind = Literal["bool", "int", "number", "choice"]

_JSON_TYPE_NAMES = {
    bool: "a boolean",
    str: "a string",
    int: "an integer",
    float: "a float",
    type(None): "null",
}


def _as_json(value: Any) -> str:
    """``value`` as the user wrote it in the ``--hf-overrides`` JSON (repr when not JSON)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _type_name(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return _JSON_TYPE_NAMES.get(type(value), f"a {type(value).__name__}")


@dataclass(frozen=True)
class HfOverrideKey:
    """One ``--hf-overrides`` key of this project.

    Attributes:
        name: the JSON key, e.g. ``"encoder_cuda_graph_max_graphs"``.
        kind: ``"bool"`` (a JSON boolean), ``"int"`` (an integer >= ``minimum``;
            ``true``/``false`` and floats are rejected), ``"number"`` (a finite
            integer or float >= ``minimum``) or ``"choice"`` (one of ``choices``).
        default: the value in force when the key is absent.
        doc: one line for the option tables.
        minimum: lower bound of ``"int"`` and ``"number"`` keys.
        choices: allowed strings of a ``"choice"`` key.
    """

    name: str
    kind: OptionKind
    default: Any
    doc: str
    minimum: float = 0
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.check(self.default) is not None:
            raise ValueError(f"registry entry {self.name}: default {self.default!r} is not {self.allowed}")

    @property
    def allowed(self) -> str:
        """What the key accepts, in words (used in error messages and docs)."""
        if self.kind == "bool":
            return "a JSON boolean (true or false)"
        if self.kind == "int":
            return f"an integer >= {self.minimum:g}"
        if self.kind == "number":
            return f"a number >= {self.minimum:g}"
        return "one of " + ", ".join(json.dumps(c) for c in self.choices)

    def _accepts(self, value: Any) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        return math.isfinite(value) and value >= self.minimum

    def check(self, value: Any) -> str | None:
        """None when ``value`` is allowed, else ``key=<JSON>: got <type>, expected <allowed>``."""
        if self._accepts(value):
            return None
        return f"{self.name}={_as_json(value)}: got {_type_name(value)}, expected {self.allowed}"


def _registry(*keys: HfOverrideKey) -> dict[str, HfOverrideKey]:
    return {key.name: key for key in keys}


#: Every ``--hf-overrides`` key this project reads, by name. Adding a key is one
#: entry here (register only keys whose behaviour exists); its consumer reads the
#: validated value from :func:`read_hf_overrides`.
HF_OVERRIDE_KEYS: dict[str, HfOverrideKey] = _registry(
    HfOverrideKey(
        name="encoder_cuda_graph",
        kind="bool",
        default=True,
        doc="build the encoder graph adapters at all (--enforce-eager always disables them)",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_max_graphs",
        kind="int",
        minimum=0,
        default=4,
        doc="graphs kept per encoder, never evicted; 0 disables capture",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_min_capture_calls",
        kind="int",
        minimum=2,
        default=2,
        doc="calls with the same input shapes, dtype, device and stream before a capture may happen",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_min_free_bytes",
        kind="int",
        minimum=0,
        default=1 << 30,
        doc="defer a capture while the device has less free memory (bytes); 0 disables",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_share_pools",
        kind="bool",
        default=True,
        doc="one graph pool + capture stream per (encoder, device, replay stream); false = one per graph",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_admission",
        kind="choice",
        choices=("cost", "count"),
        default="cost",
        doc='vision and stateless audio encoders: "cost" captures a shape only when its measured saving '
        'pays for capture and memory, "count" every shape seen min_capture_calls times '
        '(streaming audio chunks always use "count")',
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_max_bytes",
        kind="int",
        minimum=0,
        default=0,
        doc="device memory the graphs of one encoder may hold (bytes); a capture that would pass it "
        "is deferred; 0 = no limit",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_log_interval_s",
        kind="number",
        minimum=0,
        default=60.0,
        doc="seconds between INFO lines with each encoder's hit rate, graphs and bytes; 0 = off",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_streaming_audio",
        kind="bool",
        default=True,
        doc="also replay the streaming (duplex) audio chunks, bitwise equal to eager; "
        'cap max_graphs x 30 KV past lengths; admission "count"',
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_startup_capture",
        kind="bool",
        default=True,
        doc="duplex deployments: capture the streaming audio graphs of a session's chunks (first chunk, "
        "steady chunk at every past length) and the camera frame's graph while the worker warms up, "
        "before serving; false = capture them lazily, as sessions reach them",
    ),
    HfOverrideKey(
        name="vision_attn_implementation",
        kind="choice",
        choices=("sdpa", "eager", "flash_attention_2"),
        default="sdpa",
        doc='SigLIP attention, read by the model file (not an adapter option): "sdpa", "eager" (the '
        'original bf16-logit math) or "flash_attention_2" (refused unless flash-attn 2 imports)',
    ),
)

#: Unregistered keys starting with one of these are always reported as unknown.
_PROJECT_PREFIXES = ("encoder_cuda_graph",)
_NEAR_MISS_CUTOFF = 0.8
_MIN_TRUNCATED_KEY = 10


class HfOverridesError(ValueError):
    """One or more bad ``--hf-overrides`` keys of this project; ``problems`` lists each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(
            f"invalid --hf-overrides for MiniCPM-o 4.5 ({count}):\n  " + "\n  ".join(self.problems)
        )


def _closest_key(name: str) -> str | None:
    """The registered key ``name`` looks like a misspelling or truncation of, if any."""
    name = name.lower()
    match = difflib.get_close_matches(name, list(HF_OVERRIDE_KEYS), n=1, cutoff=_NEAR_MISS_CUTOFF)
    if match:
        return match[0]
    if len(name) >= _MIN_TRUNCATED_KEY:
        return next((key for key in HF_OVERRIDE_KEYS if key.startswith(name)), None)
    return None


def _unknown_key_problems(hf_config: Any) -> list[str]:
    """Unregistered attributes of ``hf_config`` that carry a project prefix or look like a key."""
    problems = []
    for name, value in getattr(hf_config, "__dict__", {}).items():
        if name in HF_OVERRIDE_KEYS or hasattr(type(hf_config), name):
            continue
        closest = _closest_key(name)
        if closest is None and not name.lower().startswith(_PROJECT_PREFIXES):
            continue
        hint = f"did you mean {closest}?" if closest else "valid keys: " + ", ".join(HF_OVERRIDE_KEYS)
        problems.append(f"{name}={_as_json(value)}: unknown key, {hint}")
    return problems


def read_hf_overrides(hf_config: Any) -> dict[str, Any]:
    """Validate this project's ``--hf-overrides`` keys on a model's HF config.

    ``--hf-overrides`` JSON keys land as attributes of
    ``model_config.hf_config``; the checkpoint's own keys live there too.

    Args:
        hf_config: any object (a ``transformers.PretrainedConfig`` when served).

    Returns:
        ``{key: value}`` for every key of :data:`HF_OVERRIDE_KEYS`, the default
        where ``hf_config`` lacks the key.

    Raises:
        HfOverridesError: (a ``ValueError``) listing every problem at once: a
            value of the wrong type or out of range (key, value as JSON, type
            received, what is allowed), and every unknown key that starts with
            ``encoder_cuda_graph`` or is a near-miss of a registered key, with
            the closest valid key.
    """
    problems = []
    values = {}
    for name, spec in HF_OVERRIDE_KEYS.items():
        value = getattr(hf_config, name, spec.default)
        problem = spec.check(value)
        if problem is not None:
            problems.append(problem)
        values[name] = value
    problems += _unknown_key_problems(hf_config)
    if problems:
        raise HfOverridesError(problems)
    return values


def _hf_field(key: str) -> Any:
    """A dataclass field whose default, type rule and doc come from ``HF_OVERRIDE_KEYS[key]``."""
    return dataclasses.field(default=HF_OVERRIDE_KEYS[key].default, metadata={"hf_key": key})


@dataclass(frozen=True)
class EncoderCudaGraphOptions:
    """The adapter's settings, read from ``--hf-overrides``.

    One instance configures both encoders; each encoder gets its own adapter,
    so caps and counters are per encoder. Each field names its key in
    :data:`HF_OVERRIDE_KEYS`, which holds the default, the rule and the doc.

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
        admission: ``encoder_cuda_graph_admission`` (``"cost"`` or
            ``"count"``, default ``"cost"``). ``"count"`` captures a shape at its
            ``min_capture_calls``-th call; ``"cost"`` also requires the measured
            saving to pay for the capture and the memory (:class:`CaptureCostModel`).
            The model wiring applies it to the vision and stateless audio
            adapters; the streaming audio adapter always counts (see
            ``streaming_audio``).
        max_bytes: ``encoder_cuda_graph_max_bytes`` (int >= 0, bytes, default 0).
            Device memory the encoder's graphs may hold (pool growth + static
            input and output buffers); a capture whose estimate would pass it is
            deferred. 0 = no limit.
        log_interval_s: ``encoder_cuda_graph_log_interval_s`` (number >= 0,
            seconds, default 60). Period of the INFO line with the hit rate,
            graphs and bytes, logged from the call path; 0 = off.
        streaming_audio: ``encoder_cuda_graph_streaming_audio`` (bool, default
            True). Read by the model wiring, not by the adapter: also route the
            stateful Whisper chunk calls of streaming (duplex) sessions,
            ``get_audio_embedding_streaming``, through an adapter of their own;
            its replays are bitwise equal to the eager path. Needs ``enabled``.
            That adapter captures by ``"count"`` whatever ``admission`` says:
            its keys are a fixed schedule (one per KV past length) that every
            session walks once per cache cycle, a recurrence the cost rule,
            which estimates it from calls seen so far, would see only after
            minutes; the other options apply to it as to each encoder.
        startup_capture: ``encoder_cuda_graph_startup_capture`` (bool, default
            True). Read by the model wiring: on a duplex deployment, capture the
            graphs every duplex session needs (its first chunk and the steady
            chunk at each KV past length of a cache cycle, and a camera frame's
            single slice) while the worker warms up, after vLLM sized the KV
            cache; False leaves them to the lazy path.

    Raises:
        HfOverridesError: (a ``ValueError``) every value of the wrong type or
            out of range, each naming the ``--hf-overrides`` key, the value as
            JSON, the type received and what is allowed. ``true`` is not
            accepted as an int and the string ``"false"`` not as a bool.
    """

    enabled: bool = _hf_field("encoder_cuda_graph")
    max_graphs: int = _hf_field("encoder_cuda_graph_max_graphs")
    min_capture_calls: int = _hf_field("encoder_cuda_graph_min_capture_calls")
    min_free_bytes: int = _hf_field("encoder_cuda_graph_min_free_bytes")
    share_pools: bool = _hf_field("encoder_cuda_graph_share_pools")
    admission: str = _hf_field("encoder_cuda_graph_admission")
    max_bytes: int = _hf_field("encoder_cuda_graph_max_bytes")
    log_interval_s: float = _hf_field("encoder_cuda_graph_log_interval_s")
    streaming_audio: bool = _hf_field("encoder_cuda_graph_streaming_audio")
    startup_capture: bool = _hf_field("encoder_cuda_graph_startup_capture")

    def __post_init__(self) -> None:
        checks = (HF_OVERRIDE_KEYS[f.metadata["hf_key"]].check(getattr(self, f.name)) for f in fields(self))
        problems = [p for p in checks if p is not None]
        if problems:
            raise HfOverridesError(problems)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EncoderCudaGraphOptions:
        """Read the options from a model's HF config, validating all project keys.

        Raises:
            HfOverridesError: see :func:`read_hf_overrides`.
        """
        values = read_hf_overrides(hf_config)
        return cls(**{f.name: values[f.metadata["hf_key"]] for f in fields(cls)})

    def describe(self) -> str:
        """``key=<JSON> ...`` for every option, as a user would write them."""
        return " ".join(f"{f.metadata['hf_key']}={_as_json(getattr(self, f.name))}" for f in fields(self))


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
       keys, least recently seen first out: every sighting moves its key to the
       back, so a shape that keeps recurring stays while one-off shapes age out;
       a key pushed out starts again from one call;
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
        # key -> calls seen (saturating at min_capture_calls); order = least recently seen first
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
        else:
            self.history.move_to_end(key)  # a re-sighting refreshes the key's place
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

    def record_miss(self, kind: str) -> None:
        """An eager call of kind ``kind`` (one of :data:`MISS_KINDS`) decided outside :meth:`admit`.

        At the capture threshold a deferral leaves the key saturated, so its next
        call is asked again: ``"warmup"`` (cost measurements not read back yet),
        ``"declined"`` (the cost rule says the graph would not pay),
        ``"budget"`` (``max_bytes`` would be passed), ``"memory"`` (free-memory
        floor). ``"profile"`` counts vLLM's start-up profiling calls, which never
        reach :meth:`admit`.

        Raises:
            ValueError: an unknown kind.
        """
        if kind not in MISS_KINDS:
            raise ValueError(f"unknown miss kind {kind!r}; expected one of {MISS_KINDS}")
        self.misses[kind] += 1

    def record_captured(self, key: Hashable) -> None:
        self.history.pop(key, None)
        self.captured.add(key)

    def record_failure(self) -> None:
        """Capture failed or was refused for good: forget the history."""
        self.history.clear()

    def total_misses(self) -> int:
        return sum(self.misses.values())


# ---------------------------------------------------------------------------
# Cost-aware admission (pure Python)
# ---------------------------------------------------------------------------

_GIB = float(1 << 30)


@dataclass(frozen=True)
class EagerCallSample:
    """One measured eager call of a key: the input of :class:`CaptureCostModel` (all times in ms).

    A backend measures a call either *unheld* (as it runs in service) or *held*: the call's
    stream first runs a spin kernel for ``hold_ms``, so the host enqueues (part of) the call
    before the GPU starts it, and the GPU time after the hold shows how busy the GPU is.

    Attributes:
        host_ms: host time the call took to enqueue its work (``perf_counter``).
        gpu_ms: an unheld call's GPU span: between events recorded on its stream right before
            and right after it. When the host is slower than the GPU this span follows the
            host (the GPU idles between launches), otherwise the GPU's own work. None for a
            held call.
        busy_ms: the GPU's busy time for the call, or an upper bound of it; None when the
            measurement does not show it (an unheld call on CUDA). For a held call, the GPU
            time from the hold's end to the call's end: the busy time when the hold outlasted
            the host's enqueueing, more (the GPU caught up and idled again) when it did not.
        hold_ms: how long the GPU held the stream before the call (0: not held).
    """

    host_ms: float
    gpu_ms: float | None
    busy_ms: float | None = None
    hold_ms: float = 0.0


@dataclass(frozen=True)
class CostVerdict:
    """What :meth:`CaptureCostModel.decide` concluded for one key (all times in ms)."""

    capture: bool
    #: latency a replay saves per call; while ``busy_ms`` is unknown, the least it saves when
    #: ``capture``, else the most it can save
    saving_ms: float
    #: replays expected over the horizon
    expected_replays: float
    #: estimated cost of the capture
    capture_ms: float
    #: charge for the bytes the graph will hold
    memory_ms: float
    #: median GPU span of the key's unheld eager calls
    span_ms: float = 0.0
    #: median GPU busy time of the key's eager calls (None: not measured)
    busy_ms: float | None = None
    #: > 0: the verdict is open until a call held this long (GPU ms) shows the busy time
    hold_ms: float = 0.0

    def describe(self) -> str:
        """E.g. ``eager 8.30 ms, GPU busy 6.70 ms: saving 1.55 ms x 32.0 replays = 49.6 ms vs
        capture 19.6 ms + memory 20.9 ms``."""
        pays = (
            f"{self.saving_ms:.2f} ms x {self.expected_replays:.1f} replays = "
            f"{self.saving_ms * self.expected_replays:.1f} ms vs capture {self.capture_ms:.1f} ms + "
            f"memory {self.memory_ms:.1f} ms"
        )
        if self.busy_ms is not None:
            return f"eager {self.span_ms:.2f} ms, GPU busy {self.busy_ms:.2f} ms: saving {pays}"
        if self.capture:
            return f"eager {self.span_ms:.2f} ms, GPU busy not measured: saving at least {pays}"
        then = f"; measuring it with a {self.hold_ms:.2f} ms hold" if self.hold_ms else ""
        return f"eager {self.span_ms:.2f} ms, GPU busy not measured: saving at most {pays}{then}"


class CaptureCostModel:
    """The ``"cost"`` admission rule: capture a key only when its graph is expected to pay.

    Pure arithmetic on measurements, testable on CPU; the adapter feeds it the
    key's measured eager calls (:class:`EagerCallSample`), its sightings and
    the bytes the graph would hold. With ``h`` the median host time, ``g`` the
    median GPU span of the unheld samples and ``b`` the median GPU busy time
    (all ms)::

        saving         S = max(0, g - b - REPLAY_HOST_MS)                per replay
        replays        R = rate * max(MIN_HORIZON_CALLS, calls)
        rate             = (sightings - 1) / (last_call - first_call)
        capture        C = scale * (h + g + CAPTURE_FIXED_MS)
        memory         M = MEMORY_MS_PER_GIB * bytes / 2**30
        capture iff    R * S >= C + M

    A replay's GPU time is about the eager call's busy time ``b`` (a graph
    launch removes the idle gaps between kernels, not the kernels), so it saves
    ``g - b``. A held sample shows at most its hold, so its ``g - b`` counts up
    to ``hold_ms``. While ``b`` is unknown (no sample shows it), ``S`` lies
    between ``MIN_SAVING_SHARE`` and all of ``min(h, g)`` (the GPU can only wait
    for the host while the host enqueues, and every shape measured saved at
    least that share): a key that pays at the low end is captured; one that
    would not pay even at the high end, or only with more than
    ``HOLD_MIN_SHARE`` of it, is declined; the others get a verdict with
    ``hold_ms`` = ``HOLD_MARGIN`` times the saving they need (at most ``h``),
    which the adapter applies to the key's current eager call. Since a hold
    only delays the GPU into time it would otherwise spend waiting for the
    host, it costs that call nothing when the key pays and at most the hold
    when it does not.

    The rate is the key's recurrence per encoder call since its first
    sighting; the horizon assumes traffic lasts about as long again as it has
    so far (``calls``: this encoder's eligible calls), but at least
    ``MIN_HORIZON_CALLS``. ``scale`` calibrates the capture estimate with this
    encoder's measured captures (:meth:`record_capture`). The design doc gives
    the constants' sources.
    """

    #: host time of a replay before its graph reaches the GPU: input copy, launch, bookkeeping (ms)
    REPLAY_HOST_MS = 0.05
    #: a capture runs the forward eagerly once (~g) and records it at host speed (~h), plus manager
    #: construction, graph instantiation and synchronisation (ms)
    CAPTURE_FIXED_MS = 3.0
    #: encoder calls a new server is assumed to serve at least
    MIN_HORIZON_CALLS = 32
    #: latency a graph must save to justify holding one GiB for the model's lifetime (ms)
    MEMORY_MS_PER_GIB = 100.0
    #: captures kept for the calibration of the capture estimate
    CALIBRATION_WINDOW = 8
    #: the least share of ``min(h, g)`` a replay saved on any shape measured (30 s audio chunk:
    #: 0.8 of 8 ms); a key that pays with it is captured without measuring its busy time
    MIN_SAVING_SHARE = 0.1
    #: a key is measured with a hold only if it would pay with this share of ``min(h, g)``
    HOLD_MIN_SHARE = 0.25
    #: the hold is this many times the saving the key needs (noise between calls up to half of it
    #: does not turn a paying key down)
    HOLD_MARGIN = 2.0

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=self.CALIBRATION_WINDOW)

    @property
    def capture_scale(self) -> float:
        """Mean of measured / estimated capture time over recent captures (1.0 before any)."""
        return sum(self._ratios) / len(self._ratios) if self._ratios else 1.0

    def capture_estimate_ms(self, host_ms: float, gpu_ms: float) -> float:
        """Estimated capture time (ms) of a key whose eager call takes ``host_ms`` / ``gpu_ms``."""
        return self.capture_scale * (host_ms + gpu_ms + self.CAPTURE_FIXED_MS)

    def record_capture(self, estimated_ms: float, measured_ms: float) -> None:
        """Calibrate later estimates with a capture's measured time (both in ms, > 0)."""
        if estimated_ms > 0 and measured_ms > 0:
            self._ratios.append(measured_ms / (estimated_ms / self.capture_scale))

    def decide(
        self,
        samples: Sequence[EagerCallSample],
        *,
        sightings: int,
        first_call: int,
        last_call: int,
        calls: int,
        graph_bytes: int,
    ) -> CostVerdict:
        """Whether capturing a key pays, from its measured eager calls.

        Args:
            samples: measured eager calls of the key, at least one unheld (with ``gpu_ms``).
            sightings: calls with the key so far, >= 2.
            first_call, last_call: this encoder's call index (1-based, eligible
                calls) at the key's first and latest sighting.
            calls: this encoder's eligible calls so far.
            graph_bytes: estimated bytes the graph would hold.

        Returns:
            The verdict; ``capture`` False with ``hold_ms > 0`` means: measure a held call first.

        Raises:
            ValueError: no unheld sample, or fewer than two sightings.
        """
        spans = [s.gpu_ms for s in samples if s.gpu_ms is not None]
        if not spans or sightings < 2 or last_call <= first_call:
            raise ValueError("a cost decision needs at least one sample of an unheld call and two sightings")
        h = statistics.median(s.host_ms for s in samples)
        g = statistics.median(spans)
        replays = (sightings - 1) / (last_call - first_call) * max(self.MIN_HORIZON_CALLS, calls)
        costs = {
            "expected_replays": replays,
            "capture_ms": self.capture_estimate_ms(h, g),
            "memory_ms": self.MEMORY_MS_PER_GIB * graph_bytes / _GIB,
            "span_ms": g,
        }
        price = costs["capture_ms"] + costs["memory_ms"]
        shown = [_shown_saving(g, s) for s in samples if s.busy_ms is not None]
        if shown:
            saving = max(0.0, statistics.median(shown) - self.REPLAY_HOST_MS)
            busy = statistics.median(s.busy_ms for s in samples if s.busy_ms is not None)
            return CostVerdict(replays * saving >= price, saving, busy_ms=busy, **costs)
        bound = max(0.0, min(h, g) - self.REPLAY_HOST_MS)
        need = price / replays
        if need <= self.MIN_SAVING_SHARE * bound:  # pays even if a replay saves the least ever seen
            return CostVerdict(True, self.MIN_SAVING_SHARE * bound, **costs)
        hold = 0.0
        if need <= self.HOLD_MIN_SHARE * bound:
            hold = min(self.HOLD_MARGIN * (need + self.REPLAY_HOST_MS), h)
        return CostVerdict(False, bound, hold_ms=hold, **costs)


def _shown_saving(span_ms: float, sample: EagerCallSample) -> float:
    """``g - b`` of a sample that shows the busy time; a held sample shows at most its hold."""
    saving = span_ms - sample.busy_ms
    return min(saving, sample.hold_ms) if sample.hold_ms > 0 else saving


# ---------------------------------------------------------------------------
# vLLM protocol adapter for one exact shape
# ---------------------------------------------------------------------------


#: Replay padding logic, ``padding_logic(dst, src)``: copy in place (shapes are equal by
#: construction of the key). The unbound tensor method itself, so a replay runs no Python frame of
#: ours per input.
_copy_exact = torch.Tensor.copy_


class ExactShapeEncoder(SupportsEncoderCudaGraph):
    """One captured shape as a ``SupportsEncoderCudaGraph`` model.

    A call's already-packed inputs are one indivisible manager item whose token
    count is the product of the output's leading dims; the manager is built with
    exactly that one token budget and a batch of one, so its packing always
    picks the single captured graph and nothing is padded.

    Buffer keys are ``"0"``, ``"1"``, ... for the positional tensor inputs; a
    None input stays None in the forward call, and a static argument keeps its
    value in every forward call (warm-up, capture and eager), so the captured
    graph bakes it in.

    Attributes:
        templates: per positional input ``(shape, dtype, device)`` of a tensor, or None.
        statics: position -> value of each static argument.
        keys: buffer keys of the tensor inputs.
        output_shape: the eager output's shape, recorded at the key's first sighting.
        output_dtype: the eager output's dtype (default: ``dtype``).
        tokens: ``prod(output_shape[:-1])`` (at least 1), the manager's token budget.
        dtype: dtype of the first tensor input (the manager's dtype).
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        inputs: Sequence[Any],
        output_shape: torch.Size,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        self._forward = forward
        self.arity = len(inputs)
        tensors = [isinstance(x, torch.Tensor) for x in inputs]
        self.templates = [(x.shape, x.dtype, x.device) if t else None for x, t in zip(inputs, tensors)]
        self.statics = {i: x for i, x in enumerate(inputs) if _is_static(x)}
        self.keys = [str(i) for i, t in enumerate(tensors) if t]
        self.output_shape = torch.Size(output_shape)
        self.tokens = max(1, math.prod(self.output_shape[:-1]))
        self.dtype = next(x.dtype for x, t in zip(inputs, tensors) if t)
        self.output_dtype = self.dtype if output_dtype is None else output_dtype
        # built once: the manager asks for the item specs twice per replay and only reads them
        self._item_specs = [EncoderItemSpec(input_size=self.tokens, output_tokens=self.tokens)]

    @property
    def static_bytes(self) -> int:
        """Bytes of the graph's static input buffers plus its output buffer (allocated outside the pool).

        Only tensor inputs have a buffer: None and static arguments hold no bytes of the graph's.
        """
        inputs = sum(math.prod(t[0]) * t[1].itemsize for t in self.templates if t is not None)
        return inputs + math.prod(self.output_shape) * self.output_dtype.itemsize

    def _call(self, values: dict[str, Any]) -> torch.Tensor:
        statics = self.statics
        return self._forward(*(statics[i] if i in statics else values.get(str(i)) for i in range(self.arity)))

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
        return self._item_specs

    def select_encoder_cudagraph_items(self, mm_kwargs: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """The one item is the whole call: ``mm_kwargs`` itself (the adapter builds it per call).

        vLLM's manager pops its reserved capture-axis entry from the returned dict, which a call
        of this adapter never has, so nothing of the caller's changes.
        """
        if indices != [0] and list(indices) != [0]:
            raise AssertionError(f"exact-shape encoder graphs hold one item, got indices {indices}")
        return mm_kwargs

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
        """Static input buffers: zeros per template, allocated outside the graph.

        They are normal tensors whatever autograd mode the capturing call runs
        in (vLLM's manager calls this outside its ``inference_mode``): every
        replay copies the live inputs into them in place, which PyTorch forbids
        on inference tensors outside ``torch.inference_mode()``, so a graph
        captured under ``inference_mode`` must still replay under ``no_grad``.
        """
        with torch.inference_mode(False):
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
        return EncoderCudaGraphReplayBuffers(values=mm_kwargs)  # read only (copied into the buffers)

    def encoder_cudagraph_forward(
        self, inputs: dict[str, torch.Tensor], path: str = "default"
    ) -> torch.Tensor:
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
        # The manager's output buffer is an inference tensor (allocated under its
        # inference_mode); cloning it in the caller's mode returns an inference
        # tensor exactly when the eager forward would.
        out = outputs["default"]
        dest[indices[0]] = out.clone() if clone else out


# ---------------------------------------------------------------------------
# The seam between policy and CUDA
# ---------------------------------------------------------------------------


class ReplayableGraph(Protocol):
    """What a backend's capture returns (vLLM's ``EncoderCudaGraphManager`` is one).

    ``execute({"0": tensor, ...})`` copies the inputs into the graph's static
    buffers, replays, and returns ``[fresh output tensor]``; ``graph_hits`` and
    ``graph_misses`` are its own counters (summed into the adapter's stats).
    """

    graph_hits: int
    graph_misses: int

    def execute(self, mm_kwargs: dict[str, Any]) -> list[torch.Tensor]: ...


class EagerMeasurement(Protocol):
    """One measured eager call, returned by :meth:`EncoderGraphBackend.measure_eager`.

    ``host_ms`` and ``peak_bytes`` are known when the call returns; ``sample()``
    is read back later without blocking (None until the device has finished the
    call), and then stays the same.
    """

    host_ms: float
    #: peak allocation during the call minus the allocation before it (bytes)
    peak_bytes: int

    def sample(self) -> EagerCallSample | None: ...


class CapturedGraph(NamedTuple):
    """What :meth:`EncoderGraphBackend.capture` returns."""

    graph: ReplayableGraph
    #: the pool the graph lives in (passed back to share it)
    pool: Any
    #: growth of the graph pool's reserved memory during this capture (bytes)
    pool_bytes: int
    #: static input buffers + output buffer, allocated outside the pool (bytes)
    static_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.static_bytes


class EncoderGraphBackend(Protocol):
    """Everything :class:`EncoderCudaGraph` needs from a device, and nothing else.

    :class:`CudaGraphBackend` is the real one. A dry run on a machine without
    CUDA implements these methods (e.g. CPU tensors eligible, a constant
    stream handle, a large free-bytes reading, measurements with fixed times, a
    capture whose ``execute`` runs ``encoder.encoder_eager_forward``) to
    exercise the adapter's real policy, keys, stats and logs.
    """

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        """The single device of the tensors in ``inputs`` if this backend can graph the call, else None.

        ``inputs`` are the call's positional inputs: tensors, None and static
        arguments; only the tensors count (a call without any is not eligible).
        Called only with autograd disabled (the adapter checks that first).
        """
        ...

    def replay_stream(self, device: torch.device) -> Hashable:
        """Handle of the stream this call runs (and a graph would replay) on; part of the key."""
        ...

    def free_bytes(self, device: torch.device) -> int:
        """Free memory of ``device`` in bytes, for the memory floor."""
        ...

    def measure_eager(
        self, device: torch.device, call: Callable[[], torch.Tensor], hold_ms: float = 0.0
    ) -> tuple[torch.Tensor, EagerMeasurement]:
        """Run ``call()`` (an eager forward on ``device``) and measure it without host syncs.

        ``call`` takes no arguments: it closes over the call's inputs, static
        arguments included, so a backend measures a call with static arguments
        like any other.

        Args:
            hold_ms: 0 measures the call as it runs (its sample has ``gpu_ms``; a
                backend that can also tell the GPU's busy time gives ``busy_ms``).
                > 0: hold the call's stream about this long (GPU ms) before the
                call, and report the GPU time after the hold as ``busy_ms`` and the
                hold as ``hold_ms`` (``gpu_ms`` None); see :class:`EagerCallSample`.

        Returns:
            ``(output, measurement)``.
        """
        ...

    def capture(
        self, encoder: ExactShapeEncoder, vllm_config: Any, device: torch.device, pool: Any | None
    ) -> CapturedGraph:
        """Capture ``encoder`` for its one shape on ``device`` and measure the bytes it holds.

        Args:
            pool: an opaque pool this backend returned from an earlier capture
                (the adapter passes it back to share it), or None for a new one.

        Raises:
            whatever the capture raised; the adapter then applies its fatal contract.
        """
        ...


def _manager_config(vllm_config: Any, tokens: int) -> Any:
    """A shallow copy of the engine config for a one-budget, batch-of-one manager."""
    config = copy.copy(vllm_config)
    compilation = copy.copy(config.compilation_config)
    compilation.encoder_cudagraph_token_budgets = [tokens]
    compilation.encoder_cudagraph_max_vision_items_per_batch = 1
    compilation.encoder_cudagraph_max_frames_per_batch = 0
    parallel = copy.copy(config.parallel_config)
    parallel.tensor_parallel_size = 1  # no manager-side DP sharding of a single item
    object.__setattr__(config, "compilation_config", compilation)
    object.__setattr__(config, "parallel_config", parallel)
    return config


class _CudaEagerMeasurement:
    """Events recorded around one eager call on its stream; read back with a non-blocking query.

    ``held`` is the event recorded after the hold's spin kernel (None for an unheld call);
    ``on_hold(ms)`` receives the hold's measured length once read back.
    """

    __slots__ = ("_end", "_held", "_on_hold", "_sample", "_start", "host_ms", "peak_bytes")

    def __init__(
        self,
        start: Any,
        held: Any | None,
        end: Any,
        host_ms: float,
        peak_bytes: int,
        on_hold: Callable[[float], None] | None = None,
    ) -> None:
        self._start, self._held, self._end, self._on_hold = start, held, end, on_hold
        self.host_ms = host_ms
        self.peak_bytes = peak_bytes
        self._sample: EagerCallSample | None = None

    def sample(self) -> EagerCallSample | None:
        if self._sample is None and self._end.query():  # cudaEventQuery: never blocks
            if self._held is None:
                self._sample = EagerCallSample(self.host_ms, self._start.elapsed_time(self._end))
            else:
                hold = self._start.elapsed_time(self._held)
                busy = self._held.elapsed_time(self._end)
                self._sample = EagerCallSample(self.host_ms, None, busy_ms=busy, hold_ms=hold)
                if self._on_hold is not None:
                    self._on_hold(hold)
            self._start = self._held = self._end = self._on_hold = None
        return self._sample


class _SpinClock:
    """How many cycles of ``torch.cuda._sleep`` make one GPU millisecond, per device index.

    ``torch.cuda._sleep(cycles)`` runs a one-thread kernel that spins on the SM
    clock (``clock64``). The first hold on a device assumes its SM clock rate
    (``nominal(device)``: the device properties' ``clock_rate`` in kHz, which is
    cycles per ms; :attr:`DEFAULT_CYCLES_PER_MS` where a torch build does not
    report it); each held call's events then give the actual rate (cycles /
    measured hold), and later holds use the mean of the last
    :attr:`WINDOW`. A hold longer than asked costs that one call some latency;
    a shorter one only makes the busy time look larger (a more conservative
    verdict), so an uncalibrated clock is safe.

    Args:
        nominal: ``nominal(device) -> cycles per ms`` before any calibration.
    """

    #: cycles per ms assumed when the device reports no clock rate (2 GHz)
    DEFAULT_CYCLES_PER_MS = 2.0e6
    WINDOW = 4

    def __init__(self, nominal: Callable[[torch.device], float] | None = None) -> None:
        self._nominal = nominal if nominal is not None else _nominal_cycles_per_ms
        self._rates: dict[int | None, deque[float]] = {}

    def cycles_per_ms(self, device: torch.device) -> float:
        rates = self._rates.get(device.index)
        return sum(rates) / len(rates) if rates else self._nominal(device)

    def cycles(self, device: torch.device, hold_ms: float) -> int:
        """Cycles for a hold of ``hold_ms`` GPU ms on ``device`` (at least 1)."""
        return max(1, round(hold_ms * self.cycles_per_ms(device)))

    def calibrate(self, index: int | None, cycles: int, held_ms: float) -> None:
        """A hold of ``cycles`` on device ``index`` measured ``held_ms``: refine that device's rate."""
        if held_ms > 0:
            self._rates.setdefault(index, deque(maxlen=self.WINDOW)).append(cycles / held_ms)


def _spin_kernel(cycles: int) -> None:
    """``torch.cuda._sleep(cycles)`` on the current stream; nothing where a torch build lacks it
    (the hold is then about 0 ms, which the events show: the verdict stays conservative)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def _nominal_cycles_per_ms(device: torch.device) -> float:
    """The device's SM clock in cycles per ms (``clock_rate``, kHz), or the default when not reported."""
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)
    return float(rate) if rate and rate > 0 else _SpinClock.DEFAULT_CYCLES_PER_MS


@dataclass
class _CudaPool:
    """A graph pool, its capture stream, and the bytes its segments reserve."""

    handle: Any
    stream: torch.cuda.Stream
    reserved_bytes: int = 0


def _pool_reserved_bytes(device: torch.device, handle: Any) -> int | None:
    """Bytes reserved by the caching allocator's segments of graph pool ``handle`` (None: unknown).

    ``torch.cuda.memory_snapshot`` walks the allocator's segments on the host
    (no device sync); segments carry ``segment_pool_id``.
    """
    try:
        segments = torch.cuda.memory_snapshot(mempool_id=handle, include_traces=False)
    except TypeError:  # a torch without per-pool snapshots
        segments = torch.cuda.memory_snapshot()
    if segments and not all("segment_pool_id" in seg for seg in segments):
        return None
    return sum(
        int(seg["total_size"])
        for seg in segments
        if tuple(seg["segment_pool_id"]) == tuple(handle) and seg.get("device", device.index) == device.index
    )


class CudaGraphBackend:
    """The CUDA backend: vLLM's ``EncoderCudaGraphManager`` on the current CUDA stream.

    - eligible: at least one tensor input, every tensor input on one CUDA
      device (None and static arguments are skipped), CUDA autocast off, and
      the current stream not being captured by someone else (both read through
      torch's C functions directly);
    - replay stream: the id of ``torch.cuda.current_stream(device)``, read
      without building a ``Stream`` object (``torch.cuda.current_stream``'s own
      building block), which saves about 3 us per call;
    - free bytes: vllm-omni's ``current_omni_platform.get_free_memory(device)``
      (``cudaMemGetInfo`` on CUDA);
    - measure: CUDA timing events recorded on the call's stream right before
      and after the eager call (read back later by ``cudaEventQuery``, never
      synchronising), the host's ``perf_counter`` around it, and the caching
      allocator's peak (``torch.accelerator.reset_peak_memory_stats`` before
      the call, ``max_memory_allocated`` after it, both host-side counters;
      this resets the device's peak statistics, as vLLM's own
      ``get_current_memory_usage`` does). A held measurement also runs
      ``torch.cuda._sleep`` on the call's stream between the first event and
      a third one, sized by a per-device spin clock (:class:`_SpinClock`) that
      each held call's events calibrate;
    - capture: one manager per shape, built from a shallow copy of the engine
      config (one token budget, one item, TP 1; the engine's config is never
      mutated), captured with ``manager.capture(graph_pool=...)`` on a capture
      stream that first waits for the replay stream (so a late capture into a
      shared pool starts after earlier replays and their output clones) and
      that the replay stream then waits for. A pool is a graph pool handle
      (``torch.cuda.graph_pool_handle()``) with its capture stream. Bytes: the
      pool's reserved segments after the capture minus before it (allocator
      snapshot of that pool; ``memory_reserved`` growth if the snapshot does
      not name pools), plus the static input and output buffers.
    """

    def __init__(self) -> None:
        self._spin = _SpinClock()

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        device = None
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                continue  # None or a static argument
            if not x.is_cuda:
                return None
            if device is None:
                device = x.device
            elif x.device != device:
                return None
        # torch.is_autocast_enabled() without a device type is CUDA's (torch's own overload, no
        # string to parse); the capturing check is torch.cuda.is_current_stream_capturing's C call
        if device is None or torch.is_autocast_enabled() or _stream_capturing():
            return None
        return device

    def replay_stream(self, device: torch.device) -> int:
        # torch.cuda.current_stream(device).stream_id without constructing a Stream
        return torch._C._cuda_getCurrentStream(device.index)[0]

    def free_bytes(self, device: torch.device) -> int:
        return omni_platforms.current_omni_platform.get_free_memory(device)

    def measure_eager(
        self, device: torch.device, call: Callable[[], torch.Tensor], hold_ms: float = 0.0
    ) -> tuple[torch.Tensor, EagerMeasurement]:
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.accelerator.reset_peak_memory_stats(device)
        allocated = torch.accelerator.memory_allocated(device)
        start.record(stream)
        held = on_hold = None
        if hold_ms > 0:
            cycles = self._spin.cycles(device, hold_ms)
            with torch.accelerator.device_index(device.index):  # _sleep uses the current device
                _spin_kernel(cycles)
            held = torch.cuda.Event(enable_timing=True)
            held.record(stream)
            on_hold = functools.partial(self._spin.calibrate, device.index, cycles)
        t0 = time.perf_counter()
        out = call()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record(stream)
        peak = torch.accelerator.max_memory_allocated(device) - allocated
        return out, _CudaEagerMeasurement(start, held, end, host_ms, peak, on_hold)

    def capture(
        self, encoder: ExactShapeEncoder, vllm_config: Any, device: torch.device, pool: Any | None
    ) -> CapturedGraph:
        from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

        replay_stream = torch.cuda.current_stream(device)
        if pool is None:
            with torch.accelerator.device_index(device.index):
                pool = _CudaPool(torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        reserved = torch.accelerator.memory_reserved(device)
        manager = EncoderCudaGraphManager(
            _manager_config(vllm_config, encoder.tokens),
            device,
            encoder.dtype,
            encoder,
            capture_error_mode=CAPTURE_ERROR_MODE,
        )
        pool.stream.wait_stream(replay_stream)
        with torch.accelerator.device_index(device.index), torch.cuda.stream(pool.stream):
            manager.capture(graph_pool=pool.handle)
        replay_stream.wait_stream(pool.stream)
        pool_now = _pool_reserved_bytes(device, pool.handle)
        if pool_now is None:  # segments do not name their pool: everything reserved meanwhile
            growth = torch.accelerator.memory_reserved(device) - reserved
        else:
            growth, pool.reserved_bytes = pool_now - pool.reserved_bytes, pool_now
        return CapturedGraph(manager, pool, max(0, growth), encoder.static_bytes)


#: ``torch.cuda.is_current_stream_capturing``'s C function (torch defines a stand-in on builds without
#: CUDA), called without the Python wrapper around it.
_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------


class EncoderCudaGraphCaptureFailedError(RuntimeError):
    """Raised by every call after a capture failed (the fatal contract)."""


def in_memory_profiling(vllm_config: Any) -> bool:
    """True while vLLM's start-up memory profiling may be running: the KV cache is not sized yet.

    vLLM's worker profiles memory in ``determine_available_memory``, whose
    ``profile_run`` calls ``model.embed_multimodal`` on dummy inputs of the
    largest size; only afterwards does ``Worker.initialize_from_config`` set
    ``cache_config.num_gpu_blocks`` (None until then). vLLM 0.28.0
    and 0.30.0 both do this, and vllm-omni's AR and generation workers inherit it
    (``OmniWorkerMixin.initialize_from_config`` calls vLLM's). The model's
    ``vllm_config`` shares ``cache_config`` with the worker's, also through
    ``VllmConfig.with_hf_config``. A config without ``cache_config`` is never
    profiling. Outside an engine, set ``cache_config.num_gpu_blocks`` (e.g. to
    0), or every call counts as a profiling call and nothing is captured.
    """
    cache_config = getattr(vllm_config, "cache_config", None)
    return cache_config is not None and getattr(cache_config, "num_gpu_blocks", 0) is None


@dataclass(frozen=True)
class GraphInfo:
    """Bytes and capture time of one graph (measured at capture, through the backend)."""

    pool_bytes: int
    static_bytes: int
    capture_ms: float

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.static_bytes


@dataclass
class _KeyRecord:
    """What an uncaptured key's eager calls showed: the cost rule's and the byte budget's input."""

    first_call: int
    last_call: int = 0
    sightings: int = 0
    #: (shape, dtype) of the eager output
    output: tuple[torch.Size, torch.dtype] | None = None
    #: unheld measurements (at most ``EncoderCudaGraph.MAX_SAMPLES``)
    measurements: list[EagerMeasurement] = dataclasses.field(default_factory=list)
    #: the one held measurement, once the cost rule asked for it
    held: EagerMeasurement | None = None
    #: > 0: the hold (GPU ms) the key's next eager call makes
    hold_ms: float = 0.0
    verdict: CostVerdict | None = None

    def taken(self) -> list[EagerMeasurement]:
        """Every measurement of the key, the held one last."""
        return self.measurements if self.held is None else [*self.measurements, self.held]

    def samples(self) -> list[EagerCallSample]:
        """The measurements read back so far (never blocks)."""
        return [sample for m in self.taken() if (sample := m.sample()) is not None]


#: Granularity of the CUDA caching allocator's segments (its small-segment size and large-size rounding).
_SEGMENT_BYTES = 2 << 20

#: Buffer keys of positional inputs (``ExactShapeEncoder.keys``), prebuilt for the hit path.
_BUFFER_KEYS = tuple(str(i) for i in range(64))


_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
    ("_global_backward_hooks", "register_module_full_backward_hook"),
)
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class EncoderCudaGraph:
    """Replay an encoder call from a CUDA graph captured for its exact input shapes.

    ``adapter(*inputs)`` returns what ``forward(*inputs)`` returns: a fresh
    tensor (replayed outputs are clones, so a returned tensor survives later
    replays), an inference tensor exactly when the eager call's would be (the
    call runs under ``torch.inference_mode()``). Graphs captured under
    ``inference_mode`` replay under plain ``torch.no_grad()`` and the reverse.
    Inputs are positional tensors or None, and with ``static_args`` also static
    arguments; the graph key is the replay stream, the device of the tensor
    inputs and, per input, a tensor's ``(shape, dtype)``, None (so "mask given"
    and "no mask" are different graphs) or a static argument's
    ``(STATIC_ARG, value)``. Strides and tensor values are not part of the
    key; replays read the live input values.

    *Static arguments* (``static_args=True``): any positional input that is
    neither a tensor nor None (an int, a tuple, an object) is part of the key
    by value (``==`` and ``hash``, so it must be hashable; an object without
    ``__eq__`` counts by identity) and is passed unchanged to every call of
    ``forward`` (warm-up, capture, eager); it never becomes a static input
    buffer. A graph bakes in what ``forward`` did with it at capture, so each
    value is its own graph. They carry what fixes the forward's control flow or
    shapes without being a tensor shape (e.g. a KV-cache length), or a
    persistent buffer the forward reads and writes in place (e.g. a K/V arena)
    instead of a static copy. The choice is made once per adapter, so an
    adapter whose inputs are all tensors keeps the tensor-only key and replay
    path; there, a call with any other input is ineligible.

    A call runs ``forward`` eagerly, without touching any graph, when it is
    *ineligible*: autograd enabled, an input that is neither a tensor nor None
    without ``static_args``, or the backend refuses the tensor inputs (for
    :class:`CudaGraphBackend`: no tensor inputs, a non-CUDA tensor, tensors on
    more than one device, CUDA autocast enabled, or the current stream being
    captured by someone else). Calls made during vLLM's start-up memory
    profiling (:func:`in_memory_profiling`) run eagerly and count as profile
    misses, without touching admission. Other eligible calls follow
    :class:`CaptureAdmission`; at a key's capture threshold, ``admission="cost"``
    asks :class:`CaptureCostModel` whether the graph pays (from the key's eager
    calls, measured by the backend), then the byte budget ``max_bytes`` and the
    free-memory floor may defer the capture (each deferral logs a WARNING the
    first time and every :attr:`MEMORY_WARNING_EVERY` deferrals).

    Stats: :meth:`get_cumulative_stats` (nine keys, vLLM's contract) and
    :meth:`get_detailed_stats` (miss kinds beyond those, bytes and hits per
    graph). With ``log_interval_s`` the call path logs one INFO line with the
    hit rate, graphs and bytes when that many seconds have passed since the
    last one (no timer thread).

    Python side effects: a replay runs the recorded GPU work only. Attribute
    writes, counters or hooks inside ``forward`` happen on the warmup calls and
    the capture, never on replay, so ``forward`` must have none. Before each
    capture (and again after it, in case the forward registered some) the
    adapter looks for forward/backward hooks on the modules ``forward`` runs
    (``captured_modules``) and for torch's global module hooks. If it finds any,
    it does not capture: it logs one WARNING naming the hooks and turns eager
    for good (no captures, no replays of earlier graphs; its calls count as
    ineligible misses). This is not fatal, as the eager forward runs the hooks
    as registered (e.g. vLLM's ``--enable-layerwise-nvtx-tracing`` hooks every
    module). Hooks registered after the last capture are not seen.

    Fatal contract: if a capture raises, the original exception propagates,
    nothing is registered, and every later call raises
    :class:`EncoderCudaGraphCaptureFailedError` without capturing or running any
    CUDA work (a failed capture can leave the CUDA context unusable). Restart
    the worker, optionally with ``--hf-overrides '{"encoder_cuda_graph": false}'``.

    Args:
        forward: the eager encoder, ``forward(*inputs) -> Tensor``; must be
            capturable (no host syncs, no data-dependent shapes) and free of
            Python side effects.
        vllm_config: the engine's ``VllmConfig``; copied per capture, never
            mutated (the manager needs ``model_config.multimodal_config``).
        max_graphs, min_capture_calls, min_free_bytes, share_pools, admission,
            max_bytes, log_interval_s: see :class:`EncoderCudaGraphOptions`
            (validated the same way).
        name: encoder name for logs (``"vision"``, ``"audio"``).
        static_args: whether inputs other than tensors and None are static
            arguments (see above); False makes such calls ineligible.
        captured_modules: dotted names, relative to the module that owns the
            bound method ``forward``, of the modules ``forward`` calls (checked
            for hooks). None checks the owner's whole module tree; a ``forward``
            that is not a module's method has only the global hooks checked.
        backend: the device seam; default :class:`CudaGraphBackend`. Kept as
            the attribute ``backend``, which a dry run may replace on an
            adapter built by :func:`make_encoder_cuda_graph` before its first call.

    Raises:
        HfOverridesError: (a ``ValueError``) invalid option values.
        RuntimeError: vLLM's ``EncoderCudaGraphManager`` cannot capture in
            :data:`CAPTURE_ERROR_MODE` (a vLLM without its ``capture_error_mode``).
    """

    #: A memory-floor or byte-budget deferral warns the first time and then every this many.
    MEMORY_WARNING_EVERY = 100
    #: Hooks named in the hooks warning (the rest are counted).
    HOOKS_NAMED = 5
    #: Eager calls measured per key (the cost rule uses their medians).
    MAX_SAMPLES = 3

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        vllm_config: Any,
        *,
        max_graphs: int = 4,
        min_capture_calls: int = 2,
        min_free_bytes: int = 1 << 30,
        share_pools: bool = True,
        admission: str = "cost",
        max_bytes: int = 0,
        log_interval_s: float = 60.0,
        name: str = "encoder",
        static_args: bool = False,
        captured_modules: Sequence[str] | None = None,
        backend: EncoderGraphBackend | None = None,
    ) -> None:
        _require_capture_error_mode()
        self.options = EncoderCudaGraphOptions(
            max_graphs=max_graphs,
            min_capture_calls=min_capture_calls,
            min_free_bytes=min_free_bytes,
            share_pools=share_pools,
            admission=admission,
            max_bytes=max_bytes,
            log_interval_s=log_interval_s,
        )
        self.forward = forward
        self.vllm_config = vllm_config
        self.name = name
        self.static_args = bool(static_args)
        self.captured_modules = None if captured_modules is None else tuple(captured_modules)
        self.backend: EncoderGraphBackend = backend if backend is not None else CudaGraphBackend()
        self.admission = CaptureAdmission(max_graphs, min_capture_calls)
        self.cost_model = CaptureCostModel()
        # key -> replayable graph (a vLLM manager) holding the key's single graph
        self.graphs: dict[GraphKey, ReplayableGraph] = {}
        # key -> bytes and capture time of its graph
        self.graph_info: dict[GraphKey, GraphInfo] = {}
        # key -> what the key's eager calls showed, for keys in the admission history
        self._records: dict[GraphKey, _KeyRecord] = {}
        # (device, replay stream id) -> the backend's pool, with share_pools
        self._capture_pools: dict[tuple[torch.device, Hashable], Any] = {}
        self._failure: BaseException | None = None
        self._eager_reason: str | None = None
        self._deferrals: Counter[str] = Counter()
        self._cap_logged = False
        self._profiling_over = False
        self._calls = 0  # eligible calls: the clock of the cost rule's rates
        self._held_calls = 0
        self._measure = admission == "cost" or max_bytes > 0
        self._log_interval = float(log_interval_s)
        self._next_log = time.monotonic() + self._log_interval

    # -- public --------------------------------------------------------------------
    @property
    def capture_failed(self) -> bool:
        return self._failure is not None

    @property
    def eager_reason(self) -> str | None:
        """Why this adapter turned eager for good (hooks found at capture), or None."""
        return self._eager_reason

    @property
    def graph_bytes(self) -> int:
        """Bytes held by this adapter's graphs (pool growth + static buffers, measured at capture)."""
        return sum(info.total_bytes for info in self.graph_info.values())

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if self._failure is not None:
            raise EncoderCudaGraphCaptureFailedError(
                f"{self.name} encoder CUDA graph capture failed earlier "
                f"({type(self._failure).__name__}: {self._failure}); this adapter is unusable. "
                "Restart the worker, optionally with --hf-overrides "
                "'{\"encoder_cuda_graph\": false}' to run the encoders eagerly."
            )
        if self._log_interval and time.monotonic() >= self._next_log:
            self._log_progress()
        device = None
        if self._eager_reason is None and not torch.is_grad_enabled():
            device = self.backend.eligible_device(inputs)
        if device is None:
            self.admission.record_ineligible()
            return self.forward(*inputs)
        if self.static_args:
            return self._call_with_statics(inputs, device)
        try:
            entries = tuple([None if x is None else (x.shape, x.dtype) for x in inputs])
        except AttributeError:  # an input that is neither a tensor nor None, without static_args
            self.admission.record_ineligible()
            return self.forward(*inputs)
        self._calls += 1
        key: GraphKey = (self.backend.replay_stream(device), device, entries)
        manager = self.graphs.get(key)
        if manager is not None:  # hit: the common case, kept to one lookup
            return manager.execute({_BUFFER_KEYS[i]: x for i, x in enumerate(inputs) if x is not None})[0]
        return self._miss(key, inputs, device)

    def get_cumulative_stats(self) -> dict[str, Any]:
        """Counters since construction (never reset), per adapter.

        Returns:
            dict with exactly :data:`STATS_KEYS`: ``graph_hits`` (calls served by
            a replay, the capturing call included), ``graph_misses`` (all eager
            calls: every miss kind of :data:`MISS_KINDS` plus any counted by
            vLLM's managers), ``hit_rate`` (hits / (hits + misses), 0.0 before
            any call), ``num_graphs``, ``ineligible_misses``,
            ``capacity_misses``, ``warmup_misses``, ``memory_misses`` and
            ``capture_failures`` (0 or 1). The other miss kinds are in
            :meth:`get_detailed_stats`.
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

    def get_detailed_stats(self) -> dict[str, Any]:
        """What :meth:`get_cumulative_stats` leaves out, since construction.

        Returns:
            dict with ``admission`` (``"cost"`` or ``"count"``),
            ``declined_misses`` (eager calls of keys the cost rule declined),
            ``held_calls`` (warmup calls the cost rule measured behind a hold),
            ``budget_misses`` (captures deferred by ``max_bytes``),
            ``profile_misses`` (calls during vLLM's start-up profiling),
            ``graph_bytes`` (int, bytes held by all graphs), ``max_bytes`` (the
            budget, 0 = none), and ``graphs``: one dict per graph in capture
            order with ``inputs`` (``[(shape, dtype) | None, ...]``), ``hits``,
            ``bytes`` (= ``pool_bytes`` + ``static_bytes``), ``pool_bytes``
            (graph pool growth at its capture), ``static_bytes`` (input and
            output buffers) and ``capture_ms`` (wall time of the capture).
        """
        m = self.admission.misses
        graphs = [
            {
                "inputs": _describe(key),
                "hits": self.graphs[key].graph_hits,
                "bytes": info.total_bytes,
                "pool_bytes": info.pool_bytes,
                "static_bytes": info.static_bytes,
                "capture_ms": info.capture_ms,
            }
            for key, info in self.graph_info.items()
            if key in self.graphs
        ]
        return {
            "admission": self.options.admission,
            "declined_misses": m["declined"],
            "held_calls": self._held_calls,
            "budget_misses": m["budget"],
            "profile_misses": m["profile"],
            "graph_bytes": self.graph_bytes,
            "max_bytes": self.options.max_bytes,
            "graphs": graphs,
        }

    def capture_now(self, *inputs: Any) -> tuple[torch.Tensor, str]:
        """Capture the graph of a call with ``inputs`` now, keyed as that call is: start-up capture.

        For calls known to recur (a duplex session's chunk forms, a camera frame), before any has
        been served: admission's sightings and the cost rule are skipped; the graph cap, the byte
        budget ``max_bytes``, the module-hooks check and the fatal capture contract apply as to
        any capture. The free-memory floor is the caller's to check (it decides what a start-up
        capture may take). The graph's capture and its first replay (which serves this call and
        leaves what the forward writes in place, as a lazy capture's does) are not counted as
        graph hits, nor the eager run that gives the output's shape as a miss; the capture is
        logged at DEBUG.

        Returns:
            ``(output, outcome)``: what ``forward(*inputs)`` returns and ``"captured"``,
            ``"present"`` (a graph already serves the key), or why nothing was captured:
            ``"ineligible"``, ``"profile"`` (vLLM's memory profiling is running), ``"capacity"``,
            ``"budget"``, ``"hooks"``.

        Raises:
            EncoderCudaGraphCaptureFailedError: a capture failed earlier.
            whatever the capture raises (the adapter is then unusable, as after any failed capture).
        """
        if self._failure is not None:
            raise EncoderCudaGraphCaptureFailedError(
                f"{self.name} encoder CUDA graph capture failed earlier ({self._failure}); restart the worker"
            )
        device = None
        if self._eager_reason is None and not torch.is_grad_enabled():
            device = self.backend.eligible_device(inputs)
        if device is None or len(inputs) > len(_BUFFER_KEYS):
            return self.forward(*inputs), "ineligible"
        if not self.static_args and any(map(_is_static, inputs)):
            return self.forward(*inputs), "ineligible"
        if in_memory_profiling(self.vllm_config):
            return self.forward(*inputs), "profile"
        entries = tuple(map(_key_entry, inputs))
        key: GraphKey = (self.backend.replay_stream(device), device, entries)
        manager = self.graphs.get(key)
        if manager is not None:
            return self._replay_uncounted(manager, inputs), "present"
        if len(self.graphs) >= self.options.max_graphs:
            return self.forward(*inputs), "capacity"
        out = self.forward(*inputs)
        record = _KeyRecord(first_call=self._calls, output=(out.shape, out.dtype))
        if self.options.max_bytes and self._over_budget(key, record):
            return out, "budget"
        if not self._capture(key, record, inputs, device, log_level=logging.DEBUG):
            return out, "hooks"
        return self._replay_uncounted(self.graphs[key], inputs), "captured"

    def _replay_uncounted(self, manager: ReplayableGraph, inputs: Sequence[Any]) -> torch.Tensor:
        hits = manager.graph_hits
        out = self._replay(manager, inputs)
        manager.graph_hits = hits
        return out

    # -- internals -------------------------------------------------------------------
    def _call_with_statics(self, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        """The rest of an eligible call of an adapter with ``static_args``: key, hit or miss."""
        self._calls += 1
        key: GraphKey = (self.backend.replay_stream(device), device, tuple(map(_key_entry, inputs)))
        try:
            manager = self.graphs.get(key)
        except TypeError as exc:  # an unhashable static argument
            raise TypeError(
                f"{self.name} encoder CUDA graph: every static argument must be hashable, got "
                f"{[type(x).__name__ for x in inputs if _is_static(x)]} ({exc})"
            ) from exc
        if manager is not None:
            return self._replay(manager, inputs)
        return self._miss(key, inputs, device)

    def _miss(self, key: GraphKey, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        """An eligible call without a graph: profiling guard, admission, cost, budget, floor, capture."""
        if not self._profiling_over and self._in_profile_run():
            self.admission.record_miss("profile")
            return self.forward(*inputs)
        # Never captured, so the hit path needs no check: more inputs than buffer keys, or, without
        # static_args, an input that has a shape and a dtype but is no tensor (e.g. a NumPy array).
        if len(inputs) > len(_BUFFER_KEYS) or (not self.static_args and any(map(_is_static, inputs))):
            self.admission.record_ineligible()
            return self.forward(*inputs)
        decision = self.admission.admit(key)
        if decision is Admission.CAPACITY:
            self._log_cap_once()
            return self.forward(*inputs)
        record = self._sighting(key)
        if decision is Admission.CAPTURE:
            deferral = self._deferral(key, record, device)
            if deferral is None:
                if self._capture(key, record, inputs, device):
                    # the capturing call is served by the new graph's first replay
                    return self._replay(self.graphs[key], inputs)
                self.admission.record_ineligible()  # refused (hooks): eager from now on
                return self.forward(*inputs)
            self.admission.record_miss(deferral)
        return self._run_eager(record, inputs, device)

    def _in_profile_run(self) -> bool:
        if in_memory_profiling(self.vllm_config):
            if not self.admission.misses["profile"]:
                logger.info(
                    "%s encoder call during vLLM's start-up memory profiling (KV cache not sized yet): "
                    "runs eagerly and does not count toward CUDA graph admission",
                    self.name,
                )
            return True
        self._profiling_over = True
        return False

    def _sighting(self, key: GraphKey) -> _KeyRecord:
        """Update (or start, when admission restarted the key's count) the key's record."""
        record = self._records.get(key)
        if record is None or self.admission.history.get(key) == 1:
            record = self._records[key] = _KeyRecord(first_call=self._calls)
            # keep records only for keys still in the admission history
            if len(self._records) > len(self.admission.history):
                for stale in [k for k in self._records if k not in self.admission.history]:
                    del self._records[stale]
        record.sightings += 1
        record.last_call = self._calls
        return record

    def _run_eager(self, record: _KeyRecord, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        """The eager forward: held once when the cost rule asked for it, else measured while the key
        has fewer than :attr:`MAX_SAMPLES` unheld samples."""
        if record.hold_ms > 0:
            self._held_calls += 1
            out, record.held = self.backend.measure_eager(
                device, lambda: self.forward(*inputs), record.hold_ms
            )
            record.hold_ms = 0.0
        elif self._measure and len(record.measurements) < self.MAX_SAMPLES:
            out, measurement = self.backend.measure_eager(device, lambda: self.forward(*inputs))
            record.measurements.append(measurement)
        else:
            out = self.forward(*inputs)
        if record.output is None:
            record.output = (out.shape, out.dtype)
        return out

    def _deferral(self, key: GraphKey, record: _KeyRecord, device: torch.device) -> str | None:
        """Why a key at its capture threshold is not captured on this call (a miss kind), or None."""
        if self.options.admission == "cost":
            verdict = record.verdict = self._cost_verdict(key, record)
            if verdict is None:
                return "warmup"  # no measurement read back yet
            if not verdict.capture:
                if verdict.hold_ms > 0:  # the rule needs the GPU's busy time: hold this call once
                    if record.held is None:
                        record.hold_ms = verdict.hold_ms
                    return "warmup"
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "%s encoder CUDA graph for inputs %s declined: %s",
                        self.name,
                        _describe(key),
                        verdict.describe(),
                    )
                return "declined"
        if self.options.max_bytes and self._over_budget(key, record):
            return "budget"
        if self._below_memory_floor(device):
            return "memory"
        return None

    def _cost_verdict(self, key: GraphKey, record: _KeyRecord) -> CostVerdict | None:
        samples = record.samples()
        if not any(s.gpu_ms is not None for s in samples):
            return None
        return self.cost_model.decide(
            samples,
            sightings=record.sightings,
            first_call=record.first_call,
            last_call=record.last_call,
            calls=self._calls,
            graph_bytes=self._estimate_bytes(key, record),
        )

    def _estimate_bytes(self, key: GraphKey, record: _KeyRecord) -> int:
        """Bytes a capture of ``key`` would hold: eager peak (~ pool growth) + inputs + output buffer.

        A capture allocates the forward's intermediates and output in the graph
        pool, which therefore grows by about the eager call's peak allocation
        delta, rounded up to the caching allocator's 2 MiB segment granularity
        (less when a shared pool already holds reusable blocks), plus static
        copies of the tensor inputs and one output buffer outside the pool
        (static arguments have no buffer).
        """
        shape, dtype = record.output
        static = math.prod(shape) * dtype.itemsize
        static += sum(math.prod(s) * d.itemsize for s, d in _tensor_entries(key))
        peak = max((m.peak_bytes for m in record.taken()), default=0)
        return -(-peak // _SEGMENT_BYTES) * _SEGMENT_BYTES + static

    def _over_budget(self, key: GraphKey, record: _KeyRecord) -> bool:
        """True (and a rate-limited WARNING) when the capture would pass ``max_bytes``."""
        estimate, held = self._estimate_bytes(key, record), self.graph_bytes
        if held + estimate <= self.options.max_bytes:
            return False
        self._warn_deferral(
            "budget",
            "%s encoder CUDA graph capture for inputs %s deferred (%d time(s) so far): its graph would "
            "hold about %s on top of %s, passing encoder_cuda_graph_max_bytes=%d; the call runs eagerly.",
            self.name,
            _describe(key),
            self._deferrals["budget"] + 1,
            _mib(estimate),
            _mib(held),
            self.options.max_bytes,
        )
        return True

    def _below_memory_floor(self, device: torch.device) -> bool:
        """True (and a rate-limited WARNING) when free memory is below the floor."""
        floor = self.options.min_free_bytes
        if not floor:
            return False
        free = self.backend.free_bytes(device)
        if free >= floor:
            return False
        self._warn_deferral(
            "memory",
            "%s encoder CUDA graph capture deferred (%d time(s) so far): %d bytes free on %s, "
            "below encoder_cuda_graph_min_free_bytes=%d; the call runs eagerly. Free device memory, "
            "lower encoder_cuda_graph_min_free_bytes, or set it to 0 to disable the floor.",
            self.name,
            self._deferrals["memory"] + 1,
            free,
            device,
            floor,
        )
        return True

    def _warn_deferral(self, kind: str, msg: str, *args: Any) -> None:
        self._deferrals[kind] += 1
        count = self._deferrals[kind]
        if count == 1 or count % self.MEMORY_WARNING_EVERY == 0:
            logger.warning(msg, *args)

    def _log_cap_once(self) -> None:
        if self._cap_logged:
            return
        self._cap_logged = True
        if self.options.max_graphs == 0:
            logger.info("%s encoder CUDA graphs disabled (encoder_cuda_graph_max_graphs=0)", self.name)
        else:
            logger.warning(
                "%s encoder CUDA graph cap reached (%d graphs); new shapes run eagerly for the "
                "lifetime of the model (raise encoder_cuda_graph_max_graphs to capture more)",
                self.name,
                self.options.max_graphs,
            )

    def _log_progress(self) -> None:
        """The periodic INFO line: hit rate, graphs, bytes and misses by kind (cumulative)."""
        self._next_log = time.monotonic() + self._log_interval
        stats = self.get_cumulative_stats()
        total = stats["graph_hits"] + stats["graph_misses"]
        if not total:
            return
        misses = ", ".join(f"{kind} {n}" for kind in MISS_KINDS if (n := self.admission.misses[kind]))
        logger.info(
            "%s encoder CUDA graphs: hit rate %.1f%% (%d of %d calls), %d graph(s) holding %s; "
            "misses: %s (admission=%s)",
            self.name,
            100.0 * stats["hit_rate"],
            stats["graph_hits"],
            total,
            stats["num_graphs"],
            _mib(self.graph_bytes),
            misses or "none",
            self.options.admission,
        )

    @staticmethod
    def _replay(manager: ReplayableGraph, inputs: Sequence[Any]) -> torch.Tensor:
        """Replay; the graph copies ``inputs`` into its static buffers and returns a clone of its output."""
        return manager.execute(
            {_BUFFER_KEYS[i]: x for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
        )[0]

    def _capture(
        self,
        key: GraphKey,
        record: _KeyRecord,
        inputs: Sequence[Any],
        device: torch.device,
        log_level: int = logging.INFO,
    ) -> bool:
        """Capture ``key`` and register it; False when hooks forbid it; raises on failure (fatal)."""
        if self._refuse_if_hooked("before"):
            return False
        start = time.perf_counter()
        pool_key = (device, key[0])
        pool = self._capture_pools.get(pool_key) if self.options.share_pools else None
        try:
            encoder = ExactShapeEncoder(self.forward, inputs, *record.output)
            captured = self.backend.capture(encoder, self.vllm_config, device, pool)
        except BaseException as exc:
            self._failure = exc
            self.admission.record_failure()
            self._records.clear()
            logger.error(
                "%s encoder CUDA graph capture failed for input shapes %s; the adapter is now "
                "unusable and later calls raise. Restart the worker, optionally with "
                "--hf-overrides '{\"encoder_cuda_graph\": false}'.",
                self.name,
                _describe(key),
            )
            raise
        capture_ms = (time.perf_counter() - start) * 1e3
        if self.options.share_pools:
            self._capture_pools[pool_key] = captured.pool
        if self._refuse_if_hooked("during"):  # the captured forward registered hooks itself
            return False
        # Registered only after a complete capture: a failure leaves no half-registered graph.
        self.graphs[key] = captured.graph
        self.graph_info[key] = GraphInfo(captured.pool_bytes, captured.static_bytes, capture_ms)
        self.admission.record_captured(key)
        self._records.pop(key, None)
        self._log_capture(key, record.verdict, self.graph_info[key], log_level)
        return True

    def _log_capture(
        self, key: GraphKey, verdict: CostVerdict | None, info: GraphInfo, level: int = logging.INFO
    ) -> None:
        if verdict is not None:
            self.cost_model.record_capture(verdict.capture_ms, info.capture_ms)
        logger.log(
            level,
            # the first literal is the prefix log readers match (tests/e2e/serve_smoke.CAPTURE_RE)
            "Captured %s encoder CUDA graph %d/%d for inputs %s in %.1f ms"
            ": %s (pool +%s, static %s); %s graphs hold %s%s",
            self.name,
            len(self.graphs),
            self.options.max_graphs,
            _describe(key),
            info.capture_ms,
            _mib(info.total_bytes),
            _mib(info.pool_bytes),
            _mib(info.static_bytes),
            self.name,
            _mib(self.graph_bytes),
            "" if verdict is None else f" ({verdict.describe()})",
        )

    def _refuse_if_hooked(self, when: str) -> bool:
        """Turn eager for good (one WARNING) if hooks would be skipped by replays."""
        hooks = list(self._hooks_in_captured_region())
        if not hooks:
            return False
        shown = ", ".join(hooks[: self.HOOKS_NAMED]) + (
            f" (+{len(hooks) - self.HOOKS_NAMED} more)" if len(hooks) > self.HOOKS_NAMED else ""
        )
        self._eager_reason = f"module hooks in the captured region: {shown}"
        self.admission.record_failure()
        self._records.clear()
        logger.warning(
            "%s encoder CUDA graphs turned off: hooks found %s capture on %s. A CUDA graph replay "
            "skips Python hooks, so this encoder now runs eagerly (hooks run as registered). To use "
            "graphs, remove the hooks before the model serves (vLLM's --enable-layerwise-nvtx-tracing "
            "adds them to every module); to silence this, pass --hf-overrides "
            "'{\"encoder_cuda_graph\": false}'.",
            self.name,
            when,
            shown,
        )
        return True

    def _hooks_in_captured_region(self) -> Iterator[str]:
        """Names of hooks that a replay of ``forward`` would skip."""
        from torch.nn.modules import module as torch_module

        for attr, register in _GLOBAL_HOOKS:
            if getattr(torch_module, attr, None):
                yield f"every module (torch.nn.modules.module.{register})"
        for name, module in self._captured_module_tree():
            kinds = [
                kind.strip("_").replace("_hooks", "") for kind in _MODULE_HOOKS if getattr(module, kind, None)
            ]
            if kinds:
                yield f"{name} ({'/'.join(kinds)} hook)"

    def _captured_module_tree(self) -> Iterator[tuple[str, nn.Module]]:
        owner = (
            self.forward if isinstance(self.forward, nn.Module) else getattr(self.forward, "__self__", None)
        )
        if not isinstance(owner, nn.Module):
            return
        owner_name = type(owner).__name__
        if self.captured_modules is None:
            yield from owner.named_modules(prefix=owner_name)
            return
        for sub in self.captured_modules:
            yield from owner.get_submodule(sub).named_modules(prefix=f"{owner_name}.{sub}")


def _require_capture_error_mode() -> None:
    """Raise unless vLLM's manager takes ``capture_error_mode``: never capture in global mode."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    if "capture_error_mode" not in inspect.signature(EncoderCudaGraphManager).parameters:
        raise RuntimeError(
            "vLLM's EncoderCudaGraphManager takes no capture_error_mode, so encoder CUDA graphs "
            "would be captured in global mode, which a CUDA call of any other thread breaks: use a vLLM "
            "whose EncoderCudaGraphManager takes capture_error_mode (the vLLM change 'encoder_cudagraph: "
            "let the caller choose the capture error mode of encoder graphs'), or run the encoders "
            "eagerly with --hf-overrides '{\"encoder_cuda_graph\": false}'."
        )


def _describe(key: GraphKey) -> list[Any]:
    """Readable inputs of a key for logs: ``[(shape, dtype) | None | static value, ...]``."""
    return [
        t if t is None else t[1] if t[0] == STATIC_ARG else (tuple(t[0]), str(t[1]).replace("torch.", ""))
        for t in key[2]
    ]


def _tensor_entries(key: GraphKey) -> Iterator[tuple[torch.Size, torch.dtype]]:
    """The ``(shape, dtype)`` entries of a key's tensor inputs (not None, not static arguments)."""
    return (t for t in key[2] if t is not None and t[0] != STATIC_ARG)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------
# Factory and LoRA
# ---------------------------------------------------------------------------


def lora_may_reach(vllm_config: Any, model: Any, module_prefixes: Sequence[str]) -> str | None:
    """Why vLLM's LoRA could put adapters on an encoder's modules, or None if it cannot.

    A replay keeps whatever weights were live at capture, so an encoder that
    LoRA can reach must stay eager. vLLM's LoRA manager (0.28 and 0.30) wraps a
    multimodal model's layers as follows: with ``--enable-lora``
    (``vllm_config.lora_config`` set) and a model without ``get_mm_mapping()``,
    every LoRA-capable layer gets the language model's adapters, encoder layers
    included; with ``get_mm_mapping()``, only modules under its language-model
    prefix do, unless ``LoRAConfig.enable_tower_connector_lora`` also opens the
    ``tower_model`` and ``connector`` prefixes.

    Args:
        vllm_config: the engine's config.
        model: the multimodal model (its class decides ``get_mm_mapping``).
        module_prefixes: the encoder's module names in ``model``, e.g. ``("vpm",)``.
    """
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        return None
    get_mapping = getattr(model, "get_mm_mapping", None)
    if get_mapping is None:
        return "LoRA is enabled and the model has no get_mm_mapping(), so adapters may target encoder layers"
    if not getattr(lora_config, "enable_tower_connector_lora", False):
        return None
    mapping = get_mapping()
    opened = [*mapping.tower_model, *mapping.connector]
    hit = next((p for p in module_prefixes for o in opened if p.startswith(o) or o.startswith(p)), None)
    if hit is None:
        return None
    return f"LoRA with enable_tower_connector_lora may target {hit}"


class EncoderCudaGraphSetup(NamedTuple):
    """What :func:`make_encoder_cuda_graph` built and the state to log."""

    adapter: EncoderCudaGraph | None
    #: ``"on"`` or ``"off (<reason>)"``, e.g. ``"off (encoder_cuda_graph_max_graphs=0)"``
    state: str


def make_encoder_cuda_graph(
    forward: Callable[..., torch.Tensor],
    vllm_config: Any,
    options: EncoderCudaGraphOptions,
    *,
    name: str,
    static_args: bool = False,
    captured_modules: Sequence[str] | None = None,
    lora_reason: str | None = None,
) -> EncoderCudaGraphSetup:
    """Build the adapter for one encoder, or None when encoder graphs are off for it.

    Off (no adapter) when ``options.enabled`` is False (``encoder_cuda_graph:
    false``), under ``--enforce-eager`` (``model_config.enforce_eager``), or when
    ``lora_reason`` (from :func:`lora_may_reach`) says LoRA may reach the
    encoder. With ``max_graphs == 0`` the adapter is built (it counts the calls
    as capacity misses) but the state is off.

    Args:
        forward, vllm_config, name, static_args, captured_modules: see
            :class:`EncoderCudaGraph`.
        options: from :meth:`EncoderCudaGraphOptions.from_hf_config`.
        lora_reason: why LoRA may reach this encoder, or None.

    Returns:
        ``(adapter or None, state)``; ``state`` is ``"on"`` or ``"off (<why>)"``.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not options.enabled:
        return EncoderCudaGraphSetup(None, "off (encoder_cuda_graph=false)")
    if getattr(model_config, "enforce_eager", False):
        return EncoderCudaGraphSetup(None, "off (--enforce-eager)")
    if lora_reason is not None:
        return EncoderCudaGraphSetup(
            None, f"off ({lora_reason}; a replay would keep the weights live at capture)"
        )
    adapter = EncoderCudaGraph(
        forward,
        vllm_config,
        max_graphs=options.max_graphs,
        min_capture_calls=options.min_capture_calls,
        min_free_bytes=options.min_free_bytes,
        share_pools=options.share_pools,
        admission=options.admission,
        max_bytes=options.max_bytes,
        log_interval_s=options.log_interval_s,
        name=name,
        static_args=static_args,
        captured_modules=captured_modules,
    )
    state = "off (encoder_cuda_graph_max_graphs=0)" if options.max_graphs == 0 else "on"
    return EncoderCudaGraphSetup(adapter, state)
