# SPDX-License-Identifier: Apache-2.0
"""Cross-session batching of duplex audio chunks (``duplex_batch.py``, ``duplex_rows.py``).

Batched steps are opt-in (``encoder_cuda_graph_duplex_batch``, default false: the exact per-session
path); the tests of the batched path set the option. CPU tests use a tiny Whisper (2 layers, 128
positions, 0.2 s chunks of 10 positions, so a cache cycle is 12 chunks) in float32 with the
adapters' CPU backend: steps of several sessions through :func:`duplex_batch.run_batched`, the code
path the model runner's batched preprocess takes. Each session's every chunk and final cache must
match its own eager run within ``minicpmo_cg.tolerance.GRAPH_REL_TOL`` (the CPU's GEMMs and masked
SDPA round a batch differently; the CUDA test asserts bitwise rows, see ``duplex_rows.RowPlan``);
the bookkeeping must be exact: cache lengths,
pages taken and returned, resets, sessions that join (a first chunk inside a batched step) or leave,
chunks the batch does not cover, a full page pool, errors, and rows that never see each other
(bitwise), not even through a NaN left in pages a row does not own. The attention choice (vLLM's
FlashAttention only where its compiled op is registered, else the SDPA reference) is checked against
faked vLLM installs. CUDA tests do the same at Whisper-medium's widths in bf16 with real speech and
whichever attention the device offers.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny_encoders import tiny_audio_model

from minicpmo_cg.duplex import DuplexChunk, DuplexSession
from minicpmo_cg.tolerance import graph_rel_tol, rel_diff
from vllm_omni.model_executor.models.minicpmo_4_5 import duplex_batch as db
from vllm_omni.model_executor.models.minicpmo_4_5 import duplex_rows as rows_mod
from vllm_omni.model_executor.models.minicpmo_4_5 import fused_layers as fused
from vllm_omni.model_executor.models.minicpmo_4_5 import startup_capture as startup
from vllm_omni.model_executor.models.minicpmo_4_5 import streaming_audio as sa

pytestmark = [pytest.mark.core_model]


N, POSITIONS, POOL = 10, 128, 2
CYCLE = math.ceil((POSITIONS - N) / N)  # 12 chunks per cache cycle
TOL = graph_rel_tol(torch.float32)


def duplex_config(sessions=8):
    """A standalone ``VllmConfig`` as a duplex deployment of ``sessions`` sessions."""
    from minicpmo_cg.vllm_config import duplex_vllm_config, standalone_vllm_config

    return duplex_vllm_config(standalone_vllm_config(), sessions)


def tiny(**config):
    return (
        tiny_audio_model(positions=POSITIONS, chunk_seconds=N / 50, pool=POOL, **config)
        .eval()
        .requires_grad_(False)
    )


def batched_model(backend_cls, sessions=8, **options):
    """A tiny model wired for a duplex deployment of ``sessions``, batched steps on (opt-in) unless
    ``duplex_batch=False``."""
    model = tiny()
    options.setdefault("duplex_batch", True)
    for key, value in options.items():
        setattr(model.config, f"encoder_cuda_graph_{key}", value)
    model._init_encoder_cuda_graphs(duplex_config(sessions))
    for adapter in (model._streaming_audio_encoder_graph, getattr(model._duplex_batch, "graph", None)):
        if adapter is not None:
            adapter.backend = backend_cls()
    return model


def stream(count, seed, first=True):
    """A session's chunks as the duplex stage frames them (float32 mel; prefix 0 on the first)."""
    g = torch.Generator().manual_seed(seed)
    return [
        DuplexChunk(
            torch.randn(1, 80, 2 * N + (2 if first and i == 0 else 4), generator=g),
            0 if first and i == 0 else 2,
        )
        for i in range(count)
    ]


class Sessions:
    """Named duplex sessions on a batched model and the same sessions on an eager reference."""

    def __init__(self, model):
        self.model, self.reference = model, tiny()
        self.live: dict[str, tuple[DuplexSession, DuplexSession]] = {}
        self.worst = 0.0
        self.bitwise = True

    def join(self, name):
        self.live[name] = (DuplexSession(), DuplexSession())

    def leave(self, name):
        del self.live[name]
        gc.collect()

    def step(self, chunks):
        """One engine step: ``chunks = {name: chunk}`` encoded through run_batched; every output is
        checked against the session's own eager encode."""
        names = list(chunks)
        calls = [lambda n=n: self.live[n][0].encode(self.model, chunks[n]) for n in names]
        with torch.inference_mode():
            got = db.run_batched(self.model, calls)
            for name, out in zip(names, got, strict=True):
                want = self.live[name][1].encode(self.reference, chunks[name])
                assert out.shape == want.shape and out.shape[-1] == 32
                diff = rel_diff(want, out)
                assert diff <= TOL, (name, diff)
                self.worst = max(self.worst, diff)
                self.bitwise &= torch.equal(out, want)
        return dict(zip(names, got, strict=True))

    def caches_match(self):
        for name, (batched, eager) in self.live.items():
            want = eager.cache.self_attention_cache
            cache = batched.cache
            length = cache.get_seq_length()
            assert length == want.get_seq_length(), name
            if isinstance(cache, rows_mod.PagedStreamingCache):
                got = cache.pool.positions(cache)
            else:
                got = torch.cat(cache.blocks, dim=4)[:, :, 0]
            for layer in range(len(want.layers)):
                for kv, tensor in enumerate((want.layers[layer].keys, want.layers[layer].values)):
                    assert rel_diff(tensor[0], got[layer, kv]) <= TOL, (name, layer, kv)


# ---------------------------------------------------------------------------
# Per-row parity and bookkeeping (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_duplex_rows_can_be_imported_first():
    """streaming_audio imports duplex_batch, which imports streaming_audio and duplex_rows: the
    last may not need the others imported before it (in a fresh interpreter; the modules the tests
    here import first load the others in an order that works)."""
    module = "vllm_omni.model_executor.models.minicpmo_4_5.duplex_rows"
    code = f"import importlib; importlib.import_module({module!r}); print('imported')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]


@pytest.mark.cpu
def test_batched_steps_match_each_sessions_own_encode_across_resets(cpu_backend):
    model = batched_model(cpu_backend)
    sessions = Sessions(model)
    streams = {name: stream(2 * CYCLE + 4, seed) for seed, name in enumerate("abcde")}
    for name in streams:
        sessions.join(name)
    for t in range(2 * CYCLE + 4):  # two resets (chunks 12 and 24)
        sessions.step({name: chunks[t] for name, chunks in streams.items()})
    sessions.caches_match()
    encoder = model._duplex_batch
    assert encoder.stats()["batched_rows"] == 5 * (2 * CYCLE + 4) and encoder.stats()["single_rows"] == 0
    for batched, _ in sessions.live.values():
        assert isinstance(batched.cache, rows_mod.PagedStreamingCache) and batched.cache.length == 4 * N
    graph = encoder.graph  # 5 rows: the 8-row bucket, one graph for every past length
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_hits"], stats["warmup_misses"]) == (1, 2 * CYCLE + 3, 1)
    print(f"per-row parity: worst rel {sessions.worst:.2e}, bitwise {sessions.bitwise}")


def row_variant_ops(monkeypatch, model, *, gemm=True, conv=True, first=True):
    """Make ``model``'s GEMMs and convolutions give every row the same bits alone and in a batch
    (one call per position row, per batch row), then make some round as kernels do for a batch:
    ``fc2``'s GEMM over more than one chunk, the first convolution over more than one row and the
    second over a first chunk's shorter frames each add 1e-3 (a stand-in for the kernels cuBLAS and
    cuDNN pick by shape)."""
    real_linear = torch.nn.functional.linear
    fc2 = tuple(model.apm.layers[0].fc2.weight.shape)

    def linear(x, weight, bias=None):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.cat([real_linear(flat[i : i + 1], weight, bias) for i in range(flat.shape[0])])
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out + 1e-3 if gemm and tuple(weight.shape) == fc2 and flat.shape[0] > N else out

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    for index, module in enumerate((model.apm.conv1, model.apm.conv2)):
        forward = module.forward

        def shifted(x, forward=forward, index=index):
            out = torch.cat([forward(x[r : r + 1]) for r in range(x.shape[0])])
            batch = conv and index == 0 and x.shape[0] > 1
            short = first and index == 1 and x.shape[-1] == 2 * N + 2
            return out + 1e-3 if batch or short else out

        monkeypatch.setattr(module, "forward", shifted)
    return fc2


@pytest.mark.cpu
def test_the_row_probe_finds_the_ops_a_batch_rounds_differently(monkeypatch):
    model = tiny()
    buckets, frames, cpu = [1, 2, 4, 8], 2 * N + 4, torch.device("cpu")
    row_variant_ops(monkeypatch, model, gemm=False, conv=False, first=False)
    exact = rows_mod.probe_row_plan(model, buckets, N, frames, cpu)
    assert exact.gemms == frozenset() and exact.convs == frozenset()
    monkeypatch.undo()
    fc2 = row_variant_ops(monkeypatch, model)
    plan = rows_mod.probe_row_plan(model, buckets, N, frames, cpu)
    assert plan.gemms == {(fc2[1], fc2[0], False, rows) for rows in (2, 4, 8)}
    assert plan.convs == {2, 4, 8} and plan.first_chunks is False
    assert f"{fc2[1]}x{fc2[0]}" in plan.describe() and "first chunks encoded alone" in plan.describe()


@pytest.mark.cpu
def test_row_linear_runs_one_gemm_per_row_only_where_the_plan_says(monkeypatch):
    weight, bias, x = torch.randn(6, 5), torch.randn(6), torch.randn(4 * N, 5)
    plan = rows_mod.RowPlan(gemms=frozenset({(5, 6, True, 4)}))
    calls = []
    real_addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(a[1].shape) or real_addmm(*a, **k))
    out = rows_mod.RowLinear(plan, 4, N)(x, weight, bias)
    assert calls == [torch.Size([N, 5])] * 4
    want = torch.cat([torch.nn.functional.linear(x[r * N : (r + 1) * N], weight, bias) for r in range(4)])
    assert torch.equal(out, want)
    calls.clear()
    for linear, args in (
        (rows_mod.RowLinear(plan, 2, N), (x[: 2 * N], weight, bias)),  # another bucket
        (rows_mod.RowLinear(plan, 4, N), (x, weight, None)),
    ):  # no bias: another shape
        assert torch.equal(linear(*args), torch.nn.functional.linear(*args))
    assert calls == []


@pytest.mark.cpu
@pytest.mark.parametrize("probed", [True, False], ids=["probed-plan", "control-no-plan"])
def test_ops_a_batch_rounds_differently_never_reach_the_rows(cpu_backend, monkeypatch, probed):
    """With fc2's GEMM and the convolutions rounding batches differently (by 1e-3, far above
    ``GRAPH_REL_TOL``), batched steps still give every row its own eager encode (first chunks sent
    alone): the probe saw the ops and the rows run them row by row. The control, a plan that
    batches everything, shows the perturbation reaches the rows. (Bitwise equality is the CUDA
    test's: the CPU's masked SDPA over the gathered pages rounds differently from its unmasked
    call, cuDNN's does not.)"""
    model = batched_model(cpu_backend)
    sessions = Sessions(model)
    for m in (model, sessions.reference):  # both run the fused layers, the path the plan serves
        m.config.encoder_fused_layers = "audio"
        assert fused.configure_fused_layers(m)["audio"] == "on"
        row_variant_ops(monkeypatch, m)
    encoder = model._duplex_batch
    pool = encoder.pool(torch.device("cpu"))
    assert pool.row_plan is not None and pool.row_plan.first_chunks is False and 4 in pool.row_plan.convs
    tol = TOL
    if not probed:
        pool.row_plan = rows_mod.RowPlan()
        monkeypatch.setattr(sys.modules[__name__], "TOL", 1.0)  # the control measures, asserts below
    streams = {name: stream(4, seed) for seed, name in enumerate("abc")}
    for name in streams:
        sessions.join(name)
    for t in range(4):
        sessions.step({name: chunks[t] for name, chunks in streams.items()})
    if probed:
        assert sessions.worst <= tol
        assert encoder.stats()["single_rows"] == 3 and encoder.stats()["batched_rows"] == 9
    else:
        assert sessions.worst > 10 * tol
        assert encoder.stats()["single_rows"] == 0 and encoder.stats()["batched_rows"] == 12


@pytest.mark.cpu
def test_rows_never_see_each_other(cpu_backend):
    """Change one session's audio: every other session's outputs and cache keep every bit."""
    outs, caches = [], []
    for variant in range(2):
        model = batched_model(cpu_backend)
        sess = {name: DuplexSession() for name in "abc"}
        streams = {name: stream(CYCLE + 3, seed) for seed, name in enumerate("abc")}
        if variant:
            streams["b"] = stream(CYCLE + 3, seed=99)
        got = []
        with torch.inference_mode():
            for t in range(CYCLE + 3):
                calls = [lambda n=n, t=t, s=sess, m=model, c=streams: s[n].encode(m, c[n][t]) for n in "abc"]
                got.append(db.run_batched(model, calls))
        outs.append(got)
        caches.append({n: s.cache.pool.positions(s.cache) for n, s in sess.items()})
    for t in range(CYCLE + 3):
        assert torch.equal(outs[0][t][0], outs[1][t][0]) and torch.equal(outs[0][t][2], outs[1][t][2])
        assert not torch.equal(outs[0][t][1], outs[1][t][1])
    assert torch.equal(caches[0]["a"], caches[1]["a"]) and torch.equal(caches[0]["c"], caches[1]["c"])


@pytest.mark.cpu
def test_sessions_join_leave_and_reset_inside_batched_steps(cpu_backend):
    model = batched_model(cpu_backend)
    encoder = model._duplex_batch
    sessions = Sessions(model)
    streams = {name: stream(40, seed) for seed, name in enumerate("abcd")}
    started = {}
    plan = {0: ["a", "b"], 3: ["c"], 13: ["d"]}  # c's and d's first chunks land in batched steps
    for t in range(30):
        for name in plan.get(t, []):
            sessions.join(name)
            started[name] = t
        if t == 7:
            pool = next(iter(encoder._pools.values()))
            before = pool.free_pages
            held = len(sessions.live["b"][0].cache.pages)
            sessions.leave("b")  # a finished session's pages go back to the pool
            assert pool.free_pages == before + held
        sessions.step({name: streams[name][t - started[name]] for name in sessions.live})
    sessions.caches_match()
    lengths = {name: s.cache.length for name, (s, _) in sessions.live.items()}
    # a resets before its chunks 12 and 24 (30 chunks), c before its 12 and 24 (27), d before its 12 (17)
    assert lengths == {"a": 6 * N, "c": 3 * N, "d": 5 * N}
    assert encoder.stats()["single_rows"] == 0
    # every page is back once the sessions are gone
    for name in list(sessions.live):
        sessions.leave(name)
    pool = next(iter(encoder._pools.values()))
    assert pool.free_pages == pool.scratch_start


@pytest.mark.cpu
def test_chunks_the_batch_does_not_cover_are_encoded_alone(cpu_backend):
    """A chunk of another length and a session the eager path started go alone, in the same step."""
    model = batched_model(cpu_backend)
    sessions = Sessions(model)
    for name in "abc":
        sessions.join(name)
    regular = {name: stream(6, seed) for seed, name in enumerate("abc")}
    g = torch.Generator().manual_seed(7)
    odd = DuplexChunk(torch.randn(1, 80, 2 * (N + 2) + 4, generator=g), 2)  # 12 positions, not 10
    sessions.step({name: regular[name][0] for name in "abc"})
    sessions.step({"a": regular["a"][1], "b": odd, "c": regular["c"][1]})
    stats = model._duplex_batch.stats()
    assert stats["single_rows"] == 1 and stats["batched_rows"] == 5
    # b's cache left the pages for the per-session layout, and comes back to them on its next chunk
    assert isinstance(sessions.live["b"][0].cache, sa.StreamingAudioKVCache)
    sessions.step({name: regular[name][2] for name in "abc"})
    assert isinstance(sessions.live["b"][0].cache, rows_mod.PagedStreamingCache)
    sessions.caches_match()


@pytest.mark.cpu
def test_a_full_page_pool_sends_the_extra_sessions_alone(cpu_backend):
    model = batched_model(cpu_backend, sessions=2)
    sessions = Sessions(model)
    for name in "abc":
        sessions.join(name)
    streams = {name: stream(11, seed) for seed, name in enumerate("abc")}
    # two sessions' worth of pages: a full cache (8 pages of 16), or at a reset the cycle's last
    # cache (118 positions, 8 pages) and the new first chunk (1 page): 9 each
    per_session = max(math.ceil(POSITIONS / 16), math.ceil((POSITIONS - N) / 16) + math.ceil(N / 16))
    for t in range(11):  # from chunk 9 on (100 positions: 7 pages each) the three caches no longer fit
        sessions.step({name: streams[name][t] for name in "abc"})
    stats = model._duplex_batch.stats()
    assert stats["batched_rows"] + stats["single_rows"] == 33 and stats["single_rows"] == 2
    pool = next(iter(model._duplex_batch._pools.values()))
    assert rows_mod.PAGE_SIZE == 16 and pool.scratch_start == 2 * per_session == 18
    sessions.caches_match()


@pytest.mark.cpu
def test_each_requests_code_runs_in_order_under_the_callers_modes(cpu_backend):
    model = batched_model(cpu_backend)
    log = []
    chunks = {name: stream(2, seed) for seed, name in enumerate("xyz")}
    sess = {name: DuplexSession() for name in chunks}

    def request(name, t):
        log.append((name, "before", threading.current_thread() is threading.main_thread()))
        log.append((name, "modes", torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        out = sess[name].encode(model, chunks[name][t])
        log.append((name, "after"))
        return name, out.shape

    for mode, inference in ((torch.inference_mode, True), (torch.no_grad, False)):
        log.clear()
        with mode():
            index = 0 if inference else 1
            results = db.run_batched(model, [lambda n=n, i=index: request(n, i) for n in "xyz"])
        assert results == [(n, (N // POOL, 32)) for n in "xyz"]
        assert [e[0] for e in log if e[1] == "before"] == list("xyz")  # up to the encoder, in order
        assert [e[0] for e in log if e[1] == "after"] == list("xyz")  # then resumed in order
        assert log.index(("z", "before", False)) < log.index(("x", "after"))  # all parked before any resumed
        assert {e[2:] for e in log if e[1] == "modes"} == {(inference, False)}
    assert model._duplex_batch.stats()["batched_calls"] == 2


@pytest.mark.cpu
def test_an_encoder_error_reaches_every_parked_request(cpu_backend, monkeypatch):
    model = batched_model(cpu_backend)
    sess = {name: DuplexSession() for name in "ab"}
    chunks = {name: stream(2, seed) for seed, name in enumerate("ab")}
    marker = object()
    model.audio_past_key_values = marker
    monkeypatch.setattr(
        model._duplex_batch, "_encode_batch", lambda rows: (_ for _ in ()).throw(ValueError("boom"))
    )
    with torch.inference_mode(), pytest.raises(RuntimeError, match="step failed: ValueError: boom") as info:
        db.run_batched(model, [lambda n=n: sess[n].encode(model, chunks[n][0]) for n in "ab"])
    assert isinstance(info.value.__cause__, ValueError)
    assert model.audio_past_key_values is marker
    monkeypatch.undo()
    with torch.inference_mode():  # nothing is left parked: the next step runs
        outs = db.run_batched(model, [lambda n=n: sess[n].encode(model, chunks[n][0]) for n in "ab"])
    assert len(outs) == 2


@pytest.mark.cpu
def test_a_worker_that_cannot_start_leaves_no_call_parked(cpu_backend, monkeypatch):
    """When the second call's worker thread cannot start, the first call, parked at its chunk, is
    resumed with that error and ends: no thread of the step stays blocked for good."""
    model = batched_model(cpu_backend)
    sess = {name: DuplexSession() for name in "ab"}
    chunks = {name: stream(1, seed) for seed, name in enumerate("ab")}
    seen = []
    real_submit, submitted = db._POOL.submit, []

    def submit(task):
        if submitted:
            raise RuntimeError("can't start new thread")
        submitted.append(task)
        real_submit(task)

    def call(name):
        try:
            return sess[name].encode(model, chunks[name][0])
        except RuntimeError as exc:
            seen.append((name, str(exc)))
            raise

    monkeypatch.setattr(db._POOL, "submit", submit)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="can't start new thread"):
        db.run_batched(model, [lambda n=n: call(n) for n in "ab"])
    assert seen == [("a", "batched duplex audio step failed: RuntimeError: can't start new thread")]
    assert submitted[0].done
    monkeypatch.undo()
    with torch.inference_mode():  # the next step runs
        assert (
            len(db.run_batched(model, [lambda n=n: sess[n].encode(model, chunks[n][0]) for n in "ab"])) == 2
        )


@pytest.mark.cpu
def test_a_failed_step_is_no_signature_error_and_each_call_gets_its_own_cache_back(cpu_backend, monkeypatch):
    """vllm-omni's duplex stage retries a chunk call that raised TypeError, with other framing and on
    whatever cache the model's attribute holds: a batched step's failure reaches each parked call as
    a RuntimeError, with that session's own cache back in the attribute, even for a TypeError."""
    model = batched_model(cpu_backend)
    chunks = {name: stream(2, seed) for seed, name in enumerate("ab")}
    caches: dict[str, object] = {"a": None, "b": None}
    retried, restored = [], {}

    def stage_call(name, index):  # what the stage does around its chunk call
        model.audio_past_key_values = caches[name]
        chunk = chunks[name][index]
        try:
            out = model.get_audio_embedding_streaming(chunk.data, use_extra_context=True,
                                                      prefix_extra_frames=chunk.prefix_extra_frames,
                                                      suffix_extra_frames=chunk.suffix_extra_frames)  # fmt: skip
        except TypeError:
            retried.append(name)
            raise
        except RuntimeError:
            restored[name] = model.audio_past_key_values is caches[name]
            raise
        caches[name] = model.audio_past_key_values
        return out

    with torch.inference_mode():
        db.run_batched(model, [lambda n=n: stage_call(n, 0) for n in "ab"])
    assert caches["a"] is not None and caches["b"] is not None and caches["a"] is not caches["b"]
    monkeypatch.setattr(
        model._duplex_batch, "_encode_batch", lambda rows: (_ for _ in ()).throw(TypeError("bad arg"))
    )
    with torch.inference_mode(), pytest.raises(RuntimeError, match="step failed: TypeError: bad arg"):
        db.run_batched(model, [lambda n=n: stage_call(n, 1) for n in "ab"])
    assert retried == [] and restored == {"a": True, "b": True}


@pytest.mark.cpu
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "option-false"])
def test_the_exact_per_session_path_is_the_default(cpu_backend, log_records, explicit):
    """Without the option (and with it false) a duplex deployment of 8 sessions keeps the exact
    per-session path: no batch encoder, the start-up line says batching is off and names the
    option, and run_batched encodes each chunk on its own, bitwise equal to eager."""
    records = log_records(db.logger)
    if explicit:
        model = batched_model(cpu_backend, duplex_batch=False)
    else:
        model = tiny()
        assert not hasattr(model.config, "encoder_cuda_graph_duplex_batch")  # the default applies
        model._init_encoder_cuda_graphs(duplex_config(8))
        model._streaming_audio_encoder_graph.backend = cpu_backend()
    assert model._duplex_batch is None and model._streaming_audio_encoder_graph is not None
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 duplex audio batching")]
    assert line == (
        "MiniCPM-o 4.5 duplex audio batching: off (encoder_cuda_graph_duplex_batch=false, the default: "
        "each session's chunk on its own, bitwise equal to eager; true batches a step's chunks, for many "
        "concurrent sessions)"
    )
    reference = tiny()
    streams = {name: stream(CYCLE + 2, seed) for seed, name in enumerate("ab")}
    sess = {n: DuplexSession() for n in "ab"}
    ref = {n: DuplexSession() for n in "ab"}
    with torch.inference_mode():
        for t in range(CYCLE + 2):
            outs = db.run_batched(
                model, [lambda n=n, t=t: sess[n].encode(model, streams[n][t]) for n in "ab"]
            )
            for n, out in zip("ab", outs, strict=True):
                assert torch.equal(out, ref[n].encode(reference, streams[n][t]))  # bitwise


@pytest.mark.cpu
@pytest.mark.parametrize(
    "sessions, mode, state",
    [
        (1, "duplex", "off (duplex_max_sessions=1)"),
        (4, "turn", "off (not a duplex deployment)"),
        (
            4,
            "duplex",
            "on, a step's chunks in one call of up to 4 rows (buckets 1, 2, 4), K/V pages for 4 sessions",
        ),
    ],
)
def test_the_start_up_line_says_whether_steps_are_batched(sessions, mode, state, log_records):
    records = log_records(db.logger)
    config = duplex_config(sessions)
    object.__setattr__(config.model_config, "session_mode", mode)
    model = tiny()
    model.config.encoder_cuda_graph_duplex_batch = True
    model._init_encoder_cuda_graphs(config)
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 duplex audio batching")]
    assert line.startswith(f"MiniCPM-o 4.5 duplex audio batching: {state}")


# ---------------------------------------------------------------------------
# The attention choice (CPU: vLLM installs faked)
# ---------------------------------------------------------------------------


def fake_flash_attn(monkeypatch, *, imports=True, fa2_available=True, op_namespace="_mcg_absent_fa2"):
    """``vllm.vllm_flash_attn`` as an install may have it: missing, FA2 unavailable, or importing
    (an empty stand-in for its extension module) with or without its compiled op in ``torch.ops``."""
    if not imports:
        monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", None)  # import raises ImportError
        return
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.FA2_AVAILABLE = fa2_available
    interface.FA2_UNAVAILABLE_REASON = (
        None if fa2_available else "libcudart.so.12: cannot open shared object file"
    )
    package = types.ModuleType("vllm.vllm_flash_attn")
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", package)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", interface)
    monkeypatch.setattr(rows_mod, "FA2_VARLEN_OP", (op_namespace, "varlen_fwd"))


#: a torch.ops namespace with a registered varlen_fwd (the compiled op, as far as the choice can tell)
_REGISTERED = torch.library.Library("_mcg_registered_fa2", "DEF")
_REGISTERED.define("varlen_fwd(Tensor q) -> Tensor")


@pytest.mark.cpu
@pytest.mark.parametrize(
    "device, dtype, capability, install, want",
    [
        ("cpu", torch.bfloat16, None, {}, ("reference", "a cpu device (vLLM's FlashAttention runs on CUDA)")),
        (
            "cuda:0",
            torch.float32,
            (9, 0),
            {},
            ("reference", "Whisper in float32 (vLLM's FlashAttention takes"),
        ),
        (
            "cuda:0",
            torch.bfloat16,
            (7, 5),
            {},
            ("reference", "compute capability 7.5 (vLLM's FlashAttention 2"),
        ),
        (
            "cuda:0",
            torch.bfloat16,
            (9, 0),
            {"imports": False},
            ("reference", "vllm.vllm_flash_attn does not import"),
        ),
        (
            "cuda:0",
            torch.bfloat16,
            (9, 0),
            {"fa2_available": False},
            ("reference", "vLLM FlashAttention 2 unavailable (libcudart.so.12"),
        ),
        (  # the package imports (a stub of its extension module), its op does not exist
            "cuda:0",
            torch.bfloat16,
            (9, 0),
            {},
            (
                "reference",
                "vLLM FlashAttention ops not built (torch.ops._mcg_absent_fa2.varlen_fwd is not registered)",
            ),
        ),
        (
            "cuda:0",
            torch.float16,
            (8, 0),
            {"op_namespace": "_mcg_registered_fa2"},
            ("flash", "vLLM FlashAttention 2 ops registered, compute capability 8.0"),
        ),
    ],
    ids=["cpu", "float32", "sm75", "no-package", "fa2-unavailable", "ops-not-built", "usable"],
)
def test_flash_attention_only_where_its_compiled_op_is_registered(
    monkeypatch, device, dtype, capability, install, want
):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or capability)
    fake_flash_attn(monkeypatch, **install)
    name, reason = rows_mod.paged_attention_choice(torch.device(device), dtype)
    assert name == want[0] and reason.startswith(want[1]), (name, reason)
    assert name in rows_mod.ATTENTION
    assert asked == ([] if device == "cpu" or dtype == torch.float32 else [torch.device(device)])


@pytest.mark.cpu
def test_the_attention_choice_is_logged_once_per_device_and_kept_in_the_stats(
    cpu_backend, monkeypatch, log_records
):
    records = log_records(db.logger)
    model = batched_model(cpu_backend)
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 duplex audio batching")]
    assert line.endswith(
        "; on cpu: attention SDPA over the gathered pages (reference_paged_attention): "
        "a cpu device (vLLM's FlashAttention runs on CUDA)"
    )
    encoder = model._duplex_batch
    with torch.inference_mode():
        for chunk in stream(2, seed=1):
            db.run_batched(model, [lambda c=chunk: DuplexSession().encode(model, c)])
    assert encoder.stats()["attention"] == {"cpu": "reference"}
    assert (
        len([m for m in records.messages() if "duplex audio batching" in m]) == 1
    )  # cpu: in the start-up line
    # another device: one line of its own, the first time only
    seen = []
    choice = (
        "reference",
        "vLLM FlashAttention ops not built (torch.ops._vllm_fa2_C.varlen_fwd is not registered)",
    )
    monkeypatch.setattr(
        db, "paged_attention_choice", lambda device, dtype: seen.append((device, dtype)) or choice
    )
    cuda = torch.device("cuda", 0)
    assert encoder.attention(cuda) == "reference" and encoder.attention(cuda) == "reference"
    assert seen == [(cuda, torch.float32)]
    lines = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 duplex audio batching on cuda:0")]
    assert lines == [
        "MiniCPM-o 4.5 duplex audio batching on cuda:0: attention SDPA over the gathered pages "
        "(reference_paged_attention): vLLM FlashAttention ops not built "
        "(torch.ops._vllm_fa2_C.varlen_fwd is not registered)"
    ]
    assert encoder.stats()["attention"] == {"cpu": "reference", "cuda:0": "reference"}


# ---------------------------------------------------------------------------
# NaN never crosses rows (CPU)
# ---------------------------------------------------------------------------


def poison(pool, sessions):
    """NaN into every page no live session owns (free pages, scratch), the zero page apart."""
    owned = {
        p for batched, _ in sessions.live.values() if batched.cache is not None for p in batched.cache.pages
    }
    others = [p for p in range(pool.num_pages) if p not in owned and p != pool.zero_page]
    pool.kv[:, :, torch.tensor(others)] = float("nan")
    return len(others)


@pytest.mark.cpu
@pytest.mark.parametrize("count", [2, 4])
def test_a_full_deployment_whose_caches_reset_in_one_step_stays_batched(cpu_backend, count):
    """``duplex_max_sessions`` sessions that started together reset in the same step; each still
    holds its cycle's last cache while its reset chunk is encoded (the caller swaps the new one in
    after the call), so the pool has room for that cache and the new cycle's first chunk at once."""
    model = batched_model(cpu_backend, sessions=count)
    sessions = Sessions(model)
    names = "abcd"[:count]
    streams = {name: stream(CYCLE + 2, seed) for seed, name in enumerate(names)}
    for name in names:
        sessions.join(name)
    for t in range(CYCLE + 2):  # every session resets at its chunk 12
        sessions.step({name: chunks[t] for name, chunks in streams.items()})
    sessions.caches_match()
    stats = model._duplex_batch.stats()
    assert stats["single_rows"] == 0 and stats["batched_rows"] == count * (CYCLE + 2)


@pytest.mark.cpu
def test_a_nan_in_pages_a_row_does_not_own_never_reaches_it(cpu_backend):
    """Before every step, NaN fills the pages no live session owns: the free pages the sessions
    take next (a join, a reset, a cache growing into a new page) and the scratch pages the padding
    rows write and read. Every real row still matches its session's own eager encode (a NaN would
    fail the comparison): a taken page is zeroed first, a row's page table ends at the zero page,
    masked positions so hold zeros or the row's own K/V."""
    model = batched_model(cpu_backend)
    encoder = model._duplex_batch
    sessions = Sessions(model)
    streams = {name: stream(CYCLE + 4, seed) for seed, name in enumerate("abc")}
    started, plan = {}, {0: "ab", 2: "c"}  # 3 rows: bucket 4, one padding row
    for t in range(CYCLE + 2):  # a and b reset at their chunk 12
        for name in plan.get(t, ""):
            sessions.join(name)
            started[name] = t
        if encoder._pools:
            assert poison(next(iter(encoder._pools.values())), sessions) > 0
        out = sessions.step({name: streams[name][t - started[name]] for name in sessions.live})
        assert all(bool(torch.isfinite(o).all()) for o in out.values()), t
    sessions.caches_match()
    pool = next(iter(encoder._pools.values()))
    assert not pool.kv[:, :, pool.zero_page].any()  # nothing wrote the zero page
    assert encoder.stats()["single_rows"] == 0 and encoder.graph.get_cumulative_stats()["graph_hits"] > 0


@pytest.mark.cpu
def test_no_row_attends_to_nothing_not_even_on_the_graph_managers_zero_inputs(monkeypatch):
    """vLLM's graph manager runs the forward on all-zero inputs before a capture: every row then
    has 0 valid positions, an all-masked softmax that some kernels turn into NaN. The forward gives
    every row at least one position."""
    model = tiny()
    model.config.encoder_cuda_graph_duplex_batch = True
    model._init_encoder_cuda_graphs(duplex_config(4))
    encoder = model._duplex_batch
    pool = encoder.pool(torch.device("cpu"))
    seen = []
    reference = rows_mod.ATTENTION["reference"]

    def watched(query, keys, values, table, used):
        seen.append(int(used.min()))
        return reference(query, keys, values, table, used)

    monkeypatch.setitem(rows_mod.ATTENTION, "reference", watched)
    mel, meta, _ = encoder.inputs([], torch.device("cpu"), 4)
    with torch.inference_mode():
        out = rows_mod.encode_rows(model, torch.zeros_like(mel), torch.zeros_like(meta), pool, N, "reference")
    assert seen == [1] * len(model.apm.layers) and bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(pool.kv).all()) and not pool.kv[:, :, : pool.scratch_start].any()


@pytest.mark.cpu
def test_paged_caches_round_trip_and_return_their_pages(cpu_backend):
    model = batched_model(cpu_backend)
    session = DuplexSession()
    with torch.inference_mode():
        for chunk in stream(5, seed=3):
            db.run_batched(model, [lambda c=chunk: session.encode(model, c)])
        paged = session.cache
        pool = paged.pool
        free = pool.free_pages
        blocks = paged.to_blocks()  # the per-session layout; pages back
        assert pool.free_pages == free + math.ceil(5 * N / rows_mod.PAGE_SIZE) and paged.pages == []
        again = rows_mod.PagedStreamingCache.from_blocks(pool, blocks)
        assert torch.equal(pool.positions(again), torch.cat(blocks.blocks, dim=4)[:, :, 0])
        del again
        gc.collect()
    assert pool.free_pages == free + math.ceil(5 * N / rows_mod.PAGE_SIZE)


# ---------------------------------------------------------------------------
# The stage model's hooks (CPU)
# ---------------------------------------------------------------------------


class Stage:
    """A stand-in for the stage model: preprocess swaps the session's cache in, as the duplex stage
    does, and encodes its chunk through the thinker."""

    model_stage = "llm"

    def __init__(self, thinker):
        self.thinker = thinker
        self.caches = {}

    def preprocess(self, *, input_ids, input_embeds=None, **infos):
        session = infos["duplex"]["session_id"]
        previous, self.thinker.audio_past_key_values = (
            self.thinker.audio_past_key_values,
            self.caches.get(session),
        )
        try:
            ((embeds,),) = self.thinker.get_audio_embedding_streaming(
                infos["chunk"].data,
                use_extra_context=True,
                prefix_extra_frames=infos["chunk"].prefix_extra_frames,
                suffix_extra_frames=2,
            )
            self.caches[session] = self.thinker.audio_past_key_values
        finally:
            self.thinker.audio_past_key_values = previous
        return input_ids + 1, embeds, {"duplex": {"session": session}}


def appends(chunks):
    return [
        {
            "duplex": {"data_plane": True, "session_id": n},
            "duplex_prompt_len": 40,
            "duplex_token_offset": 20,
            "chunk": c,
        }
        for n, c in chunks.items()
    ]


@pytest.mark.cpu
def test_can_batch_append_takes_duplex_appends_only(cpu_backend):
    stage = Stage(batched_model(cpu_backend))
    (info,) = appends({"a": stream(1, 0)[0]})
    assert db.can_batch_append(stage, info)
    assert not db.can_batch_append(stage, {**info, "duplex_token_offset": 40})  # a decode step of the request
    assert not db.can_batch_append(stage, {**info, "duplex": {"data_plane": False}})
    assert not db.can_batch_append(stage, {})
    assert not db.can_batch_append(SimpleNamespace(model_stage="tts", thinker=None), info)
    stage.thinker._duplex_batch = None
    assert not db.can_batch_append(stage, info)


@pytest.mark.cpu
def test_preprocess_append_batch_returns_what_each_preprocess_returns(cpu_backend):
    stage, alone = Stage(batched_model(cpu_backend)), Stage(tiny())
    for t in range(3):
        chunks = {n: stream(3, seed)[t] for seed, n in enumerate("abc")}
        ids = [torch.full((4,), i) for i in range(3)]
        with torch.inference_mode():
            got = db.preprocess_append_batch(stage, ids, [None] * 3, appends(chunks))
            want = [
                alone.preprocess(input_ids=i, **info) for i, info in zip(ids, appends(chunks), strict=True)
            ]
        for (g_ids, g_embeds, g_update), (w_ids, w_embeds, w_update) in zip(got, want, strict=True):
            assert torch.equal(g_ids, w_ids) and g_update == w_update
            assert rel_diff(w_embeds, g_embeds) <= TOL
    assert stage.thinker._duplex_batch.stats()["batched_rows"] == 9


@pytest.mark.cpu
def test_startup_capture_captures_every_batch_bucket(cpu_backend):
    model = batched_model(cpu_backend, sessions=8)
    report = startup.capture_at_startup(model, duplex_config(8))
    assert report.graphs["duplex audio batch"] == 4  # buckets 1, 2, 4, 8
    pool = next(iter(model._duplex_batch._pools.values()))
    assert report.arena_bytes >= pool.nbytes and pool.free_pages == pool.scratch_start  # padding rows only
    sessions = Sessions(model)
    names = list("abcdefgh")
    for name in names:
        sessions.join(name)
    streams = {n: stream(6, seed) for seed, n in enumerate(names)}
    sent = dict.fromkeys(names, 0)
    for width in (1, 2, 3, 5, 8, 8):  # steps of 1 to 8 sessions: buckets 1, 2, 4, 8, 8, 8
        sessions.step({n: streams[n][sent[n]] for n in names[:width]})
        for n in names[:width]:
            sent[n] += 1
    stats = model._duplex_batch.graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_misses"], stats["graph_hits"]) == (
        4,
        0,
        6,
    )  # every step a replay


# ---------------------------------------------------------------------------
# CUDA: Whisper-medium's widths, bf16, real speech, the attention the device offers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def medium():
    if not torch.cuda.is_available():
        pytest.skip("encoder CUDA graphs need a CUDA device")
    from minicpmo_cg import standalone

    config = duplex_config(8)
    model = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    standalone.wire_encoder_graphs(model, config, enabled=True, duplex_batch=True)
    reference = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    reference.load_state_dict(model.state_dict())
    standalone.wire_encoder_graphs(reference, duplex_config(1), enabled=False)
    return model, reference


def fa2_op_registered() -> bool:
    """Whether vLLM's compiled FA2 varlen op exists in this process (imports the package first)."""
    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        return False
    namespace, op = rows_mod.FA2_VARLEN_OP
    return hasattr(getattr(torch.ops, namespace), op)


@pytest.mark.cuda
def test_batched_steps_with_joins_leaves_and_resets_match_each_session_on_cuda(medium):
    """Eight sessions over 36 steps: joins mid-stream (first chunks inside batched steps), a leave,
    a's cache reset at its chunk 29. The attention is whichever the device offers: vLLM's
    FlashAttention over the pages only where its compiled op is registered (else the run would
    raise), else the SDPA reference over the gathered pages. With the SDPA reference and the fused
    layers every row must equal its session's own eager encode bitwise: the rows run those layers,
    cuDNN attention over the gathered pages gives a row its unmasked call's bits, and the GEMMs and
    convolutions the device's probe found row-variant run row by row (``duplex_rows.RowPlan``, the
    plan printed). With vLLM's FlashAttention or the unfused layers the bound is four bf16 steps
    (2**-6): another attention kernel, or another rounding, than the session's own. The worst difference and the attention are printed."""
    from minicpmo_cg import duplex

    model, reference = medium
    encoder = model._duplex_batch
    cuda = torch.device("cuda", torch.accelerator.current_device_index())
    assert encoder is not None
    attention, reason = encoder.attention_choice(cuda)
    assert attention == ("flash" if fa2_op_registered() else "reference"), reason
    mel = duplex.speech_mel(8 * 40)
    streams = {
        n: duplex.frame_chunks(mel[:, k * 4000 : k * 4000 + 40 * 100 + 2], 40, device="cuda")
        for k, n in enumerate("abcdefgh")
    }
    live, started, worst, bitwise = {}, {}, 0.0, True
    plan = {0: "abcde", 4: "f", 11: "gh"}
    # the exact rows are the fused layers' path (duplex_rows.RowPlan); the unfused layers run the
    # rows module by module, another rounding than the session's own
    exact = attention == "reference" and bool(getattr(model.apm, "_fused_layers", False))
    tol = 0.0 if exact else 4 * graph_rel_tol(torch.bfloat16)
    for t in range(36):  # a's cache resets at its chunk 29; f, g and h join mid-stream
        for name in plan.get(t, ""):
            live[name], started[name] = (DuplexSession(), DuplexSession()), t
        if t == 20:
            del live["b"]
        names = list(live)
        chunks = {n: streams[n][t - started[n]] for n in names}
        with torch.inference_mode():
            got = db.run_batched(model, [lambda n=n, c=chunks: live[n][0].encode(model, c[n]) for n in names])
            for n, out in zip(names, got, strict=True):
                want = live[n][1].encode(reference, chunks[n])
                diff = rel_diff(want, out)
                assert diff <= tol and (torch.equal(want, out) or not exact), (t, n, diff)
                worst, bitwise = max(worst, diff), bitwise and torch.equal(want, out)
    stats = encoder.graph.get_cumulative_stats()
    assert stats["capture_failures"] == 0 and stats["num_graphs"] <= 4 and stats["graph_hits"] >= 30
    pool = next(iter(encoder._pools.values()))
    # the eight sessions' first chunks go alone where the probe found their zero-padded rows convolve
    # differently from their own shorter calls
    first_alone = 0 if pool.row_plan is None or pool.row_plan.first_chunks else len(started)
    assert encoder.stats()["single_rows"] == first_alone
    assert encoder.stats()["attention"] == {str(cuda): attention}
    assert not pool.kv[:, :, pool.zero_page].any()  # the zero page a row's table ends at stayed zeros
    assert (pool.row_plan is not None) == exact
    print(
        f"row plan: {pool.row_plan.describe() if pool.row_plan else None}; "
        f"per-row parity on CUDA (bf16), attention {attention} ({reason}): worst rel {worst:.3e} "
        f"(bound {tol:.3e}, GRAPH_REL_TOL {graph_rel_tol(torch.bfloat16):.3e}), bitwise {bitwise}"
    )


@pytest.mark.cuda
def test_startup_capture_of_every_bucket_on_cuda_leaves_the_steps_nothing_to_capture():
    """Start-up capture on CUDA runs the batched forward on padding rows (and vLLM's manager its
    all-zero warm-up inputs) for buckets 1, 2, 4, 8 with the device's attention; then steps of 1 to
    8 sessions only replay, scratch holds no NaN and the zero page stays zeros."""
    if not torch.cuda.is_available():
        pytest.skip("encoder CUDA graphs need a CUDA device")
    from minicpmo_cg import duplex, standalone

    config = duplex_config(8)
    model = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    standalone.wire_encoder_graphs(model, config, enabled=True, duplex_batch=True)
    report = startup.capture_at_startup(model, config)
    assert report.graphs.get("duplex audio batch") == 4 and report.stopped is None, report
    encoder = model._duplex_batch
    pool = next(iter(encoder._pools.values()))
    assert bool(torch.isfinite(pool.kv).all()) and pool.free_pages == pool.scratch_start
    mel = duplex.speech_mel(8 * 3)
    streams = [duplex.frame_chunks(mel[:, k * 300 : k * 300 + 302], 3, device="cuda") for k in range(8)]
    sessions = [DuplexSession() for _ in range(8)]
    joined = [0, 1, 1, 2, 2, 2, 2, 2]  # the step each session sends its first chunk in
    with torch.inference_mode():
        for t, width in enumerate((1, 3, 8)):  # buckets 1, 4, 8
            chunks = [streams[k][t - joined[k]] for k in range(width)]
            calls = [lambda s=s, c=c: s.encode(model, c) for s, c in zip(sessions, chunks)]
            outs = db.run_batched(model, calls)
            assert len(outs) == width and all(bool(torch.isfinite(o).all()) for o in outs), t
    stats = encoder.graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["graph_misses"], stats["graph_hits"]) == (4, 0, 3)
    assert not pool.kv[:, :, pool.zero_page].any() and bool(torch.isfinite(pool.kv).all())
    print(
        f"start-up capture with batched steps, attention {encoder.attention(torch.device('cuda'))}: {report}"
    )


@pytest.mark.cuda
def test_a_replaying_batched_step_makes_the_host_wait_for_nothing(medium):
    """Four sessions' steps; the tenth (a replay) runs with synchronising CUDA calls as errors, with
    whichever attention the device offers (printed). The chunks' data are built first (their
    lengths' copy to the device is the caller's). In that step the sessions' caches grow into new
    pages (450 -> 500 positions), so the zeroing of taken pages runs in it too."""
    from minicpmo_cg import duplex

    model, _ = medium
    chunks = duplex.frame_chunks(duplex.speech_mel(12), 12, device="cuda")
    data = [(c.data, c.prefix_extra_frames) for c in chunks]
    sessions = [DuplexSession() for _ in range(4)]

    def encode(session, item):
        previous, model.audio_past_key_values = model.audio_past_key_values, session.cache
        try:
            model.get_audio_embedding_streaming(
                item[0], use_extra_context=True, prefix_extra_frames=item[1], suffix_extra_frames=2
            )
            session.cache = model.audio_past_key_values
        finally:
            model.audio_past_key_values = previous

    with torch.inference_mode():
        for t in range(10):
            calls = [lambda s=s, d=data[t]: encode(s, d) for s in sessions]
            if t < 9:
                db.run_batched(model, calls)
                continue
            torch.accelerator.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                db.run_batched(model, calls)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    assert model._duplex_batch.graph.get_cumulative_stats()["graph_hits"] >= 8
    print(f"batched step without host syncs, attention {model._duplex_batch.attention(torch.device('cuda'))}")


# ---------------------------------------------------------------------------
# The model runner's hook: appends collected and preprocessed in one call (CPU)
# ---------------------------------------------------------------------------


class RunnerModel:
    """A model with per-request preprocess and, optionally, the append batch hooks."""

    has_preprocess = True

    def __init__(self, batch: bool, *, can_batch: bool = True):
        self.calls = []
        if batch:
            self.preprocess_append_batch = self._batch
            if can_batch:
                self.can_batch_append = lambda infos: infos.get("append", False)

    def _result(self, input_ids, infos):
        index = int(infos["request_id"][1:])
        embeds = torch.full((input_ids.shape[0], 4), float(index + 1))
        return input_ids * 0 + 100 + index, embeds, {"seen": infos["request_id"]}

    def preprocess(self, *, input_ids, input_embeds=None, **infos):
        self.calls.append(("one", infos["request_id"]))
        return self._result(input_ids, infos)

    def _batch(self, *, input_ids, input_embeds, req_infos):
        self.calls.append(("batch", [infos["request_id"] for infos in req_infos]))
        assert all(
            e is None or e.shape[0] == i.shape[0] for i, e in zip(input_ids, input_embeds, strict=True)
        )
        return [self._result(i, infos) for i, infos in zip(input_ids, req_infos, strict=True)]


def run_runner_preprocess(model, monkeypatch):
    import numpy as np

    from vllm_omni.worker import gpu_model_runner as gmr

    monkeypatch.setattr(gmr, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True))
    spans = [3, 2, 4, 1]  # tokens per request; r0 and r2 are appends the model batches
    req_ids = [f"r{i}" for i in range(len(spans))]
    total = sum(spans)
    runner = object.__new__(gmr.OmniGPUModelRunner)
    updates = []
    runner.__dict__.update(
        model=model,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(async_chunk=True)),
        supports_mm_inputs=False,
        enable_prompt_embeds=False,
        uses_mrope=False,
        uses_xdrope_dim=0,  # vllm-omni 0.28.0 reads it too
        has_talker_mtp=False,
        input_ids=SimpleNamespace(gpu=torch.arange(total)),
        inputs_embeds=SimpleNamespace(gpu=torch.zeros(total, 4)),
        positions=torch.arange(total),
        input_batch=SimpleNamespace(
            req_ids=req_ids, num_computed_tokens_cpu=np.zeros(len(spans), dtype=np.int64)
        ),
        query_start_loc=SimpleNamespace(cpu=torch.tensor(np.cumsum([0, *spans])[:-1])),
        requests={r: SimpleNamespace(prompt_token_ids=[0] * 10, sampling_params=None) for r in req_ids},
        model_intermediate_buffer={r: {"append": r in ("r0", "r2")} for r in req_ids},
    )
    runner._init_model_kwargs = dict
    runner._collect_additional_information_for_prefill = lambda *a: None
    runner._update_additional_information = lambda *a: None
    runner._maybe_run_batch_preprocess = lambda *a: None
    runner._maybe_attach_mimo_audio_req_infos = lambda state, infos, req_id: infos
    runner._update_intermediate_buffer = lambda req_id, update: updates.append((req_id, update))
    scheduler_output = SimpleNamespace(
        total_num_scheduled_tokens=total, num_scheduled_tokens=dict(zip(req_ids, spans))
    )
    input_ids, embeds, *_ = runner._preprocess(scheduler_output, total)
    return input_ids.clone(), embeds.clone(), sorted(updates)


@pytest.mark.cpu
def test_the_runner_preprocesses_the_appends_a_model_batches_in_one_call(monkeypatch):
    batched, alone = RunnerModel(batch=True), RunnerModel(batch=False)
    got = run_runner_preprocess(batched, monkeypatch)
    want = run_runner_preprocess(alone, monkeypatch)
    assert batched.calls == [("one", "r1"), ("one", "r3"), ("batch", ["r0", "r2"])]
    assert alone.calls == [("one", f"r{i}") for i in range(4)]
    for g, w in zip(got, want, strict=True):  # ids, embeddings and buffer updates as one by one
        assert torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w
    assert got[0].tolist() == [100] * 3 + [101] * 2 + [102] * 4 + [103]
    # a model with preprocess_append_batch but no can_batch_append is preprocessed request by request
    half = RunnerModel(batch=True, can_batch=False)
    for g, w in zip(run_runner_preprocess(half, monkeypatch), want, strict=True):
        assert torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w
    assert half.calls == alone.calls


@pytest.mark.cpu
def test_the_stage_model_answers_the_runner_with_the_batch_module(cpu_backend, monkeypatch):
    from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni as omni

    stage = object.__new__(omni.MiniCPMO45OmniForConditionalGeneration)
    torch.nn.Module.__init__(stage)
    stage.model_stage, stage.thinker = "llm", batched_model(cpu_backend)
    (info,) = appends({"a": stream(1, 0)[0]})
    assert stage.can_batch_append(info) and not stage.can_batch_append({})
    seen = []
    monkeypatch.setattr(db, "preprocess_append_batch", lambda *args: seen.append(args) or ["r"])
    assert stage.preprocess_append_batch(input_ids=[1], input_embeds=[None], req_infos=[info]) == ["r"]
    assert seen == [(stage, [1], [None], [info])]


@pytest.mark.cpu
def test_a_batched_step_reads_nothing_on_the_host_in_the_runners_thread(cpu_backend):
    """The step's encoder call and its row bookkeeping (the runner's thread; each request's own code
    runs in its worker thread, whose reads the audio call path tests cover)."""
    from helpers.host_reads import HostReads

    model = batched_model(cpu_backend)
    sess = {n: DuplexSession() for n in "abc"}
    streams = {n: stream(CYCLE + 2, seed) for seed, n in enumerate("abc")}
    with torch.inference_mode():
        for t in range(CYCLE + 2):  # warmup, capture, replays; a reset inside
            with HostReads() as watch:
                db.run_batched(model, [lambda n=n, t=t: sess[n].encode(model, streams[n][t]) for n in "abc"])
            assert watch.reads == [], (t, watch.reads[:3])
    assert model._duplex_batch.graph.get_cumulative_stats()["graph_hits"] == CYCLE + 1
