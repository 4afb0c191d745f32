"""Scenario ``vision_path``: the whole image call, ``get_vision_hidden_states``, eager vs graphed,
with SigLIP's eager and SDPA attention side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import ROTATE, TARGETS, Ctx, log, measure_calls, vision_data
from minicpmo_cg.bench.kernels import format_kernels, fused_layers, kernel_profile, layers_label
from minicpmo_cg.bench.memory import graph_memory, mib, release_memory

ATTENTIONS = ("eager", "sdpa")
#: The attention the targets are for: the model's default.
DEFAULT_ATTENTION = "sdpa"
#: name -> (photo, duplex frame?): real photos through the checkpoint's slicer
ROWS = {
    "1 slice (duplex frame)": ("coffee", True),
    "3 slices (astronaut, padded)": ("astronaut", False),
    "10 slices (retina)": ("retina", False),
}
#: --allow-cpu: tiny grids with the same structure
CPU_ROWS = {
    "1 slice 4x4": [(4, 4)],
    "3 slices (padded)": [(4, 4), (3, 4), (2, 5)],
    "10 slices 4x4": [(4, 4)] * 10,
}
#: calls per profile (graphed and eager each), by mode
PROFILE_CALLS = {"full": 5, "quick": 5, "cpu": 1}
PROFILE_ROWS = 12


def _rotation(ctx: Ctx, name: str) -> tuple[list[dict[str, Any]], str]:
    """ROTATE call-site arguments of the row's shape, and where they come from."""
    if ctx.cpu:
        grids = CPU_ROWS[name]
        return [vision_data(ctx, grids) for _ in range(ROTATE)], f"random pixels, grids {grids}"
    photo, frame = ROWS[name]
    item = mi.vision_input(mi.make_image_processor(), name, [photo], frame=frame)
    rotation = []
    for _ in range(ROTATE):
        noisy = [(p + torch.randn(p.shape, generator=ctx.rng) * 0.02).clamp(-1, 1) for p in item.pixel_values]
        rotation.append(
            {
                "pixel_values": [p.to(ctx.device, ctx.dtype) for p in noisy],
                "tgt_sizes": item.tgt_sizes.to(ctx.device),
            }
        )
    return rotation, f"{item.source}: {item.num_slices} slice(s), tgt {item.tgt_sizes.tolist()}"


def _profile(ctx: Ctx, call: Callable[[], Any], title: str) -> str:
    """Operators of ``PROFILE_CALLS`` calls by device time (CPU time on a CPU run)."""
    calls = PROFILE_CALLS[ctx.mode]
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if ctx.cpu else [ProfilerActivity.CUDA])
    call()
    ctx.timer.sync()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        ctx.timer.sync()
    sort_by = "cpu_time_total" if ctx.cpu else "device_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=PROFILE_ROWS, max_name_column_width=56)
    return f"--- profile: {title}, {calls} call(s) ---\n{table}"


def missed_targets(row: dict[str, Any]) -> list[str]:
    """The targets a row of the default configuration (SDPA attention, fused layers) misses (empty:
    none, or no target for the row)."""
    if row["attention"] != DEFAULT_ATTENTION or row.get("layers", "fused") != "fused":
        return []
    graphed, slices, missed = row["graphed_ms"]["median"], row["slices"], []
    if slices == 1 and graphed > TARGETS["vision_path_1_slice_ms"]:
        missed.append(f"1 slice graphed {graphed:.2f} ms > {TARGETS['vision_path_1_slice_ms']:g} ms")
    if slices == 10 and graphed > TARGETS["vision_path_10_slices_ms"]:
        missed.append(f"10 slices graphed {graphed:.2f} ms > {TARGETS['vision_path_10_slices_ms']:g} ms")
    if slices == 1 and row["graph_bytes"] > TARGETS["vision_path_1_slice_graph_mib"] * 2**20:
        missed.append(
            f"1-slice graph {mib(row['graph_bytes'])} MiB > {TARGETS['vision_path_1_slice_graph_mib']:g} MiB"
        )
    return missed


def _graphed(ctx: Ctx, model: Any, rotation: list[dict[str, Any]], row: dict[str, Any]) -> Any:
    """Capture the row's shapes in a fresh adapter; its bytes, graphed timing and last output."""
    release_memory()
    adapter = ctx.new_adapter(model._encode_images, "bench-vision-path", max_graphs=1, share_pools=False)
    model.vpm._encoder_graph = adapter
    model.get_vision_hidden_states(rotation[0])  # first sighting: warmup miss (eager)
    model.get_vision_hidden_states(rotation[1])  # second: capture + replay
    stats = adapter.get_cumulative_stats()
    if stats["num_graphs"] != 1:
        ctx.problems.append(f"vision_path {row['attention']} {row['name']}: expected 1 graph, got {stats}")
    row["graph_bytes"] = adapter.get_detailed_stats()["graph_bytes"]
    row["allocator"] = graph_memory([adapter])
    row["graphed_ms"] = measure_calls(
        ctx.timer, lambda i: model.get_vision_hidden_states(rotation[i % ROTATE]), ctx.profile
    )
    out = model.get_vision_hidden_states(rotation[0])
    hits = adapter.get_cumulative_stats()["graph_hits"]
    if hits < 2:
        ctx.problems.append(
            f"vision_path {row['attention']} {row['name']}: the graph was replayed {hits} time(s)"
        )
    return adapter, out


def bench_row(ctx: Ctx, model: Any, attention: str, name: str) -> dict[str, Any]:
    """Eager vs graphed whole calls of one row with one attention and the model's current layers
    (fused or not); the model is left without a graph."""
    rotation, source = _rotation(ctx, name)
    slices = len(rotation[0]["pixel_values"])
    layers = layers_label(model, "vpm")
    row: dict[str, Any] = {
        "attention": attention,
        "layers": layers,
        "name": name,
        "source": source,
        "slices": slices,
    }
    model.vpm._encoder_graph = None
    row["eager_ms"] = measure_calls(
        ctx.timer, lambda i: model.get_vision_hidden_states(rotation[i % ROTATE]), ctx.profile
    )
    eager_out = model.get_vision_hidden_states(rotation[0])
    adapter, graphed_out = _graphed(ctx, model, rotation, row)
    row["ratio"] = (
        row["eager_ms"]["median"] / row["graphed_ms"]["median"] if row["graphed_ms"]["median"] else None
    )
    row["equal"] = bool(torch.equal(graphed_out, eager_out))
    row["finite"] = bool(torch.isfinite(eager_out).all())
    if not (row["equal"] and row["finite"]):
        diff = float((graphed_out.float() - eager_out.float()).abs().max())
        ctx.problems.append(
            f"vision_path {attention} {name}: graphed == eager {row['equal']} (max |diff| {diff:.3g}), "
            f"finite {row['finite']}"
        )
    row["missed"] = missed_targets(row)
    if attention == DEFAULT_ATTENTION:
        row["kernels"] = kernel_profile(ctx, lambda: model.get_vision_hidden_states(rotation[0]))
    if row["missed"]:
        row["profiles"] = [
            _profile(ctx, lambda: model.get_vision_hidden_states(rotation[0]), f"{attention} {name}, graphed")
        ]
        model.vpm._encoder_graph = None
        row["profiles"].append(
            _profile(ctx, lambda: model.get_vision_hidden_states(rotation[0]), f"{attention} {name}, eager")
        )
    row["stats"] = adapter.get_cumulative_stats()
    model.vpm._encoder_graph = None
    log(
        f"vision_path {attention} ({layers} layers) {name}: eager {row['eager_ms']['median']:.2f} ms, graphed "
        f"{row['graphed_ms']['median']:.2f} ms, graph {mib(row['graph_bytes'])} MiB, equal {row['equal']}"
    )
    return row


def run(ctx: Ctx) -> dict[str, Any]:
    names = list(CPU_ROWS if ctx.cpu else ROWS)
    saved = ctx.model.vpm.__dict__.get("_encoder_graph")
    models = {ctx.model.build_info.vision_attn: ctx.model}
    rows = []
    try:
        for attention in ATTENTIONS:
            if attention not in models:
                log(f"vision_path: building the encoders with vision_attn={attention!r} (same seed) ...")
                models[attention] = ctx.build_model(vision_attn=attention)
            for name in names:
                rows.append(bench_row(ctx, models[attention], attention, name))
            if attention == DEFAULT_ATTENTION and layers_label(models[attention], "vpm") == "fused":
                with fused_layers(models[attention], on=False):
                    # the CPU dry run checks the plumbing on its first row only
                    for name in names[:1] if ctx.cpu else names:
                        rows.append(bench_row(ctx, models[attention], attention, name))
            if models[attention] is not ctx.model:
                del models[attention]
                release_memory()
    finally:
        ctx.model.vpm._encoder_graph = saved
    return {"rows": rows, "default_attention": DEFAULT_ATTENTION}


def _fmt(s: dict[str, float]) -> str:
    return f"{s['median']:8.2f} {s['p90']:7.2f}"


def format_section(s: dict[str, Any]) -> list[str]:
    lines = [
        (
            "\n-- vision path: the whole get_vision_hidden_states call (pixels to resampler output), "
            "eager vs graphed (ms: median p90)"
        ),
        (
            f"{'attention':9s} {'layers':7s} {'input':30s} {'eager ms':>8s} {'p90':>7s} {'graphed ms':>10s} "
            f"{'p90':>7s} {'ratio':>6s} {'graph MiB':>9s} {'graphed == eager':>16s}"
        ),
    ]
    for r in s["rows"]:
        lines.append(
            f"{r['attention']:9s} {r.get('layers', 'unfused'):7s} {r['name']:30s} {_fmt(r['eager_ms'])}   "
            f"{_fmt(r['graphed_ms'])} {r['ratio'] or float('nan'):6.2f} {mib(r['graph_bytes']):>9s} "
            f"{'yes' if r['equal'] else 'NO':>16s}"
        )
    goals = (
        f"one slice graphed <= {TARGETS['vision_path_1_slice_ms']:g} ms, 10 slices graphed <= "
        f"{TARGETS['vision_path_10_slices_ms']:g} ms, single-slice graph <= "
        f"{TARGETS['vision_path_1_slice_graph_mib']:g} MiB"
    )
    lines.append(f"targets ({s['default_attention']} attention, fused layers): {goals}")
    for r in s["rows"]:
        if r["attention"] == s["default_attention"] and r.get("layers") == "fused" and r["slices"] in (1, 10):
            verdict = "; ".join(r["missed"]) if r["missed"] else "met"
            lines.append(f"  {r['name']:30s} {verdict}")
    for r in s["rows"]:
        if r.get("layers") == "fused":
            lines += format_kernels(f"{r['attention']} {r['name']}, graphed, fused layers", r.get("kernels"))
    for r in s["rows"]:
        lines += r.get("profiles", [])
    return lines
