# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the fused encoder layers (``fused_layers.py``, ``ops/fused_add_layer_norm.py``).

- In float32 on the CPU the fused SigLIP and Whisper layers compute what the unfused layers of the
  model file compute (the same math; float32 rounding apart), through the model's own
  call sites (``SiglipVisionTransformer._encode_last_hidden_state``, ``vision_path``'s
  ``encode_packed_slices``, the resampler, ``MiniCPMWhisperEncoder.forward`` stateless and
  streaming with a cache), with and without padding; the fused path is shown to run (its kernel is
  counted), and not to run where it must not (the option off, eager SigLIP attention, autograd
  on, head masks); with it the streaming graphs drop the chunk's all-zero mask.
- Packing q/k/v keeps one copy of the weights: the parameters are views of the packed tensor,
  weight loading writes through them, and parameters replaced since (a cast) are packed again.
- The residual add + LayerNorm op falls back to torch where Triton cannot run, saying so once;
  its Triton kernel, run by Triton's CPU interpreter, computes the reference's values. Inputs
  without contiguous rows (column-sliced, transposed) are copied once, by the op or, for SigLIP's
  stack, before its first call; rows at any row stride are read in place.
- ``--hf-overrides encoder_fused_layers``: registered, validated with the other keys, and read by
  ``configure_fused_layers`` with one INFO line.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny_encoders import tiny_audio_model, tiny_siglip_config

from vllm_omni.model_executor.models.minicpmo_4_5 import fused_layers as fused
from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm
from vllm_omni.model_executor.models.minicpmo_4_5 import siglip_attention, vision_path
from vllm_omni.model_executor.models.minicpmo_4_5.ops import fused_add_layer_norm as aln

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


#: float32: the fused and unfused paths differ by summation order only.
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the fused residual add + LayerNorm calls (each fused layer makes two)."""
    calls = []
    original = fused.add_layer_norm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused, "add_layer_norm", counting)
    return calls


def randomise_(module, seed=0, std=0.2):
    """Every parameter drawn from a seeded normal, biases and LayerNorm affines included (around 1
    for LayerNorm weights), so that a dropped or doubled bias shows."""
    generator = torch.Generator().manual_seed(seed)
    norm_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.LayerNorm)}
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std + (id(param) in norm_weights))
    return module


def siglip(attn="sdpa", layers=3, seed=0):
    vpm = llm.SiglipVisionTransformer(tiny_siglip_config(llm, attn, layers=layers, intermediate=160)).eval()
    return randomise_(vpm, seed)


def configured(module_attr, module, choice="all"):
    model = SimpleNamespace(config=SimpleNamespace(encoder_fused_layers=choice), vpm=None, apm=None)
    setattr(model, module_attr, module)
    return model, fused.configure_fused_layers(model)


def unfused(module, fn):
    previous = module._fused_layers
    module._fused_layers = False
    try:
        return fn()
    finally:
        module._fused_layers = previous


def padded_mask(vpm, lengths, positions):
    valid = torch.arange(positions)[None, :] < torch.tensor(lengths)[:, None]
    return siglip_attention.encoder_attention_mask(valid, torch.float32, False)


# ---------------------------------------------------------------------------
# SigLIP
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [None, (50, 37, 12)], ids=["full", "padded"])
@torch.no_grad()
def test_siglip_fused_layers_match_the_unfused_layers_in_float32(kernel_calls, lengths):
    vpm = siglip()
    _, states = configured("vpm", vpm)
    assert states["vision"] == "on" and vpm._fused_layers
    hidden = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(1))
    mask = None if lengths is None else padded_mask(vpm, lengths, 50)
    got = vpm._encode_last_hidden_state(hidden, mask)
    assert len(kernel_calls) == 2 * len(vpm.encoder.layers) + 1
    want = unfused(vpm, lambda: vpm._encode_last_hidden_state(hidden, mask))
    assert len(kernel_calls) == 2 * len(vpm.encoder.layers) + 1  # the unfused call made none
    assert got.shape == want.shape == (3, 50, 64) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL)


def without_contiguous_rows(hidden, layout):
    """``hidden`` ``(B, N, width)``'s values in a layout whose rows are not contiguous: every other
    column of a tensor twice as wide, or the transposed view the patch convolution returns."""
    if layout == "every other column":
        wide = torch.zeros(*hidden.shape[:-1], 2 * hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        wide[..., ::2] = hidden
        strided = wide[..., ::2]
    else:
        strided = hidden.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(strided, hidden) and strided.stride(-1) != 1
    return strided


@pytest.mark.parametrize("layout", ["every other column", "transposed"])
@torch.no_grad()
def test_siglip_fused_layers_take_an_input_without_contiguous_rows(monkeypatch, layout):
    """One slice's patch embeddings without contiguous rows: the fused stack copies them once, before
    its first residual add + LayerNorm (it raised ValueError), and computes what the unfused stack does."""
    vpm = siglip()
    configured("vpm", vpm)
    hidden = torch.randn(1, 50, 64, generator=torch.Generator().manual_seed(4))
    strided = without_contiguous_rows(hidden, layout)
    strides = []
    original = fused.add_layer_norm

    def recording(residual, *args, **kwargs):
        strides.append(residual.stride(-1))
        return original(residual, *args, **kwargs)

    monkeypatch.setattr(fused, "add_layer_norm", recording)
    got = vpm._encode_last_hidden_state(strided, None)
    assert strides == [1] * (2 * len(vpm.encoder.layers) + 1)  # copied before the first call, once
    torch.testing.assert_close(got, vpm._encode_last_hidden_state(hidden, None), rtol=0, atol=0)
    torch.testing.assert_close(got, unfused(vpm, lambda: vpm._encode_last_hidden_state(strided, None)), **TOL)


@torch.no_grad()
def test_siglip_patch_embedding_runs_as_a_gemm_with_the_convolutions_values():
    vpm = siglip()
    configured("vpm", vpm)
    pixels = torch.randn(2, 3, 14, 14 * 9, generator=torch.Generator().manual_seed(2))
    got = fused.siglip_patch_embeddings(vpm, pixels)
    want = unfused(vpm, lambda: fused.siglip_patch_embeddings(vpm, pixels))
    assert got.is_contiguous() and not want.is_contiguous()  # the GEMM's rows vs the conv's view
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(want, vpm.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2))
    # another layout (two rows of patches) keeps the convolution
    square = torch.randn(1, 3, 28, 28)
    torch.testing.assert_close(
        fused.siglip_patch_embeddings(vpm, square),
        vpm.embeddings.patch_embedding(square).flatten(2).transpose(1, 2),
    )


@torch.no_grad()
def test_siglip_whole_slice_path_matches_with_the_option_off(kernel_calls):
    """``encode_packed_slices`` (patch embedding, positions, encoder, post LayerNorm) fused vs not."""
    vpm = siglip()
    configured("vpm", vpm)
    generator = torch.Generator().manual_seed(3)
    grids = [(5, 7), (4, 4)]
    pixels = torch.zeros(2, 3, 14, 14 * 35)
    for i, (h, w) in enumerate(grids):
        pixels[i, ..., : 14 * h * w] = torch.randn(3, 14, 14 * h * w, generator=generator)
    tgt_sizes = torch.tensor(grids)
    valid = torch.arange(35)[None, :] < tgt_sizes.prod(-1, keepdim=True)
    got = vision_path.encode_packed_slices(vpm, pixels, tgt_sizes, valid)
    assert kernel_calls
    want = unfused(vpm, lambda: vision_path.encode_packed_slices(vpm, pixels, tgt_sizes, valid))
    torch.testing.assert_close(got[valid], want[valid], **TOL)


@pytest.mark.parametrize(
    "pieces",
    [
        (),
        *((p,) for p in fused.SIGLIP_PIECES),
        *(tuple(q for q in fused.SIGLIP_PIECES if q != p) for p in fused.SIGLIP_PIECES),
    ],
    ids=["none", *(f"only {p}" for p in fused.SIGLIP_PIECES), *(f"all but {p}" for p in fused.SIGLIP_PIECES)],
)
@torch.no_grad()
def test_each_siglip_piece_switched_alone_keeps_the_unfused_math(kernel_calls, pieces):
    """Any set of SigLIP's pieces still computes the unfused layers in float32; the pieces left out
    run their unfused ops (no fused kernel without ``add_layer_norm``, the convolution without
    ``patch_gemm``)."""
    vpm = siglip()
    model, _ = configured("vpm", vpm)
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randn(2, 3, 14, 14 * 12, generator=generator)
    tgt_sizes = torch.tensor([[3, 4], [3, 4]])
    with fused.siglip_fused_pieces(model, pieces):
        assert fused.siglip_patch_embeddings(vpm, pixels).is_contiguous() is ("patch_gemm" in pieces)
        got = vision_path.encode_packed_slices(vpm, pixels, tgt_sizes, None)
    assert bool(kernel_calls) is ("add_layer_norm" in pieces)
    want = unfused(vpm, lambda: vision_path.encode_packed_slices(vpm, pixels, tgt_sizes, None))
    torch.testing.assert_close(got, want, **TOL)
    assert vpm._fused_pieces == fused.SIGLIP_DEFAULT_PIECES  # restored


def test_siglip_fused_pieces_refuses_unknown_names_and_restores_on_error():
    vpm = siglip()
    model, _ = configured("vpm", vpm)
    with pytest.raises(ValueError, match=r"unknown piece\(s\) \['gelu'\]"):
        with fused.siglip_fused_pieces(model, ["gelu"]):
            pass
    with pytest.raises(RuntimeError), fused.siglip_fused_pieces(model, ["packed_qkv"]):
        assert vpm._fused_pieces == frozenset({"packed_qkv"})
        raise RuntimeError
    assert vpm._fused_pieces == fused.SIGLIP_DEFAULT_PIECES


def test_siglip_fused_layers_stay_off_where_they_do_not_apply(kernel_calls):
    eager = siglip("eager")
    _, states = configured("vpm", eager)
    assert states["vision"] == "off (vision_attn_implementation=eager)" and not eager._fused_layers
    vpm = siglip()
    _, states = configured("vpm", vpm, "audio")
    assert states["vision"] == "off (encoder_fused_layers=audio)" and not vpm._fused_layers
    vpm._fused_layers = True
    hidden = torch.randn(1, 10, 64)
    with torch.no_grad():
        eager._encode_last_hidden_state(hidden, None)
        vpm.train()
        vpm._encode_last_hidden_state(hidden, None)
        vpm.eval()
        assert not fused.siglip_fused_applies(vpm, hidden, torch.ones(1, 10, dtype=torch.bool))  # FA2's mask
    vpm._encode_last_hidden_state(hidden, None)  # autograd on
    assert kernel_calls == []
    with torch.no_grad():
        vpm._encode_last_hidden_state(hidden, None)
    assert kernel_calls


def test_resampler_attention_weights_are_asked_for_only_without_the_fused_vision_layers():
    resampler = llm.Resampler(num_queries=4, embed_dim=64, num_heads=2, kv_dim=64, adaptive=True)
    model = SimpleNamespace(
        config=SimpleNamespace(encoder_fused_layers="all"), vpm=siglip(), apm=None, resampler=resampler
    )
    fused.configure_fused_layers(model)
    assert fused.resampler_needs_weights(resampler) is False
    with fused.siglip_fused_pieces(model, [p for p in fused.SIGLIP_PIECES if p != "resampler_sdpa"]):
        assert fused.resampler_needs_weights(resampler) is True
    assert fused.resampler_needs_weights(resampler) is False
    model.config.encoder_fused_layers = "none"
    fused.configure_fused_layers(model)
    assert fused.resampler_needs_weights(resampler) is True


@torch.no_grad()
def test_resampler_output_without_weights_matches_in_float32():
    torch.manual_seed(4)
    resampler = llm.Resampler(num_queries=4, embed_dim=64, num_heads=2, kv_dim=64, adaptive=True).eval()
    randomise_(resampler, seed=4, std=0.3)
    x = torch.randn(2, 12, 64)
    tgt_sizes = torch.tensor([[3, 4], [2, 3]])
    calls = []
    resampler.attn.register_forward_pre_hook(
        lambda m, a, kw: calls.append((kw.get("need_weights"), a[1].is_contiguous(), a[2].is_contiguous())),
        with_kwargs=True,
    )
    want = resampler(x, tgt_sizes)
    assert calls == [(True, False, False)]  # the permuted (L, B, D) view of two slices
    resampler._fused_layers = True
    torch.testing.assert_close(resampler(x, tgt_sizes), want, **TOL)
    assert calls[1:] == [(False, True, True)]  # SDPA; keys and values contiguous


# ---------------------------------------------------------------------------
# Whisper
# ---------------------------------------------------------------------------


def whisper(attn="sdpa"):
    model = tiny_audio_model(positions=200, chunk_seconds=1.0, attn=attn).eval()
    randomise_(model.apm, seed=5, std=0.1)
    return model


def chunked_mask(lengths, positions, chunk):
    """The stateless call's mask: padding keys and keys past the query's chunk at -inf."""
    index = torch.arange(positions)
    masked = (index[None, None, :] >= torch.tensor(lengths)[:, None, None]) | (
        index[None, None, :] >= ((index[None, :, None] // chunk) + 1) * chunk
    )
    return torch.zeros(len(lengths), 1, positions, positions).masked_fill_(masked[:, None], float("-inf"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_whisper_fused_layers_match_the_unfused_layers_stateless(kernel_calls, attn):
    model = whisper(attn)
    apm = model.apm
    _, states = configured("apm", apm)
    assert states["audio"] == "on"
    features = torch.randn(2, 80, 200, generator=torch.Generator().manual_seed(6))
    mask = chunked_mask([100, 70], 100, 50)
    got = apm(features, attention_mask=mask, output_hidden_states=True)
    assert len(kernel_calls) == 2 * len(apm.layers) + 1
    want = unfused(apm, lambda: apm(features, attention_mask=mask, output_hidden_states=True))
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOL)
    assert len(got.hidden_states) == len(want.hidden_states) == len(apm.layers) + 1
    for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    plain = apm(features, attention_mask=mask, return_dict=False)
    assert isinstance(plain, tuple) and len(plain) == 1
    torch.testing.assert_close(plain[0], want.last_hidden_state, **TOL)
    # the model's region: encoder, projection, pooling
    torch.testing.assert_close(
        model._encode_audio_features(features, mask),
        unfused(apm, lambda: model._encode_audio_features(features, mask)),
        **TOL,
    )


def streaming_chunks(model, chunks, seed=7):
    """A session's chunks through the encoder with a cache (as get_audio_embedding_streaming
    calls it: 50 positions after the context frames, an all-zero mask); returns the outputs and
    the cache."""
    generator = torch.Generator().manual_seed(seed)
    past, outputs = None, []
    for index in range(chunks):
        prefix = 0 if index == 0 else 2
        features = torch.randn(1, 80, 100 + prefix + 2, generator=generator)
        past_len = 0 if past is None else llm._get_audio_cache_length(past)
        mask = torch.zeros(1, 1, 50, past_len + 50)
        out = model.apm(
            features,
            past_key_values=past,
            use_cache=True,
            output_hidden_states=True,
            attention_mask=mask,
            use_extra_context=True,
            prefix_extra_frames=prefix,
            suffix_extra_frames=2,
        )
        past = out.past_key_values
        outputs.append(out.hidden_states[-1])
    return outputs, past


@torch.no_grad()
def test_whisper_fused_layers_match_the_unfused_layers_streaming(kernel_calls):
    model = whisper()
    configured("apm", model.apm)
    got, got_cache = streaming_chunks(model, 3)
    assert len(kernel_calls) == 3 * (2 * len(model.apm.layers) + 1)
    assert isinstance(got_cache, llm.EncoderDecoderCache)
    want, want_cache = unfused(model.apm, lambda: streaming_chunks(model, 3))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for layer in range(len(model.apm.layers)):
        mine = got_cache.self_attention_cache.layers[layer]
        theirs = want_cache.self_attention_cache.layers[layer]
        assert mine.keys.shape == theirs.keys.shape == (1, 4, 150, 16)
        torch.testing.assert_close(mine.keys, theirs.keys, **TOL)
        torch.testing.assert_close(mine.values, theirs.values, **TOL)


def test_whisper_fused_layers_stay_off_where_they_do_not_apply(kernel_calls):
    model = whisper()
    apm = model.apm
    _, states = configured("apm", apm, "vision")
    assert states["audio"] == "off (encoder_fused_layers=vision)" and not apm._fused_layers
    apm._fused_layers = True
    hidden = torch.randn(1, 50, 64)
    assert fused.whisper_fused_applies(apm, hidden, None, False) is False  # autograd on
    with torch.no_grad():
        assert fused.whisper_fused_applies(apm, hidden, None, False)
        assert not fused.whisper_fused_applies(apm, hidden, torch.ones(2, 4), False)  # head mask
        assert not fused.whisper_fused_applies(apm, hidden, None, True)  # attention weights
        assert not fused.whisper_fused_applies(apm, hidden.half(), None, False)  # FP16's clamp
        apm.train()
        assert not fused.whisper_fused_applies(apm, hidden, None, False)


# ---------------------------------------------------------------------------
# Packed q/k/v
# ---------------------------------------------------------------------------


def storage_bytes(module):
    return sum(
        {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}.values()
    )


@torch.no_grad()
def test_packing_keeps_one_copy_of_the_weights_and_loading_writes_through_it():
    model = whisper()
    apm = model.apm
    before = storage_bytes(apm)
    state = copy.deepcopy(apm.state_dict())
    configured("apm", apm)
    attention = apm.layers[0].self_attn
    packed = fused.pack_qkv(attention)
    assert packed.weight.shape == (192, 64) and packed.bias.shape == (192,)
    for index, projection in enumerate((attention.q_proj, attention.k_proj, attention.v_proj)):
        assert projection.weight.untyped_storage().data_ptr() == packed.weight.untyped_storage().data_ptr()
        assert torch.equal(projection.weight, packed.weight[64 * index : 64 * (index + 1)])
    assert attention.k_proj.bias is None and torch.equal(packed.bias[64:128], torch.zeros(64))
    assert torch.equal(attention.q_proj.bias, packed.bias[:64])
    # one copy of the weights (the packed k bias slot adds 64 zeros per layer)
    assert storage_bytes(apm) == before + 4 * 64 * len(apm.layers)
    # in-place loading (load_state_dict copies into the parameters) reaches the packed tensor
    state["layers.0.self_attn.k_proj.weight"] = torch.full((64, 64), 0.5)
    apm.load_state_dict(state)
    assert fused.pack_qkv(attention) is packed and torch.equal(
        packed.weight[64:128], torch.full((64, 64), 0.5)
    )
    assert set(apm.state_dict()) == set(state)


@torch.no_grad()
def test_replaced_parameters_are_packed_again():
    model = whisper()
    apm = model.apm
    configured("apm", apm)
    attention = apm.layers[1].self_attn
    packed = fused.pack_qkv(attention)
    apm.double()  # swaps every parameter's .data
    assert not packed.shared_by(attention)
    features = torch.randn(1, 80, 100, dtype=torch.float64)
    got = apm(features).last_hidden_state
    repacked = attention._packed_qkv
    assert repacked is not packed and repacked.weight.dtype == torch.float64 and repacked.shared_by(attention)
    torch.testing.assert_close(got, unfused(apm, lambda: apm(features).last_hidden_state), **TOL)


# ---------------------------------------------------------------------------
# The residual add + LayerNorm op
# ---------------------------------------------------------------------------


def rows(generator, n=6, width=40, dtype=torch.float32):
    return [torch.randn(shape, generator=generator).to(dtype) for shape in ((n, width), (n, width), (width,))]


def test_add_layer_norm_falls_back_to_torch_with_one_log_line(monkeypatch, log_records):
    records = log_records(aln.logger)
    monkeypatch.setattr(aln, "_LOGGED_FALLBACKS", set())
    monkeypatch.setattr(aln, "HAS_TRITON", True)  # as on a GPU host: the device decides
    generator = torch.Generator().manual_seed(8)
    residual, update, bias = rows(generator)
    weight, ln_bias = torch.randn(40, generator=generator), torch.randn(40, generator=generator)
    for _ in range(3):
        normed, total = aln.add_layer_norm(residual, update, bias, weight, ln_bias, 1e-5)
    assert aln.triton_unavailable_reason(residual.device) == "the tensors are on cpu, not a CUDA device"
    messages = records.messages(logging.INFO)
    assert messages == [
        "MiniCPM-o 4.5 fused residual add + LayerNorm: the tensors are on cpu, not a CUDA device; "
        "running torch's add and layer_norm instead"
    ]
    torch.testing.assert_close(total, residual + (update + bias), rtol=0, atol=0)
    want = torch.nn.functional.layer_norm(residual + update + bias, (40,), weight, ln_bias, 1e-5)
    torch.testing.assert_close(normed, want, **TOL)
    normed2, none = aln.add_layer_norm(residual, None, None, weight, ln_bias, 1e-5, store_sum=False)
    assert none is None
    torch.testing.assert_close(
        normed2, torch.nn.functional.layer_norm(residual, (40,), weight, ln_bias, 1e-5)
    )
    monkeypatch.setattr(aln, "HAS_TRITON", False)
    assert aln.triton_unavailable_reason(torch.device("cuda", 0)).startswith("Triton is not available")
    aln.add_layer_norm(residual, update, bias, weight, ln_bias, 1e-5)
    aln.add_layer_norm(residual, update, bias, weight, ln_bias, 1e-5)
    assert len(records.messages(logging.INFO)) == 2  # one more line, for the other reason
    assert "Triton is not available (vllm.triton_utils.HAS_TRITON is False" in records.messages()[-1]


def test_add_layer_norm_refuses_bad_shapes():
    x = torch.zeros(4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"update must be \(4, 8\)"):
        aln.add_layer_norm(x, torch.zeros(4, 9), None, w, w, 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        aln.add_layer_norm(torch.zeros(2, 4, 8), None, None, w, w, 1e-5)
    with pytest.raises(ValueError, match="update_bias needs an update"):
        aln.add_layer_norm(x, None, w, w, w, 1e-5)


def test_add_layer_norm_copies_rows_that_are_not_contiguous_and_reads_row_strides_in_place(monkeypatch):
    """What the kernel gets: a column-sliced or transposed residual or update is copied, once (it
    raised ValueError); contiguous rows at any row stride are passed as they are. Run with the
    kernel's launch replaced by the reference, as on a GPU."""
    generator = torch.Generator().manual_seed(9)
    residual, update, bias = rows(generator)
    weight, ln_bias = torch.randn(40, generator=generator), torch.randn(40, generator=generator)
    launched = []

    def launch(residual, update, update_bias, weight, bias, eps, store_sum, block_rows, num_warps):
        launched.append((residual, update))
        return aln.add_layer_norm_reference(residual, update, update_bias, weight, bias, eps, store_sum)

    monkeypatch.setattr(aln, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(aln, "_launch", launch)
    want = aln.add_layer_norm(residual, update, bias, weight, ln_bias, 1e-5)
    wide = torch.zeros(6, 80)
    wide[:, ::2] = residual
    row_strided = torch.zeros(6, 48)
    row_strided[:, :40] = update
    layouts = [
        (wide[:, ::2], update),  # every other column
        (residual.t().contiguous().t(), update.t().contiguous().t()),  # transposed
        (residual, row_strided[:, :40]),  # contiguous rows, row stride 48
    ]
    for x, y in layouts:
        launched.clear()
        got = aln.add_layer_norm(x, y, bias, weight, ln_bias, 1e-5)
        ((seen_x, seen_y),) = launched
        assert seen_x.stride(-1) == seen_y.stride(-1) == 1
        assert (seen_x.data_ptr() == x.data_ptr()) is (x.stride(-1) == 1)  # copied only when needed
        assert (seen_y.data_ptr() == y.data_ptr()) is (y.stride(-1) == 1)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the torch fallback (the CPU's path) takes them too
    monkeypatch.undo()
    got = aln.add_layer_norm(wide[:, ::2], update, bias, weight, ln_bias, 1e-5)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys, types
    import torch, triton, triton.language as tl

    # Triton's CPU interpreter runs the kernel on CPU tensors; vLLM reports no driver here.
    sys.modules["vllm.triton_utils"] = types.SimpleNamespace(HAS_TRITON=True, triton=triton, tl=tl)
    spec = importlib.util.spec_from_file_location("fused_add_layer_norm", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for width, rows_, block_rows in ((40, 7, 1), (40, 7, 4), (128, 5, 2)):
            x, y = (torch.randn(rows_, width, generator=generator).to(dtype) for _ in range(2))
            bias, weight, ln_bias = (torch.randn(width, generator=generator).to(dtype) for _ in range(3))
            for update, store in ((True, True), (False, False)):
                got = module._launch(x, y if update else None, bias if update else None, weight, ln_bias, 1e-5,
                                     store, block_rows, 4)
                want = module.add_layer_norm_reference(x, y if update else None, bias if update else None,
                                                       weight, ln_bias, 1e-5, store)
                key = f"{dtype} {width}x{rows_} rows/program {block_rows} update {update}"
                out[key] = [
                    float((got[0].float() - want[0].float()).abs().max()),
                    None if got[1] is None else bool(torch.equal(got[1], want[1])),
                    got[1] is None and want[1] is None or got[1] is not None,
                ]
    print(json.dumps(out))
    """
)


def test_the_triton_kernel_computes_the_reference_under_the_interpreter(tmp_path):
    """Float32 and float16 (rounded to nearest as on the GPU; the interpreter's bf16 casts are not):
    the sums are the reference's bits, the LayerNorm within float rounding, rows per program 1-4."""
    pytest.importorskip("triton")
    import json

    script = tmp_path / "interpret.py"
    script.write_text(INTERPRETER_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(script), aln.__file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows_ = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows_) == 12
    for key, (norm_err, sum_equal, sum_as_asked) in rows_.items():
        limit = 1e-5 if "float32" in key else 4e-3
        assert norm_err <= limit, (key, norm_err)
        assert sum_equal in (True, None), key
        assert sum_as_asked, key


# ---------------------------------------------------------------------------
# --hf-overrides encoder_fused_layers
# ---------------------------------------------------------------------------


def test_option_is_registered_and_validated_with_the_other_keys(ecg):
    spec = ecg.HF_OVERRIDE_KEYS[fused.FUSED_LAYERS_KEY]
    # the default is a choice ("all" or "audio", whichever the CUDA bound tests support; not pinned here)
    assert (spec.kind, spec.choices) == ("choice", fused.FUSED_LAYERS_CHOICES)
    assert spec.default in spec.choices
    assert ecg.read_hf_overrides(SimpleNamespace())[fused.FUSED_LAYERS_KEY] == spec.default
    with pytest.raises(ecg.HfOverridesError) as info:
        ecg.EncoderCudaGraphOptions.from_hf_config(SimpleNamespace(encoder_fused_layers=True))
    assert info.value.problems == [
        'encoder_fused_layers=true: got a boolean, expected one of "all", "vision", "audio", "none"'
    ]
    with pytest.raises(ecg.HfOverridesError, match="did you mean encoder_fused_layers"):
        ecg.read_hf_overrides(SimpleNamespace(encoder_fused_layer="all"))


@pytest.mark.parametrize(
    "choice, vision, audio",
    [("all", "on", "on"), ("vision", "on", "off"), ("audio", "off", "on"), ("none", "off", "off")],
)
def test_configure_sets_each_encoder_and_logs_one_line(log_records, choice, vision, audio):
    records = log_records(fused.logger)
    model = SimpleNamespace(
        config=SimpleNamespace(encoder_fused_layers=choice), vpm=siglip(), apm=whisper().apm
    )
    states = fused.configure_fused_layers(model)
    assert states["vision"].startswith(vision) and states["audio"].startswith(audio)
    assert model.vpm._fused_layers is (vision == "on") and model.apm._fused_layers is (audio == "on")
    assert ("_packed_qkv" in model.vpm.encoder.layers[0].self_attn.__dict__) is (vision == "on")
    assert records.messages(logging.INFO) == [
        f"MiniCPM-o 4.5 fused encoder layers: vision={states['vision']}, audio={states['audio']} "
        f"(--hf-overrides encoder_fused_layers={choice})"
    ]


def test_the_model_file_hooks_the_fused_layers_in():
    """The constructor configures them and Whisper's forward hands its layers over (the other seams
    are the modules exercised above)."""
    import inspect

    constructor = inspect.getsource(llm.MiniCPMO45OmniLLMForConditionalGeneration.__init__)
    assert "fused_layers.configure_fused_layers(self)" in constructor
    assert "fused_layers.whisper_encoder_output(" in inspect.getsource(llm.MiniCPMWhisperEncoder.forward)
    assert "fused_layers.resampler_needs_weights(self)" in inspect.getsource(llm.Resampler.forward)
    assert "fused_layers.resampler_keys_values(self, " in inspect.getsource(llm.Resampler.forward)
