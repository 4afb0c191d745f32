"""EncoderCudaGraphManager's capture_error_mode (patches/vllm/0007, both lanes).

The manager passes the caller's cudaStreamCaptureMode to every ``torch.cuda.graph`` call;
the default stays ``"global"``. On CPU the graph API is the emulation of
``test_capture_axes`` with a recorder in front of it; the recorded keyword arguments are
bound against the real ``torch.cuda.graph`` signature, so a misspelt keyword fails here
too. The real capture in ``thread_local`` mode next to a busy second thread is in
``tests/model_executor/models/minicpmo_4_5/test_encoder_cuda_graph_threads.py``.
"""

from __future__ import annotations

import inspect

import pytest
import test_capture_axes as cap
import torch

pytestmark = [pytest.mark.core_model]


@pytest.fixture
def recorded_captures(monkeypatch) -> list[dict]:
    """Emulated capture (see ``test_capture_axes``) that records the arguments of each call."""
    import vllm.v1.worker.encoder_cudagraph as ec

    calls: list[dict] = []
    real_signature = inspect.signature(torch.cuda.graph)

    def recording_capture(graph, *args, **kwargs):
        calls.append(real_signature.bind(graph, *args, **kwargs).arguments)
        return cap._emulated_capture(graph, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", cap._EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recording_capture)
    monkeypatch.setattr(ec, "current_stream", lambda: None, raising=False)
    return calls


def _manager(**kwargs):
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    from minicpmo_cg.vllm_config import standalone_vllm_config

    config = standalone_vllm_config()
    config.compilation_config.encoder_cudagraph_token_budgets = list(cap.BUDGETS)
    config.compilation_config.encoder_cudagraph_max_vision_items_per_batch = 4
    return EncoderCudaGraphManager(config, torch.device("cpu"), torch.float32, cap.FakeAxisModel(), **kwargs)


@pytest.mark.cpu
def test_default_mode_stays_global(recorded_captures):
    manager = _manager()
    assert manager.capture_error_mode == "global"
    manager.capture(graph_pool=object())
    assert len(recorded_captures) == len(cap.BUDGETS)
    assert [c["capture_error_mode"] for c in recorded_captures] == ["global"] * len(cap.BUDGETS)


@pytest.mark.cpu
@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_chosen_mode_reaches_every_capture(recorded_captures, mode):
    pool = object()
    manager = _manager(capture_error_mode=mode)
    manager.capture(graph_pool=pool)
    assert manager.capture_error_mode == mode
    assert len(recorded_captures) == len(cap.BUDGETS) == manager.get_num_graphs_to_capture()
    for call in recorded_captures:
        assert call["capture_error_mode"] == mode
        assert call["pool"] is pool  # the other arguments are unchanged
        assert "stream" in call
    # the graphs still replay what the model computes
    items = [torch.randn(3, cap.HIDDEN), torch.randn(2, cap.HIDDEN)]
    for path, graphs in manager.budget_graphs.items():
        for meta in graphs.values():
            meta.graph.bind(manager.model, meta.input_buffers, meta.output_buffer, path)
    out = manager.execute({"items": items})
    torch.testing.assert_close(torch.cat(out), torch.cat(items), rtol=0, atol=0)


@pytest.mark.cpu
@pytest.mark.parametrize("mode", ["local", "THREAD_LOCAL", "", None, 1])
def test_unknown_mode_is_rejected_at_construction(mode):
    with pytest.raises(ValueError, match="capture_error_mode=") as info:
        _manager(capture_error_mode=mode)
    message = str(info.value)
    assert repr(mode) in message and "'global', 'thread_local', 'relaxed'" in message


@pytest.mark.cpu
def test_mode_is_keyword_only_and_listed():
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    param = inspect.signature(EncoderCudaGraphManager).parameters["capture_error_mode"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default == "global"
    assert EncoderCudaGraphManager.CAPTURE_ERROR_MODES == ("global", "thread_local", "relaxed")
    # the modes torch.cuda.graph documents for its capture_error_mode
    assert all(
        f'"{mode}"' in torch.cuda.graph.__doc__ for mode in EncoderCudaGraphManager.CAPTURE_ERROR_MODES
    )
