"""MiniCPM-o 4.5's thinker encoders, built from vllm-omni's own classes with random weights."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minicpmo_cg.thinker_config import (
    AUDIO_CONFIG,
    LLM_CONFIG,
    MODEL_MODULE,
    REDUCED_AUDIO_LAYERS,
    REDUCED_VISION_LAYERS,
    THINKER_CONFIG,
    VISION_CONFIG,
    model_module,
    thinker_config,
)

__all__ = [
    "ADAPTER_MODULE",
    "AUDIO_CONFIG",
    "FUSED_LAYERS_KEY",
    "FUSED_LAYERS_MODULE",
    "LLM_CONFIG",
    "MODEL_MODULE",
    "REDUCED_AUDIO_LAYERS",
    "REDUCED_VISION_LAYERS",
    "THINKER_CONFIG",
    "VISION_CONFIG",
    "WIRING_MISSING",
    "EncoderBuildInfo",
    "EncoderWiringMissingError",
    "audio_graph",
    "build_thinker_encoders",
    "configure_fused_layers",
    "has_graph_wiring",
    "init_weights_",
    "model_module",
    "resolve_vision_attn",
    "streaming_audio_graph",
    "thinker_config",
    "vision_graph",
    "wire_encoder_graphs",
]

#: The adapter, installed beside the model file.
ADAPTER_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"
#: The fused encoder layers, installed beside the model file (--hf-overrides encoder_fused_layers).
FUSED_LAYERS_KEY = "encoder_fused_layers"
FUSED_LAYERS_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.fused_layers"

WIRING_MISSING = (
    "the installed vllm-omni model file has no encoder CUDA graph wiring "
    "(MiniCPMO45OmniLLMForConditionalGeneration has no _init_encoder_cuda_graphs)"
)


class EncoderWiringMissingError(RuntimeError):
    """The installed vllm-omni model file lacks the encoder CUDA graph wiring."""


def _progress(msg: str) -> None:
    print(f"[encoder-graphs] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def init_weights_(module: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Initialise every parameter of ``module`` in place, deterministically."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    layer_norm_params = {
        id(p) for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)
    }
    for name, param in module.named_parameters():
        if param.is_meta:
            raise RuntimeError(f"init_weights_: parameter {name} is still on the meta device")
        leaf = name.rsplit(".", 1)[-1]
        if id(param) in layer_norm_params:
            param.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf.endswith("bias"):
            param.zero_()
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)


@dataclass(frozen=True)
class EncoderBuildInfo:
    """What :func:`build_thinker_encoders` built (for logs and reports)."""

    vision_layers: int
    audio_layers: int
    vision_attn: str
    audio_attn: str
    num_params: int
    build_s: float
    fused_layers: dict[str, str] = dataclasses.field(default_factory=dict)


def build_thinker_encoders(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    reduced: bool = False,
    seed: int = 0,
    vision_attn: str = "sdpa",
    fused_layers: str | None = None,
    config_overrides: dict[str, Any] | None = None,
    progress: bool = False,
) -> Any:
    """Build MiniCPM-o 4.5's thinker encoders (no LLM) with random weights.

    Raises:
        ValueError: a bad ``vision_attn`` (naming ``vision_attn_implementation``), or
            ``"flash_attention_2"`` without the flash-attn 2 package, from the model file.
        EncoderWiringMissingError: ``vision_attn`` other than ``"eager"`` on a model file without the
            SDPA attention for SigLIP (no ``vision_attn_implementation``).
    """
    start = time.perf_counter()
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = thinker_config(reduced=reduced, **(config_overrides or {}))
    if fused_layers is not None:
        config.encoder_fused_layers = fused_layers
    config.vision_config._attn_implementation = resolve_vision_attn(config, vision_attn)
    if progress:
        _progress(
            f"building thinker encoders ({'reduced' if reduced else 'full'}: "
            f"{config.vision_config.num_hidden_layers - int(config.drop_vision_last_layer)} vision + "
            f"{config.audio_config.encoder_layers} audio layers) ..."
        )
    model = _bare_model_on_meta(config)
    _materialise_(model, device=device, dtype=dtype, seed=seed, progress=progress)
    fused_states = configure_fused_layers(model)
    model.build_info = EncoderBuildInfo(
        vision_layers=len(model.vpm.encoder.layers),
        audio_layers=len(model.apm.layers),
        vision_attn=str(config.vision_config._attn_implementation),
        audio_attn=str(model.apm.config._attn_implementation),
        num_params=sum(p.numel() for p in model.parameters()),
        build_s=time.perf_counter() - start,
        fused_layers=fused_states,
    )
    if progress:
        _progress(f"built in {model.build_info.build_s:.1f} s ({dtype}, {device})")
    return model


def configure_fused_layers(model: Any) -> dict[str, str]:
    """Configure ``--hf-overrides encoder_fused_layers`` on ``model`` as the model's constructor does.

    Raises:
        ValueError: a bad ``encoder_fused_layers`` (or any other encoder key), naming the key.
    """
    try:
        importlib.import_module(FUSED_LAYERS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != FUSED_LAYERS_MODULE:
            raise
        if hasattr(model.config, "encoder_fused_layers"):
            raise ValueError(
                "encoder_fused_layers is set, but the installed vllm-omni tree has no fused encoder "
                f"layers ({FUSED_LAYERS_MODULE})"
            ) from exc
        return {"vision": "off (no fused_layers module)", "audio": "off (no fused_layers module)"}
    registry = importlib.import_module(ADAPTER_MODULE).options.HF_OVERRIDE_KEYS
    if FUSED_LAYERS_KEY not in registry:
        # a tree that carries the module for the graphs' imports but not yet the key: its model
        # constructor never configures the fused layers, so neither does this builder
        if hasattr(model.config, FUSED_LAYERS_KEY):
            raise ValueError(
                f"{FUSED_LAYERS_KEY} is set, but the installed vllm-omni tree does not register it"
            )
        return {"vision": f"off (no {FUSED_LAYERS_KEY} key)", "audio": f"off (no {FUSED_LAYERS_KEY} key)"}
    return importlib.import_module(FUSED_LAYERS_MODULE).configure_fused_layers(model)


def resolve_vision_attn(config: Any, vision_attn: str) -> str:
    """Set ``vision_attn_implementation`` on ``config`` and resolve it as the model's ``__init__`` does.

    Raises:
        ValueError: see :func:`build_thinker_encoders`.
        EncoderWiringMissingError: see :func:`build_thinker_encoders`.
    """
    # the model file resolves it through siglip_attention.py, beside it
    resolve = getattr(getattr(model_module(), "siglip_attention", None), "vision_attn_implementation", None)
    if resolve is None:  # a model file without SigLIP's SDPA attention: its eager attention only
        if vision_attn != "eager":
            raise EncoderWiringMissingError(
                f"vision_attn={vision_attn!r} needs a model file with SDPA attention for SigLIP "
                "(vision_attn_implementation); the installed one runs SigLIP's eager attention only"
            )
        return "eager"
    config.vision_attn_implementation = vision_attn
    return resolve(config)


def _bare_model_on_meta(config: Any) -> Any:
    """The thinker without ``__init__``, holding only the encoder modules, on the ``meta`` device."""
    mod = model_module()
    model = object.__new__(mod.MiniCPMO45OmniLLMForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = config
    with torch.device("meta"):
        vpm = mod.SiglipVisionTransformer(config.vision_config)
        if config.drop_vision_last_layer:
            vpm.encoder.layers = vpm.encoder.layers[:-1]
        vpm.embed_dim = vpm.embeddings.embed_dim
        vpm.patch_size = vpm.embeddings.patch_size
        embed_dim = config.hidden_size
        model.vpm = vpm
        model.resampler = mod.Resampler(
            num_queries=config.query_num,
            embed_dim=embed_dim,
            num_heads=embed_dim // 128,
            kv_dim=vpm.embed_dim,
            adaptive=True,
        )
        model.apm = mod.MiniCPMWhisperEncoder(config.audio_config)
        audio_output_dim = int(model.apm.config.encoder_ffn_dim // 4)
        model.audio_avg_pooler = nn.AvgPool1d(config.audio_pool_step, stride=config.audio_pool_step)
        model.audio_projection_layer = mod.MultiModalProjector(in_dim=audio_output_dim, out_dim=embed_dim)
    model.audio_encoder_layer = -1
    model.audio_past_key_values = None
    return model


def _materialise_(model: Any, *, device: torch.device, dtype: torch.dtype, seed: int, progress: bool) -> None:
    """Allocate the meta model on the CPU, initialise it (:func:`init_weights_`), move and cast it."""
    model.to_empty(device="cpu")
    # to_empty leaves buffers uninitialised: rebuild the resampler's sincos position cache.
    model.resampler._set_2d_pos_cache(model.resampler.max_size, device="cpu")
    if progress:
        num_params = sum(p.numel() for p in model.parameters())
        _progress(f"initialising {num_params / 1e6:.0f} M parameters (seed {seed}) ...")
    init_weights_(model, seed=seed)
    model.to(device=device)
    for param in model.parameters():
        param.data = param.data.to(dtype=dtype)
    model.eval()
    model.requires_grad_(False)


def has_graph_wiring(model: Any) -> bool:
    """True when the installed model class has the encoder CUDA graph wiring (``_init_encoder_cuda_graphs``)."""
    return callable(getattr(type(model), "_init_encoder_cuda_graphs", None))


def wire_encoder_graphs(
    model: Any, vllm_config: Any, *, enabled: Any, backend: Any = None, **options: Any
) -> None:
    """Set every encoder CUDA graph ``--hf-overrides`` key on ``model.config`` (those not given to
    their defaults, so no wiring inherits an earlier one's options) and wire the graphs.

    Raises:
        EncoderWiringMissingError: the installed model file has no encoder CUDA graph wiring.
        ValueError: a bad value, from ``EncoderCudaGraphOptions`` (naming the ``--hf-overrides`` key).
        TypeError: an option that ``EncoderCudaGraphOptions`` does not have.
        RuntimeError: graphs are off but the wiring still installed an adapter.
    """
    if not has_graph_wiring(model):
        raise EncoderWiringMissingError(WIRING_MISSING)
    options_cls = importlib.import_module(ADAPTER_MODULE).EncoderCudaGraphOptions
    values = {"enabled": enabled, **options}
    validated = options_cls(**values)  # raises before model.config changes
    # every key is set, those not given to their defaults: a wiring never inherits an option an
    # earlier wiring of the same model set
    for f in dataclasses.fields(options_cls):
        setattr(model.config, f.metadata["hf_key"], values.get(f.name, getattr(validated, f.name)))
    model._init_encoder_cuda_graphs(vllm_config)
    adapters = (
        vision_graph(model),
        audio_graph(model),
        streaming_audio_graph(model),
    )
    for adapter in adapters:
        if adapter is not None and backend is not None:
            adapter.backend = backend  # before the first call, as the adapter allows
    if not enabled and any(adapter is not None for adapter in adapters):
        raise RuntimeError(
            "_init_encoder_cuda_graphs installed an adapter although encoder_cuda_graph "
            "is false; the model file does not honour the switch"
        )


def vision_graph(model: Any) -> Any:
    """The vision adapter (``model.vpm._encoder_graph``) or None."""
    return getattr(getattr(model, "vpm", None), "_encoder_graph", None)


def audio_graph(model: Any) -> Any:
    """The audio adapter (``model._audio_encoder_graph``) or None."""
    return getattr(model, "_audio_encoder_graph", None)


def streaming_audio_graph(model: Any) -> Any:
    """The streaming (duplex) audio forward's bucket graphs' adapter (``model._streaming_audio.graph``) or None."""
    return getattr(getattr(model, "_streaming_audio", None), "graph", None)


