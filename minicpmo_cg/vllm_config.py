"""A ``VllmConfig`` for running the encoders outside an engine (tests and measurements).

vLLM's ``EncoderCudaGraphManager`` reads ``model_config.multimodal_config`` and the
compilation/parallel configs; a full ``ModelConfig`` would need the checkpoint, which
the encoders at random weights do not. ``ModelConfig.__new__`` gives an instance without running
its checkpoint-resolving ``__init__``; only the attributes the manager and the
adapter factory read are set. ``cache_config.num_gpu_blocks`` is set to 0 (there is no
KV cache): the adapter treats calls made while it is None as vLLM's start-up memory
profiling, which an engine ends by sizing the KV cache.
"""

from __future__ import annotations

from typing import Any


def standalone_vllm_config(*, enforce_eager: bool = False) -> Any:
    """Return a ``vllm.config.VllmConfig`` usable by the encoder graph adapter without a checkpoint.

    Args:
        enforce_eager: value of ``model_config.enforce_eager`` (``--enforce-eager``).
    """
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
    config.cache_config.num_gpu_blocks = 0  # profiling is over (see the module docstring)
    return config


def duplex_vllm_config(base: Any, max_sessions: int) -> Any:
    """``base`` (a :func:`standalone_vllm_config`) as a duplex deployment's: ``model_config`` with
    vllm-omni's ``session_mode = "duplex"`` and ``duplex_max_sessions``, which start-up capture
    and batched duplex steps read. A shallow copy; ``base`` is not changed."""
    import copy

    config = copy.copy(base)
    model_config = copy.copy(base.model_config)
    object.__setattr__(model_config, "session_mode", "duplex")
    object.__setattr__(model_config, "duplex_max_sessions", max_sessions)
    object.__setattr__(config, "model_config", model_config)
    return config


