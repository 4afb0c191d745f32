# SPDX-License-Identifier: Apache-2.0
"""CUDA tests of the encoder graph adapter's mechanics with real graphs.

Real captures through vLLM's ``EncoderCudaGraphManager`` on small forwards: replay
freshness, retained outputs, keys (mask/None, dtype, stream), graph pools, the memory
floor, the fatal contract, caps and exact stats, autograd modes, module hooks. The MiniCPM-o 4.5 SigLIP/Whisper
modules at checkpoint dimensions are in ``test_encoder_cuda_graph_models.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"),
]


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
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
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
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
    x, mask = rand(2, 64), rand(2, 8)
    calls = [(x, None), (x, mask), (x.half(), None), (x.half(), mask.half())]
    for _ in range(3):
        for args in calls:
            torch.testing.assert_close(graph(*args), enc(*args), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 4 and stats["graph_hits"] == 8 and stats["warmup_misses"] == 4
    assert all(isinstance(m, EncoderCudaGraphManager) for m in managers(graph))
    dtypes = sorted(str(key[1][0][1]) for key in graph.graphs)
    assert dtypes == ["torch.float16", "torch.float16", "torch.float32", "torch.float32"]
    # the engine's config is copied per capture, never mutated
    assert vllm_config.compilation_config.encoder_cudagraph_token_budgets == []
    assert vllm_config.parallel_config.tensor_parallel_size == 1


@torch.inference_mode()
def test_two_replay_streams_never_share_buffers(ecg, vllm_config):
    enc = TinyEncoder()
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
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
        torch.cuda.synchronize()
    assert len(graph.graphs) == 2
    assert {key[0] for key in graph.graphs} == {s.cuda_stream for s in streams}
    a, b = managers(graph)
    assert buffers_of(a).isdisjoint(buffers_of(b))
    for (rep, i), (out, seen_input) in outs.items():
        torch.testing.assert_close(out, enc(seen_input), rtol=0, atol=0)


@torch.inference_mode()
def test_shared_pools_are_per_encoder_and_replay_stream(ecg, vllm_config):
    encoders = [ecg.EncoderCudaGraph(TinyEncoder(seed=s), vllm_config, name=f"enc{s}") for s in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for enc in encoders:
                for rows in (2, 5):
                    x = rand(rows, 64)
                    enc(x), enc(x)
    torch.cuda.synchronize()
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
    capture_streams = [s for enc in encoders for (_, s) in enc._capture_pools.values()]
    assert len({s.cuda_stream for s in capture_streams}) == 4


@pytest.mark.parametrize("share_pools", [True, False])
@torch.inference_mode()
def test_interleaved_late_captures_keep_every_retained_output(ecg, vllm_config, share_pools):
    enc = TinyEncoder()
    graph = ecg.EncoderCudaGraph(enc, vllm_config, share_pools=share_pools, max_graphs=4)
    retained = []  # (output, expected)
    sizes = [8, 16, 32, 64]
    for n, rows in enumerate(sizes):
        for _ in range(2):  # warmup, then capture (a late capture into the pool)
            x = rand(rows, 64)
            retained.append((graph(x), enc(x)))
        for earlier in sizes[: n + 1][::-1]:  # replay everything captured so far
            x = rand(earlier, 64)
            retained.append((graph(x), enc(x)))
    torch.cuda.synchronize()
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
    graph = ecg.EncoderCudaGraph(
        enc, vllm_config, min_free_bytes=1024, backend=reading_backend(ecg, free_memory)
    )
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
    real = torch.cuda.mem_get_info

    def spy(device=None):
        seen.append(torch.device(device))
        return real(device)

    monkeypatch.setattr(torch.cuda, "mem_get_info", spy)
    graph = ecg.EncoderCudaGraph(TinyEncoder(), vllm_config, min_free_bytes=1)
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

    monkeypatch.setattr(EncoderCudaGraphManager, "capture", capture)
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
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
    # the failure stayed inside that adapter: a fresh one still captures and replays
    monkeypatch.setattr(EncoderCudaGraphManager, "capture", real_capture)
    fresh = ecg.EncoderCudaGraph(TinyEncoder(), vllm_config)
    fresh(x), fresh(x)
    assert len(fresh.graphs) == 1


@torch.inference_mode()
def test_zero_max_graphs_disables_capture(ecg, vllm_config):
    enc = TinyEncoder()
    graph = ecg.EncoderCudaGraph(enc, vllm_config, max_graphs=0)
    x = rand(2, 64)
    for _ in range(3):
        torch.testing.assert_close(graph(x), enc(x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 0 and stats["capacity_misses"] == 3 and not graph.admission.history


@torch.inference_mode()
def test_one_off_shapes_do_not_exhaust_admission(ecg, vllm_config):
    graph = ecg.EncoderCudaGraph(TinyEncoder(), vllm_config, max_graphs=1)
    for rows in range(1, 20):
        graph(rand(rows, 64))
    assert len(graph.admission.history) == 4 and not graph.graphs
    x = rand(33, 64)
    graph(x), graph(x)
    assert len(graph.graphs) == 1


@torch.inference_mode()
def test_exact_stats_on_a_scripted_sequence(ecg, vllm_config):
    graph = ecg.EncoderCudaGraph(TinyEncoder(), vllm_config, max_graphs=1, min_capture_calls=3)
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
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
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
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, enc(static_x), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 4 and stats["num_graphs"] == 0 and not graph.admission.history


MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@pytest.mark.parametrize(
    "capture_mode, later_mode", [("inference_mode", "no_grad"), ("no_grad", "inference_mode")]
)
def test_graph_captured_in_one_autograd_mode_replays_in_the_other(ecg, vllm_config, capture_mode, later_mode):
    """A capture under ``inference_mode`` used to leave inference-tensor static inputs that a
    later ``no_grad`` replay could not copy into ("Inplace update to inference tensor outside
    InferenceMode"); both orders must replay and match eager, returning an inference tensor
    exactly when the eager call does."""
    enc = TinyEncoder()
    graph = ecg.EncoderCudaGraph(enc, vllm_config)
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
    graph = ecg.EncoderCudaGraph(tower.encode, vllm_config, min_free_bytes=0, captured_modules=("body",))
    for _ in range(4):
        x = rand(8, 64)
        torch.testing.assert_close(graph(x), tower.encode(x), rtol=0, atol=0)
    assert len(fired) == 8  # every adapter call ran the hook (and each reference call)
    assert graph.eager_reason is not None and "HookedTower.body.0 (forward hook)" in graph.eager_reason
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 0 and stats["ineligible_misses"] == 3 and stats["warmup_misses"] == 1
