# SPDX-License-Identifier: Apache-2.0
"""Start-up capture (``startup_capture.py`` and the AR model runner's hook).

CPU tests run a tiny thinker (Whisper: 2 layers, 128 positions, 0.2 s chunks, so a cache cycle is
12 chunks; SigLIP: 2 layers, a camera frame of 4x4 patches) with the adapters' CPU backend, a stand-in
for capture that keeps the keys, counters and byte accounts: start-up capture takes every key a real
duplex session's calls then hit (the streaming audio bucket of a one-session deployment, the camera
frame; first session: no warmup miss, every chunk and frame a replay), the option turns it off, the
memory floor stops it with one WARNING and the lazy path takes over, the INFO line reports graphs,
bytes and seconds, and the runner's ``capture_model`` and the stage model's hook add the bytes. A
CUDA test does the same at Whisper-medium's widths with real graphs and checks the first session
bitwise against the eager forward. The buckets of larger deployments: ``test_streaming_audio.py``.
"""

from __future__ import annotations

import copy
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny_encoders import tiny_audio_model, tiny_siglip_config
from torch import nn

from minicpmo_cg.duplex import DuplexChunk, DuplexSession, stage_frame_data
from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm
from vllm_omni.model_executor.models.minicpmo_4_5 import startup_capture as startup

pytestmark = [pytest.mark.core_model]


N, POSITIONS = 10, 128
CYCLE = math.ceil((POSITIONS - N) / N)  # 12 chunks per cache cycle
KEYS = 1  # the streaming audio forward's one bucket of a one-session deployment
FRAME = (4, 4)  # camera frame patches: image_size 56 / patch 14


def duplex_config(session_mode="duplex"):
    from minicpmo_cg.vllm_config import standalone_vllm_config

    config = copy.copy(standalone_vllm_config())
    model_config = copy.copy(config.model_config)
    object.__setattr__(model_config, "session_mode", session_mode)
    object.__setattr__(config, "model_config", model_config)
    return config


def thinker(backend_cls, vision=True, **options):
    """A tiny thinker with Whisper (and SigLIP + resampler), adapters wired on CPU backends."""
    model = tiny_audio_model(positions=POSITIONS, chunk_seconds=N / 50, vision_batch_size=16, image_size=56)
    if vision:
        model.vpm = llm.SiglipVisionTransformer(tiny_siglip_config(llm, "sdpa"))
        model.resampler = llm.Resampler(num_queries=8, embed_dim=32, num_heads=2, kv_dim=64, adaptive=True)
    model = model.eval().requires_grad_(False)
    for key, value in options.items():
        setattr(model.config, f"encoder_cuda_graph_{key}", value)
    model._init_encoder_cuda_graphs(duplex_config())
    backends = {}
    for name, adapter in adapters(model).items():
        adapter.backend = backends[name] = backend_cls()
    return model


def adapters(model):
    found = {"streaming audio": model._streaming_audio.graph}
    if model.vpm is not None:
        found["vision"] = model.vpm._encoder_graph
    return found


def stage_chunks(count, seed):
    """A session's chunks as the duplex stage frames them: float32 mel, prefix 0 then 2, suffix 2."""
    g = torch.Generator().manual_seed(seed)
    return [
        DuplexChunk(torch.randn(1, 80, 2 * N + (2 if i == 0 else 4), generator=g), 0 if i == 0 else 2)
        for i in range(count)
    ]


def camera_frame(seed):
    g = torch.Generator().manual_seed(seed)
    pixels = [torch.rand(3, 14, FRAME[0] * FRAME[1] * 14, generator=g) * 2 - 1]
    return stage_frame_data(pixels, torch.tensor([FRAME]), device="cpu", dtype=torch.float32)


class Clock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


@pytest.mark.cpu
def test_startup_graphs_are_exactly_what_a_real_session_hits(cpu_backend, log_records):
    records = log_records(startup.logger)
    model = thinker(cpu_backend)
    report = startup.capture_at_startup(model, duplex_config(), clock=Clock(10.0, 12.5))
    assert report.graphs == {"streaming audio": KEYS, "vision": 1} and report.stopped is None
    assert report.skipped == {}
    found = adapters(model)
    for adapter in found.values():  # nothing counted: no session has been served yet
        stats = adapter.get_cumulative_stats()
        assert stats["graph_hits"] == stats["graph_misses"] == 0
    # a real session afterwards: two cache cycles and more, a frame every 5th chunk
    session = DuplexSession()
    frames = 0
    with torch.inference_mode():
        for i, chunk in enumerate(stage_chunks(2 * CYCLE + 5, seed=1)):
            session.encode(model, chunk)
            if i % 5 == 0:
                with torch.inference_mode(False), torch.no_grad():
                    model.get_vision_hidden_states(camera_frame(i))
                frames += 1
    audio, vision = (found[k].get_cumulative_stats() for k in ("streaming audio", "vision"))
    assert (audio["num_graphs"], audio["graph_hits"], audio["graph_misses"]) == (KEYS, 2 * CYCLE + 5, 0)
    assert (vision["num_graphs"], vision["graph_hits"], vision["graph_misses"]) == (1, frames, 0)
    # the INFO line: graphs, bytes (graphs + the K/V pages it allocated), seconds
    graph_bytes = sum(a.graph_bytes for a in found.values())
    pool_bytes = model._streaming_audio.pool.nbytes
    assert (report.pool_bytes, report.graph_bytes) == (pool_bytes, graph_bytes) and graph_bytes > 0
    (line,) = [m for m in records.messages(logging.INFO) if "captured at start-up" in m]
    assert line.startswith(f"MiniCPM-o 4.5 encoder CUDA graphs captured at start-up: {KEYS + 1} graphs")
    assert "in 2.50 s" in line and f"({report.total_bytes} bytes:" in line
    assert records.messages(logging.WARNING) == []


@pytest.mark.cpu
def test_the_session_cache_and_outputs_are_those_of_a_session_without_startup_capture(cpu_backend):
    lazy, eager_model = thinker(cpu_backend, vision=False), thinker(cpu_backend, vision=False)
    eager_model._streaming_audio.graph = None  # the same forward, eagerly
    model = thinker(cpu_backend, vision=False)
    startup.capture_at_startup(model, duplex_config())
    assert model.audio_past_key_values is None  # the synthetic session's cache is not left behind
    runs = {name: DuplexSession() for name in ("startup", "lazy", "eager")}
    with torch.inference_mode():
        for chunk in stage_chunks(CYCLE + 3, seed=2):
            outs = [
                runs[n].encode(m, chunk)
                for n, m in (("startup", model), ("lazy", lazy), ("eager", eager_model))
            ]
            assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
    assert runs["startup"].cache.length == runs["lazy"].cache.length == 3 * N


@pytest.mark.cpu
def test_off_switch_leaves_the_lazy_path(cpu_backend, log_records):
    records = log_records(startup.logger)
    model = thinker(cpu_backend, startup_capture=False)
    report = startup.capture_at_startup(model, duplex_config())
    assert report.num_graphs == 0 and report.total_bytes == 0
    assert all(a.get_cumulative_stats()["num_graphs"] == 0 for a in adapters(model).values())
    (line,) = records.messages(logging.INFO)
    assert "start-up encoder CUDA graph capture off (encoder_cuda_graph_startup_capture=false)" in line
    session = DuplexSession()
    with torch.inference_mode():
        for chunk in stage_chunks(CYCLE + 2, seed=3):
            session.encode(model, chunk)
    stats = model._streaming_audio.graph.get_cumulative_stats()
    assert stats["warmup_misses"] == KEYS and stats["num_graphs"] == 1  # lazily, as before


@pytest.mark.cpu
def test_turn_based_deployments_capture_nothing_at_startup(cpu_backend, log_records):
    records = log_records(startup.logger)
    model = thinker(cpu_backend)
    report = startup.capture_at_startup(model, duplex_config(session_mode="turn"))
    assert report.num_graphs == 0 and records.messages() == []


@pytest.mark.cpu
def test_below_the_memory_floor_it_stops_with_one_warning_and_lazy_capture_follows(
    cpu_backend, log_records, monkeypatch
):
    records = log_records(startup.logger)
    floor = 1 << 30
    free = {"bytes": floor + (1 << 20)}  # room for the K/V pages (under 1 MiB here)

    class Backend(cpu_backend):
        def free_bytes(self, device):
            return free["bytes"]

    model = thinker(Backend, vision=True, min_free_bytes=floor)
    graph = model._streaming_audio.graph
    calls = {"n": 0}
    capture = startup.capture_now

    def counting(adapter, *inputs):  # free memory falls below the floor after the audio bucket
        calls["n"] += 1
        if calls["n"] == 1:
            free["bytes"] = floor - 1
        return capture(adapter, *inputs)

    monkeypatch.setattr(startup, "capture_now", counting)
    report = startup.capture_at_startup(model, duplex_config())
    assert (
        report.graphs == {"streaming audio": 1}
        and "below encoder_cuda_graph_min_free_bytes" in report.stopped
    )
    assert model.vpm._encoder_graph.get_cumulative_stats()["num_graphs"] == 0  # stopped before the frame
    (warning,) = records.messages(logging.WARNING)
    assert "captured at start-up: 1 graphs" in warning and "captured lazily" in warning
    assert [m for m in records.messages() if m != warning] == []  # one line in all
    free["bytes"] = floor + (1 << 20)
    session = DuplexSession()
    with torch.inference_mode():
        for chunk in stage_chunks(2 * CYCLE + 1, seed=4):
            session.encode(model, chunk)
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == KEYS and stats["warmup_misses"] == 0
    assert model.vpm._encoder_graph.get_cumulative_stats()["num_graphs"] == 0  # the frame's graph: lazily


@pytest.mark.cpu
def test_kv_buffers_that_would_pass_the_floor_stop_it_before_anything_is_allocated(cpu_backend, log_records):
    records = log_records(startup.logger)
    floor = 1 << 30
    # one session's pages (the position table, 8 pages of 16) and one padding row's scratch (1 page)
    pool = (8 + 1) * 16 * 2 * 2 * 64 * 4  # positions x layers x K/V x d_model x float32

    class Backend(cpu_backend):
        def free_bytes(self, device):
            return floor + pool - 1  # the pages would leave one byte less than the floor

    model = thinker(Backend, vision=False, min_free_bytes=floor)
    assert model._streaming_audio.pool_bytes() == pool
    report = startup.capture_at_startup(model, duplex_config())
    assert report.num_graphs == 0 and model._streaming_audio._pool is None and report.total_bytes == 0
    (warning,) = records.messages(logging.WARNING)
    assert f"K/V pages take {pool} bytes" in warning and "captured lazily" in warning


@pytest.mark.cpu
def test_caps_and_budgets_still_bound_startup_capture(cpu_backend):
    model = thinker(cpu_backend, vision=False, max_graphs=0)
    report = startup.capture_at_startup(model, duplex_config())
    assert report.num_graphs == 0 and report.skipped == {"capacity": KEYS}


@pytest.mark.cpu
def test_capture_now_keys_as_a_call_keys(cpu_backend, ecg, vllm_config):
    adapter = ecg.EncoderCudaGraph(lambda x, *rest: x * 3, vllm_config, backend=cpu_backend())
    x = torch.ones(2, 3)
    with torch.inference_mode():
        out, outcome = ecg.capture_now(adapter, x)
        assert outcome == "captured" and torch.equal(out, x * 3)
        assert ecg.capture_now(adapter, x)[1] == "present"
        assert ecg.capture_now(adapter, torch.ones(4, 3))[1] == "captured"  # a shape is part of the key
        assert ecg.capture_now(adapter, x, 3)[1] == "ineligible"  # a non-tensor input, as a call
        assert adapter.get_cumulative_stats()["graph_hits"] == 0
        assert torch.equal(adapter(x), x * 3)  # the call hits the graph captured before
    stats = adapter.get_cumulative_stats()
    assert (stats["graph_hits"], stats["graph_misses"], stats["num_graphs"]) == (1, 0, 2)
    with torch.enable_grad():
        assert ecg.capture_now(adapter, x)[1] == "ineligible"


@pytest.mark.cpu
def test_capture_now_counts_the_pool_growth_against_the_byte_budget(cpu_backend, ecg, vllm_config):
    """As for a lazy capture, the budget counts the graph pool's growth (about the eager call's peak,
    in 2 MiB segments) on top of the static buffers, not the static buffers alone."""
    x = torch.ones(4, 8)  # 128 bytes in, 128 bytes out

    def adapter(max_bytes):
        backend = cpu_backend(peak_bytes=8 << 20)  # the eager call's peak: four 2 MiB segments
        return ecg.EncoderCudaGraph(lambda t: t * 2, vllm_config, backend=backend, max_bytes=max_bytes)

    tight = adapter(4 << 20)  # the buffers fit, the pool's growth does not
    with torch.inference_mode():
        out, outcome = ecg.capture_now(tight, x)
        assert outcome == "budget" and torch.equal(out, x * 2) and tight.graphs == {}
        assert ecg.capture_now(adapter(16 << 20), x)[1] == "captured"


# ---------------------------------------------------------------------------
# The hooks: the runner's capture_model and the stage model
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_capture_model_adds_the_bytes_the_model_captures_at_startup(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm_omni.worker import gpu_ar_model_runner as runner_mod

    order = []
    monkeypatch.setattr(GPUModelRunner, "capture_model", lambda self: order.append("vllm") or 1000)
    monkeypatch.setattr(
        runner_mod.GPUARModelRunner, "_capture_talker_mtp_graphs", lambda self: order.append("mtp")
    )
    model = SimpleNamespace(capture_graphs_at_startup=lambda: order.append("model") or 234)
    monkeypatch.setattr(GPUModelRunner, "get_model", lambda self: model)
    runner = object.__new__(runner_mod.GPUARModelRunner)  # the AR stages' runner
    assert runner.capture_model() == 1234 and order == ["vllm", "model", "mtp"]
    monkeypatch.setattr(GPUModelRunner, "get_model", lambda self: SimpleNamespace())
    assert runner.capture_model() == 1000  # a model without the hook


@pytest.mark.cpu
def test_memory_profiling_counts_the_models_graphs_before_the_kv_cache_is_sized(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm_omni.worker import gpu_ar_model_runner as runner_mod

    monkeypatch.setattr(GPUModelRunner, "profile_cudagraph_memory", lambda self: 1000)
    model = SimpleNamespace(capture_graphs_at_startup=lambda: 234)
    monkeypatch.setattr(GPUModelRunner, "get_model", lambda self: model)
    runner = object.__new__(runner_mod.GPUARModelRunner)
    assert runner.profile_cudagraph_memory() == 1234  # vLLM subtracts this estimate from the KV cache


@pytest.mark.cpu
def test_a_second_startup_capture_captures_nothing(cpu_backend, log_records):
    records = log_records(startup.logger)
    model = thinker(cpu_backend)
    first = startup.capture_at_startup(model, duplex_config())
    second = startup.capture_at_startup(model, duplex_config())
    assert first.num_graphs == KEYS + 1 and first.total_bytes > 0
    assert (second.num_graphs, second.total_bytes) == (0, 0)
    assert len([m for m in records.messages(logging.INFO) if "captured at start-up" in m]) == 1


@pytest.mark.cpu
def test_the_stage_model_captures_for_the_thinker_stage_only(cpu_backend):
    from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni as omni

    stage = object.__new__(omni.MiniCPMO45OmniForConditionalGeneration)
    nn.Module.__init__(stage)
    stage.model_stage, stage.vllm_config = "llm", duplex_config()
    stage.thinker = thinker(cpu_backend, vision=False)
    total = stage.capture_graphs_at_startup()
    encoder = stage.thinker._streaming_audio
    assert total == encoder.graph.graph_bytes + encoder.pool.nbytes
    stage.model_stage, stage.thinker = "tts", None
    assert stage.capture_graphs_at_startup() == 0


# ---------------------------------------------------------------------------
# CUDA: real graphs at Whisper-medium's widths, the first session bitwise
# ---------------------------------------------------------------------------


@pytest.mark.cuda
def test_first_session_after_startup_capture_replays_every_chunk_bitwise():
    if not torch.cuda.is_available():
        pytest.skip("encoder CUDA graphs need a CUDA device")
    from minicpmo_cg import duplex, standalone

    config = duplex_config()
    model = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    standalone.wire_encoder_graphs(model, config, enabled=True)
    report = startup.capture_at_startup(model, config)
    assert report.graphs.get("streaming audio") == 1 and report.stopped is None, report
    assert report.total_bytes > 0 and report.pool_bytes > 0
    graph = standalone.streaming_audio_graph(model)
    eager = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    eager.load_state_dict(model.state_dict())
    standalone.wire_encoder_graphs(eager, config, enabled=False)  # the same forward, eagerly
    chunks = duplex.frame_chunks(duplex.speech_mel(32), 32, device="cuda")  # float32 mel, as the stage
    session, reference = DuplexSession(), DuplexSession()
    with torch.inference_mode():
        got = [session.encode(model, c) for c in chunks]
        want = [reference.encode(eager, c) for c in chunks]
    stats = graph.get_cumulative_stats()
    assert (stats["graph_hits"], stats["graph_misses"], stats["num_graphs"]) == (32, 0, 1)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i
    print("start-up capture:", report)
