"""Scenarios ``vision`` and ``audio``: per input shape, eager vs graphed latency of the captured
region (vision: the whole image call from pixels to resampler output, ``_encode_images``; audio:
Whisper, projection and pooling), capture cost, graph memory and the graphed-vs-eager difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minicpmo_cg.bench.context import (
    ROTATE,
    TARGETS,
    Ctx,
    audio_data,
    describe_inputs,
    log,
    measure_calls,
    record_inputs,
    vision_data,
)
from minicpmo_cg.bench.kernels import format_kernels, fused_layers, kernel_profile, layers_label
from minicpmo_cg.bench.memory import graph_memory, mem_state, mib, release_memory
from minicpmo_cg.measure import within_graph_tolerance

# name, slices as (h, w) patch grids. 32x32 = one 448x448 slice = 1024 patches.
VISION_SHAPES: list[tuple[str, list[tuple[int, int]]]] = [
    ("1 slice 32x32", [(32, 32)]),
    ("2 slices 32x32", [(32, 32)] * 2),
    ("4 slices 32x32", [(32, 32)] * 4),
    ("9+1 slices 32x32", [(32, 32)] * 10),
    ("28x36 + 32x32 (padded)", [(28, 36), (32, 32)]),
    ("21x48 + 28x36 + 26x39 (padded)", [(21, 48), (28, 36), (26, 39)]),
]
# name, mel frames (100 per second)
AUDIO_SHAPES: list[tuple[str, int]] = [("1 s chunk", 100), ("5 s chunk", 500), ("30 s chunk", 3000)]
# --allow-cpu: tiny stand-ins with the same structure
CPU_VISION_SHAPES = [
    ("1 slice 4x4", [(4, 4)]),
    ("2 slices 4x4", [(4, 4)] * 2),
    ("3x4 + 4x4 (padded)", [(3, 4), (4, 4)]),
]
CPU_AUDIO_SHAPES = [("0.2 s chunk", 20), ("0.4 s chunk", 40)]


def _capture(ctx: Ctx, adapter: Any, rotation: list[tuple[Any, ...]], row: dict[str, Any]) -> None:
    """Warmup miss, then the capturing call (timed) and the memory it took."""
    adapter(*rotation[0])  # first sighting: warmup miss (eager)
    before = mem_state()
    row["capture_call_ms"] = ctx.timer(lambda: adapter(*rotation[1]))  # second sighting: capture + replay
    after = mem_state()
    stats = adapter.get_cumulative_stats()
    if stats["num_graphs"] != 1:
        ctx.problems.append(
            f"{row['encoder']} {row['name']}: expected 1 graph after the capturing call, got {stats}"
        )
    mem = graph_memory([adapter])
    row.update(
        pool_bytes=mem["pool_bytes"],
        static_bytes=mem["static_bytes"],
        allocated_delta_bytes=after["allocated"] - before["allocated"],
        reserved_delta_bytes=after["reserved"] - before["reserved"],
    )


def bench_shape(
    ctx: Ctx, encoder: str, name: str, forward: Callable[..., torch.Tensor], rotation: list[tuple[Any, ...]]
) -> dict[str, Any]:
    """Eager vs graphed latency, capture cost and graph memory of one input shape."""
    module = "apm" if encoder == "audio" else "vpm"
    row: dict[str, Any] = {
        "encoder": encoder,
        "name": name,
        "layers": layers_label(ctx.model, module),
        "inputs": describe_inputs(rotation[0]),
    }
    row["eager_ms"] = measure_calls(ctx.timer, lambda i: forward(*rotation[i % len(rotation)]), ctx.profile)
    release_memory()
    adapter = ctx.new_adapter(
        forward, f"bench-{encoder}", max_graphs=1, min_capture_calls=2, share_pools=False
    )
    _capture(ctx, adapter, rotation, row)
    row["graph_ms"] = measure_calls(ctx.timer, lambda i: adapter(*rotation[i % len(rotation)]), ctx.profile)
    row["speedup"] = (
        row["eager_ms"]["median"] / row["graph_ms"]["median"] if row["graph_ms"]["median"] else None
    )
    row["capture_extra_ms"] = row["capture_call_ms"] - row["eager_ms"]["median"]
    # graphed output == eager output on a fresh input (same kernels: expected exactly 0)
    probe = rotation[-1]
    ok, row["max_rel_diff"] = within_graph_tolerance(forward(*probe), adapter(*probe), ctx.dtype)
    if not ok:
        ctx.problems.append(
            f"{encoder} {name}: graphed output differs from eager by {row['max_rel_diff']:.3g} (relative)"
        )
    if encoder == "audio":
        row["kernels"] = kernel_profile(ctx, lambda: adapter(*probe))
    row["stats"] = adapter.get_cumulative_stats()
    return row  # the adapter (and its graph) goes with this frame; the next shape releases memory first


def run_vision(ctx: Ctx) -> list[dict[str, Any]]:
    rows = []
    for name, grids in CPU_VISION_SHAPES if ctx.cpu else VISION_SHAPES:
        rotation = [c for _ in range(ROTATE) for c in record_inputs(ctx, "vision", vision_data(ctx, grids))]
        if len(rotation) != ROTATE:  # one graph call per get_vision_hidden_states call
            raise RuntimeError(f"vision {name}: the call site made {len(rotation)} graph calls for {ROTATE}")
        log(f"vision {name}: inputs {describe_inputs(rotation[0])}")
        rows.append(bench_shape(ctx, "vision", name, ctx.model._encode_images, rotation))
        del rotation
    return rows


def run_audio(ctx: Ctx) -> list[dict[str, Any]]:
    rows = []
    for name, frames in CPU_AUDIO_SHAPES if ctx.cpu else AUDIO_SHAPES:
        rotation = [c for _ in range(ROTATE) for c in record_inputs(ctx, "audio", audio_data(ctx, frames))]
        log(f"audio {name}: inputs {describe_inputs(rotation[0])}")
        rows.append(bench_shape(ctx, "audio", name, ctx.model._encode_audio_features, rotation))
        if rows[-1]["layers"] == "fused":
            with fused_layers(ctx.model, on=False):
                rows.append(bench_shape(ctx, "audio", name, ctx.model._encode_audio_features, rotation))
        del rotation
    return rows


def _fmt_ms(s: dict[str, float]) -> str:
    return f"{s['median']:8.3f} {s['p90']:8.3f}"


def _target(row: dict[str, Any]) -> str:
    """``>=2x ok`` / ``>=3x MISS`` for the rows that have a target, else empty."""
    if row["encoder"] == "vision" and row["name"].startswith("1 slice"):
        goal = TARGETS["vision_1_slice_speedup"]
    elif row["encoder"] == "audio" and row["name"].startswith(("1 s", "0.2 s")):
        goal = TARGETS["audio_1s_speedup"]
        if row.get("layers") == "fused":
            limit = TARGETS["audio_1s_graphed_ms"]
            return f"<={limit:g}ms" + (" ok" if row["graph_ms"]["median"] <= limit else " MISS")
    else:
        return ""
    return f">={goal:.0f}x" + (" ok" if (row["speedup"] or 0) >= goal else " MISS")


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The per-shape table (vision and audio rows together)."""
    lines = [
        "\n-- per shape: captured region, eager vs graphed (ms: median p90), capture, memory per graph",
        (
            f"{'encoder':7s} {'layers':7s} {'shape':32s} {'eager med   p90':>17s} {'graph med   p90':>17s} "
            f"{'x':>6s} {'target':>11s} {'capture':>8s} {'pool MiB':>9s} {'static MiB':>10s} {'rel diff':>8s}"
        ),
    ]
    for r in rows:
        lines.append(
            f"{r['encoder']:7s} {r.get('layers', ''):7s} {r['name']:32s} {_fmt_ms(r['eager_ms'])} "
            f"{_fmt_ms(r['graph_ms'])} {r['speedup'] or float('nan'):6.2f} {_target(r):>11s} "
            f"{r['capture_call_ms']:8.1f} {mib(r['pool_bytes']):>9s} {mib(r['static_bytes']):>10s} "
            f"{r['max_rel_diff']:8.1e}"
        )
    lines.append(
        "  capture = the capturing call (manager setup + warm-up forward + capture + first replay), ms; "
        "pool = the graph's private pool segments; static = manager input + output buffers"
    )
    for r in rows:
        if r.get("layers") == "fused":
            lines += format_kernels(f"{r['encoder']} {r['name']}, graphed, fused layers", r.get("kernels"))
    return lines
