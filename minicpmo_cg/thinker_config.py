"""MiniCPM-o 4.5's thinker configuration at the checkpoint's values, without the checkpoint."""

from __future__ import annotations

import importlib
from typing import Any

MODEL_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm"

# Where each value comes from: "MiniCPMOConfig default" = a default in the installed
# minicpmo_4_5_omni_llm.py (a test checks each); "checkpoint" = the checkpoint's config.json value.

#: Thinker LLM (Qwen3-8B): only ``hidden_size`` matters to the encoders (resampler embed dim and
#: audio projection width, ``num_heads = hidden_size // 128`` = 32). Checkpoint values; the
#: MiniCPMOConfig (a Qwen2Config) defaults are Qwen2-7B's (hidden 4096, 28 layers, 28 heads).
LLM_CONFIG: dict[str, Any] = {
    "hidden_size": 4096,  # checkpoint (Qwen3-8B); = Qwen2Config default too
    "num_attention_heads": 32,  # checkpoint (Qwen3-8B); not read by the encoders
    "num_key_value_heads": 8,  # checkpoint (Qwen3-8B); not read by the encoders
    "intermediate_size": 12288,  # checkpoint (Qwen3-8B); not read by the encoders
    "num_hidden_layers": 36,  # checkpoint (Qwen3-8B); not read by the encoders
    "attention_bias": False,  # checkpoint: False selects Qwen3ForCausalLM in the model's __init__
}

#: SigLIP so400m (NaViT variant) = ``MiniCPMOConfig.default_vision_config`` verbatim.
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 1152,  # MiniCPMOConfig default_vision_config
    "image_size": 980,  # MiniCPMOConfig default_vision_config (position-bucket grid 70x70)
    "intermediate_size": 4304,  # MiniCPMOConfig default_vision_config
    "model_type": "siglip",  # MiniCPMOConfig default_vision_config
    "num_attention_heads": 16,  # MiniCPMOConfig default_vision_config
    "num_hidden_layers": 27,  # MiniCPMOConfig default_vision_config; 26 run (drop_vision_last_layer)
    "patch_size": 14,  # MiniCPMOConfig default_vision_config
}

#: Whisper-medium encoder. The checkpoint's audio_config; MiniCPMOConfig's default
#: (``WhisperConfig()``, i.e. whisper-tiny sizes: d_model 384, 4 layers, 6 heads, ffn 1536)
#: differs, its comment says "same as openai/whisper-medium".
AUDIO_CONFIG: dict[str, Any] = {
    "d_model": 1024,  # checkpoint / whisper-medium
    "encoder_layers": 24,  # checkpoint / whisper-medium
    "encoder_attention_heads": 16,  # checkpoint / whisper-medium
    "encoder_ffn_dim": 4096,  # checkpoint / whisper-medium (audio_output_dim = 4096 // 4 = 1024)
    "num_mel_bins": 80,  # checkpoint / whisper-medium = WhisperConfig default
    "max_source_positions": 1500,  # checkpoint / whisper-medium = WhisperConfig default (30 s)
}

#: Top-level MiniCPMOConfig fields.
THINKER_CONFIG: dict[str, Any] = {
    "query_num": 64,  # MiniCPMOConfig default
    "image_size": 448,  # MiniCPMOConfig default; the slicing scale_resolution
    "drop_vision_last_layer": True,  # MiniCPMOConfig default
    "vision_batch_size": 16,  # MiniCPMOConfig default
    "audio_pool_step": 5,  # MiniCPMOConfig default
    "audio_chunk_length": 1.0,  # MiniCPMOConfig default (50 Whisper frames per chunk)
    # checkpoint: MiniCPMOConfig's default slice_config is MiniCPMVSliceConfig(max_slice_nums=1);
    # the checkpoint (and MiniCPMVImageProcessor's default) use 9. patch_size 14 and
    # scale_resolution 448 are the MiniCPMVSliceConfig defaults.
    "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
    "init_tts": False,  # the talker is not part of the thinker's encoders
}

#: Layers kept by ``reduced=True``: 3 vision layers (2 after drop_vision_last_layer) and
#: 2 audio layers, all widths unchanged.
REDUCED_VISION_LAYERS = 3
REDUCED_AUDIO_LAYERS = 2


def model_module() -> Any:
    """Import and return the installed vllm-omni MiniCPM-o 4.5 thinker model module."""
    return importlib.import_module(MODEL_MODULE)


def thinker_config(*, reduced: bool = False, **overrides: Any) -> Any:
    """Return a ``MiniCPMOConfig`` at MiniCPM-o 4.5's checkpoint values."""
    mod = model_module()
    vision = dict(VISION_CONFIG)
    audio = dict(AUDIO_CONFIG)
    if reduced:
        vision["num_hidden_layers"] = REDUCED_VISION_LAYERS
        audio["encoder_layers"] = REDUCED_AUDIO_LAYERS
    config = mod.MiniCPMOConfig(vision_config=vision, audio_config=audio, **THINKER_CONFIG, **LLM_CONFIG)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
