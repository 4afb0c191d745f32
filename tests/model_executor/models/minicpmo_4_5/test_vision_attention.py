# SPDX-License-Identifier: Apache-2.0
"""CPU tests of SigLIP's attention (``vision_attn_implementation``).

- ``vision_attn_implementation``: the model resolves it from ``--hf-overrides`` (validated by
  ``siglip_attention`` itself), refuses ``flash_attention_2`` without flash-attn 2 before building
  anything heavy, builds SigLIP with the chosen class (SDPA by default) and logs it.
- SDPA attention: the same weights as eager, equal to eager in float32 (padding included), closer
  than eager to a float32 reference in bfloat16; the key-padding mask ``(B, 1, 1, N)`` adds exactly
  what the former ``(B, 1, N, N)`` mask added, and ``SiglipVisionTransformer.forward`` builds it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import logs
from helpers.tiny_encoders import ModelConfigTripwire, tiny_siglip_config

from vllm_omni.model_executor.models.minicpmo_4_5 import minicpmo_4_5_omni_llm as llm
from vllm_omni.model_executor.models.minicpmo_4_5 import siglip_attention as sa

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


if not hasattr(llm, "SiglipSdpaAttention"):
    pytest.fail(f"{llm.__file__} lacks SigLIP's SDPA attention (SiglipSdpaAttention)", pytrace=False)

PATCH = 14
SIDE = 70  # image_size 980 / patch 14: the checkpoint's position-bucket grid
HEADS_72 = {"hidden": 288, "heads": 4}  # the checkpoint's head width (1152 / 16 = 72) at a CPU-friendly size


def siglip_config(attn: str, **sizes):
    return tiny_siglip_config(llm, attn, side=SIDE, patch=PATCH, **sizes)


# ---------------------------------------------------------------------------
# vision_attn_implementation
# ---------------------------------------------------------------------------


def test_default_is_sdpa_and_every_choice_resolves(monkeypatch):
    monkeypatch.setattr(sa, "is_flash_attn_2_available", lambda: True)
    assert sa.vision_attn_implementation(SimpleNamespace()) == "sdpa"
    for value in ("sdpa", "eager", "flash_attention_2"):
        assert sa.vision_attn_implementation(SimpleNamespace(vision_attn_implementation=value)) == value


@pytest.mark.parametrize("value", ["SDPA", "flash_attention_3", "flex_attention", "", None, True, 1])
def test_bad_value_names_the_key_the_value_and_the_choices(value):
    """siglip_attention.py validates its key itself (the SDPA fix needs no other new module)."""
    problem = sa.vision_attn_problem(value)
    assert problem.startswith(f"vision_attn_implementation={json.dumps(value)}: got ")
    assert problem.endswith('expected one of "sdpa", "eager", "flash_attention_2"')
    with pytest.raises(ValueError) as info:
        sa.vision_attn_implementation(SimpleNamespace(vision_attn_implementation=value))
    assert str(info.value) == f"invalid --hf-overrides for MiniCPM-o 4.5: {problem}"


def test_flash_attention_2_needs_the_package(monkeypatch):
    hf_config = SimpleNamespace(vision_attn_implementation="flash_attention_2")
    monkeypatch.setattr(sa, "is_flash_attn_2_available", lambda: False)
    with pytest.raises(
        ValueError, match='vision_attn_implementation="flash_attention_2" needs the flash-attn 2'
    ):
        sa.vision_attn_implementation(hf_config)
    monkeypatch.setattr(sa, "is_flash_attn_2_available", lambda: True)
    assert sa.vision_attn_implementation(hf_config) == "flash_attention_2"


class _StopError(Exception):
    """Ends model construction right after SigLIP is built."""


@pytest.mark.parametrize(
    "overrides, attention",
    [({}, "sdpa"), ({"vision_attn_implementation": "eager"}, "eager")],
    ids=["default", "eager"],
)
def test_model_construction_builds_siglip_with_the_chosen_attention(monkeypatch, overrides, attention):
    built = []

    class Recording(llm.SiglipVisionTransformer):
        def __init__(self, config):
            super().__init__(config)
            built.append(self)
            raise _StopError

    monkeypatch.setattr(llm, "SiglipVisionTransformer", Recording)
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = llm.MiniCPMOConfig(vision_config={**vision, "image_size": SIDE * PATCH, "patch_size": PATCH})
    for key, value in overrides.items():
        setattr(config, key, value)  # as --hf-overrides sets it
    model_config = SimpleNamespace(
        hf_config=config, multimodal_config=SimpleNamespace(get_limit_per_prompt=lambda modality: 1)
    )
    with logs.captured(sa.logger) as records, pytest.raises(_StopError):
        llm.MiniCPMO45OmniLLMForConditionalGeneration(vllm_config=SimpleNamespace(model_config=model_config))
    (vpm,) = built
    expected = llm.SIGLIP_ATTENTION_CLASSES[attention]
    assert {type(layer.self_attn) for layer in vpm.encoder.layers} == {expected}
    assert config.vision_config._attn_implementation == attention
    assert f"MiniCPM-o 4.5 SigLIP attention: {attention} (--hf-overrides vision_attn_implementation)" in (
        records.messages()
    )


def test_unavailable_flash_attention_2_fails_construction_before_anything_heavy(monkeypatch):
    monkeypatch.setattr(sa, "is_flash_attn_2_available", lambda: False)
    hf_config = SimpleNamespace(vision_attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="vision_attn_implementation"):
        llm.MiniCPMO45OmniLLMForConditionalGeneration(
            vllm_config=SimpleNamespace(model_config=ModelConfigTripwire(hf_config))
        )


def test_unknown_attention_implementation_is_refused_by_the_layer():
    with pytest.raises(ValueError, match="'flex_attention' is not supported"):
        llm.SiglipEncoderLayer(siglip_config("flex_attention"))


# ---------------------------------------------------------------------------
# SDPA attention
# ---------------------------------------------------------------------------


def attention_pair(scale: float, *, hidden=1152, heads=16, seed=0):
    """Eager and SDPA SigLIP attention with the same weights (normal, std ``scale``)."""
    config = siglip_config("eager", hidden=hidden, heads=heads)
    eager = llm.SiglipAttention(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in eager.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    sdpa = llm.SiglipSdpaAttention(config).eval()
    sdpa.load_state_dict(eager.state_dict())  # strict: the same parameter names and shapes
    assert [n for n, _ in sdpa.named_parameters()] == [n for n, _ in eager.named_parameters()]
    return eager, sdpa


def key_padding(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    batch, n = valid.shape
    mask = torch.zeros(batch, 1, 1, n, dtype=dtype)
    return mask.masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)


def padded_valid(lengths, n):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def test_sdpa_equals_eager_in_float32_with_and_without_padding():
    eager, sdpa = attention_pair(0.05, hidden=256, heads=4)
    x = torch.randn(3, 200, 256, generator=torch.Generator().manual_seed(2))
    valid = padded_valid([200, 150, 7], 200)
    with torch.no_grad():
        for mask in (None, key_padding(valid, torch.float32)):
            want, weights = eager(x, mask)
            got, none = sdpa(x, mask)
            assert none is None and weights is not None
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # padding keys matter: without the mask the padded item's output changes
        assert not torch.allclose(
            sdpa(x, None)[0][2, :7], sdpa(x, key_padding(valid, torch.float32))[0][2, :7]
        )
        # output_attentions needs the probabilities: the eager math, weights returned
        got, weights = sdpa(x, key_padding(valid, torch.float32), output_attentions=True)
        assert weights.shape == (3, 4, 200, 200) and float(weights[2, :, :, 7:].abs().max()) == 0.0


def test_sdpa_error_is_at_most_eager_error_against_float32():
    """Logits of a few units, as trained attention has them; heads of the checkpoint's width (72)."""
    eager, sdpa = attention_pair(0.1, **HEADS_72)
    x = torch.randn(2, 512, HEADS_72["hidden"], generator=torch.Generator().manual_seed(3)).bfloat16()
    valid = padded_valid([512, 500], 512)
    with torch.no_grad():
        want = eager(x.float(), key_padding(valid, torch.float32))[0][valid]
        mask = key_padding(valid, torch.bfloat16)
        errors = {}
        for name, module in (("eager", eager), ("sdpa", sdpa)):
            out = module.bfloat16()(x, mask)[0].float()[valid]
            errors[name] = ((out - want).abs().max().item(), (out - want).abs().mean().item())
    print("bfloat16 error against float32 (max, mean):", errors)
    assert errors["sdpa"][0] <= errors["eager"][0]
    assert errors["sdpa"][1] < errors["eager"][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_key_padding_mask_adds_exactly_what_the_full_mask_added(dtype):
    eager, _ = attention_pair(0.05, hidden=256, heads=4)
    eager = eager.to(dtype)
    x = torch.randn(2, 96, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    kpm = key_padding(padded_valid([96, 40], 96), dtype)
    from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask

    assert not hasattr(llm, "_prepare_4d_attention_mask")  # the model no longer builds (B, 1, N, N)
    former = _prepare_4d_attention_mask(padded_valid([96, 40], 96), dtype)
    assert former.shape == (2, 1, 96, 96) and torch.equal(former, kpm.expand(2, 1, 96, 96))
    with torch.no_grad():
        short, _ = eager(x, kpm)
        long, _ = eager(x, former)
    assert torch.equal(short, long)
    with pytest.raises(ValueError, match="Attention mask should be of size"):
        eager(x, kpm[:, :, :, :95])


def test_vpm_forward_builds_the_key_padding_mask():
    vpm = llm.SiglipVisionTransformer(siglip_config("eager")).eval()
    masks = []
    real_forward = vpm.encoder.forward

    def recording_forward(inputs_embeds, attention_mask=None, **kwargs):
        masks.append(attention_mask)
        return real_forward(inputs_embeds, attention_mask=attention_mask, **kwargs)

    vpm.encoder.forward = recording_forward
    pixels = torch.zeros(2, 3, PATCH, 12 * PATCH)
    patch_mask = padded_valid([12, 6], 12)[:, None, :]
    with torch.no_grad():
        vpm(pixels, patch_attention_mask=patch_mask, tgt_sizes=torch.tensor([[3, 4], [2, 3]]))
    (mask,) = masks
    assert mask.shape == (2, 1, 1, 12) and mask.dtype == torch.float32
    assert (mask[1, 0, 0, 6:] == torch.finfo(torch.float32).min).all() and (mask[:, 0, 0, :6] == 0).all()


# ---------------------------------------------------------------------------
# Hidden-state layout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_siglip_hidden_states_are_contiguous_entering_every_layer(attn):
    """The embedding sum is row-major, so every encoder layer and the post LayerNorm receive a
    contiguous ``(B, N, hidden)`` tensor: none copies its input, no residual add is strided."""
    vpm = llm.SiglipVisionTransformer(siglip_config(attn)).eval()
    seen = []

    def record(_module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])

    for module in [*vpm.encoder.layers, vpm.post_layernorm]:
        module.register_forward_pre_hook(record, with_kwargs=True)
    pixels = torch.randn(2, 3, PATCH, 12 * PATCH, generator=torch.Generator().manual_seed(5))
    patch_mask = padded_valid([12, 6], 12)[:, None, :]
    with torch.no_grad():
        vpm(pixels, patch_attention_mask=patch_mask, tgt_sizes=torch.tensor([[3, 4], [2, 3]]))
    assert len(seen) == len(vpm.encoder.layers) + 1
    assert [tuple(h.stride()) for h in seen if not h.is_contiguous()] == []
