# SPDX-License-Identifier: Apache-2.0
"""SigLIP's attention for MiniCPM-o 4.5: SDPA, the key-padding mask and the choice of implementation.

The model file read the implementation from an attribute vLLM's ``ModelConfig`` never has, so serving
always ran the eager attention. ``--hf-overrides vision_attn_implementation`` (validated here) now
chooses it, ``"sdpa"`` by default. This module never imports the model file.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import is_flash_attn_2_available
from vllm.logger import init_logger

logger = init_logger(__name__)

#: The ``--hf-overrides`` key naming SigLIP's attention implementation.
VISION_ATTN_KEY = "vision_attn_implementation"
#: Its allowed values, the default first.
VISION_ATTN_CHOICES = ("sdpa", "eager", "flash_attention_2")
#: Its value when the key is absent.
VISION_ATTN_DEFAULT = "sdpa"
#: One line for the option tables.
VISION_ATTN_DOC = (
    'SigLIP attention, read by the model file (not an adapter option): "sdpa", "eager" (the '
    'original bf16-logit math) or "flash_attention_2" (refused unless flash-attn 2 imports)'
)


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", int: "an integer", float: "a float", type(None): "null"}
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return names.get(type(value), f"a {type(value).__name__}")


def vision_attn_problem(value: Any) -> str | None:
    """None when ``value`` is an allowed ``vision_attn_implementation``, else
    ``vision_attn_implementation=<value as JSON>: got <JSON type>, expected one of "sdpa", ...``."""
    if isinstance(value, str) and value in VISION_ATTN_CHOICES:
        return None
    allowed = ", ".join(json.dumps(choice) for choice in VISION_ATTN_CHOICES)
    return f"{VISION_ATTN_KEY}={_as_json(value)}: got {_json_type(value)}, expected one of {allowed}"


def vision_attn_implementation(hf_config: Any) -> str:
    """SigLIP's attention implementation, from ``--hf-overrides vision_attn_implementation``.

    Returns:
        ``"sdpa"`` (the default), ``"eager"`` (the original math: logits rounded to the model
        dtype, materialised scores) or ``"flash_attention_2"``.

    Raises:
        ValueError: a value that is not one of those strings; ``"flash_attention_2"`` while
            ``transformers.utils.is_flash_attn_2_available()`` is False.
    """
    implementation = getattr(hf_config, VISION_ATTN_KEY, VISION_ATTN_DEFAULT)
    problem = vision_attn_problem(implementation)
    if problem is not None:
        raise ValueError(f"invalid --hf-overrides for MiniCPM-o 4.5: {problem}")
    if implementation == "flash_attention_2" and not is_flash_attn_2_available():
        raise ValueError(
            f'--hf-overrides {VISION_ATTN_KEY}="flash_attention_2" needs the flash-attn 2 '
            "package, which does not import here (transformers.utils.is_flash_attn_2_available() is "
            'False: not installed, too old, or no CUDA); use "sdpa" (the default) or "eager"'
        )
    return implementation


def set_vision_attention(vision_config: Any, implementation: str) -> None:
    """Make SigLIP built from ``vision_config`` use ``implementation`` (sets its
    ``_attn_implementation``) and log one INFO line naming it."""
    vision_config._attn_implementation = implementation
    logger.info("MiniCPM-o 4.5 SigLIP attention: %s (--hf-overrides %s)", implementation, VISION_ATTN_KEY)


def siglip_attention_class(classes: dict[str, type[nn.Module]], implementation: str) -> type[nn.Module]:
    """The class of ``classes`` (attention classes by ``_attn_implementation``) for ``implementation``.

    Raises:
        ValueError: ``implementation`` is not a key of ``classes``.
    """
    attention_class = classes.get(implementation)
    if attention_class is None:
        raise ValueError(
            f"SigLIP attention implementation {implementation!r} is not supported; expected one of {sorted(classes)}"
        )
    return attention_class


def sdpa_attention(
    attention: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """SigLIP self-attention through ``F.scaled_dot_product_attention``.

    Args:
        attention: a ``SiglipAttention`` (its ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``,
            ``num_heads``, ``head_dim``, ``embed_dim``, ``scale``, ``dropout``).
        hidden_states: ``(B, N, hidden)``.
        attention_mask: None (every patch valid) or the additive key-padding mask ``(B, 1, 1, N)``
            in the hidden states' dtype (:func:`encoder_attention_mask`), which SDPA broadcasts
            over heads and queries.

    Returns:
        ``(B, N, hidden)``: the attention output after ``out_proj``; no ``(B, heads, N, N)``
        scores are materialised.
    """
    batch_size, q_len, _ = hidden_states.size()
    heads = (batch_size, q_len, attention.num_heads, attention.head_dim)
    query_states = attention.q_proj(hidden_states).view(heads).transpose(1, 2)
    key_states = attention.k_proj(hidden_states).view(heads).transpose(1, 2)
    value_states = attention.v_proj(hidden_states).view(heads).transpose(1, 2)
    attn_output = F.scaled_dot_product_attention(
        query_states,
        key_states,
        value_states,
        attn_mask=attention_mask,
        dropout_p=attention.dropout if attention.training else 0.0,
        scale=attention.scale,
    )
    attn_output = attn_output.transpose(1, 2).reshape(batch_size, q_len, attention.embed_dim)
    return attention.out_proj(attn_output)


class SiglipSdpaAttentionMixin:
    """The forward of SigLIP's SDPA attention, mixed in front of the model file's ``SiglipAttention``."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states (B, N, hidden)`` -> ``(attention output (B, N, hidden), None)``."""
        if output_attentions:
            return super().forward(hidden_states, attention_mask, output_attentions)
        return sdpa_attention(self, hidden_states, attention_mask), None


def check_attention_mask(attention_mask: torch.Tensor, batch_size: int, q_len: int, k_v_seq_len: int) -> None:
    """Refuse an additive mask that eager SigLIP attention cannot add to its ``(B, heads, N, N)`` scores.

    Raises:
        ValueError: any other size ("Attention mask should be of size ...").
    """
    if attention_mask.size() not in ((batch_size, 1, 1, k_v_seq_len), (batch_size, 1, q_len, k_v_seq_len)):
        raise ValueError(
            f"Attention mask should be of size {(batch_size, 1, 1, k_v_seq_len)} or "
            f"{(batch_size, 1, q_len, k_v_seq_len)}, but is {attention_mask.size()}"
        )


def encoder_attention_mask(
    patch_valid: torch.Tensor, dtype: torch.dtype, flash_attention_2: bool
) -> torch.Tensor:
    """SigLIP encoder's padding mask for ``patch_valid``, ``(B, N)`` bool (True: a real patch)."""
    if flash_attention_2:
        return patch_valid
    batch_size, num_patches = patch_valid.shape
    mask = torch.zeros((batch_size, 1, 1, num_patches), dtype=dtype, device=patch_valid.device)
    return mask.masked_fill_(~patch_valid.view(batch_size, 1, 1, num_patches), torch.finfo(dtype).min)
