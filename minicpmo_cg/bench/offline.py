"""Scenario ``offline``: real photos through MiniCPM-o's slicer in random order with repeats,
eager vs graphed with ``admission="count"`` and ``"cost"`` side by side (default options
otherwise; full mode adds ``"cost"`` with 16 graphs per encoder)."""

from __future__ import annotations

import random
from typing import Any

from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import TARGETS, Ctx, vision_data
from minicpmo_cg.bench.memory import mib
from minicpmo_cg.bench.session import compare_admissions, format_sessions, verdict

OFFLINE_REQUESTS = {"full": 48, "quick": 16, "cpu": 12}
#: skimage.data photos and their popularity: repeats are common, a few shapes are rare.
PHOTO_WEIGHTS = {"chelsea": 6, "astronaut": 4, "rocket": 3, "coffee": 2, "hubble_deep_field": 2, "retina": 1}
#: --allow-cpu: tiny stand-ins. With the CPU backend's scripted timings one slice is launch-bound and
#: a batch of B slices GPU-bound by B, so in these 12 requests "count" captures all four shapes and
#: "cost" declines the rare 3-slice batch.
CPU_GRIDS = {"a": [(4, 4)], "b": [(3, 4), (4, 4)], "c": [(4, 4)] * 3, "d": [(2, 4)]}
CPU_WEIGHTS = (4, 3, 2, 1)


def _inputs(ctx: Ctx) -> tuple[dict[str, Any], dict[str, str], tuple[int, ...]]:
    """Call-site data and a description per input name, and the names' weights (in order)."""
    if ctx.cpu:
        datas = {k: vision_data(ctx, g) for k, g in CPU_GRIDS.items()}
        return datas, {k: f"{len(g)} slice(s) {g}" for k, g in CPU_GRIDS.items()}, CPU_WEIGHTS
    processor = mi.make_image_processor()
    items = {p: mi.vision_input(processor, p, [p]) for p in PHOTO_WEIGHTS}
    datas = {p: it.data(ctx.device, ctx.dtype) for p, it in items.items()}
    describe = {
        p: f"{it.source}: {it.num_slices} slice(s), tgt {it.tgt_sizes.tolist()}" for p, it in items.items()
    }
    return datas, describe, tuple(PHOTO_WEIGHTS.values())


def targets(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue targets of the offline mix: ``cost`` never slower than eager, capture included, and
    holding fewer graph bytes than ``count``."""
    cost, count = runs["cost"], runs["count"]
    goal = TARGETS["offline_cost_vs_eager"]
    return [
        verdict(
            f"admission=cost >= x{goal:.2f} eager (capture included)",
            "n/a" if cost["vs_eager"] is None else f"x{cost['vs_eager']:.3f}",
            (cost["vs_eager"] or 0.0) >= goal,
        ),
        verdict(
            "admission=cost graph bytes < admission=count",
            f"{mib(cost['graph_bytes'])} vs {mib(count['graph_bytes'])} MiB",
            cost["graph_bytes"] < count["graph_bytes"],
        ),
    ]


def run(ctx: Ctx) -> dict[str, Any]:
    n = OFFLINE_REQUESTS[ctx.mode]
    datas, describe, weights = _inputs(ctx)
    order = random.Random(1234).choices(list(datas), weights=weights, k=n)
    events = [("vision", datas[p]) for p in order]
    extra = [("cost_16", {"admission": "cost", "max_graphs": 16})] if ctx.mode == "full" else []
    runs = compare_admissions(ctx, events, extra=extra)
    return {"requests": n, "order": order, "inputs": describe, "runs": runs, "targets": targets(runs)}


def format_section(s: dict[str, Any]) -> list[str]:
    return format_sessions("offline photo mix", f"{s['requests']} requests", s)
