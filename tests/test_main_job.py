# SPDX-License-Identifier: Apache-2.0
"""The main job ``minicpmo-cg-demo``: its inputs, its standalone encoders and end-to-end runs.

The end-to-end runs start the job in a subprocess (``python -m minicpmo_cg.main_job``), as a
user would, against the vllm-omni installed for the running interpreter; they need the patch
set applied (``minicpmo-cg-patch apply``). ``--quick`` on CPU takes about a minute here
(``~15 s`` of it importing vLLM).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minicpmo_cg import main_job, standalone

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

QUICK_INPUTS = ["chelsea@224", "frame@224", "speech_1s", "speech_5s"]
JOB_TIMEOUT_S = 900


def _run_job(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out_json = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.main_job", *args, "--json", str(out_json)],
        check=False,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out_json.is_file(), f"no JSON written (rc={proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    return proc, json.loads(out_json.read_text())


def _table_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of the results table keyed by input name (the lines between the dashes and the legend)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("input ") and "eager ms" in line)
    rows = {}
    for line in lines[start + 2 :]:
        if line.startswith("input shape:"):
            break
        cells = line.split()
        rows[cells[0]] = cells
    return rows


# ---------------------------------------------------------------------------------------------
# Configuration values and argument handling (cheap)
# ---------------------------------------------------------------------------------------------


def test_config_values_match_installed_defaults():
    """Values standalone.py attributes to MiniCPMOConfig defaults are the installed file's defaults."""
    mod = standalone.model_module()
    assert mod.MiniCPMOConfig.default_vision_config == standalone.VISION_CONFIG
    defaults = {
        name: p.default for name, p in inspect.signature(mod.MiniCPMOConfig.__init__).parameters.items()
    }
    for key in (
        "query_num",
        "image_size",
        "drop_vision_last_layer",
        "vision_batch_size",
        "audio_pool_step",
        "audio_chunk_length",
    ):
        assert defaults[key] == standalone.THINKER_CONFIG[key], key
    slice_defaults = {
        name: p.default for name, p in inspect.signature(mod.MiniCPMVSliceConfig.__init__).parameters.items()
    }
    assert slice_defaults["patch_size"] == 14 and slice_defaults["scale_resolution"] == 448
    config = standalone.thinker_config()
    assert config.slice_config.max_slice_nums == 9
    assert config.hidden_size == 4096
    assert config.vision_config.num_hidden_layers == 27 and config.drop_vision_last_layer
    audio = config.audio_config
    assert (
        audio.d_model,
        audio.encoder_layers,
        audio.encoder_attention_heads,
        audio.encoder_ffn_dim,
        audio.num_mel_bins,
    ) == (1024, 24, 16, 4096, 80)


def test_reduced_encoders_shapes_and_deterministic_weights():
    a = standalone.build_thinker_encoders(reduced=True, seed=3)
    b = standalone.build_thinker_encoders(reduced=True, seed=3)
    assert len(a.vpm.encoder.layers) == 2 and len(a.apm.layers) == 2
    assert a.vpm.embed_dim == 1152 and a.vpm.config.intermediate_size == 4304
    assert a.resampler.embed_dim == 4096 and a.resampler.num_heads == 32
    assert a.resampler.kv_proj.in_features == 1152
    assert a.apm.config.d_model == 1024 and a.audio_projection_layer.linear1.in_features == 1024
    assert a.audio_avg_pooler.kernel_size == (5,) and a.audio_encoder_layer == -1
    assert not a.training and all(p.dtype == torch.float32 and not p.requires_grad for p in a.parameters())
    assert a.build_info.vision_attn == "eager"
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    ln = a.vpm.post_layernorm
    assert torch.equal(ln.weight, torch.ones_like(ln.weight)) and not ln.bias.any()
    assert a.resampler.pos_embed.dtype == torch.float32 and a.resampler.pos_embed.abs().max() <= 1.0


def test_wiring_without_patch_names_the_patch_tool():
    class Unpatched:
        config = object()

    with pytest.raises(standalone.PatchMissingError, match="minicpmo-cg-patch apply"):
        standalone.wire_encoder_graphs(Unpatched(), None, enabled=True)


def test_bad_repeats_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main_job.parse_args(["--repeats", "0"])
    assert exc.value.code == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# inputs.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor():
    from minicpmo_cg import inputs

    return inputs.make_image_processor()


@pytest.mark.parametrize(
    "photo, grid",
    [("astronaut", (1, 2)), ("hubble_deep_field", (2, 2)), ("retina", (3, 3))],
)
def test_multi_slice_photo_tgt_sizes(processor, photo, grid):
    """A photo larger than 448² gives the source slice plus one slice per grid cell."""
    from minicpmo_cg import inputs

    image = inputs.load_photo(photo)
    assert processor.get_sliced_grid(image.size, inputs.MAX_SLICE_NUMS) == list(grid)
    item = inputs.vision_input(processor, photo, [photo])
    assert item.num_slices == 1 + grid[0] * grid[1] == item.tgt_sizes.shape[0]
    assert item.tgt_sizes.dtype == torch.int32
    for pixels, (h, w) in zip(item.pixel_values, item.tgt_sizes.tolist()):
        assert pixels.shape == (3, 14, h * w * 14) and pixels.dtype == torch.float32
        # every slice is scaled to about 448² pixels: ~1024 patches of 14x14
        assert 900 <= h * w <= 1100
        assert -1.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0


def test_single_slice_photo_and_duplex_frame(processor):
    from minicpmo_cg import inputs

    small = inputs.vision_input(processor, "chelsea", ["chelsea"])
    assert small.num_slices == 1 and small.tgt_sizes.tolist() == [[26, 39]]
    frame = inputs.vision_input(processor, "duplex_frame", ["coffee"], frame=True)
    assert frame.tgt_sizes.tolist() == [[32, 32]] and frame.describe() == "1 sl x 1024 p"
    data = frame.data("cpu", torch.bfloat16)
    assert data["pixel_values"][0].dtype == torch.bfloat16 and data["tgt_sizes"].shape == (1, 2)


def test_voice_files_and_mel_frames():
    from minicpmo_cg import inputs

    names = {p.name for p in inputs.voice_files()}
    assert {"default_female.wav", "default_male.wav"} <= names
    wav = inputs.load_wav_16k(inputs.voice_file("default_female"))
    assert wav.dtype.name == "float32" and 0.0 < float(abs(wav).max()) <= 1.0
    assert 8.5 < len(wav) / inputs.SAMPLING_RATE < 9.5
    extractor = inputs.make_feature_extractor()
    one = inputs.audio_input(extractor, "speech_1s", [("default_female", 1.0)])
    assert one.features[0].shape == (80, 100)
    five = inputs.audio_input(extractor, "speech_5s", [("default_female", 5.0)])
    assert five.features[0].shape == (80, 500)
    data = one.data("cpu", torch.float32)
    assert data["audio_features"].shape == (1, 80, 100)
    assert [t.tolist() for t in data["audio_feature_lens"]] == [[100]]
    pair = inputs.audio_input(extractor, "pair", [("default_male", None), ("default_female", None)])
    assert pair.as_list and pair.frames == [770, 905] and pair.describe() == "2 x 905 mel*"
    pair_data = pair.data("cpu", torch.float32)
    assert isinstance(pair_data["audio_features"], list)
    with pytest.raises(ValueError, match="exceeds 30 s"):
        inputs.mel_features(extractor, torch.zeros(31 * inputs.SAMPLING_RATE).numpy())


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def test_quick_job_on_cpu(tmp_path):
    proc, report = _run_job("--quick", "--device", "cpu", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "NOTE: encoder CUDA graphs need a CUDA device" in out
    assert "RESULT: OK" in out

    rows = _table_rows(out)
    assert sorted(rows) == sorted(QUICK_INPUTS)
    for name, cells in rows.items():
        eager_ms = float(cells[-5])
        assert math.isfinite(eager_ms) and eager_ms > 0, name
        assert cells[-4:] == ["n/a"] * 4, name  # graphed ms, speedup, max|g-e|, replays

    assert report["ok"] is True and report["device"] == "cpu" and report["cuda_graphs"] is False
    assert report["dtype"] == "float32" and report["quick"] is True
    assert report["model"]["vision_layers"] == 2 and report["model"]["audio_layers"] == 2
    by_name = {r["name"]: r for r in report["inputs"]}
    assert sorted(by_name) == sorted(QUICK_INPUTS)
    for r in by_name.values():
        assert r["finite"] and math.isfinite(r["output_max_abs"]) and r["output_max_abs"] > 0
        assert r["eager_ms_median"] > 0 and len(r["eager_ms"]) == report["repeats"]
        assert r["graphed_ms_median"] is None and r["max_abs_diff"] is None
    assert by_name["chelsea@224"]["output_shape"] == "(3, 64, 4096)"
    assert by_name["speech_1s"]["output_shape"] == "(10, 4096)"
    assert by_name["speech_5s"]["output_shape"] == "(50, 4096)"
    # The patched call sites went through the wired adapters, which stayed eager on CPU.
    for encoder in ("vision", "audio"):
        stats = report["stats"][encoder]
        assert stats["ineligible_misses"] >= 1 and stats["num_graphs"] == 0 and stats["graph_hits"] == 0
    assert all(c["max_abs_diff"] == 0.0 for c in report["cpu_routing_check"].values())
