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
token budget, fed through a one-item :class:`ExactShapeEncoder` that implements
vLLM's ``SupportsEncoderCudaGraph`` protocol. This module only decides *when* to
capture (admission), *whether* there is room (graph cap, free-memory floor) and
*where* (graph pool and capture stream), and keeps the counters.

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
- :class:`EncoderGraphBackend`: the seam between policy and CUDA (eligible
  device, replay stream handle, free bytes, capture);
  :class:`CudaGraphBackend` is the real one.
- :class:`EncoderCudaGraph`: the callable adapter; keys, memory floor, graph
  pools, hooks check, stats and the fatal capture-failure contract.
- :func:`make_encoder_cuda_graph`: the factory the model file calls, with
  :func:`lora_may_reach` deciding when LoRA keeps an encoder eager.

The user-facing contract is ``docs/design/minicpmo_encoder_cuda_graph.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import inspect
import json
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import torch
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
    "STATS_KEYS",
    "CaptureAdmission",
    "CudaGraphBackend",
    "EncoderCudaGraph",
    "EncoderCudaGraphCaptureFailedError",
    "EncoderCudaGraphOptions",
    "EncoderCudaGraphSetup",
    "EncoderGraphBackend",
    "ExactShapeEncoder",
    "HfOverrideKey",
    "HfOverridesError",
    "ReplayableGraph",
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

GraphKey = tuple[Hashable, ...]
"""``(replay stream handle, per input: (shape, dtype, device), None, or (STATIC_ARG, value))``."""

#: Tags a static argument's entry in a graph key, so it never equals a tensor's ``(shape, dtype, device)``.
STATIC_ARG = "static"


def _is_static(x: Any) -> bool:
    """A positional input that is neither a tensor nor None (see :class:`EncoderCudaGraph`)."""
    return x is not None and not isinstance(x, torch.Tensor)


#: cudaStreamCaptureMode of every capture. Captures happen while the worker serves, when other
#: threads of the process may run CUDA work (e.g. vLLM's async output copy thread); "thread_local"
#: checks only the capturing thread, so their calls neither fail nor invalidate the capture (design
#: doc, "Capturing inside a live worker"). Needs patches/vllm/0007 (checked at construction).
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
        doc="calls with the same input shapes, dtype, device and stream before capture",
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
        name="encoder_cuda_graph_streaming_audio",
        kind="bool",
        default=True,
        doc="also replay the streaming (duplex) audio chunks, bitwise equal to eager; "
        "cap max_graphs x 30 KV past lengths",
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
        streaming_audio: ``encoder_cuda_graph_streaming_audio`` (bool, default
            True). Read by the model wiring, not by the adapter: also route the
            stateful Whisper chunk calls of streaming (duplex) sessions,
            ``get_audio_embedding_streaming``, through an adapter of their own;
            its replays are bitwise equal to the eager path. Needs ``enabled``.

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
    streaming_audio: bool = _hf_field("encoder_cuda_graph_streaming_audio")

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

    def record_captured(self, key: Hashable) -> None:
        self.history.pop(key, None)
        self.captured.add(key)

    def record_failure(self) -> None:
        """Capture failed or was refused for good: forget the history."""
        self.history.clear()

    def total_misses(self) -> int:
        return sum(self.misses.values())


# ---------------------------------------------------------------------------
# vLLM protocol adapter for one exact shape
# ---------------------------------------------------------------------------


def _copy_exact(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Replay padding logic: copy in place. Shapes are equal by construction of the key."""
    dst.copy_(src)


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
        tokens: ``prod(output_shape[:-1])`` (at least 1), the manager's token budget.
        dtype: dtype of the first tensor input (the manager's dtype).
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        inputs: Sequence[Any],
        output_shape: torch.Size,
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
        return EncoderCudaGraphReplayBuffers(values=dict(mm_kwargs))

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


class EncoderGraphBackend(Protocol):
    """Everything :class:`EncoderCudaGraph` needs from a device, and nothing else.

    :class:`CudaGraphBackend` is the real one. A dry run on a machine without
    CUDA implements these four methods (e.g. CPU tensors eligible, a constant
    stream handle, a large free-bytes reading, a capture whose ``execute`` runs
    ``encoder.encoder_eager_forward``) to exercise the adapter's real policy,
    keys, stats and logs.
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

    def capture(
        self, encoder: ExactShapeEncoder, vllm_config: Any, device: torch.device, pool: Any | None
    ) -> tuple[ReplayableGraph, Any]:
        """Capture ``encoder`` for its one shape on ``device``.

        Args:
            pool: an opaque pool this backend returned from an earlier capture
                (the adapter passes it back to share it), or None for a new one.

        Returns:
            ``(graph, pool)``: the replayable graph and the pool it lives in.

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


class CudaGraphBackend:
    """The CUDA backend: vLLM's ``EncoderCudaGraphManager`` on the current CUDA stream.

    - eligible: at least one tensor input, every tensor input on one CUDA
      device (None and static arguments are skipped), CUDA autocast off, and
      the current stream not being captured by someone else;
    - replay stream: ``torch.cuda.current_stream(device).cuda_stream``;
    - free bytes: ``torch.cuda.mem_get_info(device)[0]`` (``cudaMemGetInfo``);
    - capture: one manager per shape, built from a shallow copy of the engine
      config (one token budget, one item, TP 1; the engine's config is never
      mutated), captured with ``manager.capture(graph_pool=...)`` on a capture
      stream that first waits for the replay stream (so a late capture into a
      shared pool starts after earlier replays and their output clones) and
      that the replay stream then waits for. A pool is
      ``(torch.cuda.graph_pool_handle(), torch.cuda.Stream)``.
    """

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        devices = set()
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                continue  # None or a static argument
            if not x.is_cuda:
                return None
            devices.add(x.device)
        if len(devices) != 1 or torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing():
            return None
        return devices.pop()

    def replay_stream(self, device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def free_bytes(self, device: torch.device) -> int:
        return torch.cuda.mem_get_info(device)[0]

    def capture(
        self, encoder: ExactShapeEncoder, vllm_config: Any, device: torch.device, pool: Any | None
    ) -> tuple[ReplayableGraph, Any]:
        from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

        replay_stream = torch.cuda.current_stream(device)
        if pool is None:
            with torch.cuda.device(device):
                pool = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        handle, capture_stream = pool
        manager = EncoderCudaGraphManager(
            _manager_config(vllm_config, encoder.tokens),
            device,
            encoder.dtype,
            encoder,
            capture_error_mode=CAPTURE_ERROR_MODE,
        )
        capture_stream.wait_stream(replay_stream)
        with torch.cuda.device(device), torch.cuda.stream(capture_stream):
            manager.capture(graph_pool=handle)
        replay_stream.wait_stream(capture_stream)
        return manager, pool


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------


class EncoderCudaGraphCaptureFailedError(RuntimeError):
    """Raised by every call after a capture failed (the fatal contract)."""


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
    Inputs are positional tensors, None, or static arguments; the graph key is
    the replay stream plus, per input, a tensor's ``(shape, dtype, device)``,
    None (so "mask given" and "no mask" are different graphs), or a static
    argument's value. Strides and tensor values are not part of the key;
    replays read the live input values.

    *Static arguments*: any positional input that is neither a tensor nor None
    (an int, a tuple, an object) is part of the key by value (``==`` and
    ``hash``, so it must be hashable; an object without ``__eq__`` counts by
    identity) and is passed unchanged to every call of ``forward`` (warm-up,
    capture, eager); it never becomes a static input buffer. A graph bakes in
    what ``forward`` did with it at capture, so each value is its own graph.
    They carry what fixes the forward's control flow or shapes without being a
    tensor shape (e.g. a KV-cache length), or a persistent buffer the forward
    reads and writes in place (e.g. a K/V arena) instead of a static copy.

    A call runs ``forward`` eagerly, without touching any graph, when it is
    *ineligible*: autograd enabled, or the backend refuses the inputs (for
    :class:`CudaGraphBackend`: no tensor inputs, a non-CUDA tensor, tensors on
    more than one device, CUDA autocast enabled, or the current stream being
    captured by someone else). Eligible calls follow :class:`CaptureAdmission`,
    then the free-memory floor (a deferral logs a WARNING the first time and
    every :attr:`MEMORY_WARNING_EVERY` deferrals).

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
        max_graphs, min_capture_calls, min_free_bytes, share_pools: see
            :class:`EncoderCudaGraphOptions` (validated the same way).
        name: encoder name for logs (``"vision"``, ``"audio"``).
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
            :data:`CAPTURE_ERROR_MODE` (``patches/vllm/0007`` not applied).
    """

    #: A memory-floor deferral warns the first time and then every this many deferrals.
    MEMORY_WARNING_EVERY = 100
    #: Hooks named in the hooks warning (the rest are counted).
    HOOKS_NAMED = 5

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
        captured_modules: Sequence[str] | None = None,
        backend: EncoderGraphBackend | None = None,
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
        self.captured_modules = None if captured_modules is None else tuple(captured_modules)
        self.backend: EncoderGraphBackend = backend if backend is not None else CudaGraphBackend()
        self.admission = CaptureAdmission(max_graphs, min_capture_calls)
        # key -> replayable graph (a vLLM manager) holding the key's single graph
        self.graphs: dict[GraphKey, ReplayableGraph] = {}
        # key -> output shape recorded by the eager call of its first sighting
        self._output_shapes: dict[GraphKey, torch.Size] = {}
        # (device, replay stream handle) -> the backend's pool, with share_pools
        self._capture_pools: dict[tuple[torch.device, Hashable], Any] = {}
        self._failure: BaseException | None = None
        self._eager_reason: str | None = None
        self._memory_deferrals = 0
        self._cap_logged = False

    # -- public --------------------------------------------------------------------
    @property
    def capture_failed(self) -> bool:
        return self._failure is not None

    @property
    def eager_reason(self) -> str | None:
        """Why this adapter turned eager for good (hooks found at capture), or None."""
        return self._eager_reason

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if self._failure is not None:
            raise EncoderCudaGraphCaptureFailedError(
                f"{self.name} encoder CUDA graph capture failed earlier "
                f"({type(self._failure).__name__}: {self._failure}); this adapter is unusable. "
                "Restart the worker, optionally with --hf-overrides "
                "'{\"encoder_cuda_graph\": false}' to run the encoders eagerly."
            )
        device = None
        if self._eager_reason is None and not torch.is_grad_enabled():
            device = self.backend.eligible_device(inputs)
        if device is None:
            self.admission.record_ineligible()
            return self.forward(*inputs)

        key: GraphKey = (
            self.backend.replay_stream(device),
            tuple(
                (tuple(x.shape), x.dtype, x.device)
                if isinstance(x, torch.Tensor)
                else (None if x is None else (STATIC_ARG, x))
                for x in inputs
            ),
        )
        try:
            manager = self.graphs.get(key)
        except TypeError as exc:  # an unhashable static argument
            raise TypeError(
                f"{self.name} encoder CUDA graph: every static argument must be hashable, got "
                f"{[type(x).__name__ for x in inputs if _is_static(x)]} ({exc})"
            ) from exc
        if manager is not None:  # hit: the common case, kept to one lookup
            return self._replay(manager, inputs)
        return self._miss(key, inputs, device)

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
    def _miss(self, key: GraphKey, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        """An eligible call without a graph: admission, memory floor, maybe capture."""
        decision = self.admission.admit(key)
        if decision is Admission.CAPTURE:
            if self._below_memory_floor(device):
                self.admission.record_memory_miss()
                return self.forward(*inputs)
            if self._capture(key, inputs, device):
                # the capturing call is served by the new graph's first replay
                return self._replay(self.graphs[key], inputs)
            self.admission.record_ineligible()  # refused (hooks): eager from now on
            return self.forward(*inputs)

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
                    self.name,
                    self.options.max_graphs,
                )
        return out

    def _below_memory_floor(self, device: torch.device) -> bool:
        """True (and a rate-limited WARNING) when free memory is below the floor."""
        floor = self.options.min_free_bytes
        if not floor:
            return False
        free = self.backend.free_bytes(device)
        if free >= floor:
            return False
        self._memory_deferrals += 1
        if self._memory_deferrals == 1 or self._memory_deferrals % self.MEMORY_WARNING_EVERY == 0:
            logger.warning(
                "%s encoder CUDA graph capture deferred (%d time(s) so far): %d bytes free on %s, "
                "below encoder_cuda_graph_min_free_bytes=%d; the call runs eagerly. Free device memory, "
                "lower encoder_cuda_graph_min_free_bytes, or set it to 0 to disable the floor.",
                self.name,
                self._memory_deferrals,
                free,
                device,
                floor,
            )
        return True

    @staticmethod
    def _replay(manager: ReplayableGraph, inputs: Sequence[Any]) -> torch.Tensor:
        """Replay; the graph copies ``inputs`` into its static buffers and returns a clone of its output."""
        return manager.execute({str(i): x for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)})[0]

    def _capture(self, key: GraphKey, inputs: Sequence[Any], device: torch.device) -> bool:
        """Capture ``key`` and register it; False when hooks forbid it; raises on failure (fatal)."""
        if self._refuse_if_hooked("before"):
            return False
        start = time.perf_counter()
        pool_key = (device, key[0])
        pool = self._capture_pools.get(pool_key) if self.options.share_pools else None
        try:
            encoder = ExactShapeEncoder(self.forward, inputs, self._output_shapes.pop(key))
            manager, pool = self.backend.capture(encoder, self.vllm_config, device, pool)
        except BaseException as exc:
            self._failure = exc
            self.admission.record_failure()
            self._output_shapes.clear()
            logger.error(
                "%s encoder CUDA graph capture failed for input shapes %s; the adapter is now "
                "unusable and later calls raise. Restart the worker, optionally with "
                "--hf-overrides '{\"encoder_cuda_graph\": false}'.",
                self.name,
                _describe(key),
            )
            raise
        if self.options.share_pools:
            self._capture_pools[pool_key] = pool
        if self._refuse_if_hooked("during"):  # the captured forward registered hooks itself
            return False
        # Registered only after a complete capture: a failure leaves no half-registered graph.
        self.graphs[key] = manager
        self.admission.record_captured(key)
        logger.info(
            "Captured %s encoder CUDA graph %d/%d for inputs %s in %.1f ms",
            self.name,
            len(self.graphs),
            self.options.max_graphs,
            _describe(key),
            (time.perf_counter() - start) * 1e3,
        )
        return True

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
        self._output_shapes.clear()
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
            "would be captured in global mode, which a CUDA call of any other thread breaks: apply "
            "patches/vllm/0007-encoder-cudagraph-capture-error-mode.patch (minicpmo-cg-patch apply), "
            "or run the encoders eagerly with --hf-overrides '{\"encoder_cuda_graph\": false}'."
        )


def _describe(key: GraphKey) -> list[Any]:
    """Readable inputs of a key for logs: ``[(shape, dtype) | None | static value, ...]``."""
    return [
        t if t is None else t[1] if t[0] == STATIC_ARG else (t[0], str(t[1]).replace("torch.", ""))
        for t in key[1]
    ]


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
        forward, vllm_config, name, captured_modules: see :class:`EncoderCudaGraph`.
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
        name=name,
        captured_modules=captured_modules,
    )
    state = "off (encoder_cuda_graph_max_graphs=0)" if options.max_graphs == 0 else "on"
    return EncoderCudaGraphSetup(adapter, state)
