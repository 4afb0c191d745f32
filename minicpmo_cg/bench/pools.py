"""Scenario ``pools``: the same shapes captured into shared and into separate graph pools."""

from __future__ import annotations

import time
from typing import Any

from minicpmo_cg.bench.context import Ctx, audio_data, measure_calls, record_inputs, vision_data
from minicpmo_cg.bench.memory import graph_memory, mem_state, mib, release_memory
from minicpmo_cg.bench.per_shape import AUDIO_SHAPES, CPU_AUDIO_SHAPES, CPU_VISION_SHAPES, VISION_SHAPES


def _shapes(ctx: Ctx) -> list[tuple[str, str, tuple[Any, ...]]]:
    """(encoder, shape name, recorded inputs): 4 vision and 2 audio shapes (all the CPU ones)."""
    vision_shapes = CPU_VISION_SHAPES if ctx.cpu else VISION_SHAPES[:3] + VISION_SHAPES[4:5]
    audio_shapes = CPU_AUDIO_SHAPES if ctx.cpu else AUDIO_SHAPES[:2]
    shapes = [("vision", n, record_inputs(ctx, "vision", vision_data(ctx, g))[0]) for n, g in vision_shapes]
    shapes += [("audio", n, record_inputs(ctx, "audio", audio_data(ctx, f))[0]) for n, f in audio_shapes]
    return shapes


def _variant(ctx: Ctx, shapes: list[tuple[str, str, tuple[Any, ...]]], share: bool) -> dict[str, Any]:
    """Capture every shape with ``share_pools=share``; memory, capture time and replay latency."""
    forwards = {"vision": ctx.model._encode_images, "audio": ctx.model._encode_audio_features}
    release_memory()
    before = mem_state()
    adapters = {
        e: ctx.new_adapter(forwards[e], f"bench-pools-{e}", max_graphs=16, share_pools=share)
        for e in forwards
    }
    t0 = time.perf_counter()
    for e, _, inp in shapes:
        adapters[e](*inp)
        adapters[e](*inp)  # captures
    ctx.timer.sync()
    capture_s = time.perf_counter() - t0
    after = mem_state()
    lat = {
        f"{e} {n}": measure_calls(ctx.timer, lambda i, a=adapters[e], inp=inp: a(*inp), ctx.profile)
        for e, n, inp in shapes
    }
    return {
        **graph_memory(list(adapters.values())),
        "reserved_delta_bytes": after["reserved"] - before["reserved"],
        "allocated_delta_bytes": after["allocated"] - before["allocated"],
        "capture_all_s": capture_s,
        "graph_ms": lat,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    shapes = _shapes(ctx)
    out: dict[str, Any] = {"shapes": [f"{e} {n}" for e, n, _ in shapes]}
    for share in (True, False):
        out["shared" if share else "separate"] = _variant(ctx, shapes, share)
        release_memory()  # the variant's adapters (and graphs) are gone: free them before the next
    return out


def format_section(p: dict[str, Any]) -> list[str]:
    lines = ["\n-- share_pools: same shapes captured into shared vs separate pools"]
    for k in ("shared", "separate"):
        r = p[k]
        lines.append(
            f"{k:9s} graphs {r['graphs']:2d} pools {r['pools']:2d} pool {mib(r['pool_bytes'])} MiB "
            f"static {mib(r['static_bytes'])} MiB reserved +{mib(r['reserved_delta_bytes'])} MiB "
            f"capture {r['capture_all_s']:.2f} s"
        )
    for shape in p["shapes"]:
        a, b = p["shared"]["graph_ms"][shape], p["separate"]["graph_ms"][shape]
        lines.append(f"  {shape:40s} graph ms shared {a['median']:8.3f} separate {b['median']:8.3f}")
    return lines
