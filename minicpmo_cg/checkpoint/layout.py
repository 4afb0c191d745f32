"""What a MiniCPM-o 4.5 checkpoint folder holds: its ``config.json`` per size, its special tokens and
the names, shapes and initial values of its tensors.
"""

from __future__ import annotations

import copy
from typing import Any

from minicpmo_cg.thinker_config import (
    AUDIO_CONFIG,
    LLM_CONFIG,
    REDUCED_AUDIO_LAYERS,
    REDUCED_VISION_LAYERS,
    THINKER_CONFIG,
    VISION_CONFIG,
    model_module,
)

SIZES = ("full", "reduced")
PROCESSOR_CLASS = "MiniCPMO45Processor"
PROCESSOR = f"processing_minicpmo.{PROCESSOR_CLASS}"
#: files of the folder that carry code (copied from ``minicpmo_cg/checkpoint/remote/``)
REMOTE_FILES = ("configuration_minicpmo.py", "processing_minicpmo.py")

#: Qwen3's own special tokens, from id 151643 on.
_QWEN3_SPECIALS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> "
    "<|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
    "<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()
#: MiniCPM-o's markers, from id 151669 on (image/slice/audio markers, speaker and duplex tokens).
_MINICPM_MARKERS = (
    "<image> </image> <ref> </ref> <box> </box> <quad> </quad> <point> </point> <slice> </slice> "
    "<image_id> </image_id> <unit> </unit> <asr> </asr> <query> </query> <|audio_start|> <|audio|> "
    "<|audio_end|> <|spk_bos|> <|spk|> <|spk_eos|> <unk> <video> </video>"
).split()
#: Ids vllm-omni hardcodes (pipeline stop ids 151704/151645, the talker bridge's 151703) or its
#: duplex tests pin; every other marker follows the two runs above.
PINNED_IDS = {
    "<|im_end|>": 151645, "<unit>": 151683, "</unit>": 151684, "<|tts_bos|>": 151703, "<|tts_eos|>": 151704,
    "<|listen|>": 151705, "<|speak|>": 151706, "<|interrupt|>": 151707, "<|vad_start|>": 151708,
    "<|vad_end|>": 151709, "<|turn_eos|>": 151717, "<|chunk_eos|>": 151718, "<|chunk_tts_eos|>": 151721,
    "<|tts_pad|>": 151722,
}
FIRST_SPECIAL_ID = 151643
VOCAB_SIZE = 151748  # the checkpoint's (padded) vocabulary


def special_tokens() -> dict[int, str]:
    """Every added token by id, ``FIRST_SPECIAL_ID`` .. ``VOCAB_SIZE - 1`` (gaps: ``<|reserved_N|>``)."""
    tokens = dict(enumerate(_QWEN3_SPECIALS + _MINICPM_MARKERS, start=FIRST_SPECIAL_ID))
    tokens.update({i: t for t, i in PINNED_IDS.items()})
    ids = range(FIRST_SPECIAL_ID, VOCAB_SIZE)
    return {i: tokens.get(i, f"<|reserved_{i - FIRST_SPECIAL_ID}|>") for i in ids}


#: Qwen3-8B's LLM values that ``thinker_config.LLM_CONFIG`` leaves out.
_QWEN3_8B = {
    "vocab_size": VOCAB_SIZE, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_dropout": 0.0,
    "use_sliding_window": False,
}
#: reduced LLM: two layers at hidden 256 (2 resampler heads of 128); vocabulary and head_dim unchanged
_REDUCED_LLM = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1,
}


def checkpoint_config(size: str) -> dict[str, Any]:
    """The ``config.json`` of a folder of ``size`` (``"full"`` or ``"reduced"``).

    Raises:
        ValueError: an unknown size.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    vision = {**VISION_CONFIG, "model_type": "siglip_vision_model"}
    audio = {**AUDIO_CONFIG, "model_type": "whisper", "activation_function": "gelu"}
    llm = {**LLM_CONFIG, **_QWEN3_8B}
    if size == "reduced":
        vision["num_hidden_layers"] = REDUCED_VISION_LAYERS
        audio["encoder_layers"] = REDUCED_AUDIO_LAYERS
        llm.update(_REDUCED_LLM)
    return {
        "architectures": ["MiniCPMO"],
        "model_type": "minicpmo",
        "version": "4.5",
        "auto_map": {"AutoConfig": "configuration_minicpmo.MiniCPMOConfig", "AutoProcessor": PROCESSOR},
        **llm,
        **THINKER_CONFIG,
        "use_image_id": True, "batch_vision_input": True, "stream_input": False,
        "init_vision": True, "init_audio": True,
        "init_tts": False,  # no talker weights: only the thinker stage loads from this folder
        "vision_config": vision,
        "audio_config": audio,
        # the talker's config as vllm-omni reads it (codec EOS = num_audio_tokens - 1 = 6561)
        "tts_config": {
            "model_type": "conditional_chattts", "llm_dim": llm["hidden_size"],
            "num_audio_tokens": 6562,
        },
        "bos_token_id": FIRST_SPECIAL_ID, "pad_token_id": FIRST_SPECIAL_ID,
        "eos_token_id": PINNED_IDS["<|im_end|>"],
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


def hf_config(config: dict[str, Any]) -> Any:
    """vllm-omni's ``MiniCPMOConfig`` for a ``config.json`` dict."""
    return model_module().MiniCPMOConfig(**copy.deepcopy(config))


def thinker_modules(config: Any) -> dict[str, Any]:
    """The thinker's modules on the ``meta`` device, by checkpoint prefix, built as vllm-omni's model
    builds them (last SigLIP layer dropped, Qwen3 for ``attention_bias`` false).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    mod = model_module()
    vision_config = copy.deepcopy(config.vision_config)
    vision_config._attn_implementation = "eager"  # parameter names do not depend on it
    hidden = config.hidden_size
    with torch.device("meta"):
        vpm = mod.SiglipVisionTransformer(vision_config)
        if config.drop_vision_last_layer:
            vpm.encoder.layers = vpm.encoder.layers[:-1]
        apm = mod.MiniCPMWhisperEncoder(config.audio_config)
        return {
            "vpm": vpm,
            "resampler": mod.Resampler(
                num_queries=config.query_num, embed_dim=hidden, num_heads=hidden // 128,
                kv_dim=vision_config.hidden_size, adaptive=True,
            ),
            "apm": apm,
            "audio_projection_layer": mod.MultiModalProjector(apm.config.encoder_ffn_dim // 4, hidden),
            "llm": Qwen3ForCausalLM(Qwen3Config.from_dict(config.to_dict())),
        }


def tensor_specs(config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every checkpoint tensor: ``name -> (shape, init)``, ``init`` one of ``"normal"``, ``"ones"``,
    ``"zeros"`` (norm weights 1, biases 0, everything else normal).
    """
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for prefix, module in thinker_modules(config).items():
        norms = {
            f"{name}.{leaf}" if name else leaf
            for name, sub in module.named_modules()
            if "Norm" in type(sub).__name__
            for leaf, _ in sub.named_parameters(recurse=False)
        }
        for name, tensor in module.state_dict().items():
            init = "zeros" if name.endswith("bias") else "ones" if name in norms else "normal"
            specs[f"{prefix}.{name}"] = (tuple(tensor.shape), init)
    return specs
