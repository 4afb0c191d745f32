# SPDX-License-Identifier: Apache-2.0
"""The demo ``minicpmo-cg-demo``: its inputs, its standalone encoders, its patch check and a run on CPU.

The run starts the demo in a subprocess (``python -m minicpmo_cg.demo``), as a user would,
against the vllm-omni installed for the running interpreter; it needs the patch set applied
(``minicpmo-cg-patch apply``). On CPU it takes about a minute (``~15 s`` of it importing vLLM).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import REDUCED_INPUTS, demo_table_rows, run_demo

from minicpmo_cg import demo, standalone

pytestmark = [pytest.mark.core_model]


# ---------------------------------------------------------------------------------------------
# Configuration values and argument handling (cheap)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_config_values_match_installed_defaults():
    """Values thinker_config.py (re-exported by standalone.py) attributes to MiniCPMOConfig defaults are
    the installed file's defaults."""
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


@pytest.mark.cpu
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
    assert (
        a.build_info.vision_attn == "sdpa"
    )  # the model's default (--hf-overrides vision_attn_implementation)
    assert {type(layer.self_attn).__name__ for layer in a.vpm.encoder.layers} == {"SiglipSdpaAttention"}
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    ln = a.vpm.post_layernorm
    assert torch.equal(ln.weight, torch.ones_like(ln.weight)) and not ln.bias.any()
    assert a.resampler.pos_embed.dtype == torch.float32 and a.resampler.pos_embed.abs().max() <= 1.0


@pytest.mark.cpu
def test_builder_takes_the_vision_attention_as_the_model_resolves_it(monkeypatch):
    eager = standalone.build_thinker_encoders(reduced=True, seed=3, vision_attn="eager")
    sdpa = standalone.build_thinker_encoders(reduced=True, seed=3)
    assert eager.build_info.vision_attn == eager.config.vision_attn_implementation == "eager"
    assert {type(layer.self_attn).__name__ for layer in eager.vpm.encoder.layers} == {"SiglipAttention"}
    for (name, pa), (_, pb) in zip(eager.named_parameters(), sdpa.named_parameters()):
        assert torch.equal(pa, pb), name  # the seed decides the weights, not the attention
    with pytest.raises(ValueError, match='vision_attn_implementation="sdpa2"'):
        standalone.build_thinker_encoders(reduced=True, vision_attn="sdpa2")
    mod = standalone.model_module()
    monkeypatch.setattr(mod.siglip_attention, "is_flash_attn_2_available", lambda: False)
    with pytest.raises(ValueError, match="flash-attn 2"):
        standalone.build_thinker_encoders(reduced=True, vision_attn="flash_attention_2")
    monkeypatch.delattr(mod, "siglip_attention")  # a model file without SigLIP's SDPA attention
    with pytest.raises(
        standalone.EncoderWiringMissingError,
        match=r"SDPA attention for SigLIP \(vision_attn_implementation\)",
    ):
        standalone.resolve_vision_attn(standalone.thinker_config(reduced=True), "sdpa")
    assert standalone.resolve_vision_attn(standalone.thinker_config(reduced=True), "eager") == "eager"


@pytest.mark.cpu
def test_wiring_without_patch_names_what_is_missing():
    class Unpatched:
        config = object()

    with pytest.raises(standalone.EncoderWiringMissingError, match="has no _init_encoder_cuda_graphs"):
        standalone.wire_encoder_graphs(Unpatched(), None, enabled=True)


@pytest.mark.cpu
def test_bad_repeats_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(["--repeats", "0"])
    assert exc.value.code == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


@pytest.mark.cpu
def test_quick_and_full_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(["--quick", "--full"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.cpu
@pytest.mark.parametrize(
    "flags, cuda, size",
    [
        ([], True, "full"),
        ([], False, "reduced"),  # without CUDA the full size would run eagerly for ~11 min
        (["--quick"], True, "reduced"),
        (["--full"], False, "full"),
        (["--quick"], False, "reduced"),
    ],
)
def test_size_defaults_to_reduced_without_cuda(flags, cuda, size):
    args = demo.parse_args(flags)
    assert demo.resolve_size(quick=args.quick, full=args.full, cuda=cuda) == size


# ---------------------------------------------------------------------------------------------
# Wiring options: validated by the adapter's own EncoderCudaGraphOptions
# ---------------------------------------------------------------------------------------------


class _PatchedModel:
    """Has the patched model's wiring entry point; records its calls."""

    def __init__(self):
        self.config = SimpleNamespace()
        self.wired = 0

    def _init_encoder_cuda_graphs(self, vllm_config):
        self.wired += 1


@pytest.mark.cpu
@pytest.mark.parametrize(
    "enabled, options, key",
    [
        ("false", {}, "encoder_cuda_graph"),  # the string "false" is not a boolean (it used to mean on)
        (0, {}, "encoder_cuda_graph"),
        (True, {"max_graphs": True}, "encoder_cuda_graph_max_graphs"),
        (True, {"min_capture_calls": 1}, "encoder_cuda_graph_min_capture_calls"),
    ],
)
def test_wiring_rejects_what_the_model_rejects(enabled, options, key):
    model = _PatchedModel()
    with pytest.raises(ValueError, match=key):
        standalone.wire_encoder_graphs(model, None, enabled=enabled, **options)
    assert model.wired == 0 and vars(model.config) == {}  # nothing set, nothing wired


@pytest.mark.cpu
def test_wiring_sets_the_hf_override_keys():
    model = _PatchedModel()
    options = importlib.import_module(standalone.ADAPTER_MODULE).EncoderCudaGraphOptions
    default = options(enabled=True)
    defaults = {
        f.metadata["hf_key"]: getattr(default, f.name)
        for f in dataclasses.fields(options)
        if f.name != "enabled"
    }
    standalone.wire_encoder_graphs(model, None, enabled=True, max_graphs=8, share_pools=False)
    given = {
        "encoder_cuda_graph": True,
        "encoder_cuda_graph_max_graphs": 8,
        "encoder_cuda_graph_share_pools": False,
    }
    assert vars(model.config) == {**defaults, **given}
    assert (
        defaults["encoder_cuda_graph_max_graphs"] != 8 and defaults["encoder_cuda_graph_share_pools"] is True
    )
    assert model.wired == 1
    # a later wiring inherits none of an earlier one's options
    standalone.wire_encoder_graphs(model, None, enabled=False)
    assert vars(model.config) == {**defaults, "encoder_cuda_graph": False}
    with pytest.raises(TypeError, match="max_graph"):
        standalone.wire_encoder_graphs(model, None, enabled=True, max_graph=8)


@pytest.mark.cpu
def test_graphed_pass_captures_every_input_by_the_count_rule():
    """The graphed pass expects every timed call to be a replay; under the default cost rule a
    GPU-bound batch (the full set's 10-slice ``retina``) would be declined and run eagerly."""
    model = _PatchedModel()

    def install_adapters(vllm_config):
        model.vpm = SimpleNamespace(_encoder_graph=object())
        model._audio_encoder_graph = object()
        model._streaming_audio = SimpleNamespace(graph=object())

    model._init_encoder_cuda_graphs = install_adapters
    graphs = demo.wire_graphs(SimpleNamespace(model=model, vllm_config=None))
    assert graphs == {
        "vision": model.vpm._encoder_graph,
        "audio": model._audio_encoder_graph,
        "streaming audio": model._streaming_audio.graph,
    }
    assert model.config.encoder_cuda_graph_admission == "count"
    assert model.config.encoder_cuda_graph_min_capture_calls == demo.MIN_CAPTURE_CALLS


@pytest.mark.cpu
def test_an_image_call_of_several_siglip_chunks_expects_one_replay():
    """The image graph holds every vision_batch_size chunk of SigLIP and the resampler: the full set's
    photos_x3 (18 slices, two chunks of 16 and 2) is one replay per call, not two."""
    from minicpmo_cg import inputs

    slices = [torch.zeros(3, 14, 14 * 1024) for _ in range(18)]
    item = inputs.VisionInput("photos_x3", "test", slices, torch.tensor([[32, 32]] * 18, dtype=torch.int32))
    calls = []
    model = SimpleNamespace(
        config=SimpleNamespace(vision_batch_size=16), get_vision_hidden_states=lambda data: calls.append(data)
    )
    fn, replays_per_call = demo._call_site(
        SimpleNamespace(model=model, device="cpu", dtype=torch.float32), item
    )
    assert replays_per_call == 1
    fn()
    assert len(calls) == 1 and len(calls[0]["pixel_values"]) == 18


# ---------------------------------------------------------------------------------------------
# The patch check, before any heavy import
# ---------------------------------------------------------------------------------------------


ADAPTER_REL = "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/__init__.py"


def _plan(states, adapter_state="installed", **owned_states):
    reports = [SimpleNamespace(patch=SimpleNamespace(name=name), state=st) for name, st in states.items()]
    owned = [SimpleNamespace(rel=ADAPTER_REL, state=adapter_state)]
    owned += [SimpleNamespace(rel=f"vllm_omni/{name}.py", state=st) for name, st in owned_states.items()]
    return SimpleNamespace(reports=reports, owned=owned)


@pytest.mark.cpu
def test_patch_problems_names_what_is_not_applied():
    applied = {
        "vllm/0001-a.patch": "upstream",
        "vllm-omni/0001-b.patch": "applied",
        "vllm/0002-c.patch": "n/a",
    }
    assert demo.patch_problems(_plan(applied)) == []
    assert demo.patch_problems(_plan(applied, adapter_state="n/a")) == []
    problems = demo.patch_problems(_plan({**applied, "vllm-omni/0001-b.patch": "pending"}, "missing"))
    assert problems == ["vllm-omni/0001-b.patch: pending", "adapter copy: missing"]
    assert demo.patch_problems(_plan({"x.patch": "conflict"}, "outdated")) == [
        "x.patch: conflict",
        "adapter copy: outdated",
    ]
    assert demo.patch_problems(_plan(applied, helper="missing", other="installed")) == [
        "owned file vllm_omni/helper.py: missing"
    ]


_HEAVY = ("torch", "vllm", "vllm_omni", "transformers")

_UNPATCHED_DRIVER = f"""
import sys
from types import SimpleNamespace
from minicpmo_cg import demo, patchtool
pending = SimpleNamespace(patch=SimpleNamespace(name="vllm-omni/0001-x.patch"), state="pending")
adapter = SimpleNamespace(rel="{ADAPTER_REL}", state="missing")
patchtool.build_plan = lambda install: SimpleNamespace(reports=[pending], owned=[adapter])
rc = demo.main(["--device", "cpu"])
print("IMPORTED", sorted(m for m in {_HEAVY!r} if m in sys.modules))
sys.exit(rc)
"""


@pytest.mark.cpu
def test_not_patched_fails_before_heavy_imports():
    proc = subprocess.run(
        [sys.executable, "-c", _UNPATCHED_DRIVER], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "IMPORTED []" in proc.stdout, proc.stdout
    assert "vllm-omni/0001-x.patch: pending; adapter copy: missing" in proc.stderr
    assert "run `minicpmo-cg-patch apply` first" in proc.stderr


@pytest.mark.cpu
def test_patch_check_passes_here_without_heavy_imports():
    code = (
        "import sys; from minicpmo_cg import demo; demo.check_patched(); "
        f"print('IMPORTED', sorted(m for m in {_HEAVY!r} if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED []" in proc.stdout
    assert "cannot read the patch state" not in proc.stderr  # the tool could tell: applied


# ---------------------------------------------------------------------------------------------
# inputs.py
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor():
    from minicpmo_cg import inputs

    return inputs.make_image_processor()


@pytest.mark.cpu
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


@pytest.mark.cpu
def test_single_slice_photo_and_duplex_frame(processor):
    from minicpmo_cg import inputs

    small = inputs.vision_input(processor, "chelsea", ["chelsea"])
    assert small.num_slices == 1 and small.tgt_sizes.tolist() == [[26, 39]]
    frame = inputs.vision_input(processor, "duplex_frame", ["coffee"], frame=True)
    assert frame.tgt_sizes.tolist() == [[32, 32]] and frame.describe() == "1 sl x 1024 p"
    data = frame.data("cpu", torch.bfloat16)
    assert data["pixel_values"][0].dtype == torch.bfloat16 and data["tgt_sizes"].shape == (1, 2)


@pytest.mark.cpu
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


@pytest.mark.cpu
def test_demo_on_cpu_runs_the_reduced_size_and_keeps_logs_off_stdout(tmp_path):
    proc, report = run_demo("--device", "cpu", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "NOTE: encoder CUDA graphs need a CUDA device" in out
    assert demo.REDUCED_WITHOUT_CUDA_LINE in out
    assert "RESULT: OK" in out
    # stdout is the report; progress and vLLM's log lines (the model's wiring line) are on stderr
    assert out.splitlines()[0].startswith("MiniCPM-o 4.5 thinker encoders (reduced, random weights)")
    assert "[minicpmo-cg" not in out and "[minicpmo-cg-demo]" in proc.stderr
    assert "encoder CUDA graphs: vision=" not in out
    assert "MiniCPM-o 4.5 encoder CUDA graphs: vision=" in proc.stderr

    rows = demo_table_rows(out)
    assert sorted(rows) == sorted(REDUCED_INPUTS)
    for name, cells in rows.items():
        eager_ms = float(cells[-5])
        assert math.isfinite(eager_ms) and eager_ms > 0, name
        assert cells[-4:] == ["n/a"] * 4, name  # graphed ms, speedup, max|g-e|, replays
    # the attention column: SigLIP's default for the images, Whisper's for the audio rows
    audio_attn = report["model"]["audio_attn"]
    assert report["model"]["vision_attn"] == demo.VISION_ATTN == "sdpa"
    assert {name: cells[2] for name, cells in rows.items()} == {
        "chelsea@224": "sdpa",
        "frame@224": "sdpa",
        "speech_1s": audio_attn,
        "speech_5s": audio_attn,
        "duplex_speech": audio_attn,
    }

    assert report["ok"] is True and report["device"] == "cpu" and report["cuda_graphs"] is False
    assert report["dtype"] == "float32" and report["quick"] is True
    assert report["size"] == "reduced" and report["size_defaulted"] is True
    assert report["model"]["vision_layers"] == 2 and report["model"]["audio_layers"] == 2
    by_name = {r["name"]: r for r in report["inputs"]}
    assert sorted(by_name) == sorted(REDUCED_INPUTS)
    for r in by_name.values():
        assert r["attention"] == ("sdpa" if r["modality"] == "image" else audio_attn), r["name"]
        assert r["finite"] and math.isfinite(r["output_max_abs"]) and r["output_max_abs"] > 0
        calls = demo.DUPLEX_CHUNKS["cpu"] if r["modality"] == "duplex" else report["repeats"]
        assert r["eager_ms_median"] > 0 and len(r["eager_ms"]) == calls, r["name"]
        assert r["graphed_ms_median"] is None and r["max_abs_diff"] is None
    assert by_name["chelsea@224"]["output_shape"] == "(3, 64, 4096)"
    assert by_name["speech_1s"]["output_shape"] == "(10, 4096)"
    assert by_name["speech_5s"]["output_shape"] == "(50, 4096)"
    assert by_name["duplex_speech"]["output_shape"] == f"{demo.DUPLEX_CHUNKS['cpu']} x (10, 4096)"
    assert by_name["duplex_speech"]["input_shape"] == f"{demo.DUPLEX_CHUNKS['cpu']} ch x 104 mel"
    # The patched call sites went through the wired adapters, which stayed eager on CPU.
    for encoder in ("vision", "audio", "streaming audio"):
        stats = report["stats"][encoder]
        assert stats["ineligible_misses"] >= 1 and stats["num_graphs"] == 0 and stats["graph_hits"] == 0
    assert report["stats"]["streaming audio"]["ineligible_misses"] == demo.DUPLEX_CHUNKS["cpu"]
    assert sorted(report["cpu_routing_check"]) == ["audio", "duplex", "image"]
    assert all(c["max_abs_diff"] == 0.0 for c in report["cpu_routing_check"].values())


@pytest.mark.cpu
def test_a_tree_that_does_not_register_the_fused_layers_key_builds_unfused(monkeypatch):
    """The graphs' PRs carry fused_layers.py before the PR that registers encoder_fused_layers: the
    builder then configures nothing (as that tree's model constructor), and refuses the key set."""
    from types import SimpleNamespace

    registry = importlib.import_module(standalone.ADAPTER_MODULE).options.HF_OVERRIDE_KEYS
    monkeypatch.delitem(registry, standalone.FUSED_LAYERS_KEY)
    model = SimpleNamespace(config=SimpleNamespace())
    off = "off (no encoder_fused_layers key)"
    assert standalone.configure_fused_layers(model) == {"vision": off, "audio": off}
    model.config.encoder_fused_layers = "all"
    with pytest.raises(ValueError, match="encoder_fused_layers is set"):
        standalone.configure_fused_layers(model)
