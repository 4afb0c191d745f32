# SPDX-License-Identifier: Apache-2.0
"""The Whisper encoder's hidden-state layout.

The conv output ``(B, d_model, T)`` is read as ``(B, T, d_model)`` through a transposed view; a sum
that took that layout would keep it through every layer, which would then copy its input before
both LayerNorms and run both residual adds through the strided elementwise kernel. A tiny Whisper
(2 layers) checks, for a stateless call (``get_audio_hidden_states``) and for duplex streaming
chunks over a session cache (``get_audio_embedding_streaming``), both eager paths:

- the hidden states entering every layer and the final layer_norm are contiguous;
- no layer copies a ``(B, T, d_model)`` tensor (operators counted per layer with
  ``torch.profiler``), where the former layout makes ``2`` copies per layer and ``1`` more;
- every layer's output, the embeddings and the session cache are bitwise those of the former
  layout, with SDPA and eager attention.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.tiny_encoders import copies_per_region, tiny_audio_model
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from minicpmo_cg.duplex_session import DuplexChunk, DuplexSession

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

llm = pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm")

LAYERS, D_MODEL, HEADS, EMBED, POOL = 2, 64, 4, 32, 2
POSITIONS = 128  # max_source_positions
N = 10  # positions per streaming chunk once the context frames are cut
PATHS = ("stateless", "streaming")


def tiny_model(attn: str) -> nn.Module:
    """The audio modules of MiniCPM-o 4.5 at tiny widths, bf16, with no CUDA graph adapter."""
    model = tiny_audio_model(
        positions=POSITIONS,
        chunk_seconds=N / 50,
        attn=attn,
        layers=LAYERS,
        d_model=D_MODEL,
        heads=HEADS,
        embed=EMBED,
        pool=POOL,
    )
    model._audio_encoder_graph = None
    model._streaming_audio = None
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def stateless_call(model) -> list[torch.Tensor]:
    """A 1 s item (100 mel frames) batched with a padded 0.6 s one."""
    g = torch.Generator().manual_seed(1)
    data = {
        "audio_features": torch.randn(2, 80, 100, generator=g, dtype=torch.bfloat16),
        "audio_feature_lens": [torch.tensor([100]), torch.tensor([60])],
    }
    return model.get_audio_hidden_states(data)


def streaming_session(model) -> list[torch.Tensor]:
    """Three duplex chunks of one session: the first (prefix 0) and two over a growing cache."""
    g = torch.Generator().manual_seed(2)
    session = DuplexSession()
    outs = []
    for i in range(3):
        features = torch.randn(1, 80, 2 * N + (2 if i == 0 else 4), generator=g, dtype=torch.bfloat16)
        outs.append(session.encode(model, DuplexChunk(features, 0 if i == 0 else 2)))
    return outs


CALLS: dict[str, Callable[[nn.Module], list[torch.Tensor]]] = {
    "stateless": stateless_call,
    "streaming": streaming_session,
}


def watched_modules(model) -> dict[str, nn.Module]:
    modules = {f"layer{i}": layer for i, layer in enumerate(model.apm.layers)}
    modules["layer_norm"] = model.apm.layer_norm
    return modules


def former_layout(model):
    """Give layer 0 the embedding sum in the conv output's transposed layout, as the former
    ``inputs_embeds + embed_pos`` laid it out (the same values); returns the hook handle."""

    def transpose_input(_module, args):
        hidden_states = args[0].transpose(1, 2).contiguous().transpose(1, 2)
        return (hidden_states, *args[1:])

    return model.apm.layers[0].register_forward_pre_hook(transpose_input)


def run(model, path: str, former: bool = False) -> dict:
    """One call of ``path``: the outputs, what enters and leaves each watched module, and the copies
    of a ``(B, T, d_model)`` tensor (``aten::clone``, as ``.contiguous()`` of a strided tensor makes)
    under each, counted with ``torch.profiler``."""
    seen = {"inputs": [], "outputs": []}
    ranges: dict[str, record_function] = {}

    def enter(name, args):
        seen["inputs"].append((name, args[0]))
        ranges[name] = record_function(f"region:{name}")
        ranges[name].__enter__()

    def leave(name, output):
        seen["outputs"].append((name, output[0] if isinstance(output, tuple) else output))
        ranges.pop(name).__exit__(None, None, None)

    hooks = [former_layout(model)] if former else []
    for name, module in watched_modules(model).items():
        hooks.append(module.register_forward_pre_hook(lambda _m, a, name=name: enter(name, a)))
        hooks.append(module.register_forward_hook(lambda _m, _a, o, name=name: leave(name, o)))
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            seen["result"] = CALLS[path](model)
    finally:
        for hook in hooks:
            hook.remove()
    seen["copies"] = copies_per_region(prof, watched_modules(model), D_MODEL)
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("path", PATHS)
def test_hidden_states_are_contiguous_entering_every_layer(path, attn):
    inputs = run(tiny_model(attn), path)["inputs"]
    calls = 1 if path == "stateless" else 3
    assert len(inputs) == calls * (LAYERS + 1)
    assert [(name, tuple(h.shape), h.stride()) for name, h in inputs if not h.is_contiguous()] == []


@pytest.mark.parametrize("path", PATHS)
def test_no_layer_copies_its_hidden_states(path):
    """The counter is checked on the former layout too: 2 copies per layer (one per LayerNorm) and
    1 for the final layer_norm, per call; each a strided kernel on a GPU."""
    model = tiny_model("sdpa")
    calls = 1 if path == "stateless" else 3
    former = run(model, path, former=True)["copies"]
    assert former == {"layer0": 2 * calls, "layer1": 2 * calls, "layer_norm": calls}
    assert run(model, path)["copies"] == {"layer0": 0, "layer1": 0, "layer_norm": 0}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("path", PATHS)
def test_layout_changes_no_bit_of_any_layer_or_the_cache(path, attn):
    model = tiny_model(attn)
    got, want = run(model, path), run(model, path, former=True)
    assert want["inputs"][1][1].is_contiguous() is False  # the former layout reached layer 1
    assert [name for name, _ in got["outputs"]] == [name for name, _ in want["outputs"]]
    for (name, g), (_, w) in zip(got["outputs"], want["outputs"]):
        assert torch.equal(g, w), f"{path}/{attn}: {name} differs"
    assert len(got["result"]) == len(want["result"])
    for i, (g, w) in enumerate(zip(got["result"], want["result"])):
        assert torch.equal(g, w), f"{path}/{attn}: output {i} differs"
