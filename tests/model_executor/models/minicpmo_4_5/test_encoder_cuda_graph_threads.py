# SPDX-License-Identifier: Apache-2.0
"""Captures made while another thread of the process runs CUDA work.

The adapter captures lazily, in the middle of serving, where other threads of the worker
process may be busy on the GPU (vLLM's async output copy thread calls ``event.synchronize()``;
see "Capture error mode and other threads" in
docs/design/minicpmo_encoder_cuda_graph/live_worker.md). It therefore captures in
``thread_local`` mode (vLLM's ``EncoderCudaGraphManager(capture_error_mode=...)``), which
checks only the capturing thread.

CPU: the adapter asks vLLM's manager for ``thread_local`` and refuses to be built when the
manager cannot capture in that mode. CUDA: a real second Python thread copies pageable host
memory to the device, synchronises a stream and an event and reads the result back, in a
loop, while the adapter captures a new shape; the captured forward waits until that thread
has completed several iterations during the capture, so the overlap is certain. The same
scenario with the capture forced to ``global`` mode, the control, runs in a subprocess: its
failed capture and the other thread's failed CUDA calls must not reach later tests.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import pytest
import torch
from helpers import logs
from helpers.scenarios import output_tail, run_adapter_scenario

pytestmark = [pytest.mark.core_model]

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"
)

WIDTH = 128
ROWS = 32
#: iterations the second thread completes while the capture is underway, before the captured forward goes on
ITERATIONS_DURING_CAPTURE = 8
#: seconds to wait for the second thread (never reached when it runs)
WAIT_S = 60.0
RESULT_TAG = "SCENARIO_RESULT="


# ---------------------------------------------------------------------------
# CPU: what the adapter asks of vLLM's manager
# ---------------------------------------------------------------------------


class _ManagerBuiltError(Exception):
    """Stops ``CudaGraphBackend.capture`` right after the manager is constructed (no CUDA on CPU)."""


@pytest.mark.cpu
def test_adapter_asks_the_manager_for_thread_local_captures(ecg, vllm_config, monkeypatch):
    import vllm.v1.worker.encoder_cudagraph as ec

    built: list[tuple[Any, str]] = []

    class RecordingManager(ec.EncoderCudaGraphManager):
        def __init__(self, vllm_config, device, dtype, model, *, capture_error_mode="global"):
            super().__init__(vllm_config, device, dtype, model, capture_error_mode=capture_error_mode)
            built.append((self, capture_error_mode))
            raise _ManagerBuiltError

    monkeypatch.setattr(ec, "EncoderCudaGraphManager", RecordingManager)
    # no CUDA here: the backend's stream lookup returns a stand-in, and a given pool skips pool creation
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    x = torch.ones(3, 8)
    encoder = ecg.ExactShapeEncoder(lambda t: t * 2, [x], x.shape)
    with pytest.raises(_ManagerBuiltError):
        ecg.CudaGraphBackend().capture(encoder, vllm_config, x.device, (object(), object()))
    [(manager, mode)] = built
    assert ecg.CAPTURE_ERROR_MODE == "thread_local"
    assert mode == "thread_local"
    assert manager.capture_error_mode == "thread_local"


@pytest.mark.cpu
def test_adapter_refuses_a_manager_without_capture_error_mode(ecg, vllm_config, monkeypatch):
    """Without the manager's capture_error_mode the adapter must not silently capture in global mode:
    built directly it raises; the factory the model file calls builds none and warns."""
    import vllm.v1.worker.encoder_cudagraph as ec

    class ManagerWithoutCaptureErrorMode(ec.EncoderCudaGraphManager):
        def __init__(self, vllm_config, device, dtype, model):  # the signature without capture_error_mode
            super().__init__(vllm_config, device, dtype, model)

    monkeypatch.setattr(ec, "EncoderCudaGraphManager", ManagerWithoutCaptureErrorMode)
    with pytest.raises(RuntimeError, match="takes no capture_error_mode") as info:
        ecg.EncoderCudaGraph(lambda x: x, vllm_config)
    assert "let the caller choose the capture error mode of encoder graphs" in str(
        info.value
    )  # the vLLM change
    assert '"encoder_cuda_graph": false' in str(info.value)
    # through the factory the model file calls: no adapter, the encoder runs eagerly, and one WARNING
    # names the missing vLLM change (a model on such a vLLM still builds)
    factory = sys.modules[ecg.make_encoder_cuda_graph.__module__]
    with logs.captured(factory.logger) as records:
        setup = ecg.make_encoder_cuda_graph(
            lambda x: x, vllm_config, ecg.EncoderCudaGraphOptions(), name="audio"
        )
    assert setup.adapter is None
    assert setup.state == "off (vLLM's EncoderCudaGraphManager takes no capture_error_mode)"
    warnings = records.messages(logging.WARNING)
    assert len(warnings) == 1 and "encoders run eagerly" in warnings[0]
    assert "let the caller choose the capture error mode of encoder graphs" in warnings[0]
    off = ecg.EncoderCudaGraphOptions(enabled=False)
    assert ecg.make_encoder_cuda_graph(lambda x: x, vllm_config, off, name="audio").state == (
        "off (encoder_cuda_graph=false)"
    )


# ---------------------------------------------------------------------------
# CUDA: the scenario (also run by the control's subprocess)
# ---------------------------------------------------------------------------


class CudaChatter(threading.Thread):
    """A second thread of the process doing CUDA work in a loop until ``stop`` is set.

    Each iteration: a pageable host-to-device copy of ``arange(numel) + step`` (float32) on the
    thread's current stream, a doubling on a side stream, ``event.synchronize()`` on an event
    recorded there (what vLLM's async output copy thread does), a synchronise of the current
    stream, and a device-to-host read-back compared with ``2 * host`` (``checked``/``wrong``).
    Once ``capture_started`` is set, iterations count in ``during_capture``; after
    ``ITERATIONS_DURING_CAPTURE`` of them (or on an error) ``overlapped`` is set. Errors are
    kept as strings in ``errors`` and end the loop.
    """

    def __init__(self, device: torch.device, numel: int = 1 << 16) -> None:
        super().__init__(daemon=True, name="cuda-chatter")
        self.device, self.numel = device, numel
        self.running, self.capture_started = threading.Event(), threading.Event()
        self.overlapped, self.stop = threading.Event(), threading.Event()
        self.errors: list[str] = []
        self.checked = self.wrong = self.during_capture = 0

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario, never swallowed
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.running.set()
            self.overlapped.set()

    def _loop(self) -> None:
        torch.accelerator.set_device_index(self.device)
        side = torch.cuda.Stream(self.device)
        done = torch.cuda.Event()
        step = 0
        while not self.stop.is_set():
            capturing = self.capture_started.is_set()
            host = torch.arange(self.numel, dtype=torch.float32) + step  # pageable
            dev = host.to(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                doubled = dev * 2
                done.record(side)
            done.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
            self.wrong += int(not torch.equal(doubled.cpu(), host * 2))
            self.checked += 1
            step += 1
            self.running.set()
            if capturing:
                self.during_capture += 1
                if self.during_capture >= ITERATIONS_DURING_CAPTURE:
                    self.overlapped.set()


class GatedEncoder:
    """``forward(x) = gelu(gelu(x @ W) @ W)``; under capture it first waits for ``chatter``'s overlap."""

    def __init__(self, chatter: CudaChatter, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.weight = (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(device)
        self.chatter = chatter

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            self.chatter.capture_started.set()
            if not self.chatter.overlapped.wait(WAIT_S):
                raise RuntimeError("gate timeout: the second thread never ran during the capture")
        y = torch.nn.functional.gelu(x @ self.weight)
        return torch.nn.functional.gelu(y @ self.weight)


def run_scenario(ecg, vllm_config) -> dict[str, Any]:
    """Capture a new shape while a :class:`CudaChatter` runs; return what happened (JSON-able)."""
    device = torch.device("cuda", torch.accelerator.current_device_index())
    chatter = CudaChatter(device)
    enc = GatedEncoder(chatter, device)
    # the count rule: the second call captures, whatever the cost model thinks of this tiny forward
    graph = ecg.EncoderCudaGraph(enc, vllm_config, min_free_bytes=0, admission="count", name="vision")
    result: dict[str, Any] = {"mode": ecg.backend.CAPTURE_ERROR_MODE, "capture_error": None}
    with torch.inference_mode():
        x = torch.randn(ROWS, WIDTH, device=device)
        eager = enc(x)
        graph(x)  # warmup miss: eager
        chatter.start()
        result["chatter_started"] = chatter.running.wait(WAIT_S)
        try:
            out = graph(x)  # capture, gated on the chatter's overlap, then the first replay
        except Exception as exc:  # noqa: BLE001 - the control's expected outcome, reported
            out = None
            result["capture_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            chatter.stop.set()
            chatter.join(WAIT_S)
        if out is not None:
            x2 = torch.randn_like(x)
            result["first_equal"] = bool(torch.equal(out, eager))
            result["replay_equal"] = bool(torch.equal(graph(x2), enc(x2)))
            torch.accelerator.synchronize()
    result.update(
        stats=graph.get_cumulative_stats(),
        manager_modes=[m.capture_error_mode for m in graph.graphs.values()],
        thread_errors=chatter.errors,
        thread_alive=chatter.is_alive(),
        checked=chatter.checked,
        wrong=chatter.wrong,
        during_capture=chatter.during_capture,
    )
    return result


@requires_cuda
@pytest.mark.cuda
def test_capture_next_to_a_busy_cuda_thread(ecg, vllm_config):
    result = run_scenario(ecg, vllm_config)
    assert result["capture_error"] is None, result
    assert result["thread_errors"] == [] and not result["thread_alive"], result
    assert result["chatter_started"] and result["during_capture"] >= ITERATIONS_DURING_CAPTURE, result
    assert result["wrong"] == 0 and result["checked"] >= ITERATIONS_DURING_CAPTURE, result
    stats = result["stats"]
    assert stats["num_graphs"] == 1 and stats["capture_failures"] == 0 and stats["graph_hits"] == 2, stats
    assert result["manager_modes"] == ["thread_local"]
    assert result["first_equal"] and result["replay_equal"], result


@requires_cuda
@pytest.mark.cuda
def test_control_global_mode_breaks_in_a_subprocess(ecg):
    """The same scenario in vLLM's default global mode fails: the test above proves the fix."""
    proc, results = run_adapter_scenario(
        ecg,
        __file__,
        "run_scenario",
        RESULT_TAG,
        # vLLM's default: what the adapter did before the fix
        setup='ecg.backend.CAPTURE_ERROR_MODE = "global"',
        # skip teardown: nothing after a deliberately broken capture is under test here
        hard_exit=True,
    )
    assert proc.returncode == 0 and len(results) == 1, output_tail(proc)
    result = results[0]
    assert result["mode"] == "global" and result["chatter_started"], result
    # The other thread's call fails ("operation not permitted when stream is capturing") and/or the
    # capture is invalidated (fatal for the adapter): either breaks serving.
    failures = [*result["thread_errors"], *filter(None, [result["capture_error"]])]
    assert failures and not any("gate timeout" in f for f in failures), result
    assert any("captur" in f.lower() for f in failures), result
    assert result["capture_error"] is None or result["stats"]["capture_failures"] == 1, result
