# SPDX-License-Identifier: Apache-2.0
"""CUDA tests of the encoder graph adapter's mechanics with real graphs.

Real captures through vLLM's ``EncoderCudaGraphManager`` on small forwards: replay
freshness, retained outputs, keys (mask/None, dtype, stream), graph pools, the memory
floor, the fatal contract, caps and exact stats, autograd modes, module hooks. The MiniCPM-o 4.5 SigLIP/Whisper
modules at checkpoint dimensions are in ``test_encoder_cuda_graph_models.py``.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
from helpers.scenarios import output_tail, run_adapter_scenario
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"),
]


def counting(ecg, *args, **options):
    """The adapter with ``admission="count"``: these tests pin capture mechanics on tiny forwards,
    whose graphs the cost rule would (rightly) decline; the cost rule has its own tests."""
    options.setdefault("admission", "count")
    return ecg.EncoderCudaGraph(*args, **options)


class TinyEncoder:
    """``forward(x, mask) -> gelu(x @ W + rowsum(mask))``: a capturable, shape-preserving body."""

    def __init__(self, width: int = 64, device: str = "cuda", seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.weight = (torch.randn(width, width, generator=g) / width**0.5).to(device)
        self.calls = 0
        self.fail_while_capturing = False

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        if self.fail_while_capturing and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected failure during capture")
        y = x @ self.weight.to(x.dtype)
        if mask is not None:
            y = y + mask.sum(-1, keepdim=True).to(y.dtype)
        return torch.nn.functional.gelu(y)


def reading_backend(ecg, free_memory):
    """The real CUDA backend with an injected free-memory reading ``free_memory(device)``."""

    class ReadingBackend(ecg.CudaGraphBackend):
        def free_bytes(self, device):
            return free_memory(device)

    return ReadingBackend()


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def managers(graph):
    return list(graph.graphs.values())


def buffers_of(manager):
    """Data pointers of every static input and output buffer a manager's graphs own."""
    ptrs = set()
    for graph_set in manager.budget_graphs.values():
        for meta in graph_set.values():
            ptrs.update(t.data_ptr() for t in meta.input_buffers.values())
            ptrs.add(meta.output_buffer.data_ptr())
    return ptrs


@torch.inference_mode()
def test_replay_reads_inputs_mutated_in_place_and_outputs_are_retained(ecg, vllm_config):
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config)
    x = rand(4, 64)
    graph(x)  # warmup (eager)
    first = graph(x)  # capture, served by a replay
    assert graph.get_cumulative_stats()["num_graphs"] == 1
    first_copy = first.clone()
    x.mul_(-3.0).add_(1.0)  # mutate in place: same tensor, new values
    second = graph(x)
    torch.testing.assert_close(second, enc(x), rtol=0, atol=0)
    x.copy_(rand(4, 64))
    third = graph(x)
    torch.testing.assert_close(third, enc(x), rtol=0, atol=0)
    # earlier returned outputs are clones: later replays do not overwrite them
    assert torch.equal(first, first_copy)
    assert not torch.equal(first, second) and not torch.equal(second, third)
    assert first.data_ptr() != second.data_ptr() != third.data_ptr()
    assert graph.get_cumulative_stats()["graph_hits"] == 3


@torch.inference_mode()
def test_mask_none_mask_tensor_and_dtype_are_different_graphs(ecg, vllm_config):
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config)
    x, mask = rand(2, 64), rand(2, 8)
    calls = [(x, None), (x, mask), (x.half(), None), (x.half(), mask.half())]
    for _ in range(3):
        for args in calls:
            torch.testing.assert_close(graph(*args), enc(*args), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 4 and stats["graph_hits"] == 8 and stats["warmup_misses"] == 4
    assert all(isinstance(m, EncoderCudaGraphManager) for m in managers(graph))
    dtypes = sorted(str(key[2][0][1]) for key in graph.graphs)
    assert dtypes == ["torch.float16", "torch.float16", "torch.float32", "torch.float32"]
    # the engine's config is copied per capture, never mutated
    assert vllm_config.compilation_config.encoder_cudagraph_token_budgets == []
    assert vllm_config.parallel_config.tensor_parallel_size == 1


@torch.inference_mode()
def test_two_replay_streams_never_share_buffers(ecg, vllm_config):
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [rand(3, 64), rand(3, 64)]
    outs = {}
    for rep in range(4):
        for i, stream in enumerate(streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                if rep == 3:
                    inputs[i].copy_(rand(3, 64))
                outs[(rep, i)] = (graph(inputs[i]), inputs[i].clone())
        torch.accelerator.synchronize()
    assert len(graph.graphs) == 2
    assert {key[0] for key in graph.graphs} == {s.stream_id for s in streams}
    a, b = managers(graph)
    assert buffers_of(a).isdisjoint(buffers_of(b))
    for (rep, i), (out, seen_input) in outs.items():
        torch.testing.assert_close(out, enc(seen_input), rtol=0, atol=0)


@torch.inference_mode()
def test_shared_pools_are_per_encoder_and_replay_stream(ecg, vllm_config):
    encoders = [counting(ecg, TinyEncoder(seed=s), vllm_config, name=f"enc{s}") for s in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for enc in encoders:
                for rows in (2, 5):
                    x = rand(rows, 64)
                    enc(x), enc(x)
    torch.accelerator.synchronize()
    pools = {}
    for e, enc in enumerate(encoders):
        assert len(enc.graphs) == 4
        assert len(enc._capture_pools) == 2  # one (pool, capture stream) per replay stream
        for key, manager in enc.graphs.items():
            pools.setdefault((e, key[0]), set()).add(manager.graph_pool)
    # one pool per (encoder, replay stream), each shared by that pair's two graphs...
    assert all(len(p) == 1 for p in pools.values()) and len(pools) == 4
    # ...and isolated across encoders and streams
    assert len({next(iter(p)) for p in pools.values()}) == 4
    capture_streams = [p.stream for enc in encoders for p in enc._capture_pools.values()]
    assert len({s.cuda_stream for s in capture_streams}) == 4


@pytest.mark.parametrize("share_pools", [True, False])
@torch.inference_mode()
def test_interleaved_late_captures_keep_every_retained_output(ecg, vllm_config, share_pools):
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config, share_pools=share_pools, max_graphs=4)
    retained = []  # (output, expected)
    sizes = [8, 16, 32, 64]
    for n, rows in enumerate(sizes):
        for _ in range(2):  # warmup, then capture (a late capture into the pool)
            x = rand(rows, 64)
            retained.append((graph(x), enc(x)))
        for earlier in sizes[: n + 1][::-1]:  # replay everything captured so far
            x = rand(earlier, 64)
            retained.append((graph(x), enc(x)))
    torch.accelerator.synchronize()
    for out, expected in retained:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    pools = {m.graph_pool for m in managers(graph)}
    assert len(graph.graphs) == 4
    assert len(pools) == (1 if share_pools else 4)
    assert len(graph._capture_pools) == (1 if share_pools else 0)


@torch.inference_mode()
def test_memory_floor_defers_capture_and_keeps_replaying_below_it(ecg, vllm_config):
    reading = {"free": 1023}
    asked = []

    def free_memory(device):
        asked.append(device)
        return reading["free"]

    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config, min_free_bytes=1024, backend=reading_backend(ecg, free_memory))
    x = rand(2, 64)
    for _ in range(4):  # warmup + 3 deferred captures
        torch.testing.assert_close(graph(x), enc(x), rtol=0, atol=0)
    assert graph.get_cumulative_stats()["memory_misses"] == 3 and not graph.graphs
    reading["free"] = 1024
    graph(x)
    assert len(graph.graphs) == 1
    reading["free"] = 0
    for _ in range(3):
        torch.testing.assert_close(graph(x), enc(x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert (stats["graph_hits"], stats["memory_misses"], stats["warmup_misses"]) == (4, 3, 1)
    assert asked == [x.device] * 4


@torch.inference_mode()
def test_default_floor_reads_the_inputs_device(ecg, vllm_config, monkeypatch):
    seen = []
    platform = ecg.backend.omni_platforms.current_omni_platform  # where the backend reads free memory
    real = platform.get_free_memory

    def spy(device=None):
        seen.append(torch.device(device))
        return real(device)

    monkeypatch.setattr(platform, "get_free_memory", spy)
    graph = counting(ecg, TinyEncoder(), vllm_config, min_free_bytes=1)
    x = rand(2, 64)
    graph(x), graph(x)
    assert seen == [x.device] and len(graph.graphs) == 1


@pytest.mark.parametrize("where", ["before_capture", "during_capture"])
@torch.inference_mode()
def test_capture_failure_is_fatal_without_retry_or_eager_work(ecg, vllm_config, monkeypatch, where):
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    enc = TinyEncoder()
    attempts = []
    real_capture = EncoderCudaGraphManager.capture

    def capture(self, graph_pool):
        attempts.append(graph_pool)
        if where == "before_capture":
            raise RuntimeError("injected failure before capture")
        enc.fail_while_capturing = True
        try:
            return real_capture(self, graph_pool)
        finally:
            enc.fail_while_capturing = False

    # a graph captured before the failure, as another adapter's (or vLLM's) would be
    earlier_enc = TinyEncoder(seed=1)
    earlier = counting(ecg, earlier_enc, vllm_config)
    y = rand(3, 64)
    earlier(y), earlier(y)
    assert len(earlier.graphs) == 1
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True))
    monkeypatch.setattr(EncoderCudaGraphManager, "capture", capture)
    graph = counting(ecg, enc, vllm_config)
    x = rand(2, 64)
    graph(x)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        graph(x)
    assert not isinstance(info.value, ecg.EncoderCudaGraphCaptureFailedError)
    assert not torch.cuda.is_current_stream_capturing()
    calls = enc.calls
    for args in [(x,), (rand(7, 64),), (torch.ones(2, 64),)]:
        with pytest.raises(ecg.EncoderCudaGraphCaptureFailedError, match="Restart the worker"):
            graph(*args)
    assert enc.calls == calls  # no eager work after the failure
    assert len(attempts) == 1  # no retry
    assert graph.graphs == {} and not graph.admission.history
    assert graph.get_cumulative_stats()["capture_failures"] == 1
    # the cleanup left cuBLAS's workspaces alone (the earlier graph replays into its stream's), and
    # that graph still replays what the encoder computes
    assert cleared == []
    hits = earlier.get_cumulative_stats()["graph_hits"]
    torch.testing.assert_close(earlier(y), earlier_enc(y), rtol=0, atol=0)
    assert earlier.get_cumulative_stats()["graph_hits"] == hits + 1
    # the failure stayed inside that adapter: a fresh one still captures and replays
    monkeypatch.setattr(EncoderCudaGraphManager, "capture", real_capture)
    fresh = counting(ecg, TinyEncoder(), vllm_config)
    fresh(x), fresh(x)
    assert len(fresh.graphs) == 1


class GarbageMakingEncoder(TinyEncoder):
    """Makes reference cycles while a capture records it: enough new containers that Python's
    automatic collection would start inside the capture, were it on."""

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            threshold = max(gc.get_threshold()[0], 1)
            for _ in range(4 * threshold):
                cycle: list[Any] = []
                cycle.append(cycle)
        return super().__call__(x, mask)


@torch.inference_mode()
def test_no_automatic_garbage_collection_runs_inside_a_capture(ecg, vllm_config):
    """A collection inside a capture may finalize a graph left in a reference cycle, whose reset
    invalidates the capture (``CUBLAS_STATUS_INTERNAL_ERROR`` at the next GEMM): the backend keeps
    automatic collection off while it captures and puts it back on after."""
    inside: list[bool] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            inside.append(torch.cuda.is_current_stream_capturing())

    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        graph = counting(ecg, GarbageMakingEncoder(), vllm_config)
        x = rand(5, 64)
        graph(x), graph(x)
    finally:
        gc.callbacks.remove(seen)
    assert len(graph.graphs) == 1
    assert True not in inside  # no collection started while the capture stream was capturing
    assert gc.isenabled()


class HostSyncEncoder(TinyEncoder):
    """:class:`TinyEncoder` with a host sync in its forward (``Tensor.item``): eager calls work, a
    capture of it is invalidated, so ``capture_end`` itself fails and skips torch's bookkeeping."""

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = super().__call__(x, mask)
        y.sum().item()  # reads the GPU back: not allowed while the stream is capturing
        return y


RESULT_TAG = "FAILED_CAPTURE_RESULT="
#: what must still work after the failed capture (each True, else what it raised)
AFTER_FAILURE_CHECKS = (
    "randn",
    "dropout",
    "multinomial",
    "earlier_graph_replays",
    "eager_encoder",
    "fresh_capture_replays",
    "pool_routing_ended",
    "adapter_refuses",
)


def after_a_failed_capture(ecg, vllm_config) -> dict[str, Any]:
    """Capture a forward with a host sync (it fails), then try everything else the process does.

    Runs in a fresh process (:func:`test_a_failed_capture_leaves_the_rest_of_the_process_working`):
    before the cleanup, such a failure left the CUDA generator in capture mode for good. Returns
    the capture's error, the backend's cleanup log and, per :data:`AFTER_FAILURE_CHECKS` entry,
    True or what the check raised or returned.
    """
    device = torch.device("cuda", torch.accelerator.current_device_index())
    handles = []
    new_handle = torch.cuda.graph_pool_handle

    def recording_handle():
        handles.append(new_handle())
        return handles[-1]

    torch.cuda.graph_pool_handle = recording_handle  # the backend's pools, in creation order
    cleanup_log = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: cleanup_log.append(record.getMessage())
    ecg.backend.logger.addHandler(handler)
    result: dict[str, Any] = {}
    with torch.inference_mode():
        earlier_enc = TinyEncoder(seed=1)
        earlier = counting(ecg, earlier_enc, vllm_config, name="earlier")
        y, y_later = rand(3, 64), rand(3, 64)
        earlier(y), earlier(y)  # captured before the failure, in a pool of its own
        result["earlier_graphs"] = len(earlier.graphs)
        enc = HostSyncEncoder()
        failing = counting(ecg, enc, vllm_config, name="failing")
        x = rand(2, 64)
        expected = enc(x)
        failing(x)  # warmup: eager
        try:
            failing(x)  # the capture
            result["capture_error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            result["capture_error"] = f"{type(exc).__name__}: {exc} (during: {exc.__context__!r})"
        result["capturing_after"] = bool(torch.cuda.is_current_stream_capturing())
        result["cleanup_log"] = list(cleanup_log)

        def dropout():
            out = torch.nn.functional.dropout(torch.ones(4096, device=device), 0.5, training=True)
            return bool(((out == 0) | (out == 2)).all()) and 0 < int((out == 0).sum()) < 4096

        def multinomial():
            drawn = torch.multinomial(torch.ones(4, device=device), 2).tolist()
            return len(drawn) == 2 and len(set(drawn)) == 2 and all(0 <= i < 4 for i in drawn)

        def earlier_graph_replays():
            hits = earlier.get_cumulative_stats()["graph_hits"]
            out = earlier(y_later)
            return (
                torch.equal(out, earlier_enc(y_later))
                and earlier.get_cumulative_stats()["graph_hits"] == hits + 1
            )

        def fresh_capture_replays():
            static = torch.zeros(16, device=device)
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                static * 2 + 1  # warm-up outside the capture
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = static * 2 + 1
            static.copy_(torch.arange(16.0, device=device))
            graph.replay()
            torch.cuda.current_stream(device).wait_stream(side)
            return torch.equal(out, torch.arange(16.0, device=device) * 2 + 1)

        def pool_routing_ended():
            try:  # the failing adapter's pool: the allocator must no longer route into it
                torch._C._cuda_endAllocateToPool(device.index, handles[-1])
            except RuntimeError as exc:
                return "not currently recording" in str(exc) or str(exc)
            return "the allocator was still routing into the failed capture's pool"

        def adapter_refuses():
            try:
                failing(x)
            except ecg.EncoderCudaGraphCaptureFailedError:
                return failing.get_cumulative_stats()["capture_failures"] == 1 and enc.calls == calls
            return "the failed adapter served a call"

        calls = enc.calls + 1  # the eager check below calls the forward once
        checks = {
            "randn": lambda: bool(torch.randn(8, device=device).isfinite().all()),
            "dropout": dropout,
            "multinomial": multinomial,
            "earlier_graph_replays": earlier_graph_replays,
            "eager_encoder": lambda: torch.equal(enc(x), expected),
            "fresh_capture_replays": fresh_capture_replays,
            "pool_routing_ended": pool_routing_ended,
            "adapter_refuses": adapter_refuses,
        }
        for name in AFTER_FAILURE_CHECKS:
            try:
                result[name] = checks[name]()
            except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                result[name] = f"raised {type(exc).__name__}: {exc}"
    torch.cuda.graph_pool_handle = new_handle
    return result


def test_a_failed_capture_leaves_the_rest_of_the_process_working(ecg):
    """After a capture that ``capture_end`` could not finish, the process keeps working: CUDA RNG
    (``randn``, dropout, ``multinomial``, so vLLM's sampler), a graph captured earlier, the eager
    encoder, a new capture elsewhere, the caching allocator (no longer routing into the failed
    pool) and a clean exit; the adapter itself still refuses every call (the fatal contract).

    In a fresh process: the failure changes process-wide state that earlier tests must not have
    set up and later tests must not inherit.
    """
    proc, results = run_adapter_scenario(ecg, __file__, "after_a_failed_capture", RESULT_TAG)
    assert len(results) == 1, output_tail(proc)
    result = results[0]
    assert result["earlier_graphs"] == 1, result
    # the capture failed inside CUDA's stream capture (not a Python error before it)
    assert result["capture_error"] and "captur" in result["capture_error"].lower(), result
    assert result["capturing_after"] is False, result
    assert any("cleaned up after it" in m and "capture mark cleared" in m for m in result["cleanup_log"]), (
        result
    )
    failed = {name: result[name] for name in AFTER_FAILURE_CHECKS if result[name] is not True}
    assert not failed, (failed, result)
    assert proc.returncode == 0, f"no clean exit after the failed capture: {proc.stderr[-4000:]}"


@torch.inference_mode()
def test_zero_max_graphs_disables_capture(ecg, vllm_config):
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config, max_graphs=0)
    x = rand(2, 64)
    for _ in range(3):
        torch.testing.assert_close(graph(x), enc(x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 0 and stats["capacity_misses"] == 3 and not graph.admission.history


@torch.inference_mode()
def test_one_off_shapes_do_not_exhaust_admission(ecg, vllm_config):
    graph = counting(ecg, TinyEncoder(), vllm_config, max_graphs=1)
    for rows in range(1, 20):
        graph(rand(rows, 64))
    assert len(graph.admission.history) == 4 and not graph.graphs
    x = rand(33, 64)
    graph(x), graph(x)
    assert len(graph.graphs) == 1


@torch.inference_mode()
def test_exact_stats_on_a_scripted_sequence(ecg, vllm_config):
    graph = counting(ecg, TinyEncoder(), vllm_config, max_graphs=1, min_capture_calls=3)
    a, b = rand(2, 64), rand(3, 64)
    for _ in range(4):
        graph(a)
    for _ in range(5):
        graph(b)
    with torch.enable_grad():
        graph(rand(2, 64).requires_grad_())  # ineligible: autograd on
    assert graph.get_cumulative_stats() == {
        "graph_hits": 2,
        "graph_misses": 8,
        "hit_rate": pytest.approx(2 / 10),
        "num_graphs": 1,
        "ineligible_misses": 1,
        "capacity_misses": 5,
        "warmup_misses": 2,
        "memory_misses": 0,
        "capture_failures": 0,
    }


def test_grad_autocast_and_foreign_capture_stay_eager(ecg, vllm_config):
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config)
    x = rand(2, 64)
    with torch.enable_grad():
        w = x.clone().requires_grad_()
        graph(w).sum().backward()
        assert w.grad is not None
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        graph(x), graph(x)
    # called while someone else captures the stream: run eagerly into their graph
    outer = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            enc(static_x)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(outer):
            static_out = graph(static_x)
        static_x.copy_(rand(2, 64))
        outer.replay()
        torch.accelerator.synchronize()
        torch.testing.assert_close(static_out, enc(static_x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 4 and stats["num_graphs"] == 0 and not graph.admission.history


MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@pytest.mark.parametrize(
    "capture_mode, later_mode", [("inference_mode", "no_grad"), ("no_grad", "inference_mode")]
)
def test_graph_captured_in_one_autograd_mode_replays_in_the_other(ecg, vllm_config, capture_mode, later_mode):
    """Static inputs allocated by a capture under ``inference_mode`` would be inference tensors that
    a later ``no_grad`` replay cannot copy into ("Inplace update to inference tensor outside
    InferenceMode"); both orders must replay and match eager, returning an inference tensor
    exactly when the eager call does."""
    enc = TinyEncoder()
    graph = counting(ecg, enc, vllm_config)
    mask = None
    with MODES[capture_mode]():
        x, mask = rand(4, 64), rand(4, 8)
        graph(x, mask), graph(x, mask)  # warmup, capture (served by a replay)
    assert graph.get_cumulative_stats()["num_graphs"] == 1
    for mode in (later_mode, capture_mode, later_mode, later_mode):
        with MODES[mode]():
            x, mask = rand(4, 64), rand(4, 8)
            out = graph(x, mask)
            eager = enc(x, mask)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        assert out.is_inference() == eager.is_inference() == (mode == "inference_mode"), mode
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 1 and stats["graph_hits"] == 5 and stats["ineligible_misses"] == 0


class HookedTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()

    def encode(self, x):
        return self.body(x)


@torch.inference_mode()
def test_forward_hooks_keep_the_encoder_eager_so_they_keep_running(ecg, vllm_config, monkeypatch):
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    def no_capture(self, graph_pool):
        raise AssertionError("captured although hooks are registered in the region")

    monkeypatch.setattr(EncoderCudaGraphManager, "capture", no_capture)
    tower = HookedTower()
    fired = []
    tower.body[0].register_forward_hook(lambda module, args, out: fired.append(out.shape))
    graph = counting(ecg, tower.encode, vllm_config, min_free_bytes=0, captured_modules=("body",))
    for _ in range(4):
        x = rand(8, 64)
        torch.testing.assert_close(graph(x), tower.encode(x), rtol=0, atol=0)
    assert len(fired) == 8  # every adapter call ran the hook (and each reference call)
    assert graph.eager_reason is not None and "HookedTower.body.0 (forward hook)" in graph.eager_reason
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 0 and stats["ineligible_misses"] == 3 and stats["warmup_misses"] == 1


# ---------------------------------------------------------------------------
# Cost measurements (CUDA events, no host syncs) and byte accounting
# ---------------------------------------------------------------------------


class ManySmallKernels:
    """Launch-bound: ``steps`` tiny element-wise kernels (the host launches slower than the GPU runs)."""

    def __init__(self, steps: int = 400):
        self.steps = steps

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for _ in range(self.steps):
            x = x * 1.0001 + 0.0001
        return x


class FewLargeMatmuls:
    """GPU-bound: four 4096^3 fp32 matmuls (milliseconds of GPU work, microseconds of launches)."""

    def __init__(self):
        self.weight = torch.randn(4096, 4096, device="cuda") / 64

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for _ in range(4):
            x = x @ self.weight
        return x


@torch.inference_mode()
def test_eager_measurement_needs_no_host_sync_and_reads_back_later(ecg):
    backend = ecg.CudaGraphBackend()
    enc = TinyEncoder(width=512)
    x = rand(256, 512)
    enc(x)
    torch.accelerator.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the stream busy for a while (~0.1 s)
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        out, measurement = backend.measure_eager(x.device, lambda: enc(x))
        pending = measurement.sample()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending is None  # the device is still sleeping: not read back, and not waited for
    assert 0 < measurement.host_ms < 50
    # the eager call's peak: x @ W and its gelu are alive together (2 x 256 x 512 float32)
    assert measurement.peak_bytes >= 2 * out.numel() * out.element_size()
    torch.accelerator.synchronize()
    sample = measurement.sample()
    assert sample is not None and 0 < sample.gpu_ms < 100  # the call itself, not the sleep before it
    assert (sample.busy_ms, sample.hold_ms, sample.host_ms) == (None, 0.0, measurement.host_ms)
    torch.testing.assert_close(out, enc(x), rtol=0, atol=0)


def held_sample(backend, forward, x, hold_ms):
    """A held measurement of ``forward(x)``, taken with host syncs forbidden, then read back."""
    torch.accelerator.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, measurement = backend.measure_eager(x.device, lambda: forward(x), hold_ms=hold_ms)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.accelerator.synchronize()
    return out, measurement.sample()


@torch.inference_mode()
def test_a_held_measurement_times_the_gpu_work_behind_a_calibrated_hold(ecg):
    """The spin kernel holds the stream while the host enqueues the call: the GPU time after it is
    the GPU's work, far below the unheld span of a launch-bound call, about the span of a GPU-bound
    one. The first hold calibrates the spin clock, so later holds last what they are asked."""
    backend = ecg.CudaGraphBackend()
    small, large = ManySmallKernels(), FewLargeMatmuls()
    xs, xl = rand(8, 64), rand(4096, 4096)
    small(xs), large(xl)  # warm up (kernel selection, allocator)
    torch.accelerator.synchronize()
    _, unheld = backend.measure_eager(xs.device, lambda: small(xs))
    torch.accelerator.synchronize()
    span, host = unheld.sample().gpu_ms, unheld.host_ms
    out, first = held_sample(backend, small, xs, hold_ms=2 * host)  # longer than the enqueueing
    torch.testing.assert_close(out, small(xs), rtol=0, atol=0)
    assert first.gpu_ms is None and first.hold_ms > 0 and first.busy_ms > 0
    _, held = held_sample(backend, small, xs, hold_ms=2 * host)  # calibrated by the first hold
    assert held.hold_ms == pytest.approx(2 * host, rel=0.25), (held, host)
    assert held.busy_ms < 0.8 * span, (held, span)  # 800 tiny kernels back to back: idle gaps gone
    _, unheld_large = backend.measure_eager(xl.device, lambda: large(xl))
    torch.accelerator.synchronize()
    large_span = unheld_large.sample().gpu_ms
    _, held_large = held_sample(backend, large, xl, hold_ms=1.0)
    assert held_large.busy_ms == pytest.approx(large_span, rel=0.2), (held_large, large_span)


@torch.inference_mode()
def test_cost_mode_captures_launch_bound_and_declines_gpu_bound_calls(ecg, vllm_config):
    """2000 tiny kernels (several ms of launches, a few KiB of memory) called every time pay even
    if a replay saved only a tenth of their host time: captured at the second call, unheld."""
    steps = 1000
    small = ecg.EncoderCudaGraph(ManySmallKernels(steps), vllm_config, name="launch-bound")
    large = ecg.EncoderCudaGraph(FewLargeMatmuls(), vllm_config, name="gpu-bound")
    xs, xl = rand(8, 64), rand(4096, 4096)
    torch.cuda.set_sync_debug_mode("error")
    try:  # warmup calls are measured without host syncs
        small(xs), large(xl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.accelerator.synchronize()  # let the events complete: the decision reads them back
    for _ in range(3):
        torch.testing.assert_close(small(xs), ManySmallKernels(steps)(xs), rtol=0, atol=0)
        large(xl)
        torch.accelerator.synchronize()
    assert small.get_cumulative_stats()["num_graphs"] == 1
    assert small.get_cumulative_stats()["graph_hits"] == 3
    assert large.get_cumulative_stats()["num_graphs"] == 0
    assert large.get_detailed_stats()["declined_misses"] == 3
    (record,) = large._records.values()
    assert record.verdict is not None and not record.verdict.capture
    # declined without a held call: a few launches bound what a replay could save, a small share
    # of the call's GPU span (the absolute bound moves with the host's launch speed)
    assert record.held is None and record.verdict.hold_ms == 0.0, record.verdict.describe()
    assert record.verdict.saving_ms < 0.05 * record.verdict.span_ms, record.verdict.describe()


def allocator_pool_bytes(handle):
    segments = torch.cuda.memory_snapshot()
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(handle))


@torch.inference_mode()
def test_graph_bytes_are_measured_at_capture(ecg, vllm_config):
    enc = TinyEncoder(width=1024)
    graph = counting(ecg, enc, vllm_config, max_bytes=1 << 40)
    for rows in (2048, 512):
        x, mask = rand(rows, 1024), rand(rows, 16)
        graph(x, mask), graph(x, mask)
    detail = graph.get_detailed_stats()
    assert len(detail["graphs"]) == 2
    handles = {m.graph_pool for m in managers(graph)}
    assert len(handles) == 1  # shared pool
    # the pool's segments, read independently from the allocator, are what the graphs grew it by
    assert sum(g["pool_bytes"] for g in detail["graphs"]) == allocator_pool_bytes(next(iter(handles))) > 0
    for g, manager in zip(detail["graphs"], managers(graph)):
        held = sum(t.numel() * t.element_size() for t in static_buffers(manager))
        assert g["static_bytes"] == held  # input buffers + output buffer the manager keeps
        assert g["bytes"] == g["pool_bytes"] + g["static_bytes"] and g["capture_ms"] > 0
    assert detail["graph_bytes"] == graph.graph_bytes == sum(g["bytes"] for g in detail["graphs"])
    # the first graph's intermediates (2048 x 1024 float32, several alive at once) need pool memory
    assert detail["graphs"][0]["pool_bytes"] >= 2 * 2048 * 1024 * 4


@torch.inference_mode()
def test_byte_budget_defers_with_real_estimates(ecg, vllm_config):
    enc = TinyEncoder(width=1024)
    graph = counting(ecg, enc, vllm_config, max_bytes=4 << 20)
    x = rand(2048, 1024)  # 8 MiB input alone: the estimate passes 4 MiB
    for _ in range(3):
        torch.testing.assert_close(graph(x), enc(x), rtol=0, atol=0)
    assert not graph.graphs and graph.get_detailed_stats()["budget_misses"] == 2
    key, record = next(iter(graph._records.items()))
    assert graph._estimate_bytes(key, record) >= 3 * x.numel() * x.element_size()


def static_buffers(manager):
    for graph_set in manager.budget_graphs.values():
        for meta in graph_set.values():
            yield from meta.input_buffers.values()
            yield meta.output_buffer
