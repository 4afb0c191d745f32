"""EncoderCudaGraphManager with capture axes (patches 0001-0004 on legacy, upstream on current).

The CPU tests drive the real manager with a fake ``SupportsEncoderCudaGraph`` model.
Capture itself needs CUDA, so on CPU ``torch.cuda.CUDAGraph``/``torch.cuda.graph`` are
replaced by an emulation whose ``replay()`` re-runs the model's forward on the graph's
own input buffers into its output buffer, which is what a captured graph does. The
CUDA test captures and replays real graphs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable
from typing import Any

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

pytestmark = [pytest.mark.core_model, pytest.mark.legacy_lane]

HIDDEN = 3
BUDGETS = [4, 8, 16]


class FakeAxisModel:
    """An encoder whose output is ``x + tag``; ``tag`` is a per-graph constant.

    The capture inputs hold ``tag`` = the index of the graph's axis-key combination
    (never overwritten at replay), so a replayed output tells which graph ran.
    ``select_encoder_cudagraph_items`` resolves the axis keys with ``resolve``.
    """

    supports_encoder_cudagraph = True

    def __init__(self, capture_axes=(), resolve=None, budget_range=(4, 16), paths=None):
        self.capture_axes = capture_axes
        self.paths = paths
        self.resolve = resolve
        self.budget_range = budget_range
        self.capture_calls: list[tuple[int, str, Any]] = []
        self.replay_kwargs: list[dict[str, Any]] = []
        self.eager_calls = 0

    # -- config -----------------------------------------------------------
    def get_encoder_cudagraph_config(self):
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig

        extra = {} if self.paths is None else {"paths": self.paths}
        return EncoderCudaGraphConfig(
            modalities=["image"],
            buffer_keys=["x", "tag"],
            out_hidden_size=HIDDEN,
            capture_axes=self.capture_axes,
            **extra,
        )

    def get_input_modality(self, mm_kwargs):
        return "image"

    def get_max_frames_per_video(self):
        return 1

    def get_encoder_cudagraph_budget_range(self, vllm_config):
        return self.budget_range

    # -- batching ---------------------------------------------------------
    def get_encoder_cudagraph_item_specs(self, mm_kwargs):
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderItemSpec

        return [EncoderItemSpec(input_size=x.shape[0], output_tokens=x.shape[0]) for x in mm_kwargs["items"]]

    def select_encoder_cudagraph_items(self, mm_kwargs, indices):
        from vllm.v1.worker.encoder_cudagraph_defs import ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG

        items = [mm_kwargs["items"][i] for i in indices]
        selected = {"items": items}
        if self.resolve is not None:
            selected[ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG] = self.resolve(items)
        return selected

    def postprocess_encoder_output(
        self, outputs, indices, per_item_out_tokens, dest, clone=False, batch_mm_kwargs=None
    ):
        from vllm.model_executor.models.utils import scatter_output_slices

        scatter_output_slices(outputs["default"], indices, per_item_out_tokens, dest, clone)

    # -- graph ------------------------------------------------------------
    def axis_tag(self, axis_keys) -> float:
        import itertools

        combos = list(itertools.product(*self.capture_axes))
        return float(combos.index(tuple(axis_keys))) if axis_keys else 0.0

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget,
        max_batch_size,
        max_frames_per_batch,
        device,
        dtype,
        path="default",
        axis_keys=None,
    ):
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphCaptureInputs

        self.capture_calls.append((token_budget, path, axis_keys))
        return EncoderCudaGraphCaptureInputs(
            values={
                "x": torch.zeros(token_budget, HIDDEN, device=device, dtype=dtype),
                "tag": torch.tensor(self.axis_tag(axis_keys), device=device, dtype=dtype),
            }
        )

    def prepare_encoder_cudagraph_replay_buffers(
        self, mm_kwargs, max_batch_size, max_frames_per_batch, path="default"
    ):
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphReplayBuffers

        self.replay_kwargs.append(dict(mm_kwargs))
        return EncoderCudaGraphReplayBuffers(values={"x": torch.cat(mm_kwargs["items"]), "tag": None})

    def encoder_cudagraph_forward(self, inputs, path="default"):
        return inputs["x"] + inputs["tag"]

    def encoder_eager_forward(self, mm_kwargs, path="default"):
        self.eager_calls += 1
        return torch.cat(mm_kwargs["items"]) - 1000.0


class SixArgModel(FakeAxisModel):
    """A model written against vLLM <= 0.29: six-argument capture-input signature."""

    def prepare_encoder_cudagraph_capture_inputs(  # type: ignore[override]
        self, token_budget, max_batch_size, max_frames_per_batch, device, dtype, path="default"
    ):
        return super().prepare_encoder_cudagraph_capture_inputs(
            token_budget, max_batch_size, max_frames_per_batch, device, dtype, path
        )


class _EmulatedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU (see module docstring)."""

    def __init__(self):
        self.captured = False
        self.replays = 0
        self._replay = None

    def bind(self, model, inputs, output_buffer, path):
        def run():
            # The buffers were made under inference mode, as the graph's kernels.
            with torch.inference_mode():
                output_buffer.copy_(model.encoder_cudagraph_forward({**inputs}, path=path))

        self._replay = run

    def replay(self):
        assert self.captured and self._replay is not None
        self.replays += 1
        self._replay()


@contextlib.contextmanager
def _emulated_capture(graph, pool=None, stream=None, capture_error_mode="global"):
    graph.captured = True
    yield


def _make_manager(model, *, budgets=BUDGETS, max_items=4, device="cpu"):
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    from minicpmo_cg.vllm_config import standalone_vllm_config

    config = standalone_vllm_config()
    config.compilation_config.encoder_cudagraph_token_budgets = list(budgets)
    config.compilation_config.encoder_cudagraph_max_vision_items_per_batch = max_items
    return EncoderCudaGraphManager(config, torch.device(device), torch.float32, model)


@pytest.fixture
def cpu_capture(monkeypatch):
    """Capture with the emulated graph; returns ``capture(manager)``."""
    import vllm.v1.worker.encoder_cudagraph as ec

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _emulated_capture)
    monkeypatch.setattr(ec, "current_stream", lambda: None, raising=False)

    def capture(manager):
        manager.capture(graph_pool=object())
        for path, graphs in manager.budget_graphs.items():
            for meta in graphs.values():
                meta.graph.bind(manager.model, meta.input_buffers, meta.output_buffer, path)

    return capture


TWO_AXES: tuple[tuple[Hashable, ...], ...] = (("small", "large"), (1, 2, 3))


def _resolve_two_axes(items):
    longest = max((x.shape[0] for x in items), default=0)
    return ("small" if longest <= 4 else "large", min(len(items), 3))


@pytest.mark.cpu
def test_graph_count_is_budgets_times_axis_product():
    manager = _make_manager(FakeAxisModel(capture_axes=TWO_AXES, resolve=_resolve_two_axes))
    assert manager.get_num_graphs_to_capture() == len(BUDGETS) * 2 * 3
    no_axes = _make_manager(FakeAxisModel())
    assert no_axes.get_num_graphs_to_capture() == len(BUDGETS)


@pytest.mark.cpu
def test_capture_keys_every_budget_and_axis_combination(cpu_capture):
    model = FakeAxisModel(capture_axes=TWO_AXES, resolve=_resolve_two_axes)
    manager = _make_manager(model)
    cpu_capture(manager)

    combos = [(a, b) for a in TWO_AXES[0] for b in TWO_AXES[1]]
    graphs = manager.budget_graphs["default"]
    assert set(graphs) == {(budget, combo) for budget in BUDGETS for combo in combos}
    for (budget, combo), meta in graphs.items():
        assert meta.token_budget == budget
        assert meta.axis_keys == combo
        assert float(meta.input_buffers["tag"]) == model.axis_tag(combo)
    # The model was asked for each combination once, largest budget first.
    assert [(b, tuple(k)) for b, _, k in model.capture_calls] == [
        (budget, combo) for budget in sorted(BUDGETS, reverse=True) for combo in combos
    ]
    assert manager.is_captured()


@pytest.mark.cpu
def test_without_axes_graphs_are_keyed_by_budget(cpu_capture):
    model = FakeAxisModel()
    manager = _make_manager(model)
    cpu_capture(manager)
    graphs = manager.budget_graphs["default"]
    assert sorted(graphs) == BUDGETS
    assert all(meta.axis_keys == () for meta in graphs.values())
    # Legacy (patched) passes no axis_keys without axes; upstream 0.30 passes () positionally.
    assert all(keys in (None, ()) for _, _, keys in model.capture_calls)


@pytest.mark.cpu
def test_six_argument_models_without_axes(cpu_capture, lane):
    """The documented divergence: legacy passes axis_keys only to axis models (by keyword)."""
    model = SixArgModel()
    manager = _make_manager(model)
    if lane == "legacy":
        cpu_capture(manager)
        assert sorted(manager.budget_graphs["default"]) == BUDGETS
    else:
        # vllm 0.30.0 passes a 7th positional argument to every model.
        with pytest.raises(TypeError):
            cpu_capture(manager)


@pytest.mark.cpu
@pytest.mark.parametrize("axes", [((),), (("a",), ()), ([],)])
def test_empty_capture_axis_is_rejected(axes):
    with pytest.raises(ValueError, match="must be non-empty"):
        _make_manager(FakeAxisModel(capture_axes=axes))


@pytest.mark.cpu
def test_capture_axes_with_several_paths_are_not_supported():
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphPathConfig

    paths = {
        "default": EncoderCudaGraphPathConfig(),
        "local": EncoderCudaGraphPathConfig(allow_zero_tokens=True),
    }
    with pytest.raises(NotImplementedError):
        _make_manager(FakeAxisModel(capture_axes=TWO_AXES, paths=paths))
    # Several paths without axes stay supported.
    assert _make_manager(FakeAxisModel(paths=paths)).get_num_graphs_to_capture() == 2 * len(BUDGETS)


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("axes", "budgets", "warns"),
    [
        ((tuple(range(4)), tuple(range(4))), [4, 8, 16, 32], False),  # exactly 64 graphs
        ((tuple(range(5)), tuple(range(5))), [4, 8, 16], True),  # 75 graphs
        ((tuple(range(65)),), [4], True),  # 65 graphs
    ],
)
def test_warning_above_64_graphs(monkeypatch, axes, budgets, warns):
    import vllm.v1.worker.encoder_cudagraph as ec

    manager = _make_manager(FakeAxisModel(capture_axes=axes), budgets=budgets)
    captured: list[tuple[int, Any]] = []
    monkeypatch.setattr(
        manager,
        "_capture_budget_graph",
        lambda token_budget, path="default", axis_keys=(): captured.append((token_budget, axis_keys)),
    )
    warnings: list[str] = []
    monkeypatch.setattr(ec.logger, "warning", lambda msg, *args, **kw: warnings.append(msg % args))
    manager.capture(graph_pool=object())

    expected = len(budgets)
    for axis in axes:
        expected *= len(axis)
    assert len(captured) == expected == manager.get_num_graphs_to_capture()
    assert len(set(captured)) == expected
    graph_warnings = [w for w in warnings if str(expected) in w and "graph" in w]
    assert bool(graph_warnings) is warns, warnings


def _items(*lengths, start=0.0):
    return [
        torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) + start + 100 * i
        for i, n in enumerate(lengths)
    ]


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("lengths", "expected_keys"),
    [((2, 1), ("small", 2)), ((6,), ("large", 1)), ((1, 1, 1, 1), ("small", 3))],
)
def test_execute_replays_the_graph_of_the_resolved_axis_keys(cpu_capture, lengths, expected_keys):
    from vllm.v1.worker.encoder_cudagraph_defs import ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG

    model = FakeAxisModel(capture_axes=TWO_AXES, resolve=_resolve_two_axes)
    manager = _make_manager(model)
    cpu_capture(manager)
    items = _items(*lengths)

    outputs = manager.execute({"items": items})

    tag = model.axis_tag(expected_keys)
    assert len(outputs) == len(items)
    for out, item in zip(outputs, items):
        torch.testing.assert_close(out, item + tag, rtol=0, atol=0)
    replayed = [key for key, meta in manager.budget_graphs["default"].items() if meta.graph.replays]
    budget = min(b for b in BUDGETS if b >= sum(lengths))
    assert replayed == [(budget, expected_keys)]
    assert manager.graph_hits == len(items) and manager.graph_misses == 0
    # The reserved entry was popped before the kwargs reached the model again.
    assert model.replay_kwargs and all(
        ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG not in kw for kw in model.replay_kwargs
    )


@pytest.mark.cpu
@pytest.mark.parametrize("returned", [("small",), ("small", 1, "extra"), None])
def test_wrong_number_of_axis_keys_is_rejected(cpu_capture, returned):
    model = FakeAxisModel(capture_axes=TWO_AXES, resolve=(lambda items: returned) if returned else None)
    manager = _make_manager(model)
    cpu_capture(manager)
    with pytest.raises(ValueError, match="axis keys"):
        manager.execute({"items": _items(2)})


@pytest.mark.cpu
def test_oversized_batch_runs_eagerly(cpu_capture):
    model = FakeAxisModel(capture_axes=TWO_AXES, resolve=_resolve_two_axes)
    manager = _make_manager(model)
    cpu_capture(manager)
    (out,) = manager.execute({"items": _items(20)})
    torch.testing.assert_close(out, _items(20)[0] - 1000.0)
    assert model.eager_calls == 1 and manager.graph_misses == 1 and manager.graph_hits == 0


@pytest.mark.cpu
def test_capture_input_signatures_share_axis_keys_parameter():
    """Both lanes' protocol declare ``axis_keys`` (default None) on the capture-input hook."""
    from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph

    params = inspect.signature(SupportsEncoderCudaGraph.prepare_encoder_cudagraph_capture_inputs).parameters
    assert list(params)[-2:] == ["path", "axis_keys"]
    assert params["axis_keys"].default is None
    doc = inspect.getdoc(SupportsEncoderCudaGraph.select_encoder_cudagraph_items) or ""
    assert "ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG" in doc


class CudaAxisModel(FakeAxisModel):
    """Like the fake model, with a forward that launches several kernels."""

    def encoder_cudagraph_forward(self, inputs, path="default"):
        x = inputs["x"]
        return torch.relu(x * 2.0 - x) + inputs["tag"]


@pytest.mark.cuda
@requires_cuda
def test_cuda_capture_two_axis_keys_and_replay_the_right_one():
    axes = (("narrow", "wide"),)
    model = CudaAxisModel(capture_axes=axes, resolve=lambda items: ("wide" if len(items) > 1 else "narrow",))
    manager = _make_manager(model, budgets=[8, 16], max_items=4, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        manager.capture(graph_pool=torch.cuda.graph_pool_handle())
    torch.cuda.synchronize()
    graphs = manager.budget_graphs["default"]
    assert set(graphs) == {(b, (k,)) for b in (8, 16) for k in axes[0]}
    assert {meta.axis_keys for meta in graphs.values()} == {("narrow",), ("wide",)}

    def run(lengths):
        items = [t.cuda() for t in _items(*lengths)]
        return items, manager.execute({"items": items})

    items, outputs = run((3, 2))  # wide, budget 8
    for out, item in zip(outputs, items):
        torch.testing.assert_close(out, torch.relu(item) + model.axis_tag(("wide",)))
    items, outputs = run((5,))  # narrow, budget 8
    torch.testing.assert_close(outputs[0], torch.relu(items[0]) + model.axis_tag(("narrow",)))
    items, outputs = run((9,))  # narrow, budget 16
    torch.testing.assert_close(outputs[0], torch.relu(items[0]) + model.axis_tag(("narrow",)))
    assert manager.graph_hits == 4 and manager.graph_misses == 0
    # The capture saw the axis keys of each graph.
    assert sorted((b, tuple(k)) for b, _, k in model.capture_calls) == sorted(graphs)
