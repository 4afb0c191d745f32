# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the encoder CUDA graph policy: admission, cap, memory floor and its
warnings, stats arithmetic, autograd modes, module hooks, the fatal contract and the eager
fallbacks.

The adapter runs unchanged; its device seam (``backend=``) is ``conftest.CpuGraphBackend``,
which makes CPU tensors eligible and scripts captures with vLLM's buffer flow, so the real
``__call__`` decision logic runs here; ``test_encoder_cuda_graph_cuda.py`` runs it on CUDA.
The options registry is tested in ``test_encoder_cuda_graph_options.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


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
    policy.record_miss("memory")  # memory floor deferred it: the count stays saturated
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


def test_history_is_bounded_least_recently_seen_first_out(ecg):
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=3)
    assert policy.history_limit == 4
    for key in "abcd":
        policy.admit(key)
    policy.admit("a")  # a re-sighting moves "a" to the back
    assert list(policy.history) == list("bcda") and policy.history["a"] == 2
    policy.admit("e")  # drops the least recently seen key: "b"
    assert list(policy.history) == list("cdae")
    assert policy.admit("a") is A.CAPTURE  # "a" kept its two calls
    # "b" was pushed out: it starts again from one call
    assert policy.admit("b") is A.WARMUP and policy.history["b"] == 1
    assert len(policy.history) == 4 and list(policy.history)[-2:] == ["a", "b"]


def recurring_stream(period: int, calls: int):
    """A shape that recurs every ``period``-th call among one-off shapes (issue stream)."""
    return ["recurring" if t % period == 0 else ("one-off", t) for t in range(calls)]


def test_a_shape_recurring_among_one_off_shapes_is_captured(ecg):
    """max_graphs=4, min_capture_calls=3, a shape every 9th call: 8 one-offs between sightings,
    fewer than the 16-key history, so each sighting must keep the key alive until its 3rd."""
    A = ecg.Admission
    policy = ecg.CaptureAdmission(max_graphs=4, min_capture_calls=3)
    decisions = {}
    for t, key in enumerate(recurring_stream(9, 200)):
        decision = policy.admit(key)
        if key == "recurring":
            decisions[t] = decision
            if decision is A.CAPTURE:
                policy.record_captured(key)
        assert len(policy.history) <= 16
    assert decisions[0] is A.WARMUP and decisions[9] is A.WARMUP and decisions[18] is A.CAPTURE
    assert all(d is A.REPLAY for t, d in decisions.items() if t > 18)
    assert "recurring" in policy.captured


def test_one_off_keys_do_not_block_a_repeated_key(ecg):
    policy = ecg.CaptureAdmission(max_graphs=1, min_capture_calls=2)
    for i in range(19):
        assert policy.admit(("one-off", i)) is ecg.Admission.WARMUP
    assert len(policy.history) == 4
    assert policy.admit("repeat") is ecg.Admission.WARMUP
    assert policy.admit("repeat") is ecg.Admission.CAPTURE


# ---------------------------------------------------------------------------
# The adapter's decisions, through its device seam on CPU (conftest.CpuGraphBackend)
# ---------------------------------------------------------------------------


def cpu_graph(ecg, backend_cls, forward, config, *, free=None, fail_with=None, **options):
    """The real adapter with CPU tensors eligible and captures scripted by the backend.

    Admission is ``"count"`` unless given: these tests pin the count rule and the machinery
    around it; the cost rule has its own tests (``test_encoder_cuda_graph_admission.py``).
    """
    options.setdefault("admission", "count")
    return ecg.EncoderCudaGraph(
        forward, config, backend=backend_cls(free=free, fail_with=fail_with), **options
    )


class CountingForward:
    def __init__(self):
        self.calls = 0

    def __call__(self, x, mask=None):
        self.calls += 1
        return x * 2 if mask is None else x * 2 + mask.sum()


@torch.inference_mode()
def test_scripted_sequence_exact_stats(ecg, vllm_config, cpu_backend):
    fwd = CountingForward()
    graph = cpu_graph(ecg, cpu_backend, fwd, vllm_config, max_graphs=1, min_capture_calls=3)
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
    assert graph.backend.captures == [((2, 4), [(2, 4)])]


@torch.inference_mode()
def test_mask_none_and_mask_tensor_are_different_keys(ecg, vllm_config, cpu_backend):
    graph = cpu_graph(ecg, cpu_backend, CountingForward(), vllm_config)
    x, mask = torch.ones(1, 3), torch.zeros(1, 3)
    for _ in range(2):
        graph(x, None)
        graph(x, mask)
    assert graph.get_cumulative_stats()["num_graphs"] == 2
    assert sorted(c[1][1] is None for c in graph.backend.captures) == [False, True]


@torch.inference_mode()
def test_memory_floor_defers_then_captures_and_replays_below_floor(ecg, vllm_config, cpu_backend):
    reading = {"free": 1023}
    graph = cpu_graph(
        ecg, cpu_backend, CountingForward(), vllm_config, free=lambda: reading["free"], min_free_bytes=1024
    )
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
    assert all(d == torch.device("cpu") for d in graph.backend.devices_asked)
    assert len(graph.backend.devices_asked) == 3  # never asked on replay


@torch.inference_mode()
def test_zero_free_bytes_disables_the_floor(ecg, vllm_config, cpu_backend):
    graph = cpu_graph(ecg, cpu_backend, CountingForward(), vllm_config, free=0, min_free_bytes=0)
    x = torch.ones(2)
    graph(x), graph(x)
    assert graph.get_cumulative_stats()["num_graphs"] == 1 and graph.backend.devices_asked == []


@torch.inference_mode()
def test_capture_failure_is_fatal(ecg, vllm_config, cpu_backend):
    fwd = CountingForward()
    boom = RuntimeError("capture exploded")
    graph = cpu_graph(ecg, cpu_backend, fwd, vllm_config, fail_with=boom)
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
    assert len(graph.backend.captures) == 1  # no retry
    assert graph.graphs == {} and not graph.admission.history and not graph._records
    stats = graph.get_cumulative_stats()
    assert stats["capture_failures"] == 1 and stats["num_graphs"] == 0
    assert graph.capture_failed


class _Held:
    """An object a failing capture's frame holds (weakly referenceable, unlike an exception)."""


@torch.inference_mode()
def test_a_failed_capture_keeps_no_reference_to_what_its_frames_held(ecg, vllm_config, cpu_backend):
    """The adapter keeps the failure's text, not the exception: its traceback would keep the failed
    capture's buffers (on CUDA, their graph pool) alive for the adapter's lifetime."""
    import gc
    import weakref

    held = []

    class Backend(cpu_backend):
        def capture(self, encoder, vllm_config, device, pool):
            buffers = _Held()  # what a capture's frame holds while it fails
            held.append(weakref.ref(buffers))
            raise RuntimeError("capture exploded")

    graph = ecg.EncoderCudaGraph(CountingForward(), vllm_config, backend=Backend(), admission="count")
    x = torch.ones(2)
    graph(x)
    with pytest.raises(RuntimeError, match="capture exploded"):
        graph(x)
    gc.collect()
    assert held and held[0]() is None
    with pytest.raises(ecg.EncoderCudaGraphCaptureFailedError, match=r"\(RuntimeError: capture exploded\)"):
        graph(x)


@torch.inference_mode()
def test_a_key_whose_eager_calls_all_raised_is_not_captured_until_one_returns(ecg, vllm_config, cpu_backend):
    """Admission counts a call before its eager forward runs; when every counted call raised (a
    transient error), the capture threshold is a warmup miss, not a capture of an unknown output."""

    class FlakyForward(CountingForward):
        def __call__(self, x, mask=None):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("transient")
            return x * 2

    fwd = FlakyForward()
    graph = cpu_graph(ecg, cpu_backend, fwd, vllm_config, min_capture_calls=2, max_bytes=1 << 30)
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="transient"):
        graph(x)
    assert torch.equal(graph(x), x * 2)  # at the threshold: eager, no capture, no failure
    stats = graph.get_cumulative_stats()
    assert (stats["capture_failures"], stats["num_graphs"], stats["warmup_misses"]) == (0, 0, 2)
    assert torch.equal(graph(x), x * 2)  # now captured and replayed
    assert graph.get_cumulative_stats()["num_graphs"] == 1 and not graph.capture_failed


@torch.inference_mode()
def test_key_records_only_kept_for_keys_in_history(ecg, vllm_config, cpu_backend):
    graph = cpu_graph(ecg, cpu_backend, CountingForward(), vllm_config, max_graphs=1, min_capture_calls=2)
    for n in range(1, 12):
        graph(torch.ones(n))
    assert set(graph._records) == set(graph.admission.history)
    assert len(graph._records) == 4


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
    eligible = ecg.CudaGraphBackend().eligible_device
    with torch.inference_mode():
        assert eligible([torch.ones(1)]) is None  # CPU tensor
        assert eligible([None, None]) is None  # no tensor at all
        assert eligible([3]) is None  # a non-tensor input alone: no tensor
        meta = torch.empty(1, device="meta")
        assert eligible([meta]) is None  # not CUDA


@torch.inference_mode()
def test_a_non_tensor_input_is_ineligible(ecg, vllm_config, cpu_backend):
    """The vision and audio adapters take tensors and None only: another input runs eagerly as an
    ineligible miss, whether it lacks a shape (an int) or only looks like a tensor (a NumPy array)."""
    np = pytest.importorskip("numpy")
    graph = ecg.EncoderCudaGraph(lambda x, y: x + 1, vllm_config, admission="count", backend=cpu_backend())
    x = torch.ones(2)
    for other in (3, np.ones(2, dtype=np.float32)):
        for _ in range(3):
            assert torch.equal(graph(x, other), x + 1)
    stats = graph.get_cumulative_stats()
    assert (stats["ineligible_misses"], stats["num_graphs"], stats["warmup_misses"]) == (6, 0, 0)
    assert not graph.admission.history and not graph._records


def test_stats_before_any_call(ecg, vllm_config):
    stats = ecg.EncoderCudaGraph(torch.neg, vllm_config).get_cumulative_stats()
    assert stats == dict.fromkeys(ecg.STATS_KEYS, 0) | {"hit_rate": 0.0}


def test_default_backend_is_cuda(ecg, vllm_config):
    assert isinstance(ecg.EncoderCudaGraph(torch.neg, vllm_config).backend, ecg.CudaGraphBackend)


# ---------------------------------------------------------------------------
# A shape recurring among one-off shapes, through the adapter
# ---------------------------------------------------------------------------


@torch.inference_mode()
def test_adapter_captures_a_shape_recurring_every_ninth_call(ecg, vllm_config, cpu_backend):
    graph = cpu_graph(ecg, cpu_backend, CountingForward(), vllm_config, max_graphs=4, min_capture_calls=3)
    for t, key in enumerate(recurring_stream(9, 100)):
        rows = 3 if key == "recurring" else 100 + t
        x = torch.full((rows, 2), float(t))
        torch.testing.assert_close(graph(x), x * 2, rtol=0, atol=0)
        assert len(graph.admission.history) <= 16 and len(graph._records) <= 16
    assert [shapes for _, shapes in graph.backend.captures] == [[(3, 2)]]
    stats = graph.get_cumulative_stats()
    # sightings at t = 0, 9, 18 (capture), then 27 ... 99 replay
    assert stats["num_graphs"] == 1 and stats["graph_hits"] == len(range(18, 100, 9))


# ---------------------------------------------------------------------------
# Memory floor warnings
# ---------------------------------------------------------------------------


@torch.inference_mode()
def test_memory_floor_deferrals_warn_first_and_every_nth(
    ecg, vllm_config, cpu_backend, log_records, monkeypatch
):
    monkeypatch.setattr(ecg.EncoderCudaGraph, "MEMORY_WARNING_EVERY", 3)
    records = log_records(ecg.adapter.logger)
    graph = cpu_graph(
        ecg, cpu_backend, CountingForward(), vllm_config, free=1023, min_free_bytes=1024, name="audio"
    )
    x = torch.ones(2)
    for _ in range(8):  # warmup + 7 deferred captures
        graph(x)
    assert graph.get_cumulative_stats()["memory_misses"] == 7
    warnings = records.messages(logging.WARNING)
    assert len(warnings) == 3  # deferrals 1, 3 and 6
    assert [w.split("(")[1].split(" ")[0] for w in warnings] == ["1", "3", "6"]
    for w in warnings:
        assert w.startswith("audio encoder CUDA graph capture deferred")
        assert "1023 bytes free on cpu" in w and "encoder_cuda_graph_min_free_bytes=1024" in w


@torch.inference_mode()
def test_memory_floor_warning_default_interval(ecg, vllm_config, cpu_backend, log_records):
    records = log_records(ecg.adapter.logger)
    graph = cpu_graph(ecg, cpu_backend, CountingForward(), vllm_config, free=0, min_free_bytes=1)
    x = torch.ones(2)
    for _ in range(1 + 2 * ecg.EncoderCudaGraph.MEMORY_WARNING_EVERY):
        graph(x)
    assert len(records.messages(logging.WARNING)) == 3  # first, 100th, 200th


# ---------------------------------------------------------------------------
# Autograd modes: a graph captured in one mode replays in the other
# ---------------------------------------------------------------------------


def test_static_inputs_are_normal_tensors_whatever_the_capture_mode(ecg):
    x = torch.ones(2, 3)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            encoder = ecg.ExactShapeEncoder(torch.neg, [x, None], torch.Size([2, 3]))
            values = encoder.prepare_encoder_cudagraph_capture_inputs(2, 1, 0, x.device, x.dtype).values
        assert list(values) == ["0"] and not values["0"].is_inference()
        with torch.no_grad():
            values["0"].copy_(x)  # what every replay does; an inference tensor would refuse it


MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@pytest.mark.parametrize(
    "capture_mode, later_mode", [("inference_mode", "no_grad"), ("no_grad", "inference_mode")]
)
def test_capture_in_one_autograd_mode_replays_in_the_other(
    ecg, vllm_config, cpu_backend, capture_mode, later_mode
):
    fwd = CountingForward()
    graph = cpu_graph(ecg, cpu_backend, fwd, vllm_config)
    with MODES[capture_mode]():
        x = torch.randn(2, 4)
        graph(x), graph(x)
    assert graph.get_cumulative_stats()["num_graphs"] == 1
    for mode in (later_mode, capture_mode, later_mode):
        with MODES[mode]():
            x = torch.randn(2, 4)
            out, eager = graph(x), fwd(x)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        assert out.is_inference() == eager.is_inference() == (mode == "inference_mode")
    assert graph.get_cumulative_stats()["graph_hits"] == 4


# ---------------------------------------------------------------------------
# Module hooks: replays would skip them, so the adapter refuses to capture
# ---------------------------------------------------------------------------


class Tower(torch.nn.Module):
    """A module whose bound method is the captured forward; ``side`` is outside the region."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.side = torch.nn.Linear(4, 4)

    def encode(self, x):
        return self.body(x)


def hooked_graph(ecg, vllm_config, cpu_backend, captured_modules=("body",)):
    tower = Tower()
    graph = ecg.EncoderCudaGraph(
        tower.encode, vllm_config, backend=cpu_backend(), captured_modules=captured_modules
    )
    return tower, graph


@torch.inference_mode()
def test_forward_hook_in_the_region_keeps_the_adapter_eager(ecg, vllm_config, cpu_backend, log_records):
    records = log_records(ecg.adapter.logger)
    tower, graph = hooked_graph(ecg, vllm_config, cpu_backend)
    seen = []
    tower.body[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(3, 4)
    for _ in range(5):
        torch.testing.assert_close(graph(x), tower.encode(x), rtol=0, atol=0)
    assert graph.backend.captures == []  # refused before any capture work
    assert len(seen) == 10  # the hook ran on every call (5 through the adapter, 5 references)
    assert graph.eager_reason == "module hooks in the captured region: Tower.body.0 (forward hook)"
    (warning,) = records.messages(logging.WARNING)
    assert "Tower.body.0 (forward hook)" in warning and "before capture" in warning
    assert "remove the hooks" in warning and '"encoder_cuda_graph": false' in warning
    stats = graph.get_cumulative_stats()
    assert (stats["warmup_misses"], stats["ineligible_misses"], stats["num_graphs"]) == (1, 4, 0)
    assert not graph.admission.history and not graph._records


@pytest.mark.parametrize(
    "register, named",
    [
        (torch.nn.modules.module.register_module_forward_pre_hook, "register_module_forward_pre_hook"),
        (torch.nn.modules.module.register_module_forward_hook, "register_module_forward_hook"),
        (torch.nn.modules.module.register_module_full_backward_hook, "register_module_full_backward_hook"),
    ],
)
def test_global_module_hooks_keep_the_adapter_eager(ecg, vllm_config, cpu_backend, register, named):
    _, graph = hooked_graph(ecg, vllm_config, cpu_backend)
    handle = register(lambda *args: None)
    try:
        with torch.inference_mode():
            x = torch.randn(3, 4)
            graph(x), graph(x)
    finally:
        handle.remove()
    assert graph.backend.captures == []
    assert (
        graph.eager_reason
        == f"module hooks in the captured region: every module (torch.nn.modules.module.{named})"
    )


@torch.inference_mode()
def test_hooks_outside_the_region_do_not_matter_and_none_means_the_whole_owner(ecg, vllm_config, cpu_backend):
    tower, graph = hooked_graph(ecg, vllm_config, cpu_backend)
    tower.side.register_forward_pre_hook(lambda module, args: None)
    tower.register_forward_hook(lambda module, args, out: None)  # the owner's own call is eager
    x = torch.randn(3, 4)
    graph(x), graph(x)
    assert graph.eager_reason is None and len(graph.graphs) == 1

    tower, whole = hooked_graph(ecg, vllm_config, cpu_backend, captured_modules=None)
    tower.side.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    whole(x), whole(x)
    assert whole.eager_reason == "module hooks in the captured region: Tower.side (backward hook)"
    assert not whole.graphs


@torch.inference_mode()
def test_hooks_found_later_stop_earlier_graphs_from_replaying(ecg, vllm_config, cpu_backend):
    tower, graph = hooked_graph(ecg, vllm_config, cpu_backend)
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    graph(a), graph(a)
    assert len(graph.graphs) == 1
    tower.body[1].register_forward_hook(lambda module, args, out: None)
    graph(a)  # still replays: hooks are looked for at capture only
    assert graph.get_cumulative_stats()["graph_hits"] == 2
    graph(b), graph(b)  # the next capture finds the hook: eager for good
    assert graph.eager_reason is not None and len(graph.backend.captures) == 1
    torch.testing.assert_close(graph(a), tower.encode(a), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    # a's graph is kept but no longer replayed: the last call of a is eager
    assert (stats["graph_hits"], stats["ineligible_misses"], stats["num_graphs"]) == (2, 2, 1)


@torch.inference_mode()
def test_a_forward_that_registers_hooks_while_captured_is_not_kept(
    ecg, vllm_config, cpu_backend, log_records
):
    records = log_records(ecg.adapter.logger)
    tower = Tower()
    calls = []

    def encode(x):
        calls.append(1)
        if len(calls) == 2:  # the capture's own run registers a hook
            tower.body[0].register_forward_pre_hook(lambda module, args: None)
        return tower.body(x)

    encode.__self__ = tower  # what a bound method carries
    graph = ecg.EncoderCudaGraph(encode, vllm_config, backend=cpu_backend(), captured_modules=("body",))
    x = torch.randn(3, 4)
    graph(x), graph(x)
    assert len(graph.backend.captures) == 1 and not graph.graphs
    assert "Tower.body.0 (forward_pre hook)" in graph.eager_reason
    assert "during capture" in records.messages(logging.WARNING)[0]
