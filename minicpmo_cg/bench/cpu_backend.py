"""The CPU stand-in for graph capture used by ``--allow-cpu`` (and only there)."""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from minicpmo_cg.standalone import ADAPTER_MODULE

#: Scripted host time of an eager encoder call (ms): on an H200 each encoder enqueues any of its
#: shapes in about 8 ms, as the kernel count does not depend on the batch.
HOST_MS = 8.0
#: Scripted GPU busy time per batch item (ms): an H200 keeps a 448x448 SigLIP slice busy 6.7 ms.
BUSY_MS_PER_ITEM = 6.5
#: Scripted fixed part of a capture (ms): manager construction, graph instantiation, synchronisation.
CAPTURE_FIXED_MS = 3.0


class ScriptedClock:
    """A clock that moves only when told to: the scripted duration of what "took" time."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def perf_counter(self) -> float:
        """The current reading (seconds), as :func:`time.perf_counter` would give it."""
        return self.now_s

    def advance_ms(self, ms: float) -> None:
        """Let ``ms`` milliseconds pass.

        Raises:
            ValueError: ``ms`` < 0.
        """
        if ms < 0:
            raise ValueError(f"a clock cannot go back: advance_ms({ms})")
        self.now_s += ms / 1e3


class _TimeReadingClock:
    """The ``time`` module as the adapter sees it under :func:`adapter_clock`: ``perf_counter``
    reads the scripted clock, everything else (``monotonic`` of the stats interval, ...) is real."""

    def __init__(self, clock: ScriptedClock) -> None:
        self.perf_counter = clock.perf_counter

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def adapter_clock(adapter_mod: Any, clock: ScriptedClock | None) -> Iterator[None]:
    """Within the block, the adapter times its captures with ``clock`` (None: the real clock).

    Raises:
        RuntimeError: that module does not time captures with ``time.perf_counter`` any more
            (the adapter changed; so must this function).
    """
    if clock is None:
        yield
        return
    timed = sys.modules[adapter_mod.EncoderCudaGraph._capture.__module__]
    if getattr(timed, "time", None) is not time:
        raise RuntimeError(
            f"{timed.__name__} no longer imports time for its capture timing; adapter_clock cannot script it"
        )
    timed.time = _TimeReadingClock(clock)
    try:
        yield
    finally:
        timed.time = time


class _EagerGraph:
    """Looks like a captured vLLM manager (``ReplayableGraph``); ``execute`` runs the forward eagerly."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.graph_hits = self.graph_misses = 0

    def execute(self, mm_kwargs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.graph_hits += 1
        return [self.encoder.encoder_eager_forward(mm_kwargs)]


class _ScriptedMeasurement:
    """An eager call's measurement with a scripted sample, read back at once."""

    __slots__ = ("_sample", "host_ms", "peak_bytes")

    def __init__(self, sample: Any) -> None:
        self.host_ms = sample.host_ms
        self.peak_bytes = 0
        self._sample = sample

    def sample(self) -> Any:
        return self._sample


class CpuGraphBackend:
    """The adapter's device seam with any device accepted, scripted timings and eager "replays".

    Raises:
        ValueError: a time that is not > 0.
    """

    def __init__(
        self,
        free_bytes: int = 1 << 62,
        host_ms: float = HOST_MS,
        busy_ms_per_item: float = BUSY_MS_PER_ITEM,
        clock: ScriptedClock | None = None,
    ) -> None:
        if not (host_ms > 0 and busy_ms_per_item > 0):
            raise ValueError(
                f"scripted times must be > 0 ms, got host_ms={host_ms}, busy_ms_per_item={busy_ms_per_item}"
            )
        self._free_bytes = free_bytes
        self.host_ms = host_ms
        self.busy_ms_per_item = busy_ms_per_item
        self.clock = clock

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        tensors = [x for x in inputs if torch.is_tensor(x)]  # None and static arguments do not count
        if not tensors:
            return None
        devices = {x.device for x in tensors}
        return devices.pop() if len(devices) == 1 else None

    def replay_stream(self, device: torch.device) -> int:
        return 0

    def free_bytes(self, device: torch.device) -> int:
        return self._free_bytes

    def scripted_ms(self, output_shape: Sequence[int]) -> tuple[float, float, float]:
        """``(host_ms, span_ms, busy_ms)`` of an eager call whose output has ``output_shape``."""
        items = output_shape[0] if len(output_shape) else 1
        busy = self.busy_ms_per_item * items
        return self.host_ms, max(self.host_ms, busy), busy

    def capture_ms(self, output_shape: Sequence[int]) -> float:
        """Scripted duration of a capture whose output has ``output_shape`` (ms)."""
        host, span, _ = self.scripted_ms(output_shape)
        return host + span + CAPTURE_FIXED_MS

    def measure_eager(
        self, device: torch.device, call: Callable[[], torch.Tensor], hold_ms: float = 0.0
    ) -> tuple[torch.Tensor, Any]:
        out = call()
        host, span, busy = self.scripted_ms(out.shape)
        sample = importlib.import_module(ADAPTER_MODULE).EagerCallSample
        if hold_ms > 0:
            return out, _ScriptedMeasurement(sample(host, None, max(busy, span - hold_ms), hold_ms))
        return out, _ScriptedMeasurement(sample(host, span))

    def capture(self, encoder: Any, vllm_config: Any, device: torch.device, pool: Any | None) -> Any:
        captured = importlib.import_module(ADAPTER_MODULE).CapturedGraph
        took = self.capture_ms(encoder.output_shape)
        if self.clock is not None:
            self.clock.advance_ms(took)
        else:
            time.sleep(took / 1e3)
        pool = pool if pool is not None else object()
        return captured(_EagerGraph(encoder), pool, 0, encoder.static_bytes)


def fixed_free_bytes(backend: Any, free_bytes: int) -> Any:
    """``backend`` with its free-memory reading replaced by ``free_bytes`` (memory-miss scenarios)."""

    class _Fixed(type(backend)):
        def free_bytes(self, device: torch.device) -> int:
            return free_bytes

    fixed = _Fixed.__new__(_Fixed)
    fixed.__dict__.update(backend.__dict__)
    return fixed
