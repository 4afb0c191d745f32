"""Write a MiniCPM-o 4.5 checkpoint folder of random weights under the real names (see :mod:`.layout`)."""

from __future__ import annotations

import json
import math
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

from minicpmo_cg.checkpoint import layout
from minicpmo_cg.checkpoint.tokenizer import build_tokenizer

#: bf16 bytes per shard; a folder whose weights fit in one shard gets a single ``model.safetensors``
SHARD_BYTES = 2 * 1024**3
STD = 0.02
REMOTE_DIR = Path(__file__).resolve().parent / "remote"


def random_tensor(name: str, shape: tuple[int, ...], init: str, *, seed: int, device: str) -> Any:
    """One bf16 CPU tensor: ``normal(0, 0.02)`` drawn on ``device`` by a generator seeded from ``seed``
    and ``name`` (so values do not depend on sharding; CPU and CUDA draws differ), or ones / zeros."""
    import torch

    if init != "normal":
        return (torch.ones if init == "ones" else torch.zeros)(shape, dtype=torch.bfloat16)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    values = torch.empty(shape, dtype=torch.bfloat16, device=device)
    return values.normal_(0.0, STD, generator=generator).cpu()


def shards(specs: dict[str, tuple[tuple[int, ...], str]], limit: int | None = None) -> list[list[str]]:
    """Tensor names in consecutive groups of at most ``limit`` (default ``SHARD_BYTES``) bf16 bytes;
    a larger tensor gets a group of its own."""
    limit = SHARD_BYTES if limit is None else limit
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in specs.items():
        if groups[-1] and size + 2 * math.prod(shape) > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += 2 * math.prod(shape)
    return groups


def side_files(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``preprocessor_config.json`` (read by the folder's processor) and ``generation_config.json``."""
    image = dict(
        max_slice_nums=config["slice_config"]["max_slice_nums"], scale_resolution=config["image_size"],
        patch_size=config["vision_config"]["patch_size"], use_image_id=config["use_image_id"],
        image_feature_size=config["query_num"], slice_mode=True, version=4.5,
        norm_mean=[0.5, 0.5, 0.5], norm_std=[0.5, 0.5, 0.5],
    )
    audio = dict(
        feature_size=config["audio_config"]["num_mel_bins"], sampling_rate=16000, hop_length=160,
        chunk_length=30, n_fft=400, padding_value=0.0, return_attention_mask=True,
    )
    preprocessor = {
        "auto_map": {"AutoProcessor": config["auto_map"]["AutoProcessor"]},
        "image_processor": image,
        "feature_extractor": audio,
        "processor": {
            "pool_step": config["audio_pool_step"],
            "audio_chunk_length": config["audio_chunk_length"],
        },
    }
    # eos: the thinker stage's stop ids in vllm-omni's pipeline (<|im_end|>, <|tts_eos|>)
    eos = [layout.PINNED_IDS["<|im_end|>"], layout.PINNED_IDS["<|tts_eos|>"]]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}
    generation["pad_token_id"] = config["pad_token_id"]
    return {"preprocessor_config.json": preprocessor, "generation_config.json": generation}


def build(
    out: str | Path,
    size: str = "reduced",
    *,
    seed: int = 0,
    device: str = "cpu",
    config: dict[str, Any] | None = None,
    progress: bool = False,
) -> Path:
    """Write a checkpoint folder at ``out`` (built in ``<out>.partial``, renamed when complete).

    Raises:
        FileExistsError: ``out`` exists and is not empty.
        ValueError: an unknown size, or ``device`` is CUDA without a GPU.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available")
    config = config if config is not None else layout.checkpoint_config(size)
    specs = layout.tensor_specs(layout.hf_config(config))
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # a transformers version marks the folder as current (transformers 5 otherwise suspects a Mistral regex)
    files = {"config.json": {**config, "transformers_version": transformers.__version__}}
    files.update(side_files(config))
    for name, data in files.items():
        (work / name).write_text(json.dumps(data, indent=2) + "\n")
    for name in layout.REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / name, work / name)
    build_tokenizer(work)
    groups = shards(specs)
    count = len(groups)
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    names = names if count > 1 else ["model.safetensors"]
    params = sum(math.prod(shape) for shape, _ in specs.values())
    if progress:
        print(f"[checkpoint] {len(specs)} tensors, {params / 1e9:.2f} B parameters", file=sys.stderr)
    for file, group in zip(names, groups):
        tensors = {n: random_tensor(n, *specs[n], seed=seed, device=device) for n in group}
        save_file(tensors, str(work / file), {"format": "pt"})
        del tensors  # one shard in memory at a time
        if progress:
            print(f"[checkpoint] wrote {file}", file=sys.stderr, flush=True)
    if count > 1:
        weight_map = {n: file for file, group in zip(names, groups) for n in group}
        index = {"metadata": {"total_size": 2 * params}, "weight_map": weight_map}
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    work.rename(out)
    return out
