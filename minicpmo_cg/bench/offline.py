"""Scenario ``offline``: real photos through MiniCPM-o's slicer in random order with repeats,
eager vs graphed with the default 4 graphs per encoder and (full mode) 16."""

from __future__ import annotations

import random
from typing import Any

from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import Ctx, vision_data
from minicpmo_cg.bench.session import format_sessions, run_session, warm_call_sites

OFFLINE_REQUESTS = {"full": 48, "quick": 16, "cpu": 8}
#: skimage.data photos and their popularity: repeats are common, a few shapes are rare.
PHOTO_WEIGHTS = {"chelsea": 6, "astronaut": 4, "rocket": 3, "coffee": 2, "hubble_deep_field": 2, "retina": 1}
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


def run(ctx: Ctx) -> dict[str, Any]:
    n = OFFLINE_REQUESTS[ctx.mode]
    datas, describe, weights = _inputs(ctx)
    order = random.Random(1234).choices(list(datas), weights=weights, k=n)
    events = [("vision", datas[p]) for p in order]
    warm_call_sites(ctx, events)
    res: dict[str, Any] = {
        "requests": n,
        "order": order,
        "inputs": describe,
        "eager": run_session(ctx, events, graphed=False),
    }
    res["graphed_default"] = run_session(ctx, events, graphed=True)
    if ctx.mode == "full" or ctx.cpu:
        res["graphed_16"] = run_session(ctx, events, graphed=True, max_graphs=16)
    return res


def format_section(s: dict[str, Any]) -> list[str]:
    return format_sessions("offline photo mix", f"{s['requests']} requests", s)
