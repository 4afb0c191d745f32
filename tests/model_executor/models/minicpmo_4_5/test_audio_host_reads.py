# SPDX-License-Identifier: Apache-2.0
"""The audio call paths read no tensor value on the host.

``get_audio_hidden_states`` (the stateless call) and ``get_audio_embedding_streaming`` (a duplex
session's 1 s chunk) cut the encoder output at lengths held in tensors in vllm-omni 0.30.0, so on CUDA the
host waited for the encoder (or its graph replay) before the call returned. Here the stateless call reads
``audio_feature_lens`` only where the caller passes it on the host (the multimodal field config
keeps it there) and a streaming chunk's embedding count is the encoder output's. Checked on CPU
with tiny Whisper models through :class:`helpers.host_reads.HostReads` (tensor methods and the
operators that copy values out, e.g. slicing at a tensor bound), on the eager and the graphed path
(the adapters' CPU backend).
Both calls are also compared with the model file before the change (bitwise), where the patch tool
can rebuild that file from the installed one.
CUDA tests check the same with ``torch.cuda.set_sync_debug_mode("error")`` at Whisper-medium's widths.
"""

from __future__ import annotations


import pytest
import torch
from helpers.host_reads import HostReads
from helpers.tiny_encoders import tiny_audio_model

from minicpmo_cg.duplex import DuplexChunk, DuplexSession
from vllm_omni.model_executor.models.minicpmo_4_5 import audio_lengths
from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm

pytestmark = [pytest.mark.core_model]


N = 10  # positions per streaming chunk (0.2 s)
POSITIONS = 128  # a session's cache resets every 12 chunks
POOL = 2


def audio_model(attn="sdpa", module=None, **config):
    model = tiny_audio_model(
        positions=POSITIONS, chunk_seconds=N / 50, attn=attn, pool=POOL, llm=module, **config
    )
    return model.eval().requires_grad_(False)


def wired(model, backend_cls, **options):
    """The model's adapters, each on its own CPU backend (captures run the region eagerly)."""
    from minicpmo_cg.vllm_config import duplex_vllm_config, standalone_vllm_config

    for key, value in options.items():
        setattr(model.config, f"encoder_cuda_graph_{key}", value)
    model._init_encoder_cuda_graphs(duplex_vllm_config(standalone_vllm_config(), 2))  # a test's two sessions
    model._audio_encoder_graph.backend = backend_cls()
    model._streaming_audio.graph.backend = backend_cls()
    return model


def clip_data(lengths_per_clip, seed=0, device="cpu"):
    """A stateless call's data: clips of the given chunk lengths (mel frames), padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    flat = [n for clip in lengths_per_clip for n in clip]
    features = torch.randn(len(flat), 80, max(flat), generator=g)
    for i, n in enumerate(flat):
        features[i, :, n:] = 0
    lens = [torch.tensor(clip, dtype=torch.int64, device=device) for clip in lengths_per_clip]
    return {"audio_features": features, "audio_feature_lens": lens}


CLIPS = {
    "one clip": [[60]],
    "padded batch": [[60], [44], [37]],
    "a clip in two chunks": [[60, 60], [31]],
}


def chunks(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        DuplexChunk(torch.randn(1, 80, 2 * N + (2 if i == 0 else 4), generator=g), 0 if i == 0 else 2)
        for i in range(count)
    ]


def meta_lengths(chunk):
    """The chunk's data with ``audio_feature_lens`` on another device than the host (``meta``:
    any read of it raises), as the duplex stage hands them over (moved to the device)."""
    data = chunk.data
    return {**data, "audio_feature_lens": [t.to("meta") for t in data["audio_feature_lens"]]}


def encode_streaming(model, session, data, prefix):
    previous, model.audio_past_key_values = model.audio_past_key_values, session.cache
    try:
        ((embeds,),) = model.get_audio_embedding_streaming(
            data, use_extra_context=True, prefix_extra_frames=prefix, suffix_extra_frames=2
        )
        session.cache = model.audio_past_key_values
    finally:
        model.audio_past_key_values = previous
    return embeds


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The unpatched model module, rebuilt by the patch tool from the installed (patched) file."""
    from helpers.pristine import pristine_model_module

    yield from pristine_model_module(tmp_path_factory.mktemp("pristine-minicpmo"), "audio", "audio_lengths")


@pytest.mark.cpu
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CLIPS))
def test_stateless_output_is_bitwise_the_unpatched_call(pristine, name, attn, cpu_backend):
    before = audio_model(attn, module=pristine)
    data = clip_data(CLIPS[name])
    with torch.inference_mode():
        want = before.get_audio_hidden_states(data)
        eager = audio_model(attn).get_audio_hidden_states(data)
        model = wired(audio_model(attn), cpu_backend, admission="count")
        graphed = [model.get_audio_hidden_states(data) for _ in range(3)][-1]  # warmup, capture, replay
    assert model._audio_encoder_graph.get_cumulative_stats()["graph_hits"] == 2
    assert len(want) == len(CLIPS[name])
    for w, e, g in zip(want, eager, graphed, strict=True):
        assert w.shape == e.shape == g.shape and torch.equal(e, w) and torch.equal(g, w)


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["one clip", "padded batch"])
def test_the_watch_sees_the_reads_of_the_unpatched_call_paths(pristine, name):
    data = clip_data(CLIPS[name])
    with torch.inference_mode(), HostReads(host=data["audio_feature_lens"]) as watch:
        audio_model(module=pristine).get_audio_hidden_states(data)
    assert "aten::item" in {r.what for r in watch.device_reads()}  # the output cut at tensor lengths
    chunk = chunks(1, seed=3)[0]
    with torch.inference_mode(), HostReads(host=chunk.data["audio_feature_lens"]) as watch:
        model = audio_model(module=pristine)
        model.get_audio_embedding_streaming(chunk.data, use_extra_context=True, prefix_extra_frames=0)
    assert "aten::item" in {r.what for r in watch.device_reads()}




@pytest.mark.cpu
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CLIPS))
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_stateless_call_reads_only_the_lengths_it_gets_on_the_host(name, attn, graphed, cpu_backend):
    model = audio_model(attn)
    if graphed:
        model = wired(model, cpu_backend, admission="count")
    data = clip_data(CLIPS[name])
    with torch.inference_mode():
        for _ in range(2):  # the graphed path captures on the second call
            model.get_audio_hidden_states(data)
        with HostReads(host=data["audio_feature_lens"]) as watch:
            model.get_audio_hidden_states(data)
    assert watch.device_reads() == []
    assert watch.names() == {"tolist"}  # the host lengths, once per tensor
    assert len(watch.reads) == len(data["audio_feature_lens"])
    if graphed:
        assert model._audio_encoder_graph.get_cumulative_stats()["graph_hits"] == 2


@pytest.mark.cpu
def test_the_field_config_keeps_the_lengths_on_the_host():
    config = llm._minicpmo_field_config(
        {"audio_features": torch.zeros(2, 80, 10), "audio_feature_lens": torch.ones(2, 1)}
    )
    assert config["audio_feature_lens"].field.keep_on_cpu is True
    assert config["audio_features"].field.keep_on_cpu is False  # the mel goes to the device


@pytest.mark.cpu
def test_lengths_on_the_host_as_the_model_counts_them():
    frames = torch.arange(1, 3100)
    _, want = audio_model()._get_feat_extract_output_lengths(frames)
    assert audio_lengths.pooled_lengths(frames.tolist(), POOL) == want.tolist()
    assert audio_lengths.host_values(torch.tensor([[3, 4], [5, 6]])) == [3, 4, 5, 6]
    assert audio_lengths.host_values([torch.tensor([3]), torch.tensor([4, 5])]) == [3, 4, 5]
    assert audio_lengths.host_values([torch.tensor([3]), torch.tensor([4], device="meta")]) is None
    lens = torch.tensor([7, 8])
    assert audio_lengths.to_device(lens, torch.device("cpu")) is lens


@pytest.mark.cpu
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_streaming_chunks_read_nothing_with_lengths_on_the_device(attn, graphed, cpu_backend):
    """A session of 30 chunks (two cache resets), lengths moved off the host as the duplex stage
    moves them: no read at all (a read of a ``meta`` tensor would raise), outputs bitwise those of
    lengths on the host, and on the graphed path the second cycle replays."""
    model = audio_model(attn)
    if graphed:
        model = wired(model, cpu_backend)
    session, reference = DuplexSession(), DuplexSession()
    with torch.inference_mode():
        for i, chunk in enumerate(chunks(30, seed=5)):
            with HostReads() as watch:
                got = encode_streaming(model, session, meta_lengths(chunk), chunk.prefix_extra_frames)
            assert watch.reads == [], (i, watch.reads[:3])
            want = encode_streaming(model, reference, chunk.data, chunk.prefix_extra_frames)
            assert got.shape == (N // POOL, 32) and torch.equal(got, want), i
    if graphed:
        stats = model._streaming_audio.graph.get_cumulative_stats()
        assert stats["graph_hits"] > 0 and stats["ineligible_misses"] == 0


@pytest.mark.cpu
def test_streaming_lengths_on_the_host_are_read_there_only(cpu_backend):
    model = wired(audio_model(), cpu_backend)
    session = DuplexSession()
    with torch.inference_mode():
        for chunk in chunks(14, seed=6):
            lens = chunk.data["audio_feature_lens"]
            with HostReads(host=lens) as watch:
                encode_streaming(
                    model, session, {**chunk.data, "audio_feature_lens": lens}, chunk.prefix_extra_frames
                )
            assert watch.device_reads() == [] and watch.names() == {"tolist"}


@pytest.mark.cpu
def test_a_padded_streaming_chunk_with_host_lengths_raises():
    model = audio_model()
    chunk = chunks(1, seed=7)[0]
    frames = chunk.features.shape[-1]
    data = {**chunk.data, "audio_feature_lens": [torch.tensor([frames - 8])]}
    with torch.inference_mode(), pytest.raises(ValueError, match="must not be padded"):
        model.get_audio_embedding_streaming(data, use_extra_context=True, prefix_extra_frames=0)
    # lengths that leave every embedding (the context frames are part of the chunk) are fine
    data = {**chunk.data, "audio_feature_lens": [torch.tensor([frames - 2])]}
    with torch.inference_mode():
        ((embeds,),) = model.get_audio_embedding_streaming(
            data, use_extra_context=True, prefix_extra_frames=0
        )
    assert embeds.shape[0] == N // POOL


# ---------------------------------------------------------------------------
# CUDA: the calls make the host wait for nothing (Whisper-medium's widths)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def medium():
    if not torch.cuda.is_available():
        pytest.skip("encoder CUDA graphs need a CUDA device")
    from minicpmo_cg import standalone
    from minicpmo_cg.vllm_config import standalone_vllm_config

    model = standalone.build_thinker_encoders(device="cuda", dtype=torch.bfloat16, reduced=True)
    standalone.wire_encoder_graphs(model, standalone_vllm_config(), enabled=True, admission="count")
    return model


def _no_sync(call):
    torch.accelerator.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.cuda
@torch.inference_mode()
def test_graphed_stateless_audio_call_makes_the_host_wait_for_nothing(medium):
    """A 1 s clip and a padded batch, lengths on the host as vLLM hands them over; the graph is
    captured first, then the replaying call and the eager call run with synchronising CUDA calls
    turned into errors."""
    for lengths in ([[100]], [[100], [60]]):
        features = torch.randn(len(lengths), 80, 100, generator=torch.Generator().manual_seed(0))
        data = {
            "audio_features": features.to("cuda", torch.bfloat16),
            "audio_feature_lens": [torch.tensor(clip) for clip in lengths],
        }
        for _ in range(3):
            medium.get_audio_hidden_states(data)
        hits = medium._audio_encoder_graph.get_cumulative_stats()["graph_hits"]
        graphed = _no_sync(lambda d=data: medium.get_audio_hidden_states(d))
        assert medium._audio_encoder_graph.get_cumulative_stats()["graph_hits"] == hits + 1
        saved, medium._audio_encoder_graph = medium._audio_encoder_graph, None
        try:
            eager = _no_sync(lambda d=data: medium.get_audio_hidden_states(d))
        finally:
            medium._audio_encoder_graph = saved
        for g, e in zip(graphed, eager, strict=True):
            assert torch.equal(g, e)


@pytest.mark.cuda
@torch.inference_mode()
def test_graphed_duplex_chunk_makes_the_host_wait_for_nothing(medium):
    """A session's chunks as the duplex stage passes them (float32 mel and lengths on the device):
    every key is captured at its second sighting (the steady chunk at past 0 first comes after the
    first reset, chunk 29, and is captured at chunk 58), so chunks 59-61 replay, with synchronising
    CUDA calls as errors. The data are built first (their lengths' copy to the device is the
    caller's, as the stage's move of its BatchFeature is)."""
    from minicpmo_cg import duplex

    mel = duplex.speech_mel(62)
    session = DuplexSession()
    graph = medium._streaming_audio.graph
    for i, chunk in enumerate(duplex.frame_chunks(mel, 62, device="cuda")):
        data = chunk.data
        if i < 59:
            encode_streaming(medium, session, data, chunk.prefix_extra_frames)
            continue
        hits = graph.get_cumulative_stats()["graph_hits"]
        _no_sync(lambda d=data, c=chunk: encode_streaming(medium, session, d, c.prefix_extra_frames))
        assert graph.get_cumulative_stats()["graph_hits"] == hits + 1
