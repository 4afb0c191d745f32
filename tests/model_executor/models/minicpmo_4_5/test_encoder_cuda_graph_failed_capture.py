# SPDX-License-Identifier: Apache-2.0
"""CPU tests of what the CUDA backend does after a capture raised (``backend._release_failed_capture``),
and of the pause of Python's automatic garbage collection around captures.

torch cannot abort a capture: when ``capture_end`` fails it skips its own bookkeeping, so the
backend ends the caching allocator's routing into the graph pool (and drops the capture's
reference on the pool only when that routing was still active), synchronizes the capture
stream and clears the CUDA generator's capture mark with a complete one-kernel capture. These
tests script the torch calls (``backend._CaptureRuntime``) and check which of them run, in which
order, for each state a failed capture can leave, and that the capture's own exception is what
the caller sees. ``test_encoder_cuda_graph_cuda.py`` checks the same on a GPU with a real
invalidated capture.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

DEVICE = torch.device("cuda", 3)
HANDLE = (0, 17)


class FakeRuntime:
    """Scripted torch calls: ``capturing`` (the capture stream is still capturing), ``routing``
    (the allocator still routes into the pool), ``fail`` (a method name that raises)."""

    def __init__(self, capturing=False, routing=True, fail=None):
        self.capturing, self.routing, self.fail = capturing, routing, fail
        self.calls = []

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name == self.fail:
            raise RuntimeError(f"CUDA error: injected failure in {name}")

    def stream_capturing(self, device, stream):
        self._call("stream_capturing", device, stream)
        return self.capturing

    def end_allocate_to_pool(self, device, handle):
        self._call("end_allocate_to_pool", device, handle)
        return self.routing

    def release_pool(self, device, handle):
        self._call("release_pool", device, handle)

    def synchronize(self, stream):
        self._call("synchronize", stream)

    def close_generator_capture(self, device, stream):
        self._call("close_generator_capture", device, stream)


def _pool(ecg):
    return ecg.backend._CudaPool(HANDLE, stream="capture-stream")


def _names(runtime):
    return [call[0] for call in runtime.calls]


def test_after_an_invalidated_capture_every_step_runs_in_order(ecg, log_records):
    records = log_records(ecg.backend.logger)
    runtime = FakeRuntime(routing=True)
    done = ecg.backend._release_failed_capture(DEVICE, _pool(ecg), runtime)
    assert runtime.calls == [
        ("stream_capturing", DEVICE, "capture-stream"),
        ("end_allocate_to_pool", DEVICE, HANDLE),
        ("release_pool", DEVICE, HANDLE),
        ("synchronize", "capture-stream"),
        ("close_generator_capture", DEVICE, "capture-stream"),
    ]
    assert len(done) == 3 and "reference on the pool dropped" in done[0]
    [warning] = records.messages(logging.WARNING)
    assert "cuda:3" in warning and "capture mark cleared" in warning


def test_a_capture_that_ended_its_routing_does_not_release_the_pool_again(ecg):
    """``endAllocateToPool`` finds nothing to end (capture_end got that far, or the capture never
    began): the pool's references belong to live graphs, so none is dropped. The generator step
    still runs: ``capture_begin`` marks the generator before it routes any allocation."""
    runtime = FakeRuntime(routing=False)
    done = ecg.backend._release_failed_capture(DEVICE, _pool(ecg), runtime)
    assert "release_pool" not in _names(runtime)
    assert _names(runtime) == [
        "stream_capturing",
        "end_allocate_to_pool",
        "synchronize",
        "close_generator_capture",
    ]
    assert done[0] == "graph pool routing already ended"


def test_a_stream_still_capturing_is_left_alone_and_logged(ecg, log_records):
    records = log_records(ecg.backend.logger)
    runtime = FakeRuntime(capturing=True)
    done = ecg.backend._release_failed_capture(DEVICE, _pool(ecg), runtime)
    assert _names(runtime) == ["stream_capturing"]
    assert done == ["capture stream still capturing: left as is"]
    [error] = records.messages(logging.ERROR)
    assert "still capturing" in error and "cuda:3" in error


ALL_STEPS = [
    "stream_capturing",
    "end_allocate_to_pool",
    "release_pool",
    "synchronize",
    "close_generator_capture",
]


@pytest.mark.parametrize(
    "fail, ran",
    [
        # a device error at the stream sync: a device in error cannot capture, so no generator capture
        ("synchronize", ALL_STEPS[:4]),
        # the allocator's bookkeeping is host state: its failure does not stop the device steps
        ("end_allocate_to_pool", ["stream_capturing", "end_allocate_to_pool", "synchronize", "close_generator_capture"]),
        ("release_pool", ALL_STEPS),
        ("close_generator_capture", ALL_STEPS),
        # the capture stream's state is unknown: nothing is touched
        ("stream_capturing", ["stream_capturing"]),
    ],
)  # fmt: skip
def test_a_failing_step_is_logged_and_never_raised(ecg, log_records, fail, ran):
    """Whatever fails, nothing is raised (the capture's own error must reach the caller) and one
    ERROR names what was not cleaned up."""
    records = log_records(ecg.backend.logger)
    runtime = FakeRuntime(fail=fail)
    done = ecg.backend._release_failed_capture(DEVICE, _pool(ecg), runtime)
    assert _names(runtime) == ran
    assert f"RuntimeError: CUDA error: injected failure in {fail}" in "; ".join(done)
    [error] = records.messages(logging.ERROR)
    assert "cleaning up after it failed too" in error and f"injected failure in {fail}" in error
    assert not [m for m in records.messages(logging.WARNING) if "cleaned up after it:" in m]


class _FailingManager:
    """vLLM's manager as a capture that raises meets it: constructed, then ``capture`` raises
    (recording whether Python's automatic garbage collection was on)."""

    error = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    gc_enabled: list[bool] = []

    def __init__(self, *args, **kwargs):
        pass

    def capture(self, graph_pool):
        _FailingManager.gc_enabled.append(gc.isenabled())
        raise self.error


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_stream(self, other):
        self.waited.append(other)


def test_the_backend_cleans_up_before_the_capture_error_propagates(ecg, vllm_config, monkeypatch):
    import vllm.v1.worker.encoder_cudagraph as ec

    runtime = FakeRuntime(routing=True)
    monkeypatch.setattr(ecg.backend, "_CAPTURE_RUNTIME", runtime)
    monkeypatch.setattr(ec, "EncoderCudaGraphManager", _FailingManager)
    # no CUDA here: stand-ins for the replay stream and the capture stream's context
    replay = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: replay)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    x = torch.ones(3, 8)
    encoder = ecg.ExactShapeEncoder(lambda t: t * 2, [x], x.shape)
    pool = ecg.backend._CudaPool(HANDLE, _Stream())
    with pytest.raises(RuntimeError) as info:
        ecg.CudaGraphBackend().capture(encoder, vllm_config, x.device, pool)
    assert info.value is _FailingManager.error  # the capture's own exception, unchanged
    assert _names(runtime) == [
        "stream_capturing",
        "end_allocate_to_pool",
        "release_pool",
        "synchronize",
        "close_generator_capture",
    ]
    assert runtime.calls[1] == ("end_allocate_to_pool", x.device, HANDLE)
    assert _FailingManager.gc_enabled[-1] is False and gc.isenabled()  # off in the capture, back on after
    assert (
        pool.stream.waited == [replay] and replay.waited == []
    )  # the replay stream does not wait on failure


def test_a_manager_that_cannot_be_built_needs_no_cleanup(ecg, vllm_config, monkeypatch):
    """Nothing began: the cleanup runs only around ``manager.capture``."""
    import vllm.v1.worker.encoder_cudagraph as ec

    class Unbuildable:
        def __init__(self, *args, **kwargs):
            raise ValueError("bad config")

    runtime = FakeRuntime()
    monkeypatch.setattr(ecg.backend, "_CAPTURE_RUNTIME", runtime)
    monkeypatch.setattr(ec, "EncoderCudaGraphManager", Unbuildable)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    x = torch.ones(3, 8)
    encoder = ecg.ExactShapeEncoder(lambda t: t * 2, [x], x.shape)
    with pytest.raises(ValueError, match="bad config"):
        ecg.CudaGraphBackend().capture(
            encoder, vllm_config, x.device, ecg.backend._CudaPool(HANDLE, _Stream())
        )
    assert runtime.calls == []


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_gc_pause_nests_and_restores_what_it_found(ecg, enabled_before):
    """Captures on two threads overlap: collection stays off until the last ends, then is as before."""
    pause = ecg.backend._AutomaticGcPause()
    was = gc.isenabled()
    try:
        gc.enable() if enabled_before else gc.disable()
        with pause():
            assert not gc.isenabled()
            with pause():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the first capture still runs
        assert gc.isenabled() is enabled_before
        with pytest.raises(RuntimeError, match="capture raised"), pause():
            raise RuntimeError("capture raised")
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable() if was else gc.disable()


def test_synchronizing_the_capture_stream_keeps_cublas_workspaces(ecg, monkeypatch):
    """Every live graph of the process (the adapters' earlier ones, vLLM's) replays into the cuBLAS
    workspace its stream had at capture: the cleanup must not free those blocks to the allocator."""
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)

    class Stream:
        synchronized = 0

        def synchronize(self):
            self.synchronized += 1

    stream = Stream()
    ecg.backend._CaptureRuntime().synchronize(stream)
    assert stream.synchronized == 1 and cleared == []
