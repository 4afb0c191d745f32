# SPDX-License-Identifier: Apache-2.0
"""The factory the model file calls, and the LoRA rule that keeps an encoder eager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from vllm.logger import init_logger

from .adapter import EncoderCudaGraph
from .backend import NO_CAPTURE_ERROR_MODE, manager_takes_capture_error_mode
from .options import EncoderCudaGraphOptions

logger = init_logger(__name__)

__all__ = ["EncoderCudaGraphSetup", "lora_may_reach", "make_encoder_cuda_graph"]


def lora_may_reach(vllm_config: Any, model: Any, module_prefixes: Sequence[str]) -> str | None:
    """Why vLLM's LoRA could put adapters on an encoder's modules, or None if it cannot.

    A replay keeps the weights live at capture, so an encoder LoRA can reach stays eager: with
    ``--enable-lora`` every layer of a model without ``get_mm_mapping()`` can be reached, else the
    tower and connector only with ``enable_tower_connector_lora``.

    Args:
        vllm_config: the engine's config.
        model: the multimodal model (its class decides ``get_mm_mapping``).
        module_prefixes: the encoder's module names in ``model``, e.g. ``("vpm",)``.
    """
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        return None
    get_mapping = getattr(model, "get_mm_mapping", None)
    if get_mapping is None:
        return "LoRA is enabled and the model has no get_mm_mapping(), so adapters may target encoder layers"
    if not getattr(lora_config, "enable_tower_connector_lora", False):
        return None
    mapping = get_mapping()
    opened = [*mapping.tower_model, *mapping.connector]
    hit = next((p for p in module_prefixes for o in opened if p.startswith(o) or o.startswith(p)), None)
    if hit is None:
        return None
    return f"LoRA with enable_tower_connector_lora may target {hit}"


class EncoderCudaGraphSetup(NamedTuple):
    """What :func:`make_encoder_cuda_graph` built and the state to log."""

    adapter: EncoderCudaGraph | None
    #: ``"on"`` or ``"off (<reason>)"``, e.g. ``"off (encoder_cuda_graph_max_graphs=0)"``
    state: str


def make_encoder_cuda_graph(
    forward: Callable[..., torch.Tensor],
    vllm_config: Any,
    options: EncoderCudaGraphOptions,
    *,
    name: str,
    captured_modules: Sequence[str] | None = None,
    lora_reason: str | None = None,
) -> EncoderCudaGraphSetup:
    """Build the adapter for one encoder, or None when encoder graphs are off for it.

    Args:
        forward, vllm_config, name, captured_modules: see :class:`EncoderCudaGraph`.
        options: from :meth:`EncoderCudaGraphOptions.from_hf_config`.
        lora_reason: why LoRA may reach this encoder, or None.

    Returns:
        ``(adapter or None, state)``; ``state`` is ``"on"`` or ``"off (<why>)"``.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not options.enabled:
        return EncoderCudaGraphSetup(None, "off (encoder_cuda_graph=false)")
    if getattr(model_config, "enforce_eager", False):
        return EncoderCudaGraphSetup(None, "off (--enforce-eager)")
    if lora_reason is not None:
        return EncoderCudaGraphSetup(
            None, f"off ({lora_reason}; a replay would keep the weights live at capture)"
        )
    if not manager_takes_capture_error_mode():
        logger.warning_once(
            "MiniCPM-o 4.5 encoder CUDA graphs are off and the encoders run eagerly: %s.",
            NO_CAPTURE_ERROR_MODE,
        )
        return EncoderCudaGraphSetup(None, "off (vLLM's EncoderCudaGraphManager takes no capture_error_mode)")
    adapter = EncoderCudaGraph(
        forward,
        vllm_config,
        max_graphs=options.max_graphs,
        min_capture_calls=options.min_capture_calls,
        min_free_bytes=options.min_free_bytes,
        share_pools=options.share_pools,
        admission=options.admission,
        max_bytes=options.max_bytes,
        log_interval_s=options.log_interval_s,
        name=name,
        captured_modules=captured_modules,
    )
    state = "off (encoder_cuda_graph_max_graphs=0)" if options.max_graphs == 0 else "on"
    return EncoderCudaGraphSetup(adapter, state)
