# SPDX-License-Identifier: Apache-2.0
"""CUDA tests of the fused encoder layers (``fused_layers.py``) at the checkpoint's size.

The thinker's encoders from the tests' builder (:func:`minicpmo_cg.standalone.build_thinker_encoders`:
26 SigLIP layers of width 1152 with 16 heads and a 4304-wide MLP, Whisper-medium's 24 layers of
width 1024 with 16 heads and a 4096-wide FFN, the resampler and the audio projection), bf16, the same
random weights in every model; the biases and LayerNorm affines, which the builder zeroes, are drawn
too, so that a dropped or doubled bias shows.

- Bound: against the original math (the upstream layers: SigLIP's eager attention, Whisper's eager
  attention, no fused layers) the fused model's output stays within 1e-2 of the original's largest
  magnitude (``max |fused - original| <= 1e-2 * max |original|``), for the image call (one
  1024-patch slice, three padded slices), 100 mel frames (1 s) and a duplex session's chunks; and its
  mean error against a float32 model with the same (bf16-rounded) weights is no larger than the
  original's. The image-call bound runs for both vision configurations, SigLIP fused
  (``encoder_fused_layers="all"``) and unfused (``"audio"``), and both must hold it, whichever the
  option's default selects.
- SigLIP's own output (patch embedding to post LayerNorm, before the resampler): there upstream's
  SDPA layers themselves differ from the eager-attention ones by more than 1e-2 of the largest
  magnitude (2.2e-2 at one slice, 2.4e-2 at three padded slices, on an H200), so the fused stack is
  held to upstream SDPA's own divergence: at most :data:`STACK_SLACK` times it (or 1e-2, whichever is
  larger), with a mean error against float32 no larger than the original's.
- Inputs without contiguous rows (a column-sliced or transposed view of the patch embeddings): both
  SigLIP stacks take them, the fused one copying them once, and compute what they compute from the
  contiguous input.
- SigLIP's pieces: a table of the bound's figures for each fused piece on its own, each left out and
  the default set (``fused_layers.SIGLIP_PIECES``), for choosing the default.
- Graphs: a replay equals the fused eager call bitwise and differs from the unfused one (the
  graph ran the fused kernels); the single-slice image graph's bytes with its static buffers are
  printed, with where its pool's bytes go (segments, live blocks, peak, largest allocations with
  the code that made them).
- The Triton kernel against its torch reference on the GPU, the fallback, and packing refused
  inside a capture.
"""

from __future__ import annotations

import contextlib
import logging
import zlib

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused layers' kernels need a CUDA device"),
]

BOUND = 1e-2
#: mean-error slack against the original layers' (run-to-run identical; a margin for kernel variants)
MEAN_SLACK = 1.05
#: SigLIP's own output: the fused stack may diverge from the eager-attention layers by at most this
#: many times upstream's SDPA layers' own divergence from them (a quarter again: another kernel's
#: rounding at each of 26 layers, never a dropped or doubled term, which shows as a multiple)
STACK_SLACK = 1.25
ONE_SLICE = [(32, 32)]
PADDED = [(32, 32), (23, 45), (23, 45)]  # 1024, 1035 and 1035 patches: a padded call


@torch.no_grad()
def draw_affines_(model, seed=7):
    """Biases ~ N(0, 0.02) and LayerNorm weights ~ 1 + N(0, 0.05), by parameter name, in place
    (the fused model's packed q/k/v views included), the same in every model."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    for name, param in model.named_parameters():
        if not (name.endswith("bias") or id(param) in norms):
            continue
        generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        values = torch.randn(param.shape, generator=generator)
        values = 1 + 0.05 * values if id(param) in norms else 0.02 * values
        param.copy_(values.to(param.dtype))


def build(**kwargs):
    from minicpmo_cg.standalone import build_thinker_encoders

    model = build_thinker_encoders(device="cuda", seed=3, **kwargs)
    draw_affines_(model)
    return model


def fuses_vision(choice):
    return choice in ("all", "vision")


#: the two vision configurations: SigLIP fused, and SigLIP on its unfused SDPA layers
VISION_CONFIGS = ["all", "audio"]


@pytest.fixture(scope="module")
def fused():
    """Both encoders fused, whatever the option's default (tests switch SigLIP's off by its flags)."""
    model = build(dtype=torch.bfloat16, vision_attn="sdpa", fused_layers="all")
    assert model.build_info.fused_layers == {"vision": "on", "audio": "on"}
    assert len(model.vpm.encoder.layers) == 26 and len(model.apm.layers) == 24
    return model


@pytest.fixture(scope="module")
def original():
    model = build(dtype=torch.bfloat16, vision_attn="eager", fused_layers="none")
    model.apm.config._attn_implementation = "eager"
    assert model.build_info.fused_layers["vision"].startswith("off")
    return model


@pytest.fixture(scope="module")
def reference():
    """float32, the original math, the bf16 models' weights rounded to bf16."""
    model = build(dtype=torch.float32, vision_attn="eager", fused_layers="none")
    model.apm.config._attn_implementation = "eager"
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    return model


def vision_data(grids, seed, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    pixels = [torch.randn(3, 14, h * w * 14, generator=generator).to("cuda", dtype) for h, w in grids]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(grids, dtype=torch.int32, device="cuda")}


def audio_data(lengths, frames, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), 80, frames, generator=generator)
    for i, n in enumerate(lengths):
        feats[i, :, n:] = 0
    return {
        "audio_features": feats.to("cuda", dtype),
        "audio_feature_lens": [torch.tensor([n], device="cuda") for n in lengths],
    }


def bound_figures(got, want, ref):
    """``(max|got - want| / max|want|, mean|got - ref|, mean|want - ref|)`` in float32."""
    got, want, ref = got.float(), want.float(), ref.float()
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    rel = float((got - want).abs().max() / want.abs().max())
    return rel, float((got - ref).abs().mean()), float((want - ref).abs().mean())


def check_bound(got, want, ref, what):
    """The bound against the original and the mean error against float32; returns the figures.

    Every configuration that fuses a layer is held to it, the option's default or not: a user who
    opts into one gets the same guarantee."""
    rel, fused_mean, original_mean = bound_figures(got, want, ref)
    print(
        f"{what}: max|fused - original| / max|original| = {rel:.3e} (bound {BOUND}); mean error vs float32 "
        f"fused {fused_mean:.3e}, original {original_mean:.3e}"
    )
    assert rel <= BOUND, f"{what}: {rel} > {BOUND}"
    assert fused_mean <= MEAN_SLACK * original_mean, (what, fused_mean, original_mean)
    return rel, fused_mean, original_mean


@contextlib.contextmanager
def vision_config(model, choice):
    """SigLIP (and the resampler) of ``model`` as ``encoder_fused_layers=choice`` sets them, graph
    adapters detached, for the block."""
    adapter = model.vpm.__dict__.get("_encoder_graph")
    modules = (model.vpm, model.resampler)
    states = [m._fused_layers for m in modules]
    model.vpm._encoder_graph = None
    for m in modules:
        m._fused_layers = fuses_vision(choice)
    try:
        yield
    finally:
        model.vpm._encoder_graph = adapter
        for m, state in zip(modules, states, strict=True):
            m._fused_layers = state


def siglip_stack(model, pixels, tgt, valid, padded):
    """SigLIP's own output (patch embedding to post LayerNorm), the valid patches of each slice."""
    from vllm_omni.model_executor.models.minicpmo_4_5 import vision_path

    return vision_path.encode_packed_slices(model.vpm, pixels, tgt, valid if padded else None)[valid]


def stack_inputs(grids, seed):
    from vllm_omni.model_executor.models.minicpmo_4_5 import vision_path

    data = vision_data(grids, seed=seed)
    pixels, padded = vision_path.pad_vision_slices(data["pixel_values"])
    tgt = data["tgt_sizes"]
    n = pixels.shape[-1] // 14
    valid = torch.arange(n, device="cuda")[None, :] < tgt.prod(-1, keepdim=True)
    return data, pixels, tgt, valid, padded


# ---------------------------------------------------------------------------
# Bound against the original layers
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("choice", VISION_CONFIGS)
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_image_call_within_the_bound_of_the_original_layers(fused, original, reference, grids, choice):
    data = vision_data(grids, seed=11)
    with vision_config(fused, choice):
        got = fused.get_vision_hidden_states(data)
    want = original.get_vision_hidden_states(data)
    ref = reference.get_vision_hidden_states(
        {**data, "pixel_values": [p.float() for p in data["pixel_values"]]}
    )
    assert got.shape == want.shape == (len(grids), 64, 4096)
    check_bound(got, want, ref, f"image call ({choice}), {len(grids)} slice(s)")


@pytest.mark.cuda
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_siglip_stack_diverges_no_more_than_upstream_sdpa_does(fused, original, reference, grids):
    """SigLIP's own output (patch embedding to post LayerNorm), the valid patches of each slice: the
    fused stack against the eager-attention layers, next to upstream's SDPA layers against them."""
    _, pixels, tgt, valid, padded = stack_inputs(grids, seed=12)
    with vision_config(fused, "all"):
        got = siglip_stack(fused, pixels, tgt, valid, padded)
    with vision_config(fused, "audio"):
        sdpa = siglip_stack(fused, pixels, tgt, valid, padded)
    want = siglip_stack(original, pixels, tgt, valid, padded)
    ref = siglip_stack(reference, pixels.float(), tgt, valid, padded)
    rel, fused_mean, original_mean = bound_figures(got, want, ref)
    sdpa_rel, sdpa_mean, _ = bound_figures(sdpa, want, ref)
    limit = max(BOUND, STACK_SLACK * sdpa_rel)
    print(
        f"SigLIP stack, {len(grids)} slice(s), max|x - original| / max|original|: fused {rel:.3e}, "
        f"upstream SDPA {sdpa_rel:.3e} (limit {limit:.3e}); mean error vs float32: fused {fused_mean:.3e}, "
        f"upstream SDPA {sdpa_mean:.3e}, original {original_mean:.3e}"
    )
    assert rel <= limit, (rel, sdpa_rel)
    assert fused_mean <= MEAN_SLACK * original_mean, (fused_mean, original_mean)


def relative_max_error(got, want):
    """``max |got - want| / max |want|`` in float32."""
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["every other column", "transposed"])
@torch.inference_mode()
def test_siglip_stacks_take_an_input_without_contiguous_rows(fused, layout):
    """One slice's patch embeddings in a layout without contiguous rows (every other column of a
    tensor twice as wide, or the transposed view a patch convolution returns), into SigLIP's fused
    and unfused stacks: the fused stack copies them once (it raised ValueError) and each stack
    computes what it computes from the contiguous input, so the two differ as they do there."""
    generator = torch.Generator(device="cuda").manual_seed(13)
    width = fused.vpm.config.hidden_size
    hidden = torch.randn(1, 1024, width, device="cuda", generator=generator).bfloat16()
    if layout == "every other column":
        wide = torch.zeros(1, 1024, 2 * width, device="cuda", dtype=hidden.dtype)
        wide[..., ::2] = hidden
        strided = wide[..., ::2]
    else:
        strided = hidden.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(strided, hidden) and strided.stride(-1) != 1
    outputs = {}
    for choice in ("all", "audio"):  # SigLIP fused, then on its unfused SDPA layers
        with vision_config(fused, choice):
            outputs[choice] = [fused.vpm._encode_last_hidden_state(x, None) for x in (strided, hidden)]
    (got, want), (unfused_got, unfused_want) = outputs["all"], outputs["audio"]
    assert torch.equal(got, want)  # the copy holds the input's bits: the same kernels on the same rows
    torch.testing.assert_close(unfused_got, unfused_want)
    rel, contiguous_rel = relative_max_error(got, unfused_got), relative_max_error(want, unfused_want)
    print(
        f"SigLIP stack, {layout}: max|fused - unfused| / max|unfused| = {rel:.3e} "
        f"(contiguous input: {contiguous_rel:.3e})"
    )
    assert rel <= STACK_SLACK * contiguous_rel, (rel, contiguous_rel)


def piece_rows():
    """``(label, pieces or None)``: None runs SigLIP's unfused SDPA layers; then the fused path with
    no piece, each piece alone, each left out, and the default set."""
    from vllm_omni.model_executor.models.minicpmo_4_5.fused_layers import SIGLIP_DEFAULT_PIECES, SIGLIP_PIECES

    rows = [("unfused SDPA layers", None), ("fused, no piece", ())]
    rows += [(f"only {p}", (p,)) for p in SIGLIP_PIECES]
    rows += [(f"all but {p}", tuple(q for q in SIGLIP_PIECES if q != p)) for p in SIGLIP_PIECES]
    left_out = [p for p in SIGLIP_PIECES if p not in SIGLIP_DEFAULT_PIECES]
    label = f"default (without {', '.join(left_out)})" if left_out else "default (every piece)"
    rows += [(label, tuple(SIGLIP_DEFAULT_PIECES))]
    return rows


@pytest.mark.cuda
@torch.inference_mode()
def test_siglip_pieces_table(fused, original, reference):
    """The bound's figures for each of SigLIP's fused pieces (a diagnostic for choosing the default):
    max rel error vs the original and mean error vs float32, for the stack at one slice and three
    padded slices and for the whole image call at one slice (the resampler's piece shows only
    there); ``=`` marks a row bitwise equal to the fused path with no piece."""
    from vllm_omni.model_executor.models.minicpmo_4_5.fused_layers import siglip_fused_pieces

    cases = []
    for grids, label in ((ONE_SLICE, "stack 1"), (PADDED, "stack 3p")):
        data, pixels, tgt, valid, padded = stack_inputs(grids, seed=12)
        cases.append(
            (
                label,
                lambda pixels=pixels, tgt=tgt, valid=valid, padded=padded: siglip_stack(
                    fused, pixels, tgt, valid, padded
                ),
                siglip_stack(original, pixels, tgt, valid, padded),
                siglip_stack(reference, pixels.float(), tgt, valid, padded),
            )
        )
    data = vision_data(ONE_SLICE, seed=11)
    cases.append(
        (
            "image 1",
            lambda: fused.get_vision_hidden_states(data),
            original.get_vision_hidden_states(data),
            reference.get_vision_hidden_states(
                {**data, "pixel_values": [p.float() for p in data["pixel_values"]]}
            ),
        )
    )
    table, outputs = {}, {}
    for label, pieces in piece_rows():
        with vision_config(fused, "audio" if pieces is None else "all"), contextlib.ExitStack() as stack:
            if pieces is not None:
                stack.enter_context(siglip_fused_pieces(fused, pieces))
            outputs[label] = [call() for _, call, _, _ in cases]
        table[label] = [
            bound_figures(got, want, ref) for got, (_, _, want, ref) in zip(outputs[label], cases)
        ]
    base = outputs["fused, no piece"]
    header = "".join(f" | {name:>8s} rel   mean  " for name, *_ in cases)
    lines = [
        f"SigLIP fused pieces (bound {BOUND}; original mean error vs float32: "
        + ", ".join(f"{name} {table['fused, no piece'][i][2]:.3e}" for i, (name, *_) in enumerate(cases))
        + ")",
        f"{'configuration':58s}{header}",
    ]
    for label, figures in table.items():
        cells = "".join(
            f" | {'=' if torch.equal(out, b) else ' '}{rel:.3e} {mean:.3e}"
            for (rel, mean, _), out, b in zip(figures, outputs[label], base)
        )
        lines.append(f"{label[:58]:58s}{cells}")
    print("\n".join(lines))
    for label, figures in table.items():
        assert all(torch.isfinite(torch.tensor(f)).all() for f in figures), label
    # the fused path with no piece runs the upstream SDPA layers' math: their very bits
    assert all(torch.equal(out, b) for out, b in zip(outputs["unfused SDPA layers"], base, strict=True)), (
        "the fused path with every piece off differs from the unfused SDPA layers"
    )
    # the encoder's output (the image call) holds the bound in every configuration
    assert all(figures[2][0] <= BOUND for figures in table.values()), {k: v[2] for k, v in table.items()}
    # the switches take effect: the GELU epilogue rounds elsewhere, the resampler's SDPA is another kernel
    assert not torch.equal(outputs["only gelu_epilogue"][0], base[0])
    assert not torch.equal(outputs["only resampler_sdpa"][2], base[2])
    assert torch.equal(outputs["only resampler_sdpa"][0], base[0])  # it does not touch the stack


@pytest.mark.cuda
@pytest.mark.parametrize(
    "lengths, frames", [([100], 100), ([100, 60], 100)], ids=["1 s", "1 s + 0.6 s padded"]
)
@torch.inference_mode()
def test_audio_call_within_the_bound_of_the_original_layers(fused, original, reference, lengths, frames):
    data = audio_data(lengths, frames, seed=13)
    got, want, ref = (m.get_audio_hidden_states(data) for m in (fused, original, reference))
    for i, (g, w, r) in enumerate(zip(got, want, ref, strict=True)):
        check_bound(g, w, r, f"audio item {i} of {lengths}")


@pytest.mark.cuda
@torch.inference_mode()
def test_duplex_chunks_within_the_bound_of_the_original_layers(fused, original, reference):
    from minicpmo_cg.duplex import DuplexSession, frame_chunks

    mel = torch.randn(80, 4 * 100 + 2, generator=torch.Generator().manual_seed(14))
    chunks = frame_chunks(mel, 4, device="cuda")
    sessions = {name: DuplexSession() for name in ("fused", "original", "reference")}
    models = {"fused": fused, "original": original, "reference": reference}
    for index, chunk in enumerate(chunks):
        outs = {name: sessions[name].encode(models[name], chunk) for name in models}
        check_bound(outs["fused"], outs["original"], outs["reference"], f"duplex chunk {index}")


# ---------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graphed(fused):
    from minicpmo_cg.standalone import wire_encoder_graphs
    from minicpmo_cg.vllm_config import standalone_vllm_config

    wire_encoder_graphs(fused, standalone_vllm_config(), enabled=True, max_graphs=8, admission="count")
    yield fused
    wire_encoder_graphs(fused, standalone_vllm_config(), enabled=False)


def detached(model, fn, fused_on=True):
    """``fn()`` with the graph adapters detached, the fused layers on or off."""
    adapters = model.vpm._encoder_graph, model._audio_encoder_graph
    model.vpm._encoder_graph = model._audio_encoder_graph = None
    modules = (model.vpm, model.resampler, model.apm)
    states = [m._fused_layers for m in modules]
    for m in modules:
        m._fused_layers = fused_on
    try:
        return fn()
    finally:
        model.vpm._encoder_graph, model._audio_encoder_graph = adapters
        for m, state in zip(modules, states, strict=True):
            m._fused_layers = state


def _frame(frames):
    """``name (file:line)`` of the innermost frame in the model's code, else the innermost one."""
    ours = [f for f in frames if "minicpmo_4_5" in f["filename"]]
    f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    inner = frames[0]["name"] if frames else "?"
    return f"{f['name']} ({f['filename'].rsplit('/', 1)[-1]}:{f['line']}) <- {inner}"


def recorded_pool_breakdown(call):
    """``call()`` with the caching allocator's history on; returns ``(its result, lines)`` that say
    where the bytes of the graph pool segments created meanwhile went: each segment with its live
    blocks after the capture (what stays allocated inside the pool: e.g. a cuBLAS workspace made on
    the capture stream), the peak of live bytes in those segments during the call and the largest
    allocations in them, each with the code that made it."""
    torch.accelerator.synchronize()
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        out = call()
        torch.accelerator.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    segments = [
        seg
        for seg in snapshot["segments"]
        if seg["address"] not in before and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    ]
    mib = 2**-20
    lines = [
        f"graph pool segments: {len(segments)}, {sum(s['total_size'] for s in segments) * mib:.1f} MiB "
        f"(large {sum(s['total_size'] for s in segments if s['segment_type'] == 'large') * mib:.1f}, "
        f"small {sum(s['total_size'] for s in segments if s['segment_type'] == 'small') * mib:.1f}); "
        f"pool ids {sorted({tuple(s['segment_pool_id']) for s in segments})}"
    ]
    for seg in sorted(segments, key=lambda s: -s["total_size"]):
        live = [b for b in seg["blocks"] if b["state"] != "inactive"]
        lines.append(
            f"  segment {seg['total_size'] * mib:6.1f} MiB {seg['segment_type']:5s}: "
            f"{seg['allocated_size'] * mib:.2f} MiB live after the call in {len(live)} block(s)"
            + "".join(f"; {b['size'] * mib:.2f} MiB by {_frame(b.get('frames', []))}" for b in live[:3])
        )
    spans = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    inside = [
        e
        for trace in snapshot.get("device_traces", [])
        for e in trace
        if "addr" in e and any(lo <= e["addr"] < hi for lo, hi in spans)
    ]
    live_bytes = peak = 0
    allocs = []
    for entry in inside:
        if entry["action"] == "alloc":
            live_bytes += entry["size"]
            peak = max(peak, live_bytes)
            allocs.append(entry)
        elif entry["action"] == "free_requested":
            live_bytes -= entry["size"]
    lines.append(f"  {len(allocs)} allocations in the pool, peak live {peak * mib:.1f} MiB")
    for entry in sorted(allocs, key=lambda e: -e["size"])[:10]:
        lines.append(f"    {entry['size'] * mib:6.2f} MiB by {_frame(entry.get('frames', []))}")
    return out, lines


@pytest.mark.cuda
@pytest.mark.parametrize("grids", [ONE_SLICE, PADDED], ids=["1 slice", "3 padded slices"])
@torch.inference_mode()
def test_image_graph_replays_the_fused_layers_bitwise(graphed, grids):
    graph = graphed.vpm._encoder_graph
    data = vision_data(grids, seed=15)
    before = graph.get_cumulative_stats()["num_graphs"]

    def calls():
        for _ in range(3):
            out = graphed.get_vision_hidden_states(data)
        return out

    out, breakdown = recorded_pool_breakdown(calls) if grids == ONE_SLICE else (calls(), [])
    assert graph.get_cumulative_stats()["num_graphs"] == before + 1
    assert torch.equal(out, detached(graphed, lambda: graphed.get_vision_hidden_states(data)))
    assert not torch.equal(
        out, detached(graphed, lambda: graphed.get_vision_hidden_states(data), fused_on=False)
    )
    if grids == ONE_SLICE:
        graphs = graph.get_detailed_stats()["graphs"]
        (entry,) = [g for g in graphs if tuple(g["inputs"][0][0]) == (1, 3, 14, 1024 * 14)]
        mib = entry["bytes"] / 2**20
        print(
            f"single-slice image graph: {mib:.1f} MiB (pool {entry['pool_bytes'] / 2**20:.1f}, "
            f"static {entry['static_bytes'] / 2**20:.1f})"
        )
        print("\n".join(breakdown))


@pytest.mark.cuda
@torch.inference_mode()
def test_audio_graph_replays_the_fused_layers_bitwise(graphed):
    data = audio_data([100], 100, seed=16)
    for _ in range(3):
        out = graphed.get_audio_hidden_states(data)[0]
    assert graphed._audio_encoder_graph.get_cumulative_stats()["graph_hits"] >= 1
    assert torch.equal(out, detached(graphed, lambda: graphed.get_audio_hidden_states(data))[0])
    assert not torch.equal(
        out, detached(graphed, lambda: graphed.get_audio_hidden_states(data), fused_on=False)[0]
    )


@pytest.mark.cuda
@torch.inference_mode()
def test_streaming_graphs_replay_the_fused_layers_bitwise(graphed):
    """Two sessions over the same chunks: the first is seen (a warmup miss), the second's chunks
    replay the bucket's graph (count admission, two sightings); each equals the same forward run
    eagerly, chunk for chunk."""
    from minicpmo_cg.duplex import DuplexSession, frame_chunks

    encoder = graphed._streaming_audio
    adapter = encoder.graph
    assert adapter is not None
    mel = torch.randn(80, 5 * 100 + 2, generator=torch.Generator().manual_seed(17))
    chunks = frame_chunks(mel, 5, device="cuda")
    first, second = DuplexSession(), DuplexSession()
    for chunk in chunks:
        first.encode(graphed, chunk)
    got = [second.encode(graphed, chunk) for chunk in chunks]
    assert adapter.get_cumulative_stats()["graph_hits"] >= len(chunks)
    encoder.graph = None
    try:
        eager_session = DuplexSession()
        want = [eager_session.encode(graphed, chunk) for chunk in chunks]
    finally:
        encoder.graph = adapter
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"chunk {index}: max diff {(g.float() - w.float()).abs().max()}"


# ---------------------------------------------------------------------------
# The kernel, its fallback, packing
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("rows, cols", [(1024, 1152), (10240, 1152), (50, 1024), (1500, 1024), (3, 80)])
def test_triton_kernel_matches_its_torch_reference(rows, cols):
    from vllm_omni.model_executor.models.minicpmo_4_5.ops import fused_add_layer_norm as aln

    assert aln.triton_unavailable_reason(torch.device("cuda")) is None
    generator = torch.Generator(device="cuda").manual_seed(rows + cols)
    x, y = (torch.randn(rows, cols, device="cuda", generator=generator).bfloat16() for _ in range(2))
    bias, ln_bias = (0.1 * torch.randn(cols, device="cuda", generator=generator).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(cols, device="cuda", generator=generator)).bfloat16()
    normed, total = aln.add_layer_norm(x, y, bias, weight, ln_bias, 1e-6)
    want_normed, want_total = aln.add_layer_norm_reference(x, y, bias, weight, ln_bias, 1e-6)
    assert torch.equal(total, want_total)  # the same float32 sums, rounded once
    diff = float((normed.float() - want_normed.float()).abs().max())
    assert diff <= 2**-7 * float(want_normed.float().abs().max()), diff
    only, none = aln.add_layer_norm(x, None, None, weight, ln_bias, 1e-6, store_sum=False)
    assert none is None
    torch.testing.assert_close(only, torch.nn.functional.layer_norm(x, (cols,), weight, ln_bias, 1e-6))
    # without a bias the sum is torch's bf16 residual + update, bitwise (SigLIP's residual stream)
    normed, total = aln.add_layer_norm(x, y, None, weight, ln_bias, 1e-6)
    assert torch.equal(total, x + y)
    want = torch.nn.functional.layer_norm(x + y, (cols,), weight, ln_bias, 1e-6)
    diff = float((normed.float() - want.float()).abs().max())
    assert diff <= 2**-7 * float(want.float().abs().max()), diff
    strided = torch.randn(rows, 2 * cols, device="cuda", generator=generator).bfloat16()[:, :cols]
    got, _ = aln.add_layer_norm(strided, y, None, weight, ln_bias, 1e-6)
    torch.testing.assert_close(got, aln.add_layer_norm_reference(strided, y, None, weight, ln_bias, 1e-6)[0])


@pytest.mark.cuda
def test_without_triton_the_torch_ops_run_with_one_log_line(monkeypatch, log_records):
    from vllm_omni.model_executor.models.minicpmo_4_5.ops import fused_add_layer_norm as aln

    records = log_records(aln.logger)
    monkeypatch.setattr(aln, "HAS_TRITON", False)
    monkeypatch.setattr(aln, "_LOGGED_FALLBACKS", set())
    x = torch.randn(64, 1152, device="cuda").bfloat16()
    w = torch.ones(1152, device="cuda").bfloat16()
    for _ in range(2):
        got, total = aln.add_layer_norm(x, x, None, w, w, 1e-6)
    assert len(records.messages(logging.INFO)) == 1 and "Triton is not available" in records.messages()[0]
    monkeypatch.setattr(aln, "HAS_TRITON", True)
    torch.testing.assert_close(got, aln.add_layer_norm(x, x, None, w, w, 1e-6)[0], atol=1e-2, rtol=2**-7)


@pytest.mark.cuda
def test_packing_is_refused_inside_a_capture():
    from vllm_omni.model_executor.models.minicpmo_4_5 import fused_layers

    attention = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Linear(64, 64, device="cuda"))
    packed = fused_layers.pack_qkv(attention)
    assert fused_layers.pack_qkv(attention) is packed
    attention.k_proj.weight.data = attention.k_proj.weight.data.clone()  # replaced: must pack again
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"), torch.cuda.graph(graph):
        fused_layers.pack_qkv(attention)
    torch.accelerator.synchronize()
    assert fused_layers.pack_qkv(attention).shared_by(attention)
