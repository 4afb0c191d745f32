# SPDX-License-Identifier: Apache-2.0
"""Admission policy, pure Python: recurrence, graph cap, misses and the ``"cost"`` rule."""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the policy imports neither torch nor the device seam
    import torch

    from .backend import EagerMeasurement

__all__ = [
    "MISS_KINDS",
    "STATS_KEYS",
    "Admission",
    "CaptureAdmission",
    "CaptureCostModel",
    "CostVerdict",
    "EagerCallSample",
    "in_memory_profiling",
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

#: Miss kinds counted by :class:`CaptureAdmission`, all part of ``graph_misses``.
MISS_KINDS = ("ineligible", "capacity", "warmup", "memory", "declined", "budget", "profile")


class Admission(enum.Enum):
    """What :meth:`CaptureAdmission.admit` decided for one eligible call."""

    REPLAY = "replay"  # a graph exists for the key
    CAPACITY = "capacity"  # the cap is reached; run eagerly (never evicts)
    WARMUP = "warmup"  # not seen often enough yet; run eagerly
    CAPTURE = "capture"  # capture now (subject to the memory floor)


class CaptureAdmission:
    """Admission, graph cap and miss accounting for one encoder.

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

    def record_miss(self, kind: str) -> None:
        """An eager call of kind ``kind`` (one of :data:`MISS_KINDS`) decided outside :meth:`admit`.

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


_GIB = float(1 << 30)


@dataclass(frozen=True)
class EagerCallSample:
    """One measured eager call of a key: the input of :class:`CaptureCostModel` (all times in ms).

    Attributes:
        host_ms: host time the call took to enqueue its work (``perf_counter``).
        gpu_ms: an unheld call's GPU span between events right before and after it; None for a
            held call.
        busy_ms: the GPU's busy time, or an upper bound of it (a held call: from the hold's end to
            the call's end); None when not shown (an unheld call on CUDA).
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

    Pure arithmetic on the key's measured eager calls; the formula and the constants' sources are in
    ``docs/design/minicpmo_encoder_cuda_graph/cost_admission.md``.
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
    #: the least share of ``min(h, g)`` a replay saved on any shape measured (docs/results/); a key
    #: that pays with it is captured without measuring its busy time
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
    saving = span_ms - sample.busy_ms
    return min(saving, sample.hold_ms) if sample.hold_ms > 0 else saving


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


def in_memory_profiling(vllm_config: Any) -> bool:
    """True while vLLM's start-up memory profiling may be running: the KV cache is not sized yet.

    Reads ``cache_config.num_gpu_blocks`` (None until vLLM sizes the KV cache). Outside an engine, set
    it (e.g. to 0), or every call counts as a profiling call and nothing is captured.
    """
    cache_config = getattr(vllm_config, "cache_config", None)
    return cache_config is not None and getattr(cache_config, "num_gpu_blocks", 0) is None
