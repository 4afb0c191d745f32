# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EncoderCudaGraphManager's capture_error_mode.

The manager passes its capture_error_mode (the cudaStreamCaptureMode of a
capture) to every torch.cuda.graph() call it makes.

Test organization:
  No GPU required:
    - the default stays "global"; other values are rejected at construction;
      the argument is keyword-only
    - every capture is made with the chosen mode (torch.cuda.graph recorded)
  GPU required:
    - a "thread_local" capture completes while another thread of the process
      makes CUDA calls that global mode forbids during a capture, and the
      graphs replay what the model computes
    - the same capture in the default "global" mode does not complete (the
      control: the other thread's calls are the ones global mode forbids)
    - "thread_local" still fails a capture whose forward syncs with the host
  The two failing captures run in a fresh Python process each: torch cannot
  abort a capture, so a failed one leaves the process unable to capture again.
"""

import contextlib
import inspect
import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig
from vllm.platforms import current_platform
from vllm.v1.worker import encoder_cudagraph
from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager
from vllm.v1.worker.encoder_cudagraph_defs import (
    EncoderCudaGraphCaptureInputs,
    EncoderCudaGraphConfig,
)

_HIDDEN = 8
_BUDGETS = [8, 16]
# Seconds the captured forward waits for the other thread (never reached
# when that thread runs).
_WAIT_S = 60.0
# Iterations the other thread completes while a capture is underway.
_ITERATIONS_DURING_CAPTURE = 4


class AffineEncoder:
    """A minimal SupportsEncoderCudaGraph model: ``forward(x) = 2 * x + 1``.

    Only what capture needs: the config, the capture inputs of a budget and
    the forward. ``on_capture``, when set, is called inside the captured
    forward (while the stream is being captured).
    """

    supports_encoder_cudagraph = True

    def __init__(self, on_capture=None):
        self.on_capture = on_capture

    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            modalities=["image"], buffer_keys=["x"], out_hidden_size=_HIDDEN
        )

    def get_encoder_cudagraph_budget_range(self, vllm_config) -> tuple[int, int]:
        return min(_BUDGETS), max(_BUDGETS)

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget,
        max_batch_size,
        max_frames_per_batch,
        device,
        dtype,
        path="default",
        axis_keys=None,
    ) -> EncoderCudaGraphCaptureInputs:
        x = torch.zeros(token_budget, _HIDDEN, device=device, dtype=dtype)
        return EncoderCudaGraphCaptureInputs(values={"x": x})

    def encoder_cudagraph_forward(self, inputs, path="default") -> torch.Tensor:
        if self.on_capture is not None and torch.cuda.is_current_stream_capturing():
            self.on_capture()
        return inputs["x"] * 2 + 1


def _vllm_config():
    """What the manager reads of a VllmConfig, without a model checkpoint."""
    compilation_config = CompilationConfig(
        encoder_cudagraph_token_budgets=list(_BUDGETS),
        encoder_cudagraph_max_vision_items_per_batch=2,
    )
    return SimpleNamespace(
        compilation_config=compilation_config,
        model_config=SimpleNamespace(multimodal_config=MultiModalConfig()),
        parallel_config=ParallelConfig(),
    )


def _make_manager(model, device, **kwargs) -> EncoderCudaGraphManager:
    return EncoderCudaGraphManager(
        _vllm_config(), torch.device(device), torch.float32, model, **kwargs
    )


# ---------------------------------------------------------------------------
# No GPU required
# ---------------------------------------------------------------------------


def test_default_mode_is_global():
    assert _make_manager(AffineEncoder(), "cpu").capture_error_mode == "global"


def test_mode_is_keyword_only_and_its_values_are_torchs():
    param = inspect.signature(EncoderCudaGraphManager).parameters["capture_error_mode"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert param.default == "global"
    modes = EncoderCudaGraphManager.CAPTURE_ERROR_MODES
    assert modes == ("global", "thread_local", "relaxed")
    # The values torch.cuda.graph documents for its capture_error_mode.
    assert all(f'"{mode}"' in torch.cuda.graph.__doc__ for mode in modes)


@pytest.mark.parametrize("mode", ["local", "THREAD_LOCAL", "", None, 1])
def test_unknown_mode_is_rejected_at_construction(mode):
    with pytest.raises(ValueError, match="capture_error_mode=") as info:
        _make_manager(AffineEncoder(), "cpu", capture_error_mode=mode)
    message = str(info.value)
    assert repr(mode) in message
    assert "'global', 'thread_local', 'relaxed'" in message


class _RecordedGraph:
    """Stands in for torch.cuda.CUDAGraph where no GPU is present."""


@pytest.mark.parametrize("mode", [None, "global", "thread_local", "relaxed"])
def test_every_capture_uses_the_chosen_mode(monkeypatch, mode):
    calls: list[dict] = []
    real_signature = inspect.signature(torch.cuda.graph)

    @contextlib.contextmanager
    def recording_graph(graph, *args, **kwargs):
        # Bound against the real signature: a misspelt keyword fails here.
        calls.append(real_signature.bind(graph, *args, **kwargs).arguments)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recording_graph)
    monkeypatch.setattr(encoder_cudagraph, "current_stream", lambda: None)
    kwargs = {} if mode is None else {"capture_error_mode": mode}
    manager = _make_manager(AffineEncoder(), "cpu", **kwargs)
    pool = object()
    manager.capture(graph_pool=pool)

    assert len(calls) == manager.get_num_graphs_to_capture() == len(_BUDGETS)
    expected = mode or "global"
    assert [call.get("capture_error_mode", "global") for call in calls] == [
        expected
    ] * len(_BUDGETS)
    assert all(call["pool"] is pool for call in calls)


# ---------------------------------------------------------------------------
# GPU required
# ---------------------------------------------------------------------------


class _CudaChatter(threading.Thread):
    """Another thread doing pageable copies and stream synchronizes in a loop.

    Each iteration copies pageable host memory to the GPU and back on the
    thread's own stream and synchronizes that stream: calls that global
    capture mode forbids in every thread while a graph is being captured.
    Once ``capture_started`` is set, ``during_capture`` counts iterations and
    ``overlapped`` is set after ``_ITERATIONS_DURING_CAPTURE`` of them (or on
    an error, kept in ``errors``).
    """

    def __init__(self, device: torch.device):
        super().__init__(daemon=True)
        self.device = device
        self.capture_started = threading.Event()
        self.overlapped = threading.Event()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.during_capture = 0
        self.wrong = 0

    def run(self):
        try:
            stream = torch.cuda.Stream(self.device)
            step = 0
            while not self.stop.is_set():
                capturing = self.capture_started.is_set()
                host = torch.arange(1 << 14, dtype=torch.float32) + step
                with torch.cuda.stream(stream):
                    back = host.to(self.device).cpu()
                    stream.synchronize()
                self.wrong += int(not torch.equal(back, host))
                step += 1
                if capturing:
                    self.during_capture += 1
                    if self.during_capture >= _ITERATIONS_DURING_CAPTURE:
                        self.overlapped.set()
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.overlapped.set()


def _capture_beside_chatter(mode: str):
    """Capture every budget in ``mode`` while a :class:`_CudaChatter` runs.

    Returns ``(manager, chatter, error)``: ``error`` is what the capture
    raised (None when it completed)."""
    device = torch.device("cuda", torch.cuda.current_device())
    chatter = _CudaChatter(device)

    def wait_for_the_other_thread():
        chatter.capture_started.set()
        if not chatter.overlapped.wait(_WAIT_S):
            raise RuntimeError("the other thread never ran during the capture")

    model = AffineEncoder(on_capture=wait_for_the_other_thread)
    manager = _make_manager(model, device, capture_error_mode=mode)
    chatter.start()
    stream = torch.cuda.Stream(device)
    error = None
    try:
        with torch.cuda.stream(stream):
            manager.capture(graph_pool=torch.cuda.graph_pool_handle())
        torch.cuda.synchronize(device)
    except RuntimeError as exc:
        error = exc
    finally:
        chatter.stop.set()
        chatter.join(_WAIT_S)
    return manager, chatter, error


def _capture_with_host_sync(mode: str) -> RuntimeError | None:
    """Capture in ``mode`` a forward that reads a value on the host
    (``.item()``, a device-to-host sync); return what the capture raised."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = AffineEncoder(on_capture=lambda: torch.ones(1, device=device).item())
    manager = _make_manager(model, device, capture_error_mode=mode)
    try:
        with torch.cuda.stream(torch.cuda.Stream(device)):
            manager.capture(graph_pool=torch.cuda.graph_pool_handle())
    except RuntimeError as exc:
        return exc
    return None


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _global_beside_chatter() -> dict:
    _, chatter, error = _capture_beside_chatter("global")
    return {"capture_error": _text(error), "chatter_errors": chatter.errors}


def _thread_local_host_sync() -> dict:
    error = _capture_with_host_sync("thread_local")
    return {"capture_error": _text(error), "chatter_errors": []}


# What a fresh process runs (``python THIS_FILE SCENARIO``) and reports as
# one JSON line: the capture's error and the other thread's.
_SCENARIOS = {
    "global-beside-chatter": _global_beside_chatter,
    "thread-local-host-sync": _thread_local_host_sync,
}


def _run_in_fresh_process(scenario: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), scenario],
        capture_output=True,
        text=True,
        timeout=10 * _WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not current_platform.is_cuda(), reason="requires a CUDA device")
def test_thread_local_capture_tolerates_another_threads_cuda_calls():
    device = torch.device("cuda", torch.cuda.current_device())
    manager, chatter, error = _capture_beside_chatter("thread_local")

    assert error is None, error
    assert chatter.errors == []
    assert chatter.during_capture >= _ITERATIONS_DURING_CAPTURE
    assert chatter.wrong == 0
    graphs = manager.budget_graphs["default"]
    assert set(graphs) == set(_BUDGETS)
    for budget, meta in graphs.items():
        x = torch.randn(budget, _HIDDEN, device=device)
        meta.input_buffers["x"].copy_(x)
        meta.graph.replay()
        torch.cuda.synchronize(device)
        torch.testing.assert_close(meta.output_buffer, x * 2 + 1, rtol=0, atol=0)


@pytest.mark.skipif(not current_platform.is_cuda(), reason="requires a CUDA device")
def test_global_capture_fails_beside_the_same_cuda_calls():
    """The control of the test above: in the default mode the other thread's
    calls are forbidden, so the capture or those calls fail."""
    report = _run_in_fresh_process("global-beside-chatter")
    errors = [report["capture_error"] or "", *report["chatter_errors"]]
    # CUDA's capture errors ("operation not permitted when stream is
    # capturing", "... invalidated ...") all name the capture
    assert any("captur" in error for error in errors), report


@pytest.mark.skipif(not current_platform.is_cuda(), reason="requires a CUDA device")
def test_thread_local_capture_still_fails_on_a_host_sync_in_the_forward():
    """Thread-local mode relaxes only the other threads: the capturing
    thread's own host sync still fails its capture."""
    report = _run_in_fresh_process("thread-local-host-sync")
    assert "captur" in (report["capture_error"] or ""), report


if __name__ == "__main__":
    print(json.dumps(_SCENARIOS[sys.argv[1]]()), flush=True)
    # Skip interpreter teardown: after a failed capture, freeing its graphs
    # and pool is not something this check is about.
    os._exit(0)
