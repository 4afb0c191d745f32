# SPDX-License-Identifier: Apache-2.0
"""The streaming (duplex) audio encoder through CUDA graphs.

A tiny Whisper (2 layers, d_model 64, 128 positions) runs duplex-style sessions: chunks of ``N`` =
10 positions with the duplex stage's context frames (prefix 0 on a session's first chunk, else 2;
suffix 2), so a session's cache resets every 12 chunks. CPU tests cover the option, the wiring,
the unchanged eager path, the key and cache bookkeeping (through the adapter's CPU backend), the
arena, and the bypasses. CUDA tests (marked ``cuda``) replay real graphs and require every session
to equal its own eager run bitwise, chunk by chunk, for the tiny model and for Whisper-medium's
widths and 1500 positions with real speech.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny_encoders import tiny_audio_model

from minicpmo_cg.duplex import DuplexChunk, DuplexSession, past_lengths
from vllm_omni.model_executor.models.minicpmo_4_5 import encoder_cuda_graph as ecg
from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm

pytestmark = [pytest.mark.core_model]

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="encoder CUDA graphs need a CUDA device"
)


if getattr(llm, "streaming_audio", None) is None:
    pytest.fail(f"{llm.__file__} lacks the streaming audio CUDA graphs (streaming_audio)", pytrace=False)
sa = llm.streaming_audio

Model = llm.MiniCPMO45OmniLLMForConditionalGeneration

N = 10  # positions per chunk once the context frames are cut: 5 embeddings with pooling 2
POSITIONS = 128  # max_source_positions: past lengths 0, 10, ..., 110, then the cache resets
LAYERS, D_MODEL, HEADS, EMBED, POOL = 2, 64, 4, 32, 2
CYCLE = math.ceil((POSITIONS - N) / N)  # chunks per cache cycle: 12
KEYS = 1 + CYCLE  # graph keys of a session: the first chunk's form + the later form at each past length
AUDIO_MODULES = ("apm", "audio_projection_layer", "audio_avg_pooler")


# ---------------------------------------------------------------------------
# Tiny model and duplex sessions
# ---------------------------------------------------------------------------


def tiny_model(device="cpu", dtype=torch.float32, attn="sdpa", **config) -> Model:
    """A model object with what the audio paths read; Whisper attention as the checkpoint runs it (sdpa)
    unless ``attn`` names another implementation."""
    model = tiny_audio_model(
        positions=POSITIONS,
        chunk_seconds=N / 50,
        attn=attn,
        layers=LAYERS,
        d_model=D_MODEL,
        heads=HEADS,
        embed=EMBED,
        pool=POOL,
        **config,
    )
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def vllm_config(enforce_eager=False):
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return standalone_vllm_config(enforce_eager=enforce_eager)


def wired(model, backend=None, **options):
    """Run the model's _init_encoder_cuda_graphs with ``encoder_cuda_graph_<key>`` options."""
    for key, value in options.items():
        setattr(model.config, f"encoder_cuda_graph_{key}", value)
    model._init_encoder_cuda_graphs(vllm_config())
    if backend is not None:
        model._streaming_audio_encoder_graph.backend = backend
    return model


def duplex_chunks(count, seed, device="cpu", positions=N):
    """Random mel chunks framed as the duplex stage frames them.

    The first chunk has no left context (2 positions + 2 mel frames, prefix 0), later ones 2 frames
    on each side (2 positions + 4, prefix 2); suffix 2 always. Each yields ``positions`` positions.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        DuplexChunk(
            torch.randn(1, 80, 2 * positions + (2 if i == 0 else 4), generator=g).to(device),
            0 if i == 0 else 2,
        )
        for i in range(count)
    ]


def encode(model, chunk):
    """One chunk with whatever cache the model holds (``audio_past_key_values`` updated in place)."""
    out = model.get_audio_embedding_streaming(
        chunk.data,
        use_extra_context=True,
        prefix_extra_frames=chunk.prefix_extra_frames,
        suffix_extra_frames=2,
    )
    ((embeds,),) = out
    return embeds


def eager_run(model, chunks, mode=torch.inference_mode):
    """One session on the eager path (the streaming adapter detached): its outputs and final cache."""
    saved = model._streaming_audio_encoder_graph
    model._streaming_audio_encoder_graph = None
    session, outs = DuplexSession(), []
    try:
        for chunk in chunks:
            with mode():
                outs.append(session.encode(model, chunk))
    finally:
        model._streaming_audio_encoder_graph = saved
    return outs, session.cache


def interleaved(model, runs, mode=torch.inference_mode):
    """Encode the sessions ``runs = {name: chunks}`` alternately, chunk by chunk."""
    sessions = {name: DuplexSession() for name in runs}
    outs = {name: [] for name in runs}
    for i in range(max(len(c) for c in runs.values())):
        for name, chunks in runs.items():
            if i < len(chunks):
                with mode():
                    outs[name].append(sessions[name].encode(model, chunks[i]))
    return outs, {name: s.cache for name, s in sessions.items()}


def assert_bitwise(got, want, what, per_chunk=N // POOL, embed=EMBED):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == (per_chunk, embed), (what, i, g.shape)
        assert torch.equal(g, w), (
            f"{what}: chunk {i} differs, max |diff| {(g.float() - w.float()).abs().max()}"
        )


# ---------------------------------------------------------------------------
# Option and wiring (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_option_is_one_registry_entry_default_on():
    spec = ecg.HF_OVERRIDE_KEYS["encoder_cuda_graph_streaming_audio"]
    assert (spec.kind, spec.default) == ("bool", True)
    assert ecg.EncoderCudaGraphOptions().streaming_audio is True
    off = ecg.EncoderCudaGraphOptions.from_hf_config(
        SimpleNamespace(encoder_cuda_graph_streaming_audio=False)
    )
    assert off.streaming_audio is False and off.enabled is True
    assert "encoder_cuda_graph_streaming_audio=false" in off.describe()
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(
            SimpleNamespace(encoder_cuda_graph_streaming_audio="false")
        )
    assert info.value.problems == [
        'encoder_cuda_graph_streaming_audio="false": got a string, expected a JSON boolean (true or false)'
    ]


@pytest.mark.cpu
def test_bad_streaming_option_fails_model_construction():
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(encoder_cuda_graph_streaming_audio=1))
    )
    with pytest.raises(ValueError, match="encoder_cuda_graph_streaming_audio=1"):
        Model(vllm_config=config)


@pytest.mark.cpu
def test_init_builds_a_third_adapter_with_a_cap_per_past_length(log_records):
    records = log_records(sa.logger)
    model = wired(tiny_model(), max_graphs=3, min_capture_calls=3)
    graph = model._streaming_audio_encoder_graph
    assert isinstance(graph, ecg.EncoderCudaGraph)
    assert graph is not model._audio_encoder_graph and graph.name == "streaming audio"
    assert graph.forward == model._encode_audio_streaming_graphed
    assert graph.captured_modules == AUDIO_MODULES  # looked for hooks, like the stateless audio region
    # 3 chunk forms x ceil(128 positions / 10 per chunk) past lengths
    assert graph.options.max_graphs == 3 * math.ceil(POSITIONS / N) == 39
    assert graph.options.min_capture_calls == 3 and graph.options.share_pools is True
    assert model._streaming_audio_arenas == {}
    assert Model._streaming_audio_encoder_graph is None  # bare or unwired models stay eager
    line = "MiniCPM-o 4.5 streaming audio encoder CUDA graphs: on, up to 39 graphs"
    admission = 'admission "count" (each past length recurs once per cache cycle)'
    assert f"{line} (3 chunk forms x 13 past lengths), {admission}" in records.messages()


def _set_option(model, key, value):
    setattr(model.config, "encoder_cuda_graph" if key == "enabled" else f"encoder_cuda_graph_{key}", value)


@pytest.mark.cpu
@pytest.mark.parametrize(
    "options, enforce_eager, state",
    [
        ({"streaming_audio": False}, False, "off (encoder_cuda_graph_streaming_audio=false)"),
        ({"enabled": False}, False, "off (encoder_cuda_graph=false)"),
        ({}, True, "off (--enforce-eager)"),
        ({"max_graphs": 0}, False, "off (encoder_cuda_graph_max_graphs=0)"),
    ],
    ids=["streaming_audio_false", "encoder_cuda_graph_false", "enforce_eager", "max_graphs_0"],
)
def test_streaming_adapter_off_states(options, enforce_eager, state, log_records):
    records = log_records(sa.logger)
    model = tiny_model()
    model._streaming_audio_encoder_graph = "stale"
    for key, value in options.items():
        _set_option(model, key, value)
    model._init_encoder_cuda_graphs(vllm_config(enforce_eager=enforce_eager))
    assert f"MiniCPM-o 4.5 streaming audio encoder CUDA graphs: {state}" in records.messages()
    if "max_graphs" in options:  # built, counting capacity misses, like the other adapters
        assert model._streaming_audio_encoder_graph.options.max_graphs == 0
    else:
        assert model._streaming_audio_encoder_graph is None
    # the stateless audio adapter does not depend on the streaming option
    assert (model._audio_encoder_graph is not None) == (not enforce_eager and "enabled" not in options)


@pytest.mark.cpu
def test_no_audio_encoder_no_streaming_adapter(log_records):
    records = log_records(sa.logger)
    model = tiny_model()
    model.apm = None
    model._init_encoder_cuda_graphs(vllm_config())
    assert model._streaming_audio_encoder_graph is None
    assert "MiniCPM-o 4.5 streaming audio encoder CUDA graphs: off (no encoder)" in records.messages()


@pytest.mark.cpu
def test_lora_keeps_the_streaming_path_eager_with_the_reason(log_records):
    from vllm.config import LoRAConfig

    config = copy.copy(vllm_config())
    object.__setattr__(config, "lora_config", LoRAConfig())
    records = log_records(sa.logger)
    model = tiny_model()
    model._init_encoder_cuda_graphs(config)
    assert model._streaming_audio_encoder_graph is None
    (line,) = [m for m in records.messages() if m.startswith("MiniCPM-o 4.5 streaming audio")]
    assert "off (LoRA is enabled and the model has no get_mm_mapping()" in line


# ---------------------------------------------------------------------------
# The eager path is vllm-omni 0.30.0's code (CPU)
# ---------------------------------------------------------------------------


def released_streaming(model, chunk):
    """vllm-omni's get_audio_embedding_streaming encoder call as shipped (before its CUDA graphs)."""
    wavforms, prefix = chunk.features, chunk.prefix_extra_frames
    current = (wavforms.shape[-1] - 1) // 2 + 1 - (prefix + 1) // 2 * (prefix > 0) - 1
    past = model.audio_past_key_values
    if past is not None and llm._get_audio_cache_length(past) + current >= POSITIONS:
        past = None
    past_len = 0 if past is None else llm._get_audio_cache_length(past)
    mask = torch.zeros((1, 1, current, past_len + current), dtype=model.apm.conv1.weight.dtype)
    outputs = model.apm(
        wavforms,
        past_key_values=past,
        use_cache=True,
        output_hidden_states=True,
        attention_mask=mask,
        use_extra_context=True,
        prefix_extra_frames=prefix,
        suffix_extra_frames=2,
        cnn_min_length=None,
    )
    model.audio_past_key_values = outputs.past_key_values
    embeds = model.audio_projection_layer(outputs.hidden_states[model.audio_encoder_layer])
    return model.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2)[0]


@pytest.mark.cpu
def test_eager_path_unchanged_with_the_option_off():
    model = wired(tiny_model(), streaming_audio=False)
    chunks = duplex_chunks(2 * CYCLE + 3, seed=1)
    reference = tiny_model()
    with torch.inference_mode():
        want = [released_streaming(reference, c) for c in chunks]
        got = [encode(model, c) for c in chunks]
    assert_bitwise(got, want, "option off vs the release")
    assert isinstance(model.audio_past_key_values, llm.EncoderDecoderCache)
    assert llm._get_audio_cache_length(model.audio_past_key_values) == 3 * N  # reset twice, 3 chunks since


# ---------------------------------------------------------------------------
# Graphed path on CPU: the real adapter runs the captured region eagerly (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_graphed_path_equals_eager_for_interleaved_sessions_on_cpu():
    model = wired(tiny_model())
    runs = {"a": duplex_chunks(40, seed=1), "b": duplex_chunks(40, seed=2)}
    want = {name: eager_run(model, chunks)[0] for name, chunks in runs.items()}
    got, caches = interleaved(model, runs)
    for name in runs:
        assert_bitwise(got[name], want[name], f"session {name}")
        cache = caches[name]
        assert isinstance(cache, sa.StreamingAudioKVCache)
        # 40 chunks: resets before chunks 12, 24, 36, so 4 chunks since the last one
        assert cache.length == 4 * N and [b.shape[4] for b in cache.blocks] == [N] * 4
        assert all(
            b.is_contiguous() and b.shape == (LAYERS, 2, 1, HEADS, N, D_MODEL // HEADS) for b in cache.blocks
        )
    assert caches["a"].token is not caches["b"].token
    assert list(model._streaming_audio_arenas) == [(torch.device("cpu"), None)]
    stats = model._streaming_audio_encoder_graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 80 and stats["num_graphs"] == 0  # CPU tensors: never captured


# ---------------------------------------------------------------------------
# Key and cache bookkeeping through the adapter's CPU backend (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_graph_keys_are_chunk_form_and_past_length_and_sessions_share_them(cpu_backend):
    backend = cpu_backend()
    model = wired(tiny_model(), backend=backend)
    graph = model._streaming_audio_encoder_graph
    runs = {"a": duplex_chunks(40, seed=1), "b": duplex_chunks(40, seed=2)}
    want = {name: eager_run(model, chunks)[0] for name, chunks in runs.items()}
    got, _ = interleaved(model, runs)
    for name in runs:
        assert_bitwise(got[name], want[name], f"session {name}")

    (arena,) = model._streaming_audio_arenas.values()
    cpu = torch.device("cpu")
    expected = set()
    for i, past in enumerate(past_lengths(40, POSITIONS, N)):
        prefix = 0 if i == 0 else 2
        mel = ((1, 80, 2 * N + (2 if i == 0 else 4)), torch.float32)
        # the side holding the past: the session's chunks since its last reset, modulo 2
        side = past // N % 2
        plan = model._streaming_audio_mask_plans[(cpu, N, past + N)]
        statics = tuple((ecg.STATIC_ARG, v) for v in (arena, side, past, N, plan, True, prefix, 2))
        expected.add((backend.STREAM, cpu, (mel, *statics, None)))
    assert set(graph.graphs) == expected and len(expected) == KEYS
    # every key is first seen (warmup, eager) once, by whichever session gets there first
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["warmup_misses"], stats["graph_hits"]) == (KEYS, KEYS, 80 - KEYS)
    # the graphs' static input is the mel only: neither the cache nor the zero mask is a per-graph buffer
    for manager in graph.graphs.values():
        assert sorted(manager.input_buffers) == ["0"]
    assert all(encoder.statics[1] is arena for encoder in backend.encoders)
    # sdpa on the CPU: SDPA's choice for the eager call is pinned and the all-zero mask left out
    assert {p.sdpa_backend for p in model._streaming_audio_mask_plans.values()} == {
        sa.eager_sdpa_choice(model.apm, cpu, N, N)
    }
    assert all(p.drop_mask for p in model._streaming_audio_mask_plans.values())


# ---------------------------------------------------------------------------
# The all-zero mask: dropped where the eager call's kernel can be pinned (CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize(
    "attn, choice, plan",
    [
        ("eager", None, (True, None)),
        ("sdpa", "EFFICIENT_ATTENTION", (True, "EFFICIENT_ATTENTION")),
        ("sdpa", "FLASH_ATTENTION", (True, "FLASH_ATTENTION")),
        ("sdpa", "MATH", (True, "MATH")),
        ("sdpa", "CUDNN_ATTENTION", (False, None)),
        ("sdpa", "OVERRIDEABLE", (False, None)),
        ("sdpa", "ERROR", (False, None)),
        ("flash_attention_2", None, (False, None)),
    ],
)
def test_zero_mask_plan_pins_the_eager_kernel_or_keeps_the_mask(attn, choice, plan):
    from torch.nn.attention import SDPBackend

    asked = []

    def sdpa_choice():
        asked.append(attn)
        return SDPBackend.__members__[choice]

    got = sa.zero_mask_plan(attn, sdpa_choice)
    want_backend = None if plan[1] is None else SDPBackend.__members__[plan[1]]
    assert got == sa.ZeroMaskPlan(drop_mask=plan[0], sdpa_backend=want_backend)
    assert asked == ([attn] if attn == "sdpa" else [])  # SDPA is asked only for its own implementation
    hash(got)  # a static argument of the adapter: part of the graph key


def _sdpa_choice_forced(monkeypatch, name):
    """Make SDPA's choice for every eager streaming call ``name``; returns the shapes asked."""
    from torch.nn.attention import SDPBackend

    asked = []

    def choice(apm, device, positions, total):
        asked.append((device, positions, total))
        return SDPBackend.__members__[name]

    monkeypatch.setattr(sa, "eager_sdpa_choice", choice)
    return asked


@pytest.mark.cpu
@pytest.mark.parametrize("attn, forced", [("sdpa", None), ("eager", None), ("sdpa", "CUDNN_ATTENTION")])
def test_graphed_path_equals_eager_with_the_mask_kept_or_dropped(attn, forced, cpu_backend, monkeypatch):
    asked = _sdpa_choice_forced(monkeypatch, forced) if forced else []
    model = wired(tiny_model(attn=attn), backend=cpu_backend())
    runs = {"a": duplex_chunks(2 * CYCLE + 3, seed=7), "b": duplex_chunks(CYCLE, seed=8)}
    want = {name: eager_run(model, chunks)[0] for name, chunks in runs.items()}
    got, _ = interleaved(model, runs)
    for name in runs:
        assert_bitwise(got[name], want[name], f"{attn} attention, SDPA choice {forced}: session {name}")
    plans = model._streaming_audio_mask_plans
    # one plan per chunk shape: N positions over N, 2N, ..., CYCLE * N
    assert sorted(total for _, _, total in plans) == [N * k for k in range(1, CYCLE + 1)]
    assert {p.drop_mask for p in plans.values()} == {forced is None}
    if forced:  # SDPA was asked once per shape, with the shapes of the eager call
        assert sorted(asked, key=lambda a: a[2]) == sorted(plans, key=lambda a: a[2])
    stats = model._streaming_audio_encoder_graph.get_cumulative_stats()
    assert stats["num_graphs"] == KEYS and stats["graph_hits"] > 0


# ---------------------------------------------------------------------------
# Admission: the streaming adapter captures by count (CPU)
# ---------------------------------------------------------------------------

#: eager time of one 1 s duplex chunk on an H200 (ms); host-bound, so the GPU span follows the host
DUPLEX_CHUNK_MS = 9.7
#: chunks per cache cycle at the checkpoint's sizes: past lengths 0, 50, ..., 1400
CHECKPOINT_CYCLE = len(set(past_lengths(100)))


@pytest.mark.cpu
@pytest.mark.parametrize("admission", ["cost", "count"])
def test_streaming_adapter_counts_whatever_the_admission_option_says(admission, cpu_backend):
    backend = cpu_backend(timing=(DUPLEX_CHUNK_MS, DUPLEX_CHUNK_MS))
    model = wired(tiny_model(), backend=backend, admission=admission)
    graph = model._streaming_audio_encoder_graph
    assert graph.options.admission == "count" and graph.get_detailed_stats()["admission"] == "count"
    assert graph.static_args is True
    # the option still governs the stateless audio adapter
    assert model._audio_encoder_graph.options.admission == admission
    assert model._audio_encoder_graph.static_args is False
    # one session, two cache cycles and a chunk: every key seen before replays from its second sighting
    chunks = duplex_chunks(2 * CYCLE + 1, seed=3)
    want, _ = eager_run(model, chunks)
    session = DuplexSession()
    with torch.inference_mode():
        got = [session.encode(model, chunk) for chunk in chunks]
    assert_bitwise(got, want, "one session")
    stats = graph.get_cumulative_stats()
    # the first chunk's form is seen once; the CYCLE later-chunk forms twice
    assert (stats["warmup_misses"], stats["num_graphs"], stats["graph_hits"]) == (KEYS, CYCLE, CYCLE)
    assert graph.get_detailed_stats()["declined_misses"] == 0


@pytest.mark.cpu
@torch.inference_mode()
def test_the_cost_rule_would_hold_the_checkpoint_schedule_back(cpu_backend):
    """Why the streaming adapter counts. At the checkpoint's sizes a session's chunk keys (one per
    past length) recur once per 29-chunk cache cycle. Fed a duplex chunk's eager time, the cost rule
    estimates that recurrence from the calls seen so far and declines every key at its second
    sighting (about 2 replays expected within its 32-call horizon do not repay a ~24 ms capture);
    the count rule replays the whole second cycle."""

    pasts = past_lengths(2 * CHECKPOINT_CYCLE + 1)

    def session(admission):
        graph = ecg.EncoderCudaGraph(
            lambda x, past, first: x + past,
            vllm_config(),
            max_graphs=4 * (CHECKPOINT_CYCLE + 1),
            admission=admission,
            static_args=True,
            backend=cpu_backend(timing=(DUPLEX_CHUNK_MS, DUPLEX_CHUNK_MS)),
        )
        x = torch.ones(2)
        for i, past in enumerate(pasts):
            assert torch.equal(graph(x, past, i == 0), x + past)
        return graph.get_cumulative_stats(), graph.get_detailed_stats()

    assert CHECKPOINT_CYCLE == 29
    count, _ = session("count")
    assert (count["num_graphs"], count["graph_hits"]) == (CHECKPOINT_CYCLE, CHECKPOINT_CYCLE)
    cost, details = session("cost")
    assert (cost["num_graphs"], cost["graph_hits"]) == (0, 0)
    assert details["declined_misses"] == CHECKPOINT_CYCLE


# ---------------------------------------------------------------------------
# Arena and session cache (CPU)
# ---------------------------------------------------------------------------


def arena_and_caches():
    arena = sa.StreamingAudioKVArena(
        layers=LAYERS, heads=HEADS, head_dim=2, max_positions=16, dtype=torch.float32, device="cpu"
    )
    return arena, sa.StreamingAudioKVCache(), sa.StreamingAudioKVCache()


def write_chunk(arena, cache, value, n=3):
    """What a graph replay does for a chunk (past and new positions to the other side), then the copy-out."""
    side, past = arena.side(cache), cache.length
    written = arena.positions(1 - side, past + n)
    written[:, :, :, :past] = arena.positions(side, past)
    written[:, :, :, past:] = value
    arena.save(cache, n)


@pytest.mark.cpu
def test_arena_copies_a_session_in_only_when_it_holds_another():
    arena, a, b = arena_and_caches()
    with torch.inference_mode():  # the arena stays a normal tensor whatever the mode it is made in
        assert not sa.StreamingAudioKVArena(
            layers=1, heads=1, head_dim=1, max_positions=1, dtype=torch.float32, device="cpu"
        ).kv.is_inference()
    # two sides, each with every layer's keys and values for 16 positions
    assert arena.kv.shape == (2, LAYERS, 2, HEADS * 16 * 2)
    arena.load(a)
    write_chunk(arena, a, 1.0)
    write_chunk(arena, a, 2.0)
    assert a.length == 6 and arena.holds == (a.token, 6) and arena.side(a) == 0
    arena.positions(0, 6).fill_(-1.0)  # would be overwritten by a copy-in
    arena.load(a)  # the same session continuing: nothing copied
    assert (arena.positions(0, 6) == -1.0).all()
    arena.load(b)  # another session: the arena now holds b's (empty) cache
    write_chunk(arena, b, 7.0, n=4)
    assert arena.side(b) == 1 and arena.holds == (b.token, 4)
    arena.load(a)  # back to a: a's own positions, none of b's
    assert torch.equal(arena.positions(0, 6), torch.cat(a.blocks, dim=4)[:, :, 0])
    assert set(arena.positions(0, 6)[:, :, :, :3].unique().tolist()) == {1.0}
    assert set(arena.positions(0, 6)[:, :, :, 3:6].unique().tolist()) == {2.0}
    assert b.length == 4 and set(b.blocks[0].unique().tolist()) == {7.0}
    # blocks are copies: later writes to the arena do not reach a session's cache
    arena.kv.fill_(5.0)
    assert set(torch.cat(a.blocks, dim=4).unique().tolist()) == {1.0, 2.0}


@pytest.mark.cpu
def test_arena_layout_is_the_eager_caches_per_layer():
    arena, _, _ = arena_and_caches()
    arena.kv.copy_(torch.arange(arena.kv.numel(), dtype=torch.float32).view_as(arena.kv))
    for side in (0, 1):
        for length in (0, 5, 16):
            whole = arena.positions(side, length)
            assert whole.shape == (LAYERS, 2, HEADS, length, 2)
            for layer in range(LAYERS):
                keys, values = arena.layer(side, layer, length)
                for i, t in enumerate((keys, values)):
                    # contiguous (1, heads, length, head_dim) at the start of the layer's row
                    assert t.shape == (1, HEADS, length, 2) and t.is_contiguous()
                    assert torch.equal(t[0], whole[layer, i])
                    if length:
                        assert t.data_ptr() == arena.kv[side, layer, i].data_ptr()
    with pytest.raises(RuntimeError):
        arena.positions(0, 17)  # past the rows: no silent wrap into the next tensor


@pytest.mark.cpu
def test_arena_past_returns_what_dynamic_cache_returns_and_never_writes_what_it_reads():
    arena, cache, _ = arena_and_caches()
    g = torch.Generator().manual_seed(0)
    past = llm.DynamicCache()
    for _ in range(3):
        side = arena.side(cache)
        read = arena.kv[side].clone()
        view = sa.StreamingAudioKVArenaPast(arena, side, cache.length)
        assert view.get_seq_length() == llm._get_audio_cache_length(view) == cache.length
        for layer in range(LAYERS):
            k, v = torch.randn(2, 1, HEADS, 3, 2, generator=g)
            got = view.update(k, v, layer)
            want = past.update(k, v, layer)
            for i, (x, y) in enumerate(zip(got, want)):
                assert x.is_contiguous() and torch.equal(x, y)
                # written to the other side, where attention reads it and the next chunk finds its past
                assert x.data_ptr() == arena.kv[1 - side, layer, i].data_ptr()
        assert torch.equal(arena.kv[side], read)  # so a second run of the forward sees the same past
        arena.save(cache, 3)
        assert arena.side(cache) == 1 - side
    eager = cache.to_eager()
    assert isinstance(eager, llm.EncoderDecoderCache) and llm._get_audio_cache_length(eager) == 9
    pairs = list(zip(eager.self_attention_cache, past))
    assert len(pairs) == LAYERS
    for converted, reference in pairs:
        assert torch.equal(converted[0], reference[0]) and torch.equal(converted[1], reference[1])


@pytest.mark.cpu
@torch.inference_mode()
def test_the_captured_forward_can_run_twice_with_the_same_result():
    """vLLM's manager runs the forward once on its zero buffers before capturing, and the capturing
    call then replays it with the real inputs: a forward that overwrote its own past would replay
    on a corrupted one."""
    model = wired(tiny_model())
    chunks = duplex_chunks(3, seed=6)
    want, _ = eager_run(model, chunks)
    session = DuplexSession()
    session.encode(model, chunks[0])
    session.encode(model, chunks[1])
    cache = session.cache
    arena = sa.streaming_audio_arena(model, torch.device("cpu"))
    arena.load(cache)
    chunk = chunks[2]
    plan = sa.streaming_audio_mask_plan(model, torch.device("cpu"), N, cache.length + N)
    args = (arena, arena.side(cache), cache.length, N, plan, True, chunk.prefix_extra_frames, 2, None)
    model._encode_audio_streaming_graphed(torch.zeros_like(chunk.features), *args)  # the warm-up
    got = model._encode_audio_streaming_graphed(chunk.features, *args)
    assert torch.equal(got[0], want[2])
    arena.save(cache, N)
    assert torch.equal(cache.to_eager().self_attention_cache.layers[0].keys, eager_keys(model, chunks))


def eager_keys(model, chunks):
    """Layer 0's keys in the eager cache after ``chunks``."""
    return eager_run(model, chunks)[1].self_attention_cache.layers[0].keys


@pytest.mark.cpu
def test_reset_gives_the_session_a_new_cache_and_leaves_the_old_one_alone():
    model = wired(tiny_model())
    chunks = duplex_chunks(CYCLE + 1, seed=3)
    with torch.inference_mode():
        for chunk in chunks[:CYCLE]:
            encode(model, chunk)
        full = model.audio_past_key_values
        assert full.length == CYCLE * N
        encode(model, chunks[CYCLE])  # past + N >= POSITIONS: reset
    fresh = model.audio_past_key_values
    assert fresh is not full and fresh.length == N and full.length == CYCLE * N
    (arena,) = model._streaming_audio_arenas.values()
    assert arena.holds == (fresh.token, N)


# ---------------------------------------------------------------------------
# Bypasses (CPU)
# ---------------------------------------------------------------------------


class Counting:
    def __init__(self, graph):
        self.graph = graph
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.graph(*args)


@pytest.mark.cpu
def test_grad_mode_bypasses_converts_the_cache_and_stays_eager_until_reset():
    model = wired(tiny_model())
    counting = Counting(model._streaming_audio_encoder_graph)
    model._streaming_audio_encoder_graph = counting
    chunks = duplex_chunks(CYCLE + 2, seed=4)
    want, _ = eager_run(model, chunks)
    got, kinds = [], []
    for i, chunk in enumerate(chunks):
        with torch.enable_grad() if i == 2 else torch.no_grad():
            got.append(encode(model, chunk).detach())
        kinds.append(type(model.audio_past_key_values).__name__)
    assert_bitwise(got, want, "grad bypass")
    # chunks 0-1 graphed, 2 eager under autograd (cache converted), 3..CYCLE-1 stay eager, then reset
    assert kinds[:2] == ["StreamingAudioKVCache"] * 2
    assert kinds[2:CYCLE] == ["EncoderDecoderCache"] * (CYCLE - 2)
    assert kinds[CYCLE:] == ["StreamingAudioKVCache"] * 2
    assert counting.calls == 4


@pytest.mark.cpu
def test_training_fp16_autocast_and_long_chunks_take_the_eager_path():
    model = wired(tiny_model())
    mel = torch.zeros(1, 80, 24)
    assert torch.is_grad_enabled() and not sa.streaming_audio_graph_applies(model, mel, N)
    with torch.no_grad():
        assert sa.streaming_audio_graph_applies(model, mel, N)
        assert sa.streaming_audio_graph_applies(model, mel, POSITIONS)
        assert not sa.streaming_audio_graph_applies(model, mel, POSITIONS + 1)  # past the position table
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not sa.streaming_audio_graph_applies(model, mel, N)
        model.train()
        assert not sa.streaming_audio_graph_applies(model, mel, N)
        model.eval()
        model.audio_past_key_values = llm.EncoderDecoderCache(llm.DynamicCache(), llm.DynamicCache())
        assert not sa.streaming_audio_graph_applies(model, mel, N)  # a cache the eager path made
        model.audio_past_key_values = None
        model.apm.half()
        assert not sa.streaming_audio_graph_applies(model, mel, N)


@pytest.mark.cpu
def test_a_chunk_longer_than_the_position_table_runs_eagerly():
    model = wired(tiny_model())
    counting = Counting(model._streaming_audio_encoder_graph)
    model._streaming_audio_encoder_graph = counting
    chunks = duplex_chunks(1, seed=5, positions=POSITIONS + 6)
    want, _ = eager_run(model, chunks)
    with torch.inference_mode():
        got = encode(model, chunks[0])
    assert torch.equal(got, want[0]) and counting.calls == 0
    assert isinstance(model.audio_past_key_values, llm.EncoderDecoderCache)


# ---------------------------------------------------------------------------
# CUDA: real graphs, bitwise against eager
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_model():
    return wired(tiny_model(device="cuda", dtype=torch.bfloat16))


def fresh_adapter(model):
    """Rebuild the streaming adapter and its arenas so that a test starts without graphs."""

    sa.init_streaming_audio_graph(
        model, vllm_config(), ecg.EncoderCudaGraphOptions.from_hf_config(model.config)
    )
    return model._streaming_audio_encoder_graph


@pytest.mark.cuda
@needs_cuda
def test_interleaved_duplex_sessions_replay_bitwise_equal_to_their_own_eager_runs(cuda_model):
    model = cuda_model
    graph = fresh_adapter(model)
    runs = {"a": duplex_chunks(40, seed=11, device="cuda"), "b": duplex_chunks(40, seed=12, device="cuda")}
    want = {name: eager_run(model, chunks)[0] for name, chunks in runs.items()}
    got, caches = interleaved(model, runs)
    for name in runs:
        assert_bitwise(got[name], want[name], f"session {name}")
        assert caches[name].length == 4 * N
    stats = graph.get_cumulative_stats()
    assert (stats["num_graphs"], stats["warmup_misses"], stats["graph_hits"]) == (KEYS, KEYS, 80 - KEYS)
    assert stats["ineligible_misses"] == stats["capacity_misses"] == stats["memory_misses"] == 0
    # one arena (two sides) for the device and stream; each graph owns only the mel buffer
    ((key, arena),) = model._streaming_audio_arenas.items()
    assert key == (
        torch.device("cuda", torch.accelerator.current_device_index()),
        torch.cuda.current_stream().cuda_stream,
    )
    assert arena.kv.shape == (2, LAYERS, 2, HEADS * POSITIONS * (D_MODEL // HEADS))
    for manager in graph.graphs.values():
        for graph_set in manager.budget_graphs.values():
            for meta in graph_set.values():
                assert sorted(meta.input_buffers) == ["0"]
                assert meta.input_buffers["0"].shape[:2] == (1, 80)  # the mel, not a cache copy


@pytest.mark.cuda
@needs_cuda
def test_a_session_captured_and_replayed_under_no_grad_is_bitwise_equal(cuda_model):
    model = cuda_model
    graph = fresh_adapter(model)
    chunks = duplex_chunks(2 * CYCLE + 4, seed=13, device="cuda")
    want, _ = eager_run(model, chunks, mode=torch.no_grad)
    other = duplex_chunks(2 * CYCLE + 4, seed=14, device="cuda")
    got, _ = interleaved(model, {"s": chunks, "t": other}, mode=torch.no_grad)
    assert_bitwise(got["s"], want, "no_grad session")
    assert graph.get_cumulative_stats()["graph_hits"] > 0


@pytest.mark.cuda
@needs_cuda
def test_graphs_captured_under_inference_mode_replay_under_no_grad(cuda_model):
    # Session a (inference mode) captures the later chunks' graphs in its second cache cycle;
    # session b (no_grad) then replays them, and a continues. The duplex stage's callers run in
    # either mode, so neither the static buffers nor the arena may be inference tensors.
    model = cuda_model
    graph = fresh_adapter(model)
    chunks = {
        name: duplex_chunks(2 * CYCLE + 2, seed=seed, device="cuda") for name, seed in (("a", 15), ("b", 16))
    }
    want = {name: eager_run(model, c)[0] for name, c in chunks.items()}
    sessions = {"a": DuplexSession(), "b": DuplexSession()}
    got = {"a": [], "b": []}
    plan = [("a", i, torch.inference_mode) for i in range(2 * CYCLE)]
    plan += [("b", i, torch.no_grad) for i in range(2 * CYCLE + 2)]
    plan += [("a", i, torch.inference_mode) for i in range(2 * CYCLE, 2 * CYCLE + 2)]
    for name, i, mode in plan:
        with mode():
            got[name].append(sessions[name].encode(model, chunks[name][i]))
    for name, outs in got.items():
        assert_bitwise(outs, want[name], f"session {name}")
    assert graph.get_cumulative_stats()["graph_hits"] >= 2 * CYCLE


@pytest.mark.cuda
@needs_cuda
@torch.inference_mode()
def test_the_eager_sdpa_kernel_gives_the_same_bits_without_the_zero_mask_on_cuda():
    """What dropping the mask rests on, at Whisper-medium's attention widths in bf16: for every total
    length a duplex session reaches (and the 8-aligned ones, where SDPA does not pad the mask), SDPA's
    choice for the eager call drops the mask (the memory-efficient kernel on an H200), and that kernel,
    pinned, returns the eager call's exact bits without the mask."""
    from torch.nn.attention import sdpa_kernel

    heads, head_dim, n = 16, 64, 50
    apm = SimpleNamespace(
        config=SimpleNamespace(encoder_attention_heads=heads, d_model=heads * head_dim),
        conv1=SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16)),
    )
    device = torch.device("cuda", torch.accelerator.current_device_index())
    g = torch.Generator(device=device).manual_seed(0)
    for total in sorted({n + past for past in past_lengths(30)} | {200, 1000}):
        plan = sa.zero_mask_plan("sdpa", lambda t=total: sa.eager_sdpa_choice(apm, device, n, t))
        assert plan.drop_mask, f"SDPA picks {plan.sdpa_backend} for {total} keys: the mask is kept"
        q = torch.randn(1, heads, n, head_dim, device=device, generator=g, dtype=torch.bfloat16)
        k, v = torch.randn(2, 1, heads, total, head_dim, device=device, generator=g, dtype=torch.bfloat16)
        mask = torch.zeros(1, 1, n, total, device=device, dtype=torch.bfloat16)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        with sdpa_kernel(plan.sdpa_backend):
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
        assert torch.equal(got, want), (total, plan, (got.float() - want.float()).abs().max())


@pytest.mark.cuda
@needs_cuda
def test_whisper_medium_widths_real_speech_sessions_are_bitwise_equal_with_a_reset():
    """Whisper-medium's widths and 1500 positions (2 layers), bf16, real speech framed as the duplex
    stage frames it: 40 chunks per session (the cache resets before chunk 29), two sessions
    interleaved, each chunk bitwise equal to the session's own eager run; 30 graphs serve both."""
    from minicpmo_cg import duplex, standalone

    model = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    standalone.wire_encoder_graphs(model, vllm_config(), enabled=True)
    graph = standalone.streaming_audio_graph(model)
    mel = duplex.speech_mel(80)
    runs = {
        "a": duplex.frame_chunks(mel[:, : 40 * 100 + 2], 40, device="cuda", dtype=torch.bfloat16),
        "b": duplex.frame_chunks(mel[:, 40 * 100 :], 40, device="cuda", dtype=torch.bfloat16),
    }
    want = {name: eager_run(model, chunks)[0] for name, chunks in runs.items()}
    got, caches = interleaved(model, runs)
    for name in runs:
        assert_bitwise(got[name], want[name], f"session {name}", per_chunk=10, embed=4096)
        assert caches[name].length == duplex.past_lengths(41)[-1]
    stats = graph.get_cumulative_stats()
    assert stats["num_graphs"] == 30 and stats["capture_failures"] == 0
    assert stats["graph_hits"] == 80 - 30  # each key warms up once and captures on its second sighting
