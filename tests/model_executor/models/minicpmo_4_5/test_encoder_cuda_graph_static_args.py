# SPDX-License-Identifier: Apache-2.0
"""Static arguments of the adapter (``static_args=True``): positional inputs that are neither
tensors nor None.

They are part of the graph key by value, reach every call of the forward (warm-up, capture,
replay's recorded work, eager), and never become static input buffers or graph bytes. Adapters
without ``static_args`` keep the tensor-only key (``test_encoder_cuda_graph_policy.py`` tests that
they treat such a call as ineligible). CPU tests drive the real adapter through the CPU backend of
the adapter's seam (``conftest.CpuGraphBackend``, whose graphs keep vLLM's buffer flow); the CUDA
test captures and replays real graphs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.core_model]


class Scaled:
    """``forward(x, scale, sink, mask) -> x * scale``, recording the non-tensor arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, scale, sink, mask):
        self.calls.append((scale, sink, mask))
        return x * scale


@pytest.mark.cpu
@torch.inference_mode()
def test_static_arguments_are_keyed_by_value_and_reach_every_forward_call(ecg, vllm_config, cpu_backend):
    fwd = Scaled()
    backend = cpu_backend()
    graph = ecg.EncoderCudaGraph(fwd, vllm_config, max_graphs=8, static_args=True, backend=backend)
    sink, other = object(), object()
    x = torch.ones(2, 3)
    for _ in range(3):  # warmup, capture + replay, replay
        assert torch.equal(graph(x, 2, sink, None), x * 2)
    assert torch.equal(graph(x, 3, sink, None), x * 3)  # another value: another key (warmup)
    assert torch.equal(graph(x, 2, other, None), x * 2)  # another object: another key (warmup)
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (1, 2, 3)
    ((key, manager),) = graph.graphs.items()
    tensor = ((2, 3), torch.float32)
    cpu = torch.device("cpu")
    assert key == (backend.STREAM, cpu, (tensor, (ecg.STATIC_ARG, 2), (ecg.STATIC_ARG, sink), None))
    (encoder,) = backend.encoders
    assert encoder.keys == ["0"] and encoder.statics == {1: 2, 2: sink} and encoder.dtype == torch.float32
    assert backend.captures == [((2, 3), [(2, 3), None, None, None])]
    assert list(manager.input_buffers) == ["0"]  # only tensors become static input buffers
    # warmup, the capture's buffer forward, the two replays' recomputation: all with the statics
    assert fwd.calls[:4] == [(2, sink, None)] * 4
    assert fwd.calls[-2:] == [(3, sink, None), (2, other, None)]
    assert ecg.shapes._describe(key) == [((2, 3), "float32"), 2, sink, None]


@pytest.mark.cpu
@torch.inference_mode()
def test_a_static_value_never_collides_with_a_tensor_entry(ecg, vllm_config, cpu_backend):
    graph = ecg.EncoderCudaGraph(
        lambda x, y: x if isinstance(y, tuple) else x + y,
        vllm_config,
        static_args=True,
        backend=cpu_backend(),
    )
    x = torch.ones(2)
    y = torch.ones(2)
    as_tensor = (torch.Size([2]), torch.float32)  # a tuple equal to y's key entry
    for _ in range(2):
        graph(x, y)
        graph(x, as_tensor)
    assert graph.get_cumulative_stats()["num_graphs"] == 2
    assert torch.equal(graph(x, as_tensor), x) and torch.equal(graph(x, y), x + y)


@pytest.mark.cpu
@torch.inference_mode()
def test_an_unhashable_static_argument_fails_naming_the_adapter(ecg, vllm_config, cpu_backend):
    graph = ecg.EncoderCudaGraph(
        lambda x, s: x, vllm_config, static_args=True, backend=cpu_backend(), name="toy"
    )
    with pytest.raises(
        TypeError, match=r"toy encoder CUDA graph: every static argument must be hashable.*list"
    ):
        graph(torch.ones(2), [1, 2])


@pytest.mark.cpu
@torch.inference_mode()
def test_static_arguments_hold_no_graph_bytes_and_count_toward_no_budget(ecg, vllm_config, cpu_backend):
    """Only tensor inputs have buffers: the byte estimate, the measured static bytes and the budget
    check see the (2, 3) float32 input and the output, never the static arguments."""
    backend = cpu_backend(peak_bytes=1 << 20, pool_bytes=3 << 20)
    tensor_bytes = 2 * (2 * 3 * 4)  # the input buffer and the output buffer
    graph = ecg.EncoderCudaGraph(
        lambda x, n, tag: x * n,
        vllm_config,
        static_args=True,
        max_bytes=(2 << 20) + tensor_bytes,  # the 2 MiB segment of the eager peak + the buffers, exactly
        backend=backend,
    )
    x, tag = torch.ones(2, 3), ("a" * 4096,)  # a large static value: no bytes of the graph's
    for _ in range(3):
        assert torch.equal(graph(x, 5, tag), x * 5)
    ((key, info),) = graph.graph_info.items()
    assert list(ecg.shapes._tensor_entries(key)) == [(torch.Size([2, 3]), torch.float32)]
    assert info.static_bytes == tensor_bytes == backend.encoders[0].static_bytes
    assert info.pool_bytes == 3 << 20
    details = graph.get_detailed_stats()
    assert details["budget_misses"] == 0 and details["graph_bytes"] == (3 << 20) + tensor_bytes
    assert details["graphs"][0]["inputs"] == [((2, 3), "float32"), 5, tag]
    assert details["graphs"][0]["static_bytes"] == tensor_bytes and details["graphs"][0]["hits"] == 2


@pytest.mark.cpu
@torch.inference_mode()
def test_tensor_only_adapters_never_build_a_static_key(ecg, vllm_config, cpu_backend, monkeypatch):
    """The hit path of an adapter without static_args is the tensor-only one: no per-input static
    classification (``_key_entry``) on any call, hits and misses alike."""

    def classify(x):
        raise AssertionError("static-argument key built for a tensor-only adapter")

    monkeypatch.setattr(ecg.adapter, "_key_entry", classify)
    graph = ecg.EncoderCudaGraph(lambda x, m: x * 2, vllm_config, admission="count", backend=cpu_backend())
    x = torch.ones(2, 3)
    for mask in (None, None, None, torch.ones(2), torch.ones(2)):
        assert torch.equal(graph(x, mask), x * 2)
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (2, 3, 2)
    cpu = torch.device("cpu")
    assert set(graph.graphs) == {
        (cpu_backend.STREAM, cpu, ((torch.Size([2, 3]), torch.float32), None)),
        (cpu_backend.STREAM, cpu, ((torch.Size([2, 3]), torch.float32), (torch.Size([2]), torch.float32))),
    }


@pytest.mark.cpu
def test_static_arguments_do_not_change_eligibility(ecg):
    eligible = ecg.CudaGraphBackend().eligible_device
    with torch.inference_mode():
        assert eligible([torch.ones(1), 3, "x"]) is None  # a CPU tensor
        assert eligible([3, None]) is None  # no tensor at all
        assert eligible([torch.empty(1, device="meta"), 3]) is None  # not CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device")
@torch.inference_mode()
def test_static_arguments_are_baked_into_real_graphs(ecg, vllm_config):
    class Sink:
        def __init__(self):
            self.buf = torch.zeros(4, 8, device="cuda")

    def forward(x, scale, sink):
        sink.buf.copy_(x * scale)  # a persistent buffer, written in place by every replay
        return x + scale

    graph = ecg.EncoderCudaGraph(forward, vllm_config, max_graphs=4, static_args=True, admission="count")
    sink = Sink()
    for scale in (2, 2, 2, 3, 3, 2):
        x = torch.randn(4, 8, device="cuda")
        out = graph(x, scale, sink)
        torch.testing.assert_close(out, x + scale, rtol=0, atol=0)
        torch.testing.assert_close(sink.buf, x * scale, rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (2, 4, 2)
    assert {key[2][1] for key in graph.graphs} == {(ecg.STATIC_ARG, 2), (ecg.STATIC_ARG, 3)}
    # graph bytes: the (4, 8) float32 input and output buffers only, not the sink
    assert all(info.static_bytes == 2 * 4 * 8 * 4 for info in graph.graph_info.values())
    for manager in graph.graphs.values():  # the static arguments are no buffers
        for graph_set in manager.budget_graphs.values():
            assert all(list(meta.input_buffers) == ["0"] for meta in graph_set.values())
