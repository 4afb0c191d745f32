# SPDX-License-Identifier: Apache-2.0
"""Static arguments of the adapter: positional inputs that are neither tensors nor None.

They are part of the graph key by value, reach every call of the forward (warm-up, capture,
replay's recorded work, eager), and never become static input buffers. CPU tests drive the
real adapter through the CPU backend of the adapter's seam (``conftest.CpuGraphBackend``,
whose graphs keep vLLM's buffer flow); the CUDA test captures and replays real graphs.
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
    graph = ecg.EncoderCudaGraph(fwd, vllm_config, max_graphs=8, backend=backend)
    sink, other = object(), object()
    x = torch.ones(2, 3)
    for _ in range(3):  # warmup, capture + replay, replay
        assert torch.equal(graph(x, 2, sink, None), x * 2)
    assert torch.equal(graph(x, 3, sink, None), x * 3)  # another value: another key (warmup)
    assert torch.equal(graph(x, 2, other, None), x * 2)  # another object: another key (warmup)
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (1, 2, 3)
    ((key, manager),) = graph.graphs.items()
    tensor = ((2, 3), torch.float32, torch.device("cpu"))
    assert key == (backend.STREAM, (tensor, (ecg.STATIC_ARG, 2), (ecg.STATIC_ARG, sink), None))
    (encoder,) = backend.encoders
    assert encoder.keys == ["0"] and encoder.statics == {1: 2, 2: sink} and encoder.dtype == torch.float32
    assert backend.captures == [((2, 3), [(2, 3), None, None, None])]
    assert list(manager.input_buffers) == ["0"]  # only tensors become static input buffers
    # warmup, the capture's buffer forward, the two replays' recomputation: all with the statics
    assert fwd.calls[:4] == [(2, sink, None)] * 4
    assert fwd.calls[-2:] == [(3, sink, None), (2, other, None)]
    assert ecg._describe(key) == [((2, 3), "float32"), 2, sink, None]


@pytest.mark.cpu
@torch.inference_mode()
def test_a_static_value_never_collides_with_a_tensor_entry(ecg, vllm_config, cpu_backend):
    graph = ecg.EncoderCudaGraph(
        lambda x, y: x if isinstance(y, tuple) else x + y, vllm_config, backend=cpu_backend()
    )
    x = torch.ones(2)
    y = torch.ones(2)
    as_tensor = ((2,), torch.float32, torch.device("cpu"))  # a tuple that looks like y's key entry
    for _ in range(2):
        graph(x, y)
        graph(x, as_tensor)
    assert graph.get_cumulative_stats()["num_graphs"] == 2
    assert torch.equal(graph(x, as_tensor), x) and torch.equal(graph(x, y), x + y)


@pytest.mark.cpu
@torch.inference_mode()
def test_an_unhashable_static_argument_fails_naming_the_adapter(ecg, vllm_config, cpu_backend):
    graph = ecg.EncoderCudaGraph(lambda x, s: x, vllm_config, backend=cpu_backend(), name="toy")
    with pytest.raises(
        TypeError, match=r"toy encoder CUDA graph: every static argument must be hashable.*list"
    ):
        graph(torch.ones(2), [1, 2])


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

    graph = ecg.EncoderCudaGraph(forward, vllm_config, max_graphs=4)
    sink = Sink()
    for scale in (2, 2, 2, 3, 3, 2):
        x = torch.randn(4, 8, device="cuda")
        out = graph(x, scale, sink)
        torch.testing.assert_close(out, x + scale, rtol=0, atol=0)
        torch.testing.assert_close(sink.buf, x * scale, rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (2, 4, 2)
    assert {key[1][1] for key in graph.graphs} == {(ecg.STATIC_ARG, 2), (ecg.STATIC_ARG, 3)}
    for manager in graph.graphs.values():  # the static arguments are no buffers
        for graph_set in manager.budget_graphs.values():
            assert all(list(meta.input_buffers) == ["0"] for meta in graph_set.values())
