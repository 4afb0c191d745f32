# SPDX-License-Identifier: Apache-2.0
"""The device seam :class:`EncoderGraphBackend` and its CUDA implementation :class:`CudaGraphBackend`."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import vllm_omni.platforms as omni_platforms
from vllm.logger import init_logger

from .admission import EagerCallSample
from .shapes import ExactShapeEncoder

logger = init_logger(__name__)

__all__ = [
    "CAPTURE_ERROR_MODE",
    "CapturedGraph",
    "CudaGraphBackend",
    "EagerMeasurement",
    "EncoderGraphBackend",
    "ReplayableGraph",
]

#: cudaStreamCaptureMode of every capture: other threads of the serving process may run CUDA work
#: meanwhile, which "thread_local" neither fails nor lets invalidate the capture.
CAPTURE_ERROR_MODE = "thread_local"


class ReplayableGraph(Protocol):
    """What a backend's capture returns (vLLM's ``EncoderCudaGraphManager`` is one)."""

    graph_hits: int
    graph_misses: int

    def execute(self, mm_kwargs: dict[str, Any]) -> list[torch.Tensor]: ...


class EagerMeasurement(Protocol):
    """One measured eager call, returned by :meth:`EncoderGraphBackend.measure_eager`."""

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


class EncoderGraphBackend(Protocol):
    """Everything :class:`EncoderCudaGraph` needs from a device, and nothing else."""

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        """The single device of the tensors in ``inputs`` if this backend can graph the call, else None."""
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

        Args:
            hold_ms: 0 measures the call as it runs; > 0 holds the call's stream about this long
                (GPU ms) before the call and reports the GPU time after the hold as ``busy_ms``.

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
            whatever the capture raised, after cleaning up what it left in the process
            (:func:`_release_failed_capture`).
        """
        ...


def _manager_config(vllm_config: Any, tokens: int) -> Any:
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
    """Events recorded around one eager call on its stream; read back with a non-blocking query."""

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
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)
    return float(rate) if rate and rate > 0 else _SpinClock.DEFAULT_CYCLES_PER_MS


@dataclass
class _CudaPool:
    """A graph pool, its capture stream, and the bytes its segments reserve."""

    handle: Any
    stream: torch.cuda.Stream
    reserved_bytes: int = 0


def _pool_reserved_bytes(device: torch.device, handle: Any) -> int | None:
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


class _CaptureRuntime:
    """The torch calls :func:`_release_failed_capture` makes, one method each (a seam for CPU tests)."""

    def stream_capturing(self, device: torch.device, stream: Any) -> bool:
        """Whether ``stream`` (on ``device``) is still in capture mode."""
        with torch.accelerator.device_index(device.index), torch.cuda.stream(stream):
            return bool(_stream_capturing())

    def end_allocate_to_pool(self, device: torch.device, handle: Any) -> bool:
        """End the caching allocator's routing of a capture's allocations into graph pool ``handle``.

        Returns:
            True when a capture was still routing into it; False when none was (nothing changed).
        """
        try:
            torch._C._cuda_endAllocateToPool(device.index, handle)
        except RuntimeError:
            return False
        return True

    def release_pool(self, device: torch.device, handle: Any) -> None:
        """Drop one reference on graph pool ``handle`` (what ``torch.cuda.use_mem_pool`` does on exit)."""
        torch._C._cuda_releasePool(device.index, handle)

    def synchronize(self, stream: Any) -> None:
        """Wait for ``stream``."""
        stream.synchronize()

    def close_generator_capture(self, device: torch.device, stream: Any) -> None:
        """Capture (and discard) a one-element in-place add on ``stream``: a complete capture."""
        with torch.accelerator.device_index(device.index), torch.cuda.stream(stream):
            scratch = torch.zeros(1, device=device)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                scratch.add_(1)
            finally:
                graph.capture_end()
            graph.reset()


_CAPTURE_RUNTIME = _CaptureRuntime()


class _AutomaticGcPause:
    """Python's automatic garbage collection off while any capture of this process runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._was_enabled:
                    gc.enable()


_automatic_gc_paused = _AutomaticGcPause()


def _release_failed_capture(
    device: torch.device, pool: _CudaPool, runtime: _CaptureRuntime | None = None
) -> list[str]:
    """Clean up what a capture that raised left in this process, so that the rest of it keeps working.

    Returns:
        One phrase per step, in order (what the log line lists).
    """
    runtime = _CAPTURE_RUNTIME if runtime is None else runtime
    done: list[str] = []
    failed = False
    try:
        if runtime.stream_capturing(device, pool.stream):
            logger.error(
                "encoder CUDA graph capture on %s failed and its capture stream is still capturing; "
                "nothing was cleaned up: CUDA RNG calls and other graph captures in this process may "
                "fail until the worker restarts",
                device,
            )
            return ["capture stream still capturing: left as is"]
    except Exception as exc:  # noqa: BLE001 - the capture's own exception must propagate, not this one
        done.append(f"capture state unknown: {type(exc).__name__}: {exc}")
        failed = True
    if not failed:
        try:  # independent of the device steps below: the allocator's bookkeeping is host state
            if runtime.end_allocate_to_pool(device, pool.handle):
                runtime.release_pool(device, pool.handle)
                done.append("graph pool routing ended and the capture's reference on the pool dropped")
            else:
                done.append("graph pool routing already ended")
        except Exception as exc:  # noqa: BLE001
            done.append(f"graph pool not released: {type(exc).__name__}: {exc}")
            failed = True
        try:
            runtime.synchronize(pool.stream)
            done.append("capture stream synchronized")
            runtime.close_generator_capture(device, pool.stream)
            done.append("CUDA generator's capture mark cleared")
        except Exception as exc:  # noqa: BLE001
            done.append(f"stopped: {type(exc).__name__}: {exc}")
            failed = True
    if failed:
        logger.error(
            "encoder CUDA graph capture on %s failed, and cleaning up after it failed too (%s); CUDA RNG "
            "calls and other graph captures in this process may fail until the worker restarts",
            device,
            "; ".join(done),
        )
    else:
        logger.warning(
            "encoder CUDA graph capture on %s failed; cleaned up after it: %s", device, "; ".join(done)
        )
    return done


class CudaGraphBackend:
    """The CUDA backend: vLLM's ``EncoderCudaGraphManager`` on the current CUDA stream.

    Eligible: tensor inputs on one CUDA device, CUDA autocast off, the current stream not capturing.
    A capture waits for the replay stream (a late capture into a shared pool starts after earlier
    replays and their clones), runs with Python's automatic GC paused, and a capture that raises is
    cleaned up by :func:`_release_failed_capture`. Measuring resets the device's peak-memory statistics.
    """

    def __init__(self) -> None:
        self._spin = _SpinClock()

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        device = None
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                continue  # None (a non-tensor input never gets here: ineligible)
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
        with _automatic_gc_paused():  # the cleanup's own one-kernel capture included
            try:
                with torch.accelerator.device_index(device.index), torch.cuda.stream(pool.stream):
                    manager.capture(graph_pool=pool.handle)
            except BaseException:
                _release_failed_capture(device, pool)
                raise
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


#: Why encoder graphs need more than the installed vLLM offers, when its manager lacks ``capture_error_mode``.
NO_CAPTURE_ERROR_MODE = (
    "vLLM's EncoderCudaGraphManager takes no capture_error_mode, so encoder CUDA graphs would be captured "
    "in global mode, which a CUDA call of any other thread breaks (the vLLM change 'encoder_cudagraph: let "
    "the caller choose the capture error mode of encoder graphs' adds it)"
)


def manager_takes_capture_error_mode() -> bool:
    """Whether vLLM's ``EncoderCudaGraphManager`` takes ``capture_error_mode`` (read off its signature)."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    return "capture_error_mode" in inspect.signature(EncoderCudaGraphManager).parameters


def _require_capture_error_mode() -> None:
    if not manager_takes_capture_error_mode():
        raise RuntimeError(
            f"{NO_CAPTURE_ERROR_MODE}: use a vLLM whose EncoderCudaGraphManager takes capture_error_mode, "
            "or run the encoders eagerly with --hf-overrides '{\"encoder_cuda_graph\": false}'."
        )
