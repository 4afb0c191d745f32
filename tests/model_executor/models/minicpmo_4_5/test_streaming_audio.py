# SPDX-License-Identifier: Apache-2.0
"""The one streaming-audio path (``streaming_audio.py``, ``duplex_step.py``, start-up capture's buckets).

CPU tests use a tiny Whisper (2 layers, 128 positions, 0.2 s chunks of 10 positions, so a cache cycle
is 12 chunks) in float32 with the adapters' CPU backend: the per-row layout, page allocation and
release, buckets, the eager fallbacks, start-up capture's one loop over the buckets and the stage's
``preprocess_batch`` pre-pass (collection, planning, hand-out). On the CPU a batch's GEMMs may round
differently from one row's, so rows are compared with their solo encode within
``minicpmo_cg.tolerance.GRAPH_REL_TOL`` (bookkeeping exactly); the CUDA tests (Whisper-medium's widths,
bf16) assert batch invariance bitwise: each row equal to the same session encoded alone whatever shares
the step (joins, leaves, first chunks, cache resets), a full pool, NaN-filled free pages, graphed equal
to eager.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.tiny_encoders import tiny_audio_model

from minicpmo_cg.duplex import DuplexChunk, DuplexSession
from minicpmo_cg.tolerance import graph_rel_tol, rel_diff
from vllm_omni.model_executor.models.minicpmo_4_5 import duplex_step as ds
from vllm_omni.model_executor.models.minicpmo_4_5 import startup_capture as startup
from vllm_omni.model_executor.models.minicpmo_4_5 import streaming_audio as sa

pytestmark = [pytest.mark.core_model]

N, POSITIONS, POOL = 10, 128, 2
CYCLE = math.ceil((POSITIONS - N) / N)  # 12 chunks per cache cycle
TOL = graph_rel_tol(torch.float32)
PACKAGE = Path(sa.__file__).parent


def duplex_config(sessions=8):
    from minicpmo_cg.vllm_config import duplex_vllm_config, standalone_vllm_config

    return duplex_vllm_config(standalone_vllm_config(), sessions)


def tiny(**config):
    return (
        tiny_audio_model(positions=POSITIONS, chunk_seconds=N / 50, pool=POOL, **config)
        .eval()
        .requires_grad_(False)
    )


def wired(backend_cls=None, sessions=8, **options):
    """A tiny model wired for a duplex deployment of ``sessions`` (graphs on the CPU backend when given)."""
    model = tiny()
    for key, value in options.items():
        setattr(model.config, f"encoder_cuda_graph_{key}", value)
    model._init_encoder_cuda_graphs(duplex_config(sessions))
    if backend_cls is not None and model._streaming_audio.graph is not None:
        model._streaming_audio.graph.backend = backend_cls()
    return model


def stream(count, seed, first=True, device="cpu", dtype=torch.float32, n=N, mels=80):
    """A session's chunks as the duplex stage frames them (prefix 0 on the first)."""
    g = torch.Generator().manual_seed(seed)
    return [
        DuplexChunk(
            torch.randn(1, mels, 2 * n + (2 if first and i == 0 else 4), generator=g).to(device, dtype),
            0 if first and i == 0 else 2,
        )
        for i in range(count)
    ]


def as_chunk(chunk, cache):
    return sa.StreamingAudioChunk(chunk.features, chunk.prefix_extra_frames, cache)


class Sessions:
    """Sessions encoded in steps through ``encoder.encode`` and each alone (a batch of one) on a twin model."""

    def __init__(self, model, solo, tol):
        self.model, self.solo, self.tol = model, solo, tol
        self.caches, self.solo_caches, self.worst = {}, {}, 0.0

    def join(self, name):
        self.caches[name] = self.solo_caches[name] = None

    def leave(self, name):
        sa.release_cache(self.caches.pop(name))
        sa.release_cache(self.solo_caches.pop(name))

    def step(self, chunks):
        names = list(chunks)
        with torch.inference_mode():
            got = self.model._streaming_audio.encode([as_chunk(chunks[n], self.caches[n]) for n in names])
            for name, (out, cache) in zip(names, got, strict=True):
                ((want, self.solo_caches[name]),) = self.solo._streaming_audio.encode(
                    [as_chunk(chunks[name], self.solo_caches[name])]
                )
                self.caches[name] = cache
                diff = rel_diff(want, out)
                assert diff <= self.tol and (self.tol or torch.equal(want, out)), (name, diff)
                self.worst = max(self.worst, diff)
        return {n: out for n, (out, _) in zip(names, got, strict=True)}

    def lengths(self):
        return {n: c.length for n, c in self.caches.items()}


# ---------------------------------------------------------------------------
# Policy (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_buckets_hold_every_step():
    assert [sa.bucket_for(r, 32) for r in (1, 2, 3, 5, 8, 9, 17, 32, 40)] == [1, 2, 4, 8, 8, 16, 32, 32, 32]
    assert sa.bucket_for(7, 4) == 4  # capped at the deployment's largest bucket
    encoder = sa.StreamingAudioEncoder(tiny(), None, sessions=5, chunk=N)
    assert encoder.largest == 8 and encoder.buckets == (1, 2, 4, 8)


@pytest.mark.cpu
def test_the_row_layout_puts_every_row_in_its_own_pages_and_padding_in_scratch():
    layout = sa.RowLayout(rows=4, chunk=3, pages=2)
    meta = layout.build(np.array([0, 6]), np.array([0, 17]), np.array([True, False]), scratch_start=10)
    assert meta.dtype == np.int32 and meta.size == layout.size
    start, used, positions, table, slots = layout.split(torch.from_numpy(meta))
    assert start.tolist() == [0, 1, 0, 0] and used.tolist() == [3, 20, 3, 3]
    assert positions.tolist() == [[0, 1, 2], [17, 18, 19], [0, 1, 2], [0, 1, 2]]
    assert table.tolist() == [[0, 1], [6, 7], [10, 10], [10, 10]]
    # slot + 1 of each new position: page 6 starts at slot 96; padding rows 0 (their scratch slot)
    assert slots.tolist() == [1, 2, 3, 96 + 17 + 1, 96 + 18 + 1, 96 + 19 + 1] + [0] * 6


def _cpu_pool(**dims: int) -> sa.KVPagePool:
    return sa.KVPagePool(dtype=torch.float32, device="cpu", **dims)


@pytest.mark.cpu
def test_the_pool_gives_zeroed_pages_lowest_first_and_takes_them_back_explicitly():
    pool = _cpu_pool(layers=2, heads=2, head_dim=4, max_positions=40, sessions=3, rows=2, chunk=10)
    assert pool.pages_per_session == 3 and pool.scratch_start == 9 and pool.kv.shape[2] == 9 + 2
    assert pool.nbytes == sa.KVPagePool.nbytes_for(
        layers=2, d_model=8, itemsize=4, max_positions=40, sessions=3, rows=2, chunk=10
    )
    pool.kv.fill_(float("nan"))
    a, b = pool.acquire(), pool.acquire()
    assert (a.first_page, b.first_page) == (0, 3) and pool.free_sessions == 1
    assert not pool.kv[:, :, 0:6].any() and bool(pool.kv[:, :, 6:].isnan().all())  # only taken pages zeroed
    a.length = 20
    sa.release_cache(a)
    assert a.released and a.length == 0 and pool.free_sessions == 2
    sa.release_cache(a)  # idempotent
    sa.release_cache(None)
    assert pool.free_sessions == 2
    assert pool.acquire().first_page == 0 and pool.acquire().first_page == 6 and pool.acquire() is None
    with pytest.raises(ValueError, match="sessions >= 1"):
        _cpu_pool(layers=1, heads=1, head_dim=1, max_positions=1, sessions=0, rows=1, chunk=1)


@pytest.mark.cpu
def test_rows_match_each_session_alone_over_joins_leaves_first_chunks_and_resets(cpu_backend):
    model, solo = wired(cpu_backend), wired(cpu_backend)
    sessions = Sessions(model, solo, TOL)
    streams = {name: stream(40, seed) for seed, name in enumerate("abcd")}
    started, plan = {}, {0: "ab", 3: "c", 13: "d"}  # c's and d's first chunks inside batched steps
    pool = model._streaming_audio.pool
    for t in range(30):
        for name in plan.get(t, ""):
            sessions.join(name)
            started[name] = t
        if t == 7:
            sessions.leave("b")
            assert pool.free_sessions == pool.sessions - 2  # b's pages are back
        sessions.step({name: streams[name][t - started[name]] for name in sessions.caches})
    # a resets before its chunks 12 and 24, c before its 12 and 24, d before its 12
    assert sessions.lengths() == {"a": 6 * N, "c": 3 * N, "d": 5 * N}
    encoder = model._streaming_audio
    assert encoder.stats()["eager_chunks"] == 0 and encoder.rows == 3 * 2 + 4 * 3 + 6 * 2 + 17 * 3
    for name in list(sessions.caches):
        sessions.leave(name)
    assert pool.free_sessions == pool.sessions


@pytest.mark.cpu
def test_rows_never_see_each_other(cpu_backend):
    """Change one session's audio: every other session's outputs and pages keep every bit."""
    outs, pages = [], []
    for variant in range(2):
        encoder = wired(cpu_backend)._streaming_audio
        streams = {name: stream(CYCLE + 3, seed) for seed, name in enumerate("abc")}
        if variant:
            streams["b"] = stream(CYCLE + 3, seed=99)
        caches, got = dict.fromkeys("abc"), []
        with torch.inference_mode():
            for t in range(CYCLE + 3):
                step = encoder.encode([as_chunk(streams[n][t], caches[n]) for n in "abc"])
                caches = {n: c for n, (_, c) in zip("abc", step, strict=True)}
                got.append([o for o, _ in step])
        outs.append(got)
        pages.append({n: c.pool.positions(c).clone() for n, c in caches.items()})
    for t in range(CYCLE + 3):
        assert torch.equal(outs[0][t][0], outs[1][t][0]) and torch.equal(outs[0][t][2], outs[1][t][2])
        assert not torch.equal(outs[0][t][1], outs[1][t][1])
    assert torch.equal(pages[0]["a"], pages[1]["a"]) and torch.equal(pages[0]["c"], pages[1]["c"])


@pytest.mark.cpu
def test_nan_in_free_and_scratch_pages_never_reaches_a_row(cpu_backend):
    model, solo = wired(cpu_backend), wired(cpu_backend)
    sessions = Sessions(model, solo, TOL)
    pool = model._streaming_audio.pool
    streams = {name: stream(CYCLE + 2, seed) for seed, name in enumerate("abc")}
    started, plan = {}, {0: "ab", 2: "c"}  # 3 rows: bucket 4, one padding row
    for t in range(CYCLE + 2):
        for name in plan.get(t, ""):
            sessions.join(name)
            started[name] = t
        owned = {c.first_page for c in sessions.caches.values() if c is not None}
        for page in range(0, pool.kv.shape[2], pool.pages_per_session):
            if page not in owned:
                pool.kv[:, :, page : page + pool.pages_per_session] = float("nan")
        out = sessions.step({name: streams[name][t - started[name]] for name in sessions.caches})
        assert all(bool(torch.isfinite(o).all()) for o in out.values()), t


@pytest.mark.cpu
def test_the_model_files_chunk_call_runs_the_paged_forward_and_resets_explicitly(cpu_backend):
    """Through ``get_audio_embedding_streaming`` (vllm-omni patch 0006): the session's cache is its pages;
    the model's reset rule gives them back before the next cycle takes new ones; values match the
    original eager code within the fused bound."""
    model, reference = wired(cpu_backend, sessions=2), tiny()
    session, eager = DuplexSession(), DuplexSession()
    pool = model._streaming_audio.pool
    with torch.inference_mode():
        for t, chunk in enumerate(stream(2 * CYCLE + 2, seed=5)):
            got, want = session.encode(model, chunk), eager.encode(reference, chunk)
            assert rel_diff(want, got) <= TOL, t
            assert isinstance(session.cache, sa.SessionAudioCache) and pool.free_sessions == 1
    assert session.cache.length == 2 * N == eager.cache.get_seq_length()


@pytest.mark.cpu
def test_what_the_forward_does_not_cover_runs_the_original_eager_code(cpu_backend, log_records):
    model, reference = wired(cpu_backend, sessions=1), tiny()
    encoder = model._streaming_audio
    pool = encoder.pool
    a, b = stream(3, 1), stream(2, 2)
    with torch.inference_mode():
        ((_, paged),) = encoder.encode([as_chunk(a[0], None)])
        # a second session: the pool (one session) is full, so it runs the eager code, with one WARNING
        records = log_records(sa.logger)
        ((out, cache),) = encoder.encode([as_chunk(b[0], None)])
        assert isinstance(cache, sa.EncoderDecoderCache) and encoder.eager_chunks == 1
        assert "duplex_max_sessions=1" in records.messages()[-1]
        ((want, _),) = [sa.encode_eager(reference, b[0].features, None, N, (True, 0, 2, None))]
        assert torch.equal(out, want)
        # a chunk of another length
        odd = DuplexChunk(torch.randn(1, 80, 2 * N + 8), 2)
        assert not encoder.covers(as_chunk(odd, paged))
    with torch.no_grad(), torch.enable_grad():  # autograd: the paged cache is copied out, its pages released
        ((_, eager_cache),) = encoder.encode([as_chunk(a[1], paged)])
    assert isinstance(eager_cache, sa.EncoderDecoderCache) and eager_cache.get_seq_length() == 2 * N
    assert paged.released and pool.free_sessions == 1


@pytest.mark.cpu
def test_startup_capture_captures_every_bucket_in_one_loop_and_counts_the_pool(cpu_backend, log_records):
    model = wired(cpu_backend, sessions=8)
    encoder = model._streaming_audio
    records = log_records(startup.logger)
    report = startup.capture_at_startup(model, duplex_config(8))
    assert report.graphs == {"streaming audio": 4} and report.stopped is None  # buckets 1, 2, 4, 8
    assert (
        report.pool_bytes == encoder.pool_bytes() == encoder.pool.nbytes
        and report.total_bytes >= report.pool_bytes
    )
    assert encoder.pool.free_sessions == 8 and not encoder.pool.kv[:, :, : encoder.pool.scratch_start].any()
    assert (
        "streaming audio 4" in records.messages()[-1]
        and f"{report.total_bytes} bytes" in records.messages()[-1]
    )
    assert startup.capture_at_startup(model, duplex_config(8)).num_graphs == 0  # once per set of adapters
    sessions, names = Sessions(model, wired(cpu_backend), TOL), "abcdefgh"
    streams = {n: stream(6, seed) for seed, n in enumerate(names)}
    for n in names:
        sessions.join(n)
    sent = dict.fromkeys(names, 0)
    for width in (1, 2, 3, 5, 8):  # buckets 1, 2, 4, 8, 8
        sessions.step({n: streams[n][sent[n]] for n in names[:width]})
        for n in names[:width]:
            sent[n] += 1
    stats = encoder.graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_misses"], stats["graph_hits"]) == (4, 0, 5)


@pytest.mark.cpu
def test_startup_capture_stops_before_a_pool_that_would_pass_the_memory_floor(cpu_backend):
    model = wired(cpu_backend, sessions=4)
    encoder = model._streaming_audio
    encoder.graph.backend.free = encoder.pool_bytes() + 10
    model.config.encoder_cuda_graph_min_free_bytes = 100
    report = startup.capture_at_startup(model, duplex_config(4))
    assert "encoder_cuda_graph_min_free_bytes=100" in report.stopped and report.num_graphs == 0
    assert encoder._pool is None


@pytest.mark.cpu
def test_the_option_of_the_old_batched_path_is_gone():
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph import HF_OVERRIDE_KEYS

    assert "encoder_cuda_graph_duplex_batch" not in HF_OVERRIDE_KEYS
    model = tiny()
    model.config.encoder_cuda_graph_duplex_batch = True
    with pytest.raises(ValueError, match="encoder_cuda_graph_duplex_batch"):
        model._init_encoder_cuda_graphs(duplex_config(2))


@pytest.mark.cpu
def test_the_streaming_modules_start_no_thread_and_import_no_cycle():
    modules = {"streaming_audio", "duplex_step", "startup_capture"}
    imports = {}
    for name in modules:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                found |= {node.module or ""} | ({a.name for a in node.names} if node.level else set())
        assert not found & {"threading", "queue", "concurrent"}, name
        imports[name] = {m.lstrip(".") for m in found} & modules
    assert imports["streaming_audio"] == set()  # the leaf the others import
    assert not (imports["duplex_step"] & {"startup_capture"}) and not (
        imports["startup_capture"] & {"duplex_step"}
    )


# ---------------------------------------------------------------------------
# The stage's preprocess_batch pre-pass (CPU)
# ---------------------------------------------------------------------------


class Processor:
    """A streaming processor stand-in: each call returns the next chunk of a session's mel stream."""

    def __init__(self, chunks):
        self.chunks, self.calls = list(chunks), 0

    def process(self, audio):
        chunk = self.chunks[self.calls]
        self.calls += 1
        return {
            "audio_features": chunk.features,
            "audio_feature_lens": [torch.tensor([chunk.features.shape[-1]])],
        }


class Helper:
    """The duplex stage's runtime, as far as the pre-pass reads it: 100 samples per chunk."""

    SIZE = 100

    def __init__(self):
        self.sessions = {}

    def _configure_streaming_processor(self, state):
        return state.streaming_processor

    def _streaming_chunk_size(self, processor):
        return self.SIZE

    def _consumed_audio_samples(self, index, size, *, processor):
        return size

    def _process_streaming_audio(self, audio, index, *, processor):
        assert len(audio) == self.SIZE
        return processor.process(audio)

    @staticmethod
    def _decode_audio_payload(payload):
        return np.zeros(payload["samples"], dtype=np.float32)


def session_state(name, chunks, buffered=0):
    return SimpleNamespace(
        session_id=name,
        streaming_processor=Processor(chunks),
        audio_buffer=np.zeros(buffered, np.float32),
        audio_chunk_idx=1,
        prepared_append_identity=None,
        audio_past_key_values=None,
        planned_audio_chunks=[],
    )


def append(name, seq, samples):
    return {
        "duplex": {
            "data_plane": True,
            "session_id": name,
            "seq": seq,
            "epoch": 0,
            "payload": {"samples": samples},
        }
    }


@pytest.mark.cpu
def test_the_pre_pass_collects_only_new_appends_of_known_sessions_past_their_first_chunk():
    helper = Helper()
    helper.sessions = {
        "a": session_state("a", []),
        ("b", 2): session_state("b", []),
        "c": session_state("c", []),
    }
    helper.sessions["c"].audio_chunk_idx = 0  # its first append: the stage pads it, the stage encodes it
    helper.sessions["a"].prepared_append_identity = (0, 7)
    buffer = {
        "r1": append("a", 8, 100),
        "r2": append("a", 7, 100),
        "r3": {**append("b", 1, 100)},
        "r4": append("c", 1, 100),
        "r5": append("x", 1, 100),
        "r6": {"duplex": {"data_plane": False}},
        "r7": {},
    }
    buffer["r3"]["duplex"]["incarnation"] = 2  # vllm-omni 0.28 keys its sessions by id and incarnation
    got = ds.collect_appends(helper, ["r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"], buffer)
    assert [(state.session_id, len(wave)) for state, wave in got] == [("a", 100), ("b", 100)]


@pytest.mark.cpu
def test_the_pre_pass_plans_each_appends_chunks_as_the_stage_loop_cuts_them():
    helper = Helper()
    chunks = stream(3, 1, first=False)
    state = session_state("a", chunks, buffered=30)
    planned = ds.plan_chunks(helper, state, np.zeros(250, np.float32))  # 280 samples: two chunks, 80 left
    assert len(planned.chunks) == 2 and state.streaming_processor.calls == 2 and len(state.audio_buffer) == 30
    assert all(c.prefix_frames == 2 and c.cache is None for c in planned.chunks)
    assert torch.equal(planned.chunks[1].mel, chunks[1].features)


@pytest.mark.cpu
def test_the_pre_pass_encodes_a_steps_appends_together_and_hands_each_session_its_chunks(cpu_backend):
    model, solo = wired(cpu_backend), wired(cpu_backend)
    stage = SimpleNamespace(model_stage="llm", thinker=model, _minicpmo45_duplex_data_plane_helper=Helper())
    streams = {n: stream(6, seed, first=False) for seed, n in enumerate("abc")}
    helper = stage._minicpmo45_duplex_data_plane_helper
    helper.sessions = {n: session_state(n, chunks) for n, chunks in streams.items()}
    solo_caches = dict.fromkeys("abc")
    encoder = model._streaming_audio
    for step, samples in enumerate((100, 200, 100)):  # the second step's appends carry two chunks each
        buffer = {f"r{n}": append(n, step, samples) for n in "abc"}
        ds.preprocess_batch(stage, list(buffer), buffer, torch.device("cpu"))
        for n, state in helper.sessions.items():
            for feature, embeds in state.planned_audio_chunks:
                chunk = DuplexChunk(feature["audio_features"], 2)
                with torch.inference_mode():
                    ((want, solo_caches[n]),) = solo._streaming_audio.encode(
                        [as_chunk(chunk, solo_caches[n])]
                    )
                assert embeds.shape == want[0].shape and rel_diff(want[0], embeds) <= TOL
            state.planned_audio_chunks.clear()  # the stage's loop takes them
            state.audio_chunk_idx += samples // 100
    assert encoder.calls == 4 and encoder.rows == 12  # one call per wave of chunks
    assert {n: s.audio_past_key_values.length for n, s in helper.sessions.items()} == dict.fromkeys(
        "abc", 4 * N
    )
    ds.release_session(helper.sessions["a"])
    assert helper.sessions["a"].audio_past_key_values is None and encoder.pool.free_sessions == 8 - 2


@pytest.mark.cpu
def test_the_stage_model_answers_the_runners_pre_pass_and_releases_a_finished_session(monkeypatch):
    """vllm-omni patch 0010: the stage model's ``preprocess_batch`` (what the runner's
    ``_maybe_run_batch_preprocess`` calls) is the pre-pass; a finished request's session gives its
    pages back. Patch 0011/0012: the stage's session state carries the planned chunks."""
    from torch import nn

    from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni as omni

    try:
        from vllm_omni.model_executor.models.minicpmo_4_5.duplex import stage0
    except ImportError:  # vllm-omni 0.28
        from vllm_omni.experimental.fullduplex.minicpmo45 import stage0
    assert stage0._MiniCPMO45Stage0SessionState(session_id="a").planned_audio_chunks == []
    seen = []
    monkeypatch.setattr(ds, "preprocess_batch", lambda *args: seen.append(args))
    stage = object.__new__(omni.MiniCPMO45OmniForConditionalGeneration)
    nn.Module.__init__(stage)
    stage.preprocess_batch(req_ids=["r1"], model_intermediate_buffer={"r1": {}}, device="cpu")
    assert seen == [(stage, ["r1"], {"r1": {}}, "cpu")]
    encoder = wired(sessions=2)._streaming_audio
    state = session_state("a", [])
    state.audio_past_key_values = encoder.pool.acquire()
    stage._minicpmo45_duplex_request_sessions = {"r1": "a"}
    stage._minicpmo45_duplex_data_plane_helper = SimpleNamespace(sessions={"a": state})
    stage.model = SimpleNamespace()
    stage.on_requests_finished({"r1"})
    assert state.audio_past_key_values is None and encoder.pool.free_sessions == 2


# ---------------------------------------------------------------------------
# CUDA: Whisper-medium's widths (a few layers), bf16
# ---------------------------------------------------------------------------


def medium_model(sessions, *, graphs=True, layers=4):
    """Whisper-medium's widths (d_model 1024, 16 heads, fc1/fc2 4096) and position table, bf16, 1 s chunks."""
    model = (
        tiny_audio_model(
            positions=1500, chunk_seconds=1.0, pool=5, layers=layers, d_model=1024, heads=16, embed=3584
        )
        .eval()
        .requires_grad_(False)
        .to("cuda", torch.bfloat16)
    )
    model.config.encoder_cuda_graph = graphs
    model._init_encoder_cuda_graphs(duplex_config(sessions))
    return model


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the streaming audio forward's bits need CUDA"
)


@pytest.mark.cuda
@needs_cuda
def test_cuda_rows_are_bitwise_their_session_alone_over_joins_leaves_first_chunks_and_resets():
    model, solo = medium_model(8), medium_model(8)
    solo.load_state_dict(model.state_dict())
    startup.capture_at_startup(model, duplex_config(8))
    sessions = Sessions(model, solo, 0.0)
    streams = {n: stream(40, seed, device="cuda", n=50) for seed, n in enumerate("abcdefgh")}
    started, plan = {}, {0: "abcde", 4: "f", 11: "gh"}
    for t in range(36):  # a, b, ... reset at their chunk 29
        for name in plan.get(t, ""):
            sessions.join(name)
            started[name] = t
        if t == 20:
            sessions.leave("b")
        sessions.step({n: streams[n][t - started[n]] for n in sessions.caches})
    stats = model._streaming_audio.graph.get_cumulative_stats()
    assert stats["capture_failures"] == 0 and stats["graph_misses"] == 0 and stats["graph_hits"] == 36
    print(
        f"row plan: {model._streaming_audio.pool.row_plan.describe()}; attention {model._streaming_audio.attention}"
    )


@pytest.mark.cuda
@needs_cuda
def test_cuda_graphed_is_bitwise_the_eager_forward_and_close_to_the_original_code():
    graphed, eager = medium_model(4), medium_model(4, graphs=False)
    eager.load_state_dict(graphed.state_dict())
    assert eager._streaming_audio.graph is None
    original = medium_model(1, graphs=False)
    original.load_state_dict(graphed.state_dict())
    original._streaming_audio = None  # the original eager code (get_audio_embedding_streaming's fallback)
    sessions = {n: (DuplexSession(), DuplexSession(), DuplexSession()) for n in "abc"}
    streams = {n: stream(35, seed, device="cuda", n=50) for seed, n in enumerate("abc")}
    worst = 0.0
    with torch.inference_mode():
        for t in range(35):  # through a cache reset
            for n, (g, e, o) in sessions.items():
                out, want = g.encode(graphed, streams[n][t]), e.encode(eager, streams[n][t])
                assert torch.equal(out, want), (n, t)
                worst = max(worst, rel_diff(o.encode(original, streams[n][t]), out))
    assert worst <= 4 * graph_rel_tol(torch.bfloat16), worst
    print(f"graphed == eager bitwise; against the original eager code: worst rel {worst:.3e}")
    assert graphed._streaming_audio.graph.get_cumulative_stats()["graph_hits"] > 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_full_pool_and_nan_filled_free_pages():
    model, solo = medium_model(2), medium_model(2)
    solo.load_state_dict(model.state_dict())
    encoder = model._streaming_audio
    pool = encoder.pool
    pool.kv.fill_(float("nan"))
    sessions = Sessions(model, solo, 0.0)
    streams = {n: stream(3, seed, device="cuda", n=50) for seed, n in enumerate("abc")}
    for n in "ab":
        sessions.join(n)
    for t in range(3):
        out = sessions.step({n: streams[n][t] for n in "ab"})
        assert all(bool(torch.isfinite(o).all()) for o in out.values())
    with torch.inference_mode():  # a third session: no pages left, the original eager code
        ((out, cache),) = encoder.encode([as_chunk(streams["c"][0], None)])
    assert (
        isinstance(cache, sa.EncoderDecoderCache)
        and bool(torch.isfinite(out).all())
        and pool.free_sessions == 0
    )
