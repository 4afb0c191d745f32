"""A ``VllmConfig`` for running the encoders outside an engine (tests and measurements)."""

from __future__ import annotations

from typing import Any


def standalone_vllm_config(*, enforce_eager: bool = False) -> Any:
    """Return a ``vllm.config.VllmConfig`` usable by the encoder graph adapter without a checkpoint."""
    import torch
    from vllm.config import DeviceConfig, ModelConfig, MultiModalConfig, VllmConfig

    # Without a GPU vLLM cannot infer a device type; the encoders then only run eagerly.
    config = (
        VllmConfig() if torch.cuda.is_available() else VllmConfig(device_config=DeviceConfig(device="cpu"))
    )
    model_config = ModelConfig.__new__(ModelConfig)
    object.__setattr__(model_config, "multimodal_config", MultiModalConfig())
    object.__setattr__(model_config, "enforce_eager", enforce_eager)
    object.__setattr__(config, "model_config", model_config)
    config.cache_config.num_gpu_blocks = 0  # the KV cache is sized: vLLM's start-up profiling is over
    return config


def duplex_vllm_config(base: Any, max_sessions: int) -> Any:
    """``base`` (a :func:`standalone_vllm_config`) as a duplex deployment's: ``model_config`` with
    vllm-omni's ``session_mode = "duplex"`` and ``duplex_max_sessions``, which start-up capture
    and batched duplex steps read. A shallow copy; ``base`` is not changed.
    """
    import copy

    config = copy.copy(base)
    model_config = copy.copy(base.model_config)
    object.__setattr__(model_config, "session_mode", "duplex")
    object.__setattr__(model_config, "duplex_max_sessions", max_sessions)
    object.__setattr__(config, "model_config", model_config)
    return config


