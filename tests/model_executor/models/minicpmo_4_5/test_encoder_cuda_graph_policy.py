# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the encoder CUDA graph policy: options, admission, cap, memory floor,
stats arithmetic, the fatal contract and the eager fallbacks.

The CUDA plumbing (stream lookup, eligibility of CUDA tensors, capture through vLLM's
manager) is replaced by a scripted double in ``ScriptedGraph`` so the real ``__call__``
decision logic runs here; ``test_encoder_cuda_graph_cuda.py`` runs it for real.
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------

BAD_OPTIONS = [
    ("encoder_cuda_graph", "false", "JSON boolean"),
    ("encoder_cuda_graph", 1, "JSON boolean"),
    ("encoder_cuda_graph_share_pools", "true", "JSON boolean"),
    ("encoder_cuda_graph_max_graphs", True, "integer >= 0"),
    ("encoder_cuda_graph_max_graphs", -1, "integer >= 0"),
    ("encoder_cuda_graph_max_graphs", 2.0, "integer >= 0"),
    ("encoder_cuda_graph_min_capture_calls", 1, "integer >= 2"),
    ("encoder_cuda_graph_min_capture_calls", 2.5, "integer >= 2"),
    ("encoder_cuda_graph_min_free_bytes", -1, "integer >= 0"),
    ("encoder_cuda_graph_min_free_bytes", "1GiB", "integer >= 0"),
]


@pytest.mark.parametrize("key,value,allowed", BAD_OPTIONS)
def test_bad_hf_override_names_key_value_and_allowed(ecg, key, value, allowed):
    hf_config = types.SimpleNamespace(**{key: value})
    with pytest.raises(ValueError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(hf_config)
    message = str(info.value)
    assert key in message and repr(value) in message and allowed in message


def test_options_defaults_and_overrides(ecg):
    defaults = ecg.EncoderCudaGraphOptions.from_hf_config(object())
    assert defaults == ecg.EncoderCudaGraphOptions(True, 4, 2, 1 << 30, True)
    hf_config = types.SimpleNamespace(
        encoder_cuda_graph=False,
        encoder_cuda_graph_max_graphs=0,
        encoder_cuda_graph_min_capture_calls=5,
        encoder_cuda_graph_min_free_bytes=0,
        encoder_cuda_graph_share_pools=False,
    )
    assert ecg.EncoderCudaGraphOptions.from_hf_config(hf_config) == ecg.EncoderCudaGraphOptions(
        enabled=False, max_graphs=0, min_capture_calls=5, min_free_bytes=0, share_pools=False
    )


def test_options_read_from_a_transformers_config(ecg):
    from transformers import PretrainedConfig

    config = PretrainedConfig(encoder_cuda_graph_max_graphs=7)
    assert ecg.EncoderCudaGraphOptions.from_hf_config(config).max_graphs == 7
    with pytest.raises(ValueError, match="encoder_cuda_graph_min_capture_calls"):
        ecg.EncoderCudaGraphOptions.from_hf_config(PretrainedConfig(encoder_cuda_graph_min_capture_calls=0))


def test_adapter_constructor_validates_like_the_options(ecg, vllm_config):
    with pytest.raises(ValueError, match="encoder_cuda_graph_max_graphs"):
        ecg.EncoderCudaGraph(torch.neg, vllm_config, max_graphs=True)
    with pytest.raises(ValueError, match="encoder_cuda_graph_share_pools"):
        ecg.EncoderCudaGraph(torch.neg, vllm_config, share_pools=0)


def test_factory_builds_nothing_when_disabled_or_enforce_eager(ecg):
    from minicpmo_cg.vllm_config import standalone_vllm_config

    on = ecg.EncoderCudaGraphOptions()
    adapter = ecg.make_encoder_cuda_graph(torch.neg, standalone_vllm_config(), on, name="vision")
    assert isinstance(adapter, ecg.EncoderCudaGraph) and adapter.name == "vision"
    assert ecg.make_encoder_cuda_graph(torch.neg, standalone_vllm_config(enforce_eager=True), on, name="v") is None
    off = ecg.EncoderCudaGraphOptions(enabled=False)
    assert ecg.make_encoder_cuda_graph(torch.neg, standalone_vllm_config(), off, name="v") is None


# ---------------------------------------------------------------------------
# Admission policy
# ---------------------------------------------------------------------------


def test_admission_order_default_threshold(ecg):
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=2, min_capture_calls=2)
    assert policy.admit("a") is A.WARMUP
    assert policy.admit("a") is A.CAPTURE
    policy.record_captured("a")
    assert "a" not in policy.history
    assert policy.admit("a") is A.REPLAY
    assert policy.misses == {"warmup": 1}


def test_admission_threshold_three_and_saturation(ecg):
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=3)
    assert [policy.admit("k") for _ in range(3)] == [A.WARMUP, A.WARMUP, A.CAPTURE]
    policy.record_memory_miss()  # memory floor deferred it: the count stays saturated
    assert policy.history["k"] == 3
    assert policy.admit("k") is A.CAPTURE
    assert policy.misses == {"warmup": 2, "memory": 1}


def test_cap_is_never_evicting(ecg):
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=2)
    policy.admit("a"), policy.admit("a"), policy.record_captured("a")
    assert [policy.admit("b") for _ in range(3)] == [A.CAPACITY] * 3
    assert policy.admit("a") is A.REPLAY
    assert policy.captured == {"a"} and not policy.history
    assert policy.misses == {"warmup": 1, "capacity": 3}


def test_zero_graphs_never_touches_history(ecg):
    policy = ecg.CaptureAdmission(max_graphs=0, min_capture_calls=2)
    assert {policy.admit(k) for k in "abcab"} == {ecg.Admission.CAPACITY}
    assert policy.history_limit == 0 and not policy.history
    assert policy.misses == {"capacity": 5}


def test_history_is_bounded_fifo_by_first_sighting(ecg):
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=3)
    assert policy.history_limit == 4
    for key in "abcd":
        policy.admit(key)
    policy.admit("a")  # a re-sighting does not move "a" to the back
    assert list(policy.history) == list("abcd") and policy.history["a"] == 2
    policy.admit("e")  # drops the oldest first sighting: "a", despite its two calls
    assert list(policy.history) == list("bcde")
    # "a" was pushed out: it starts again from one call
    assert policy.admit("a") is A.WARMUP and policy.history["a"] == 1
    assert list(policy.history) == list("cdea")


def test_one_off_keys_do_not_block_a_repeated_key(ecg):
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=2)
    for i in range(19):
        assert policy.admit(("one-off", i)) is ecg.Admission.WARMUP
    assert len(policy.history) == 4
    assert policy.admit("repeat") is ecg.Admission.WARMUP
    assert policy.admit("repeat") is ecg.Admission.CAPTURE


# ---------------------------------------------------------------------------
# The adapter's decisions, with the CUDA plumbing scripted
# ---------------------------------------------------------------------------


class FakeManager:
    """Stands in for a captured vLLM manager: replays ``forward`` and counts hits."""

    def __init__(self, forward):
        self.forward = forward
        self.graph_hits = 0
        self.graph_misses = 0

    def execute(self, mm_kwargs):
        self.graph_hits += 1
        n = 1 + max(int(k) for k in mm_kwargs)
        return [self.forward(*(mm_kwargs.get(str(i)) for i in range(n))).clone()]


def scripted_graph(ecg, forward, config, *, free=None, fail_with=None, **options):
    """An adapter whose CPU tensors count as eligible and whose capture is scripted."""

    class ScriptedGraph(ecg.EncoderCudaGraph):
        captures: list = []
        devices_asked: list = []

        @staticmethod
        def _eligible_device(inputs):
            if torch.is_grad_enabled():
                return None
            return torch.device("cpu")

        @staticmethod
        def _replay_stream(device):
            return types.SimpleNamespace(cuda_stream=7)

        def _capture_graph(self, output_shape, inputs, device, replay_stream):
            self.captures.append((tuple(output_shape), [None if x is None else tuple(x.shape) for x in inputs]))
            if fail_with is not None:
                raise fail_with
            return FakeManager(self.forward)

    def free_memory(device):
        ScriptedGraph.devices_asked.append(device)
        return free() if callable(free) else (1 << 62 if free is None else free)

    return ScriptedGraph(forward, config, free_memory_fn=free_memory, **options)


class CountingForward:
    def __init__(self):
        self.calls = 0

    def __call__(self, x, mask=None):
        self.calls += 1
        return x * 2 if mask is None else x * 2 + mask.sum()


@torch.inference_mode()
def test_scripted_sequence_exact_stats(ecg, vllm_config):
    fwd = CountingForward()
    graph = scripted_graph(ecg, fwd, vllm_config, max_graphs=1, min_capture_calls=3)
    a, b = torch.ones(2, 4), torch.ones(3, 4)
    for _ in range(4):  # warmup, warmup, capture+replay (hit), replay (hit)
        out = graph(a)
        assert torch.equal(out, a * 2)
    for _ in range(5):  # cap reached: capacity misses
        assert torch.equal(graph(b), b * 2)
    stats = graph.get_cumulative_stats()
    assert list(stats) == list(ecg.STATS_KEYS)
    assert stats == {
        "graph_hits": 2,
        "graph_misses": 7,
        "hit_rate": pytest.approx(2 / 9),
        "num_graphs": 1,
        "ineligible_misses": 0,
        "capacity_misses": 5,
        "warmup_misses": 2,
        "memory_misses": 0,
        "capture_failures": 0,
    }
    # the capture used the output shape recorded by the first eager call
    assert graph.captures == [((2, 4), [(2, 4)])]


@torch.inference_mode()
def test_mask_none_and_mask_tensor_are_different_keys(ecg, vllm_config):
    graph = scripted_graph(ecg, CountingForward(), vllm_config)
    x, mask = torch.ones(1, 3), torch.zeros(1, 3)
    for _ in range(2):
        graph(x, None)
        graph(x, mask)
    assert graph.get_cumulative_stats()["num_graphs"] == 2
    assert sorted(c[1][1] is None for c in graph.captures) == [False, True]


@torch.inference_mode()
def test_memory_floor_defers_then_captures_and_replays_below_floor(ecg, vllm_config):
    reading = {"free": 1023}
    graph = scripted_graph(ecg, CountingForward(), vllm_config, free=lambda: reading["free"], min_free_bytes=1024)
    x = torch.ones(2)
    graph(x)  # warmup
    graph(x)  # below the floor: memory miss, eager
    graph(x)  # still below: tries again, memory miss
    assert graph.get_cumulative_stats()["memory_misses"] == 2 and not graph.graphs
    reading["free"] = 1024
    graph(x)  # at the floor: captures
    reading["free"] = 0
    graph(x)  # existing graph replays below the floor
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["memory_misses"]) == (1, 2, 2)
    assert all(d == torch.device("cpu") for d in graph.devices_asked)
    assert len(graph.devices_asked) == 3  # never asked on replay


@torch.inference_mode()
def test_zero_free_bytes_disables_the_floor(ecg, vllm_config):
    graph = scripted_graph(ecg, CountingForward(), vllm_config, free=0, min_free_bytes=0)
    x = torch.ones(2)
    graph(x), graph(x)
    assert graph.get_cumulative_stats()["num_graphs"] == 1 and graph.devices_asked == []


@torch.inference_mode()
def test_capture_failure_is_fatal(ecg, vllm_config):
    fwd = CountingForward()
    boom = RuntimeError("capture exploded")
    graph = scripted_graph(ecg, fwd, vllm_config, fail_with=boom)
    x = torch.ones(2)
    graph(x)
    with pytest.raises(RuntimeError) as info:
        graph(x)
    assert info.value is boom  # the original exception propagates
    calls_before = fwd.calls
    for args in [(x,), (torch.ones(5),), (torch.ones(2, requires_grad=True),)]:
        with pytest.raises(ecg.EncoderCudaGraphCaptureFailedError, match="Restart the worker"):
            graph(*args)
    assert fwd.calls == calls_before == 1  # no eager work after the failure
    assert len(graph.captures) == 1  # no retry
    assert graph.graphs == {} and not graph.admission.history and not graph._output_shapes
    stats = graph.get_cumulative_stats()
    assert stats["capture_failures"] == 1 and stats["num_graphs"] == 0
    assert graph.capture_failed


@torch.inference_mode()
def test_output_shapes_only_kept_for_keys_in_history(ecg, vllm_config):
    graph = scripted_graph(ecg, CountingForward(), vllm_config, max_graphs=1, min_capture_calls=2)
    for n in range(1, 12):
        graph(torch.ones(n))
    assert set(graph._output_shapes) == set(graph.admission.history)
    assert len(graph._output_shapes) == 4


# ---------------------------------------------------------------------------
# Eager fallbacks with the real eligibility check
# ---------------------------------------------------------------------------


def test_cpu_and_grad_paths_stay_eager_and_keep_gradients(ecg, vllm_config):
    graph = ecg.EncoderCudaGraph(lambda x, m: (x * 3).sum(-1), vllm_config)
    x = torch.ones(2, 3, requires_grad=True)
    out = graph(x, None)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), 3.0))
    with torch.inference_mode():
        graph(torch.ones(2, 3), None)
    stats = graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 2 == stats["graph_misses"]
    assert stats["hit_rate"] == 0.0 and stats["num_graphs"] == 0
    assert not graph.admission.history


def test_eligibility_rules(ecg):
    eligible = ecg.EncoderCudaGraph._eligible_device
    with torch.inference_mode():
        assert eligible([torch.ones(1)]) is None  # CPU tensor
        assert eligible([None, None]) is None  # no tensor at all
        assert eligible([3]) is None  # not a tensor
        meta = torch.empty(1, device="meta")
        assert eligible([meta]) is None  # not CUDA


def test_stats_before_any_call(ecg, vllm_config):
    stats = ecg.EncoderCudaGraph(torch.neg, vllm_config).get_cumulative_stats()
    assert stats == dict.fromkeys(ecg.STATS_KEYS, 0) | {"hit_rate": 0.0}
