# SPDX-License-Identifier: Apache-2.0
"""Fused layer paths for MiniCPM-o 4.5's SigLIP and Whisper encoder layers, same parameters.

One q/k/v GEMM on weights packed once (:func:`pack_qkv`), bias + GELU in the GEMM epilogue where
that is the activation's math, the residual add fused with the next LayerNorm
(:func:`~.ops.add_layer_norm`), and SDPA on packed q/k/v with pinned backends. Error against the
unfused layers is bounded by ``test_fused_layers_cuda.py``; graphed and eager calls run the same
functions, so a replay is bitwise equal to its eager call. Only inference calls take them
(eval, no autograd, no autocast, not FP16 Whisper); ``encoder_fused_layers`` chooses the encoders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from vllm.logger import init_logger

from .encoder_cuda_graph import read_hf_overrides
from .ops.fused_add_layer_norm import add_layer_norm, add_layer_norm_reference, contiguous_rows

logger = init_logger(__name__)

__all__ = [
    "FUSED_LAYERS_CHOICES",
    "FUSED_LAYERS_KEY",
    "SIGLIP_SDPA_BACKENDS",
    "WHISPER_SDPA_BACKENDS",
    "WHISPER_STREAMING_SDPA_BACKENDS",
    "SIGLIP_DEFAULT_PIECES",
    "SIGLIP_PIECES",
    "PackedQKV",
    "configure_fused_layers",
    "pack_qkv",
    "resampler_keys_values",
    "resampler_needs_weights",
    "siglip_encode",
    "siglip_fused_applies",
    "siglip_fused_pieces",
    "siglip_patch_embeddings",
    "whisper_encode_layers",
    "whisper_encoder_output",
    "whisper_fused_applies",
]

#: The ``--hf-overrides`` key choosing the encoders that run the fused layers.
FUSED_LAYERS_KEY = "encoder_fused_layers"
#: Its values: both encoders, one of them, or neither.
FUSED_LAYERS_CHOICES = ("all", "vision", "audio", "none")

#: The pieces of SigLIP's fused path, each of which a diagnostic can switch off (:func:`siglip_fused_pieces`).
SIGLIP_PIECES = (
    "patch_gemm",
    "packed_qkv",
    "attention_backends",
    "gelu_epilogue",
    "add_layer_norm",
    "resampler_sdpa",
    "resampler_kv_layout",
)
#: The pieces SigLIP's fused path runs (``encoder_fused_layers`` ``"all"`` or ``"vision"``).
SIGLIP_DEFAULT_PIECES: frozenset[str] = frozenset(SIGLIP_PIECES)

#: SDPA backends for SigLIP's attention, in priority order (the first that supports the inputs
#: runs; a padded multi-slice call carries a key-padding mask, which flash attention refuses).
SIGLIP_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
#: SDPA backends for Whisper's stateless calls, which always carry their (B, 1, T, T) mask.
WHISPER_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
#: SDPA backends for Whisper's streaming rows (queries over gathered pages, later positions masked):
#: cuDNN first, whose masked call gives a row its own bits whatever the batch.
WHISPER_STREAMING_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)




def configure_fused_layers(model: nn.Module) -> dict[str, str]:
    """Choose, from ``--hf-overrides encoder_fused_layers``, which encoders of ``model`` run fused.

    Args:
        model: the thinker (``MiniCPMO45OmniLLMForConditionalGeneration``) or anything with
            ``config`` and optional ``vpm`` / ``apm`` attributes.

    Returns:
        ``{"vision": state, "audio": state}``, each ``"on"`` or ``"off (<why>)"``.

    Raises:
        HfOverridesError: (a ``ValueError``) a bad value of this or any other key of the
            project (``read_hf_overrides``).
    """
    choice = read_hf_overrides(model.config)[FUSED_LAYERS_KEY]
    states = {}
    vpm = getattr(model, "vpm", None)
    if vpm is None:
        states["vision"] = "off (no encoder)"
    elif choice not in ("all", "vision"):
        states["vision"] = f"off ({FUSED_LAYERS_KEY}={choice})"
    elif vpm.config._attn_implementation != "sdpa":
        states["vision"] = f"off (vision_attn_implementation={vpm.config._attn_implementation})"
    else:
        states["vision"] = "on"
    if vpm is not None:
        vpm._fused_layers = states["vision"] == "on"
        vpm._fused_pieces = SIGLIP_DEFAULT_PIECES
        if vpm._fused_layers:
            for layer in vpm.encoder.layers:
                pack_qkv(layer.self_attn)
        resampler = getattr(model, "resampler", None)
        if resampler is not None:
            resampler._fused_layers = vpm._fused_layers
            resampler._fused_pieces = SIGLIP_DEFAULT_PIECES
    apm = getattr(model, "apm", None)
    if apm is None:
        states["audio"] = "off (no encoder)"
    elif choice not in ("all", "audio"):
        states["audio"] = f"off ({FUSED_LAYERS_KEY}={choice})"
    elif apm.config._attn_implementation not in ("sdpa", "eager"):
        states["audio"] = f"off (Whisper attention {apm.config._attn_implementation})"
    else:
        states["audio"] = "on"
    if apm is not None:
        apm._fused_layers = states["audio"] == "on"
        if apm._fused_layers:
            for layer in apm.layers:
                pack_qkv(layer.self_attn)
    logger.info(
        "MiniCPM-o 4.5 fused encoder layers: vision=%s, audio=%s (--hf-overrides %s=%s)",
        states["vision"],
        states["audio"],
        FUSED_LAYERS_KEY,
        choice,
    )
    return states


def _inference_call(module: nn.Module, device: torch.device) -> bool:
    return not module.training and not torch.is_grad_enabled() and not torch.is_autocast_enabled(device.type)


def _piece(module: nn.Module, name: str) -> bool:
    return name in module.__dict__.get("_fused_pieces", SIGLIP_DEFAULT_PIECES)


@contextlib.contextmanager
def siglip_fused_pieces(model: nn.Module, pieces: Sequence[str]) -> Any:
    """Run SigLIP's fused path with only ``pieces`` of :data:`SIGLIP_PIECES` for the block.

    Raises:
        ValueError: a name that is not one of :data:`SIGLIP_PIECES`.
    """
    unknown = sorted(set(pieces) - set(SIGLIP_PIECES))
    if unknown:
        raise ValueError(f"siglip_fused_pieces: unknown piece(s) {unknown}; choose from {SIGLIP_PIECES}")
    modules = [m for m in (getattr(model, "vpm", None), getattr(model, "resampler", None)) if m is not None]
    saved = [m.__dict__.get("_fused_pieces") for m in modules]
    try:
        for module in modules:
            module._fused_pieces = frozenset(pieces)
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            if value is None:
                module.__dict__.pop("_fused_pieces", None)
            else:
                module._fused_pieces = value




@dataclass(frozen=True)
class PackedQKV:
    """The q/k/v projections of one attention module as one GEMM.

    Attributes:
        weight: ``(3E, E)``: rows ``[0, E)`` are ``q_proj.weight``, ``[E, 2E)`` ``k_proj.weight``,
            ``[2E, 3E)`` ``v_proj.weight``; those parameters are views of it.
        bias: ``(3E,)``: the three biases (views of it where the module has one, zeros where it
            has none).
        pointers: the ``data_ptr()`` each of the six parameters (weights, then biases; None for
            a missing bias) had right after packing: a parameter found elsewhere was replaced.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    pointers: tuple[int | None, ...]

    def shared_by(self, attention: nn.Module) -> bool:
        """Whether ``attention``'s q/k/v parameters are still views of this packing."""
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        current = tuple(p.weight.data_ptr() for p in projections) + tuple(
            None if p.bias is None else p.bias.data_ptr() for p in projections
        )
        return current == self.pointers


def pack_qkv(attention: nn.Module) -> PackedQKV:
    """The packed q/k/v projection of ``attention``, packing (or re-packing) it when needed.

    Args:
        attention: a module with ``q_proj``, ``k_proj`` and ``v_proj`` ``nn.Linear`` of the same
            input width (SigLIP's and Whisper's attention).

    Returns:
        the :class:`PackedQKV`, also kept on ``attention`` as ``_packed_qkv``.

    Raises:
        RuntimeError: packing is needed while the current CUDA stream is capturing a graph.
    """
    packed = attention.__dict__.get("_packed_qkv")
    if packed is not None and packed.shared_by(attention):
        return packed
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    weight = projections[0].weight
    if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the q/k/v weights of a fused encoder layer must be packed before a CUDA graph capture, "
            "not during it (run the layer eagerly first)"
        )
    with torch.no_grad(), torch.inference_mode(False):
        rows = [p.weight.shape[0] for p in projections]
        packed_weight = torch.cat([p.weight.detach() for p in projections])
        packed_bias = torch.cat(
            [
                p.bias.detach() if p.bias is not None else weight.new_zeros(n)
                for p, n in zip(projections, rows, strict=True)
            ]
        )
        start = 0
        for projection, n in zip(projections, rows, strict=True):
            projection.weight.data = packed_weight[start : start + n]
            if projection.bias is not None:
                projection.bias.data = packed_bias[start : start + n]
            start += n
    pointers = tuple(p.weight.data_ptr() for p in projections) + tuple(
        None if p.bias is None else p.bias.data_ptr() for p in projections
    )
    packed = PackedQKV(packed_weight, packed_bias, pointers)
    attention.__dict__["_packed_qkv"] = packed
    return packed




def _sdpa_pin(backends: Sequence[SDPBackend]) -> contextlib.AbstractContextManager:
    try:
        return sdpa_kernel(list(backends), set_priority=True)
    except TypeError:  # torch without set_priority: the set, in torch's own order
        return sdpa_kernel(list(backends))


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    backends: Sequence[SDPBackend] | None,
) -> torch.Tensor:
    """SDPA of ``(B, heads, Nq, d)`` q over ``(B, heads, Nk, d)`` k/v, backend pinned on CUDA
    (``backends`` None: SDPA's own choice).
    """
    if query.device.type == "cuda" and backends is not None:
        with _sdpa_pin(backends):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    batch, heads, positions, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, positions, heads * head_dim)


def _split_qkv(qkv: torch.Tensor, batch: int, positions: int, heads: int) -> tuple[torch.Tensor, ...]:
    head_dim = qkv.shape[-1] // (3 * heads)
    split = qkv.view(batch, positions, 3, heads, head_dim)
    return tuple(split[:, :, index].transpose(1, 2) for index in range(3))


def _attention_update(
    attention: nn.Module,
    normed: torch.Tensor,
    batch: int,
    positions: int,
    mask: torch.Tensor | None,
    scale: float,
    backends: Sequence[SDPBackend] | None,
    cache: Any = None,
    packed: bool = True,
    out_bias: bool = False,
    linear: Callable[..., torch.Tensor] = F.linear,
) -> torch.Tensor:
    if packed:
        qkv = pack_qkv(attention)
        query, key, value = _split_qkv(
            linear(normed, qkv.weight, qkv.bias), batch, positions, attention.num_heads
        )
    else:
        query, key, value = (
            projection(normed).view(batch, positions, attention.num_heads, -1).transpose(1, 2)
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)
    attended = _attention(query, key, value, mask, scale, backends)
    del query, key, value  # the q/k/v GEMM's output goes with its last views
    out_proj = attention.out_proj
    return linear(attended.view(batch * positions, -1), out_proj.weight, out_proj.bias if out_bias else None)


def _siglip_mlp(mlp: nn.Module, normed: torch.Tensor, epilogue: bool) -> torch.Tensor:
    """SigLIP's MLP with fc2's bias in its GEMM (as ``nn.Linear`` rounds it; cuBLAS also picks a
    faster kernel with the bias epilogue at these shapes: 21 vs 26 us per layer at 1 x 1024
    patches on an H200); fc1 with the bias + GELU epilogue where ``epilogue`` and the activation is
    the tanh GELU. fc1's output is freed on return.
    """
    if epilogue and mlp.config.hidden_act == "gelu_pytorch_tanh":
        return mlp.fc2(_gelu_tanh_epilogue(mlp.fc1, normed))
    return mlp.fc2(mlp.activation_fn(mlp.fc1(normed)))


def _norm(
    residual: torch.Tensor,
    update: torch.Tensor | None,
    update_bias: torch.Tensor | None,
    norm: nn.Module,
    store_sum: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    op = add_layer_norm if fused else add_layer_norm_reference
    return op(residual, update, update_bias, norm.weight, norm.bias, norm.eps, store_sum)


def _gelu_tanh_epilogue(linear: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    if hidden.is_cuda and linear.bias is not None:
        return torch._addmm_activation(linear.bias, hidden, linear.weight.t(), use_gelu=True)
    # torch._addmm_activation(use_gelu=True) computes the exact GELU on the CPU.
    return F.gelu(F.linear(hidden, linear.weight, linear.bias), approximate="tanh")


def _affine_layer_norms(norms: Sequence[Any]) -> bool:
    return all(isinstance(n, nn.LayerNorm) and n.weight is not None and n.bias is not None for n in norms)




def siglip_fused_applies(
    vpm: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    """Whether :func:`siglip_encode` runs this call of ``vpm``'s encoder."""
    if not getattr(vpm, "_fused_layers", False) or not _inference_call(vpm, hidden_states.device):
        return False
    if attention_mask is not None and not attention_mask.is_floating_point():
        return False
    layers = vpm.encoder.layers
    return len(layers) > 0 and _affine_layer_norms(
        [vpm.post_layernorm, *(n for layer in layers for n in (layer.layer_norm1, layer.layer_norm2))]
    )


def siglip_patch_embeddings(vpm: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """SigLIP's patch embedding of packed slices, ``(B, 3, P, P * N)`` -> ``(B, N, hidden)``."""
    conv = vpm.embeddings.patch_embedding
    patch = conv.kernel_size[0]
    gemm = (
        siglip_fused_applies(vpm, pixel_values, None)
        and _piece(vpm, "patch_gemm")
        and pixel_values.dim() == 4
        and pixel_values.shape[1] == conv.in_channels
        and pixel_values.shape[2] == patch
        and pixel_values.shape[3] % patch == 0
        and tuple(conv.kernel_size) == (patch, patch)
        and tuple(conv.stride) == (patch, patch)
        and conv.padding in ((0, 0), "valid")
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )
    if not gemm:
        return conv(pixel_values).flatten(2).transpose(1, 2)
    batch, channels, _, width = pixel_values.shape
    positions = width // patch
    rows = pixel_values.reshape(batch, channels, patch, positions, patch).permute(0, 3, 1, 2, 4)
    rows = rows.reshape(batch * positions, channels * patch * patch)
    embeddings = F.linear(rows, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return embeddings.view(batch, positions, conv.out_channels)


def resampler_needs_weights(resampler: nn.Module) -> bool:
    """``need_weights`` for the resampler's attention call: False with the fused vision layers."""
    return not (getattr(resampler, "_fused_layers", False) and _piece(resampler, "resampler_sdpa"))


def resampler_keys_values(resampler: nn.Module, keys: torch.Tensor) -> torch.Tensor:
    """The resampler's keys and values ``(L, B, D)`` as its attention reads them.

    Args:
        resampler: the ``Resampler`` (its ``_fused_layers`` and pieces).
        keys: ``(L, B, D)`` in the model dtype, any layout.

    Returns:
        ``(L, B, D)``: ``keys`` or its contiguous copy.
    """
    if getattr(resampler, "_fused_layers", False) and _piece(resampler, "resampler_kv_layout"):
        return keys.contiguous()
    return keys


def siglip_encode(
    vpm: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """SigLIP's encoder layers and post LayerNorm, fused: ``post_layernorm(encoder(hidden_states))``.

    Args:
        vpm: ``SiglipVisionTransformer`` (its ``encoder.layers`` and ``post_layernorm``).
        hidden_states: ``(B, N, hidden)`` patch embeddings in the model dtype (contiguous, or
            copied once).
        attention_mask: None (every patch valid) or the additive key-padding mask
            ``(B, 1, 1, N)`` in the hidden states' dtype (0 valid, the dtype's minimum padding).

    Returns:
        ``(B, N, hidden)`` in the model dtype, what ``vpm._encode_last_hidden_state`` returns up
        to rounding (see the module docstring); tensor ops only, nothing read on the host.
    """
    layers = vpm.encoder.layers
    batch, positions, width = hidden_states.shape
    packed, epilogue, fused_norm = (_piece(vpm, n) for n in ("packed_qkv", "gelu_epilogue", "add_layer_norm"))
    backends = SIGLIP_SDPA_BACKENDS if _piece(vpm, "attention_backends") else None
    # A column-sliced or transposed input is copied here, once, not by each of the two calls below.
    residual = contiguous_rows(hidden_states.reshape(batch * positions, width))
    normed, _ = _norm(residual, None, None, layers[0].layer_norm1, store_sum=False, fused=fused_norm)
    # Intermediates are handed on, never kept in a name, so a graph's pool holds one sub-layer's at a time.
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        normed, residual = _norm(
            residual,
            _attention_update(
                attention,
                normed,
                batch,
                positions,
                attention_mask,
                attention.scale,
                backends,
                packed=packed,
                out_bias=True,
            ),
            None,
            layer.layer_norm2,
            fused=fused_norm,
        )
        last = index + 1 == len(layers)
        next_norm = vpm.post_layernorm if last else layers[index + 1].layer_norm1
        normed, residual = _norm(
            residual,
            _siglip_mlp(layer.mlp, normed, epilogue),
            None,
            next_norm,
            store_sum=not last,
            fused=fused_norm,
        )
    return normed.view(batch, positions, width)




def whisper_fused_applies(
    apm: nn.Module, hidden_states: torch.Tensor, head_mask: torch.Tensor | None, output_attentions: bool
) -> bool:
    """Whether :func:`whisper_encode_layers` runs this call of ``apm``'s layers."""
    if not getattr(apm, "_fused_layers", False) or head_mask is not None or output_attentions:
        return False
    if hidden_states.dtype == torch.float16 or not _inference_call(apm, hidden_states.device):
        return False
    layers = apm.layers
    return len(layers) > 0 and _affine_layer_norms(
        [
            apm.layer_norm,
            *(n for layer in layers for n in (layer.self_attn_layer_norm, layer.final_layer_norm)),
        ]
    )


def _fc1(fc1: nn.Module, normed: torch.Tensor, linear: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Whisper's ``fc1``: the module's own call, or ``linear`` on its weight and bias when the
    caller passed one."""
    return fc1(normed) if linear is F.linear else linear(normed, fc1.weight, fc1.bias)


def whisper_encode_layers(
    apm: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    output_hidden_states: bool = False,
    linear: Callable[..., torch.Tensor] = F.linear,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Whisper's encoder layers and final LayerNorm, fused.

    Args:
        apm: ``MiniCPMWhisperEncoder`` (its ``layers`` and ``layer_norm``).
        hidden_states: ``(B, T, d_model)``, the embeddings plus positions, in the model dtype.
        attention_mask: None, or the additive mask ``(B, 1, T, T_keys)`` in that dtype.
        past_key_values: None (stateless), an ``EncoderDecoderCache``, or a cache whose
            ``update(key, value, layer_idx)`` returns past and new ``(B, heads, T, head_dim)`` concatenated.
        output_hidden_states: also return the unfused encoder's ``encoder_states``.
        linear: every GEMM of the layers, ``linear(x, weight, bias)`` as ``F.linear``.

    Returns:
        ``(last_hidden_state (B, T, d_model), encoder_states or None)``, what the unfused loop
        and ``apm.layer_norm`` compute up to rounding (see the module docstring).
    """
    layers = apm.layers
    batch, positions, width = hidden_states.shape
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    backends = WHISPER_SDPA_BACKENDS if cache is None else WHISPER_STREAMING_SDPA_BACKENDS
    states = [hidden_states] if output_hidden_states else None
    residual = hidden_states.reshape(batch * positions, width)
    normed, _ = _norm(residual, None, None, layers[0].self_attn_layer_norm, store_sum=False)
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        # Whisper scales the projected queries; SDPA scales the scores by the same factor. The
        # intermediates are handed on as in siglip_encode.
        normed, residual = _norm(
            residual,
            _attention_update(
                attention,
                normed,
                batch,
                positions,
                attention_mask,
                attention.scaling,
                backends,
                cache,
                linear=linear,
            ),
            attention.out_proj.bias,
            layer.final_layer_norm,
        )
        last = index + 1 == len(layers)
        next_norm = apm.layer_norm if last else layers[index + 1].self_attn_layer_norm
        normed, residual = _norm(
            residual,
            linear(layer.activation_fn(_fc1(layer.fc1, normed, linear)), layer.fc2.weight, None),
            layer.fc2.bias,
            next_norm,
            store_sum=not last,
        )
        if states is not None:
            states.append(
                normed.view(batch, positions, width) if last else residual.view(batch, positions, width)
            )
    return normed.view(batch, positions, width), None if states is None else tuple(states)


def whisper_encoder_output(
    apm: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    use_cache: bool | None,
    output_hidden_states: bool | None,
    return_dict: bool | None,
) -> Any:
    """What ``MiniCPMWhisperEncoder.forward`` returns after its layers, with the fused layers."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    # The layers get the cache whether or not use_cache is set, as in the unfused forward.
    last, states = whisper_encode_layers(
        apm, hidden_states, attention_mask, past_key_values, bool(output_hidden_states)
    )
    if not return_dict:
        return tuple(v for v in (last, states) if v is not None)
    return BaseModelOutputWithPast(
        last_hidden_state=last,
        hidden_states=states,
        attentions=None,
        past_key_values=past_key_values if use_cache else None,
    )
