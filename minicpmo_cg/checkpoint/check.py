"""Validate a checkpoint folder: every file vllm-omni reads for the thinker; weights by their headers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from minicpmo_cg.checkpoint import layout

#: config.json keys vllm-omni's thinker (and the talker's config hook) read
REQUIRED_KEYS = (
    "hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size vocab_size "
    "query_num image_size drop_vision_last_layer slice_config use_image_id vision_batch_size audio_pool_step "
    "audio_chunk_length vision_config audio_config tts_config"
).split()


class CheckError(Exception):
    """A problem with one file of the folder; ``str()`` is the one-line report ``<file>: <what>``."""

    def __init__(self, file: str, what: str) -> None:
        super().__init__(f"{file}: {what}")


def _json(folder: Path, name: str) -> dict[str, Any]:
    if not (folder / name).is_file():
        raise CheckError(name, "missing")
    try:
        data = json.loads((folder / name).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckError(name, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckError(name, "not a JSON object")
    return data


def _expect(file: str, what: str, value: Any, wanted: Any) -> None:
    if value != wanted:
        raise CheckError(file, f"{what} is {value!r}, expected {wanted!r}")


def _check_config(folder: Path) -> dict[str, Any]:
    config = _json(folder, "config.json")
    wanted = dict(model_type="minicpmo", architectures=["MiniCPMO"], version="4.5", attention_bias=False)
    for key, value in wanted.items():
        _expect("config.json", key, config.get(key), value)
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise CheckError("config.json", f"missing keys: {', '.join(missing)}")
    auto_map = config.get("auto_map") or {}
    for auto in ("AutoConfig", "AutoProcessor"):
        module = str(auto_map.get(auto, "")).split(".")[0] + ".py"
        if auto not in auto_map or not (folder / module).is_file():
            raise CheckError("config.json", f"auto_map {auto} names no code file of the folder")
    if (hidden := config["hidden_size"]) % 128:
        raise CheckError("config.json", f"hidden_size {hidden} is no multiple of 128 (the head size)")
    return config


def _check_tokenizer(folder: Path, config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer

    tok_config = _json(folder, "tokenizer_config.json")
    _expect("tokenizer_config.json", "eos_token", tok_config.get("eos_token"), "<|im_end|>")
    if not tok_config.get("chat_template"):
        raise CheckError("tokenizer_config.json", "no chat_template")
    if not (folder / "tokenizer.json").is_file():
        raise CheckError("tokenizer.json", "missing")
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises its own exception types
        raise CheckError("tokenizer.json", f"does not load ({exc})") from None
    for token_id, token in layout.special_tokens().items():
        _expect("tokenizer.json", f"id of {token}", tokenizer.token_to_id(token), token_id)
    if (size := tokenizer.get_vocab_size()) > config["vocab_size"]:
        raise CheckError("tokenizer.json", f"{size} tokens for vocab_size {config['vocab_size']}")


def _check_weights(folder: Path, specs: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Every tensor of ``specs`` in the folder's safetensors file(s) at its shape, in bf16, and no other."""
    from safetensors import safe_open

    index = "model.safetensors.index.json"
    if (folder / index).is_file():
        where = _json(folder, index).get("weight_map")
        if not isinstance(where, dict) or not where:
            raise CheckError(index, "no weight_map")
    elif (folder / "model.safetensors").is_file():
        where = dict.fromkeys(safe_open(str(folder / "model.safetensors"), "pt").keys(), "model.safetensors")
    else:
        raise CheckError("model.safetensors", "missing (and no model.safetensors.index.json)")
    total = 0
    for file in sorted(set(where.values())):
        if not (folder / file).is_file():
            raise CheckError(file, f"missing (named in {index})")
        try:
            handle = safe_open(str(folder / file), "pt")
        except Exception as exc:  # safetensors raises its own exception types
            raise CheckError(file, f"not a safetensors file ({exc})") from None
        listed, present = {n for n, f in where.items() if f == file}, set(handle.keys())
        for name in sorted(listed | present):
            if name not in specs:
                raise CheckError(file, f"unknown tensor {name} (no parameter of the thinker)")
            if name not in present or name not in listed:
                where_not = "the file" if name in listed else index
                raise CheckError(file, f"tensor {name} is not in {where_not}")
            piece = handle.get_slice(name)
            _expect(file, f"shape of {name}", tuple(piece.get_shape()), specs[name][0])
            _expect(file, f"dtype of {name}", piece.get_dtype(), "BF16")
            total += 2 * math.prod(specs[name][0])
    missing = sorted(set(specs) - set(where))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckError("model.safetensors", f"missing tensor {missing[0]}{more}")
    return total


def check(folder: str | Path) -> str:
    """Validate a checkpoint folder.

    Raises:
        CheckError: the first problem found, naming its file.
    """
    from minicpmo_cg.checkpoint.build import side_files

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckError(str(folder), "not a directory")
    config = _check_config(folder)
    _check_tokenizer(folder, config)
    try:
        wanted_files = side_files(config)
        specs = layout.tensor_specs(layout.hf_config(config))
    except Exception as exc:  # a malformed value reaches vllm-omni's config or module constructors
        raise CheckError("config.json", f"builds no thinker ({type(exc).__name__}: {exc})") from None
    for name, wanted in wanted_files.items():
        data = _json(folder, name)
        for key, value in wanted.items():
            _expect(name, key, data.get(key), value)
    nbytes = _check_weights(folder, specs)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    return f"{folder}: ok (MiniCPM-o 4.5, {layers} LLM layers, hidden {hidden}, {nbytes / 1e9:.2f} GB)"
