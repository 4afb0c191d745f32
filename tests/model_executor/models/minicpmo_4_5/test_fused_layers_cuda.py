# SPDX-License-Identifier: Apache-2.0
"""CUDA tests of the fused encoder layers (``fused_layers.py``) at the checkpoint's size.

The thinker's encoders from the tests' builder (:func:`minicpmo_cg.standalone.build_thinker_encoders`:
26 SigLIP layers of width 1152 with 16 heads and a 4304-wide MLP, Whisper-medium's 24 layers of
width 1024 with 16 heads and a 4096-wide FFN, the resampler and the audio projection), bf16, the same
random weights in every model; the biases and LayerNorm affines, which the builder zeroes, are drawn
too, so that a dropped or doubled bias shows.

- Bound: against the original math (the upstream layers: SigLIP's eager attention, Whisper's eager
  attention, no fused layers) the fused model's output stays within 1e-2 of the original's largest
  magnitude (``max |fused - original| <= 1e-2 * max |original|``), for one 1024-patch slice, three
  padded slices, 100 mel frames (1 s) and a duplex session's chunks; and its mean error against a
  float32 model with the same (bf16-rounded) weights is no larger than the original's.
- Graphs: a replay equals the fused eager call bitwise and differs from the unfused one (the
  graph ran the fused kernels); the single-slice image graph holds at most 64 MiB with its static
  buffers.
- The Triton kernel against its torch reference on the GPU, the fallback, and packing refused
  inside a capture.
"""

from __future__ import annotations

import logging
import zlib

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused layers' kernels need a CUDA device"),
]

BOUND = 1e-2
#: mean-error slack against the original layers' (run-to-run identical; a margin for kernel variants)
MEAN_SLACK = 1.05
ONE_SLICE = [(32, 32)]
PADDED = [(32, 32), (23, 45), (23, 45)]  # 1024, 1035 and 1035 patches: a padded call


@torch.no_grad()
def draw_affines_(model, seed=7):
    """Biases ~ N(0, 0.02) and LayerNorm weights ~ 1 + N(0, 0.05), by parameter name, in place
    (the fused model's packed q/k/v views included), the same in every model."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    for name, param in model.named_parameters():
        if not (name.endswith("bias") or id(param) in norms):
            continue
        generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        values = torch.randn(param.shape, generator=generator)
        values = 1 + 0.05 * values if id(param) in norms else 0.02 * values
        param.copy_(values.to(param.dtype))


def build(**kwargs):
    from minicpmo_cg.standalone import build_thinker_encoders

    model = build_thinker_encoders(device="cuda", seed=3, **kwargs)
    draw_affines_(model)
    return model


@pytest.fixture(scope="module")
def fused():
    model = build(dtype=torch.bfloat16, vision_attn="sdpa")
    assert model.build_info.fused_layers == {"vision": "on", "audio": "on"}
    assert len(model.vpm.encoder.layers) == 26 and len(model.apm.layers) == 24
    return model


@pytest.fixture(scope="module")
def original():
    model = build(dtype=torch.bfloat16, vision_attn="eager", fused_layers="none")
    model.apm.config._attn_implementation = "eager"
    assert model.build_info.fused_layers["vision"].startswith("off")
    return model


@pytest.fixture(scope="module")
def reference():
    """float32, the original math, the bf16 models' weights rounded to bf16."""
    model = build(dtype=torch.float32, vision_attn="eager", fused_layers="none")
    model.apm.config._attn_implementation = "eager"
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def vision_data(grids, seed, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    pixels = [torch.randn(3, 14, h * w * 14, generator=generator).to("cuda", dtype) for h, w in grids]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(grids, dtype=torch.int32, device="cuda")}


def audio_data(lengths, frames, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), 80, frames, generator=generator)
    for i, n in enumerate(lengths):
        feats[i, :, n:] = 0
    return {
        "audio_features": feats.to("cuda", dtype),
        "audio_feature_lens": [torch.tensor([n], device="cuda") for n in lengths],
    }


def check_bound(got, want, ref, what):
    """The bound against the original and the mean error against float32; returns both figures."""
    got, want, ref = got.float(), want.float(), ref.float()
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    rel = float((got - want).abs().max() / want.abs().max())
    fused_mean = float((got - ref).abs().mean())
    original_mean = float((want - ref).abs().mean())
    print(
        f"{what}: max|fused - original| / max|original| = {rel:.3e} (bound {BOUND}); mean error vs float32 "
        f"fused {fused_mean:.3e}, original {original_mean:.3e}"
    )
    assert rel <= BOUND, f"{what}: {rel} > {BOUND}"
    assert fused_mean <= MEAN_SLACK * original_mean, (what, fused_mean, original_mean)
    return rel, fused_mean, original_mean


# ---------------------------------------------------------------------------
# Bound against the original layers
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_image_call_within_the_bound_of_the_original_layers(fused, original, reference, grids):
    data = vision_data(grids, seed=11)
    got = fused.get_vision_hidden_states(data)
    want = original.get_vision_hidden_states(data)
    ref = reference.get_vision_hidden_states(
        {**data, "pixel_values": [p.float() for p in data["pixel_values"]]}
    )
    assert got.shape == want.shape == (len(grids), 64, 4096)
    check_bound(got, want, ref, f"image call, {len(grids)} slice(s)")


@pytest.mark.cuda
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_siglip_stack_within_the_bound_of_the_original_layers(fused, original, reference, grids):
    """SigLIP's own output (patch embedding to post LayerNorm), the valid patches of each slice."""
    from vllm_omni.model_executor.models.minicpmo_4_5 import vision_path

    data = vision_data(grids, seed=12)
    pixels, padded = vision_path.pad_vision_slices(data["pixel_values"])
    tgt = data["tgt_sizes"]
    n = pixels.shape[-1] // 14
    valid = torch.arange(n, device="cuda")[None, :] < tgt.prod(-1, keepdim=True)
    outs = [
        vision_path.encode_packed_slices(m.vpm, p, tgt, valid if padded else None)
        for m, p in ((fused, pixels), (original, pixels), (reference, pixels.float()))
    ]
    check_bound(*(o[valid] for o in outs), f"SigLIP stack, {len(grids)} slice(s)")


@pytest.mark.cuda
@pytest.mark.parametrize(
    "lengths, frames", [([100], 100), ([100, 60], 100)], ids=["1 s", "1 s + 0.6 s padded"]
)
@torch.inference_mode()
def test_audio_call_within_the_bound_of_the_original_layers(fused, original, reference, lengths, frames):
    data = audio_data(lengths, frames, seed=13)
    got, want, ref = (m.get_audio_hidden_states(data) for m in (fused, original, reference))
    for i, (g, w, r) in enumerate(zip(got, want, ref, strict=True)):
        check_bound(g, w, r, f"audio item {i} of {lengths}")


@pytest.mark.cuda
@torch.inference_mode()
def test_duplex_chunks_within_the_bound_of_the_original_layers(fused, original, reference):
    from minicpmo_cg.duplex import DuplexSession, frame_chunks

    mel = torch.randn(80, 4 * 100 + 2, generator=torch.Generator().manual_seed(14))
    chunks = frame_chunks(mel, 4, device="cuda")
    sessions = {name: DuplexSession() for name in ("fused", "original", "reference")}
    models = {"fused": fused, "original": original, "reference": reference}
    for index, chunk in enumerate(chunks):
        outs = {name: sessions[name].encode(models[name], chunk) for name in models}
        check_bound(outs["fused"], outs["original"], outs["reference"], f"duplex chunk {index}")


# ---------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graphed(fused):
    from minicpmo_cg.standalone import wire_encoder_graphs
    from minicpmo_cg.vllm_config import standalone_vllm_config

    wire_encoder_graphs(fused, standalone_vllm_config(), enabled=True, max_graphs=8, admission="count")
    yield fused
    wire_encoder_graphs(fused, standalone_vllm_config(), enabled=False)


def detached(model, fn, fused_on=True):
    """``fn()`` with the graph adapters detached, the fused layers on or off."""
    adapters = model.vpm._encoder_graph, model._audio_encoder_graph
    model.vpm._encoder_graph = model._audio_encoder_graph = None
    modules = (model.vpm, model.resampler, model.apm)
    states = [m._fused_layers for m in modules]
    for m in modules:
        m._fused_layers = fused_on
    try:
        return fn()
    finally:
        model.vpm._encoder_graph, model._audio_encoder_graph = adapters
        for m, state in zip(modules, states, strict=True):
            m._fused_layers = state


@pytest.mark.cuda
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_image_graph_replays_the_fused_layers_bitwise(graphed, grids):
    graph = graphed.vpm._encoder_graph
    data = vision_data(grids, seed=15)
    before = graph.get_cumulative_stats()["num_graphs"]
    for _ in range(3):
        out = graphed.get_vision_hidden_states(data)
    assert graph.get_cumulative_stats()["num_graphs"] == before + 1
    assert torch.equal(out, detached(graphed, lambda: graphed.get_vision_hidden_states(data)))
    assert not torch.equal(
        out, detached(graphed, lambda: graphed.get_vision_hidden_states(data), fused_on=False)
    )
    if grids == ONE_SLICE:
        graphs = graph.get_detailed_stats()["graphs"]
        (entry,) = [g for g in graphs if tuple(g["inputs"][0][0]) == (1, 3, 14, 1024 * 14)]
        mib = entry["bytes"] / 2**20
        print(
            f"single-slice image graph: {mib:.1f} MiB (pool {entry['pool_bytes'] / 2**20:.1f}, "
            f"static {entry['static_bytes'] / 2**20:.1f})"
        )
        assert mib <= 64.0


@pytest.mark.cuda
@torch.inference_mode()
def test_audio_graph_replays_the_fused_layers_bitwise(graphed):
    data = audio_data([100], 100, seed=16)
    for _ in range(3):
        out = graphed.get_audio_hidden_states(data)[0]
    assert graphed._audio_encoder_graph.get_cumulative_stats()["graph_hits"] >= 1
    assert torch.equal(out, detached(graphed, lambda: graphed.get_audio_hidden_states(data))[0])
    assert not torch.equal(
        out, detached(graphed, lambda: graphed.get_audio_hidden_states(data), fused_on=False)[0]
    )


@pytest.mark.cuda
@torch.inference_mode()
def test_streaming_graphs_replay_the_fused_layers_bitwise_without_the_zero_mask(graphed):
    """Two sessions over the same chunks: the first is seen (warmup misses), the second's chunks are
    captured and replayed (count admission, two sightings); each equals an eager session's chunk."""
    from minicpmo_cg.duplex import DuplexSession, frame_chunks

    adapter = graphed._streaming_audio_encoder_graph
    assert adapter is not None
    mel = torch.randn(80, 5 * 100 + 2, generator=torch.Generator().manual_seed(17))
    chunks = frame_chunks(mel, 5, device="cuda")
    first, second = DuplexSession(), DuplexSession()
    for chunk in chunks:
        first.encode(graphed, chunk)
    got = [second.encode(graphed, chunk) for chunk in chunks]
    assert adapter.get_cumulative_stats()["graph_hits"] >= len(chunks)
    graphed._streaming_audio_encoder_graph = None
    try:
        eager_session = DuplexSession()
        want = [eager_session.encode(graphed, chunk) for chunk in chunks]
    finally:
        graphed._streaming_audio_encoder_graph = adapter
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"chunk {index}: max diff {(g.float() - w.float()).abs().max()}"
    plans = graphed._streaming_audio_mask_plans
    assert plans and all(plan.drop_mask and plan.sdpa_backend is None for plan in plans.values())


# ---------------------------------------------------------------------------
# The kernel, its fallback, packing
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("rows, cols", [(1024, 1152), (10240, 1152), (50, 1024), (1500, 1024), (3, 80)])
def test_triton_kernel_matches_its_torch_reference(rows, cols):
    from vllm_omni.model_executor.models.minicpmo_4_5.ops import fused_add_layer_norm as aln

    assert aln.triton_unavailable_reason(torch.device("cuda")) is None
    generator = torch.Generator(device="cuda").manual_seed(rows + cols)
    x, y = (torch.randn(rows, cols, device="cuda", generator=generator).bfloat16() for _ in range(2))
    bias, ln_bias = (0.1 * torch.randn(cols, device="cuda", generator=generator).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(cols, device="cuda", generator=generator)).bfloat16()
    normed, total = aln.add_layer_norm(x, y, bias, weight, ln_bias, 1e-6)
    want_normed, want_total = aln.add_layer_norm_reference(x, y, bias, weight, ln_bias, 1e-6)
    assert torch.equal(total, want_total)  # the same float32 sums, rounded once
    diff = float((normed.float() - want_normed.float()).abs().max())
    assert diff <= 2**-7 * float(want_normed.float().abs().max()), diff
    only, none = aln.add_layer_norm(x, None, None, weight, ln_bias, 1e-6, store_sum=False)
    assert none is None
    torch.testing.assert_close(only, torch.nn.functional.layer_norm(x, (cols,), weight, ln_bias, 1e-6))
    strided = torch.randn(rows, 2 * cols, device="cuda", generator=generator).bfloat16()[:, :cols]
    got, _ = aln.add_layer_norm(strided, y, None, weight, ln_bias, 1e-6)
    torch.testing.assert_close(got, aln.add_layer_norm_reference(strided, y, None, weight, ln_bias, 1e-6)[0])


@pytest.mark.cuda
def test_without_triton_the_torch_ops_run_with_one_log_line(monkeypatch, log_records):
    from vllm_omni.model_executor.models.minicpmo_4_5.ops import fused_add_layer_norm as aln

    records = log_records(aln.logger)
    monkeypatch.setattr(aln, "HAS_TRITON", False)
    monkeypatch.setattr(aln, "_LOGGED_FALLBACKS", set())
    x = torch.randn(64, 1152, device="cuda").bfloat16()
    w = torch.ones(1152, device="cuda").bfloat16()
    for _ in range(2):
        got, total = aln.add_layer_norm(x, x, None, w, w, 1e-6)
    assert len(records.messages(logging.INFO)) == 1 and "Triton is not available" in records.messages()[0]
    monkeypatch.setattr(aln, "HAS_TRITON", True)
    torch.testing.assert_close(got, aln.add_layer_norm(x, x, None, w, w, 1e-6)[0], atol=1e-2, rtol=2**-7)


@pytest.mark.cuda
def test_packing_is_refused_inside_a_capture():
    from vllm_omni.model_executor.models.minicpmo_4_5 import fused_layers

    attention = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Linear(64, 64, device="cuda"))
    packed = fused_layers.pack_qkv(attention)
    assert fused_layers.pack_qkv(attention) is packed
    attention.k_proj.weight.data = attention.k_proj.weight.data.clone()  # replaced: must pack again
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"), torch.cuda.graph(graph):
        fused_layers.pack_qkv(attention)
    torch.accelerator.synchronize()
    assert fused_layers.pack_qkv(attention).shared_by(attention)
