# SPDX-License-Identifier: Apache-2.0
"""The offline MiniCPM-o 4.5 checkpoint (``minicpmo-cg-checkpoint``): its folder loads through
transformers' auto classes and vLLM's multimodal processor, its placeholders match the embeddings
vllm-omni's thinker makes, its tensors are the thinker's, and ``check`` names a damaged file.

Most tests use a test-only folder (the reduced layout at narrower widths: seconds to build); one
builds the reduced size and one a sharded folder.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from minicpmo_cg.checkpoint import build, check, cli, layout

pytestmark = [pytest.mark.core_model]

SR = 16000


def tiny_config() -> dict:
    """The reduced ``config.json`` at narrow widths; every value a placeholder depends on unchanged."""
    config = layout.checkpoint_config("reduced")
    config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=1)
    vision, audio = config["vision_config"], config["audio_config"]
    vision.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=2)
    audio.update(d_model=64, encoder_ffn_dim=256, encoder_attention_heads=2, encoder_layers=1)
    config["tts_config"]["llm_dim"] = 128
    return config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build.build(tmp_path_factory.mktemp("ckpt") / "tiny", config=tiny_config(), seed=3)


@pytest.fixture(scope="module")
def processor(tiny):
    """vLLM's multimodal processor for the folder, as vllm-omni's thinker stage creates it."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    args = OmniEngineArgs(
        model=str(tiny),
        trust_remote_code=True,
        model_stage="llm",
        model_arch="MiniCPMO45OmniForConditionalGeneration",
        max_model_len=8192,
        dtype="float32",
    )
    return MULTIMODAL_REGISTRY.create_processor(args.create_model_config())


@pytest.fixture(scope="module")
def thinker(tiny):
    """vllm-omni's thinker without its LLM, the encoder weights loaded by its own ``load_weights``.

    Returns:
        the model and the warnings ``load_weights`` logged.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder, mod = tiny, layout.model_module()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = object.__new__(mod.MiniCPMO45OmniLLMForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.config = config
    for prefix, module in layout.thinker_modules(config).items():
        if prefix != "llm":
            setattr(model, prefix, module.to_empty(device="cpu"))
    model.vpm.embed_dim = config.vision_config.hidden_size
    model.vpm.patch_size = config.vision_config.patch_size
    model.resampler._set_2d_pos_cache(model.resampler.max_size)  # a buffer to_empty left unset
    model.audio_avg_pooler = torch.nn.AvgPool1d(config.audio_pool_step, stride=config.audio_pool_step)
    model.audio_encoder_layer, model.audio_past_key_values = -1, None
    weights = load_file(str(folder / "model.safetensors"))
    warnings = []
    original = mod.logger.warning
    mod.logger.warning = lambda msg, *args: warnings.append(msg % args)
    try:
        loaded = model.load_weights((k, v) for k, v in weights.items() if not k.startswith("llm."))
    finally:
        mod.logger.warning = original
    assert loaded == {k for k in weights if not k.startswith("llm.")}
    return model.float().eval().requires_grad_(False), warnings


def placeholders_and_embeddings(processor, model, content: str, mm_data: dict):
    """Embed counts of the placeholders vLLM's processor puts in a chat prompt, per modality, and the
    rows of the thinker's embeddings for the processed items (as vLLM's model runner batches them)."""
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    tokenizer = processor.info.get_tokenizer()
    messages = [{"role": "user", "content": content}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(prompt, processor.info.parse_mm_data(mm_data), hf_processor_mm_kwargs={})
    counts = {m: [r.get_num_embeds() for r in ranges] for m, ranges in out["mm_placeholders"].items()}
    rows = {}
    items = [(m, item) for m, group in out["mm_kwargs"].items() for item in group]
    with torch.no_grad():
        for modality, _, kwargs in group_and_batch_mm_kwargs(items):
            embeddings = model.get_multimodal_embeddings(**kwargs)
            rows.setdefault(modality, []).extend(len(e) for e in embeddings)
    return counts, rows


def damaged(tiny: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "damaged"
    shutil.copytree(tiny, folder)
    return folder


# ---------------------------------------------------------------------------------------------
# Loading through transformers and vLLM
# ---------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_auto_classes_load_the_folder(tiny):
    """AutoConfig, AutoTokenizer and AutoProcessor resolve the folder's own classes and ids."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny, trust_remote_code=True)
    assert type(config).__name__ == "MiniCPMOConfig" and config.version == "4.5"
    assert config.hidden_size == 128 and config.vision_config.hidden_size == config.audio_config.d_model == 64
    tokenizer = AutoTokenizer.from_pretrained(tiny, trust_remote_code=True)
    assert len(tokenizer) == config.vocab_size == layout.VOCAB_SIZE
    stops = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|tts_bos|>", "<|tts_eos|>"])
    assert stops == [151645, 151703, 151704]  # the ids vllm-omni's pipeline and talker bridge hardcode
    assert tokenizer.eos_token_id == 151645
    text = "Hi, wörld (<image>./</image>)"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    processor = AutoProcessor.from_pretrained(tiny, trust_remote_code=True)
    assert type(processor).__name__ == layout.PROCESSOR_CLASS
    out = processor(
        text=["(<image>./</image>) and (<audio>./</audio>)"],
        images=[[Image.new("RGB", (448, 448))]],
        audios=[[np.zeros(2 * SR, np.float32)]],
        chunk_input=True,
    )
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    audio_start = tokenizer.convert_tokens_to_ids("<|audio_start|>")
    assert int((out["input_ids"] == unk).sum()) == config.query_num + 2 * 10
    assert int((out["input_ids"] == audio_start).sum()) == 2  # one group per 1 s chunk
    assert out["tgt_sizes"][0].tolist() == [[32, 32]]
    assert out["audio_features"].shape == (1, 80, 200) and out["audio_feature_lens"][0].tolist() == [200]


def audio_tokens(config: dict, seconds: float) -> int:
    """LLM tokens of a clip: 100 mel frames per second, Whisper's stride 2, pooled by audio_pool_step."""
    return (int(seconds * 100) // 2) // config["audio_pool_step"]


def image_tokens(config: dict, width: int, height: int) -> int:
    """``query_num`` per slice: the whole image plus one per ``image_size`` tile (sides multiples of it)."""
    tiles = (width // config["image_size"]) * (height // config["image_size"])
    return config["query_num"] * (1 + (tiles if tiles > 1 else 0))


@pytest.mark.cpu
@pytest.mark.parametrize(
    "content, mm",
    [
        ("(<image>./</image>)\nWhat is it?", {"image": [(448, 448)]}),
        ("(<image>./</image>)\nRead it.", {"image": [(1344, 1344)]}),
        ("(<audio>./</audio>)\nWhat is said?", {"audio": [1.0]}),
        ("(<audio>./</audio>)\nTranscribe.", {"audio": [30.0]}),
        ("(<image>./</image>)\n(<audio>./</audio>)\nBoth?", {"image": [(1344, 448)], "audio": [45.0]}),
    ],
    ids=["image 1 slice", "image 10 slices", "audio 1 s", "audio 30 s", "image 4 slices + audio 45 s"],
)
def test_placeholders_match_thinker_embeddings(tiny, processor, thinker, content, mm):
    """vLLM's processor reserves as many embedding positions as the thinker's encoders produce, and
    both equal the count the config implies (query_num per slice; 10 audio tokens per second)."""
    config = json.loads((tiny / "config.json").read_text())
    model, warnings = thinker
    assert warnings == []  # no "missing" / "unexpected" from the thinker's load_weights
    rng = np.random.default_rng(0)
    data, wanted = {}, {}
    for w, h in mm.get("image", []):
        data.setdefault("image", []).append(Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
        wanted.setdefault("image", []).append(image_tokens(config, w, h))
    for seconds in mm.get("audio", []):
        clip = rng.standard_normal(int(seconds * SR)).astype(np.float32) * 0.1
        data.setdefault("audio", []).append((clip, SR))
        wanted.setdefault("audio", []).append(audio_tokens(config, seconds))
    counts, rows = placeholders_and_embeddings(processor, model, content, data)
    assert counts == wanted
    assert rows == wanted


# ---------------------------------------------------------------------------------------------
# Tensors: names, values, sizes, shards
# ---------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_reduced_size_is_the_thinker_at_full_encoder_widths(tmp_path):
    """The reduced folder passes ``check``; each tensor is a parameter of a thinker module built
    independently here from the folder's config; encoders keep the full size's widths; it stays small."""
    from safetensors import safe_open
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = build.build(tmp_path / "reduced", "reduced")
    assert "ok" in check.check(folder)
    config = json.loads((folder / "config.json").read_text())
    full = layout.checkpoint_config("full")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "patch_size", "image_size"):
        assert config["vision_config"][key] == full["vision_config"][key]
    for key in ("d_model", "encoder_ffn_dim", "encoder_attention_heads", "num_mel_bins"):
        assert config["audio_config"][key] == full["audio_config"][key]
    assert (config["num_hidden_layers"], full["num_hidden_layers"], full["hidden_size"]) == (2, 36, 4096)
    mod = layout.model_module()
    hf = mod.MiniCPMOConfig(**config)
    hf.vision_config._attn_implementation = "eager"
    with torch.device("meta"):
        vpm = mod.SiglipVisionTransformer(hf.vision_config)
        del vpm.encoder.layers[-1]  # the thinker drops SigLIP's last layer
        modules = {
            "llm": Qwen3ForCausalLM(Qwen3Config(**config)),
            "vpm": vpm,
            "resampler": mod.Resampler(64, hf.hidden_size, hf.hidden_size // 128, kv_dim=1152, adaptive=True),
            "apm": mod.MiniCPMWhisperEncoder(hf.audio_config),
            "audio_projection_layer": mod.MultiModalProjector(4096 // 4, hf.hidden_size),
        }
    params = {f"{p}.{k}": tuple(v.shape) for p, m in modules.items() for k, v in m.state_dict().items()}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == params
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 400e6


@pytest.mark.cpu
def test_weights_are_seeded_and_sane(tiny):
    """Values depend on the seed only (per tensor, whatever the sharding); std 0.02, norms 1, biases 0."""
    from safetensors.torch import load_file

    weights = load_file(str(tiny / "model.safetensors"))
    name = "llm.model.layers.0.mlp.down_proj.weight"
    again = build.random_tensor(name, tuple(weights[name].shape), "normal", seed=3, device="cpu")
    other = build.random_tensor(name, tuple(weights[name].shape), "normal", seed=4, device="cpu")
    assert torch.equal(weights[name], again) and not torch.equal(weights[name], other)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert abs(weights["llm.model.embed_tokens.weight"].float().std().item() - 0.02) < 1e-3
    assert torch.all(weights["llm.model.norm.weight"] == 1)
    assert torch.all(weights["apm.layer_norm.weight"] == 1)
    assert torch.all(weights["vpm.encoder.layers.0.self_attn.q_proj.bias"] == 0)


@pytest.mark.cpu
def test_sharded_folder_has_an_index_and_checks(tmp_path, monkeypatch):
    """Above the shard size (the full size's case) tensors go to numbered shards named by an index;
    a missing shard is named by ``check``."""
    monkeypatch.setattr(build, "SHARD_BYTES", 30 * 1024**2)
    folder = build.build(tmp_path / "sharded", config=tiny_config(), seed=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        2 * math.prod(s) for s, _ in layout.tensor_specs(layout.hf_config(tiny_config())).values()
    )
    assert not (folder / "model.safetensors").exists()
    assert "ok" in check.check(folder)
    (folder / files[-1]).unlink()
    with pytest.raises(check.CheckError, match=rf"^{files[-1]}: missing"):
        check.check(folder)


# ---------------------------------------------------------------------------------------------
# A damaged folder: one line naming the file
# ---------------------------------------------------------------------------------------------


def _drop_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    del weights[name]
    save_file(weights, str(folder / "model.safetensors"))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.cpu
@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "tokenizer.json").unlink(), r"^tokenizer\.json: missing$"),
        (lambda f: (f / "config.json").write_text("{"), r"^config\.json: not valid JSON"),
        (lambda f: _edit_config(f, model_type="qwen3"), r"^config\.json: model_type is 'qwen3', expected"),
        (lambda f: _edit_config(f, version=4.5), r"^config\.json: version is 4\.5, expected '4\.5'$"),
        (
            lambda f: _drop_tensor(f, "resampler.proj"),
            r"^model\.safetensors: missing tensor resampler\.proj$",
        ),
        (
            lambda f: (f / "preprocessor_config.json").write_text(
                json.dumps({**json.loads((f / "preprocessor_config.json").read_text()), "auto_map": {}})
            ),
            r"^preprocessor_config\.json: auto_map is \{\}",
        ),
    ],
    ids=["missing file", "bad json", "model_type", "version not a string", "missing tensor", "processor"],
)
def test_check_names_the_damaged_file(tiny, tmp_path, capsys, damage, message):
    folder = damaged(tiny, tmp_path)
    damage(folder)
    with pytest.raises(check.CheckError, match=message):
        check.check(folder)
    assert cli.main(["check", str(folder)]) == cli.EXIT_BAD
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minicpmo-cg-checkpoint check: ")


@pytest.mark.cpu
def test_check_catches_an_unknown_or_reshaped_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = damaged(tiny, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "llm.model.extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(check.CheckError, match=r"unknown tensor llm\.model\.extra\.weight"):
        check.check(folder)
    weights["apm.conv1.bias"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(check.CheckError, match=r"shape of apm\.conv1\.bias is \(3,\), expected \(64,\)"):
        check.check(folder)


@pytest.mark.cpu
def test_command_reports_one_line_without_traceback(tiny, tmp_path):
    """The installed entry point (``python -m minicpmo_cg.checkpoint``): exit 2, one stderr line."""
    folder = damaged(tiny, tmp_path)
    _edit_config(folder, architectures=["Qwen3ForCausalLM"])
    run = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.checkpoint", "check", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    wanted = "config.json: architectures is ['Qwen3ForCausalLM'], expected ['MiniCPMO']"
    assert run.stderr.strip() == f"minicpmo-cg-checkpoint check: {wanted}"
    run = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.checkpoint", "build", str(tiny), "--size", "reduced"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("exists and is not empty")


@pytest.mark.cpu
def test_every_token_vllm_omni_resolves_is_special():
    """The markers of vllm-omni's processor, talker suffix and duplex policy (where the installed
    vllm-omni has one) are single special tokens, the pinned ones at their ids."""
    tokens = layout.special_tokens()
    assert len(tokens) == layout.VOCAB_SIZE - layout.FIRST_SPECIAL_ID == len(set(tokens.values()))
    assert all(tokens[i] == t for t, i in layout.PINNED_IDS.items())
    tts_suffix = layout.model_module().MiniCPMO45OmniLLMMultiModalProcessor._TTS_SUFFIX
    markers = {"<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>", "<unk>"}
    markers |= {"<|audio_start|>", "<|audio_end|>", *re.findall(r"<\|\w+\|>", tts_suffix)}
    try:
        from vllm_omni.model_executor.models.minicpmo_4_5.duplex import policy as duplex

        policy = duplex.MiniCPMO45DuplexPolicy
    except ModuleNotFoundError:  # vllm-omni 0.28 (legacy lane) has no duplex stage
        policy = None
    if policy is not None:
        markers |= {*policy.SPECIAL_TOKEN_FIELDS.values(), *policy.OPTIONAL_TOKEN_FIELDS.values()}
        assert len(markers) >= 20
    assert markers - set(tokens.values()) == set()
