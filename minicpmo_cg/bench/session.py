"""A sequence of calls through the model's patched call sites, eager or graphed: what the
``streaming`` and ``offline`` scenarios replay, and how their sections are printed."""

from __future__ import annotations

import time
from typing import Any

from minicpmo_cg.bench.context import Ctx, call_site
from minicpmo_cg.bench.memory import graph_memory, mem_state, mib, release_memory
from minicpmo_cg.measure import summary
from minicpmo_cg.standalone import audio_graph, vision_graph, wire_encoder_graphs

Events = list[tuple[str, dict[str, Any]]]  # (modality, call-site data)

MISS_KINDS = ("warmup_misses", "capacity_misses", "memory_misses", "ineligible_misses")


def _full_options(ctx: Ctx, options: dict[str, Any]) -> dict[str, Any]:
    """Every option explicit: wire_encoder_graphs leaves earlier sessions' keys on model.config."""
    defaults = ctx.adapter_mod.EncoderCudaGraphOptions()
    full = {
        k: getattr(defaults, k)
        for k in ("max_graphs", "min_capture_calls", "min_free_bytes", "share_pools", "streaming_audio")
    }
    full.update(options)
    return full


def _graph_results(adapters: dict[str, Any]) -> dict[str, Any]:
    stats = {k: a.get_cumulative_stats() for k, a in adapters.items() if a is not None}
    total = sum(s["graph_hits"] + s["graph_misses"] for s in stats.values())
    return {
        "stats": stats,
        "memory": graph_memory(list(adapters.values())),
        "hit_rate": sum(s["graph_hits"] for s in stats.values()) / total if total else 0.0,
    }


def run_session(ctx: Ctx, events: Events, graphed: bool, **options: Any) -> dict[str, Any]:
    """Run ``events`` through the model; graphs wired or not. Times every call at its call site."""
    model = ctx.model
    release_memory()
    before = mem_state()
    full = _full_options(ctx, options)
    wire_encoder_graphs(model, ctx.vllm_config, enabled=graphed, backend=ctx.backend, **full)
    per: dict[str, list[float]] = {"vision": [], "audio": []}
    t_start = time.perf_counter()
    for modality, data in events:
        fn = call_site(ctx, modality)
        per[modality].append(ctx.timer(lambda fn=fn, data=data: fn(data)))
    wall = (time.perf_counter() - t_start) * 1e3
    after = mem_state()
    res: dict[str, Any] = {
        "graphed": graphed,
        "options": full,
        "encoder_ms_total": sum(per["vision"]) + sum(per["audio"]),
        "wall_ms": wall,
        "per_modality": {k: {"calls": len(v), "total_ms": sum(v), **summary(v)} for k, v in per.items() if v},
        "reserved_delta_bytes": after["reserved"] - before["reserved"],
    }
    if graphed:
        res.update(_graph_results({"vision": vision_graph(model), "audio": audio_graph(model)}))
    wire_encoder_graphs(model, ctx.vllm_config, enabled=False)  # drop the adapters (and their graphs)
    release_memory()
    return res


def warm_call_sites(ctx: Ctx, events: Events) -> None:
    """One eager call per modality, so that the first timed session does not pay lazy setup."""
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    seen = set()
    for modality, data in events:
        if modality not in seen:
            seen.add(modality)
            call_site(ctx, modality)(data)
    ctx.timer.sync()


def _run_line(label: str, r: dict[str, Any], eager_total: float) -> str:
    line = f"{label:22s} encoder {r['encoder_ms_total']:9.1f} ms"
    for mod, pm in r["per_modality"].items():
        line += f" | {mod} med {pm['median']:.2f} p90 {pm['p90']:.2f}"
    if r["graphed"]:
        misses = {k: sum(v[k] for v in r["stats"].values()) for k in MISS_KINDS}
        mem = r["memory"]
        line += (
            f" | hit rate {r['hit_rate']:.1%} graphs {mem['graphs']} misses "
            + " ".join(f"{k.split('_')[0]} {v}" for k, v in misses.items())
            + f" | graph mem {mib((mem['pool_bytes'] or 0) + mem['static_bytes'])} MiB"
            + f" | x{eager_total / r['encoder_ms_total']:.2f}"
        )
    return line


def format_sessions(title: str, extra: str, s: dict[str, Any]) -> list[str]:
    """The eager run and every ``graphed*`` run of a scenario, one line each."""
    lines = [f"\n-- {title} ({extra}); encoder ms = sum of per-call latencies at the call sites"]
    runs = [("eager", s["eager"])] + [
        (k.replace("graphed_", "graphed max_graphs="), v)
        for k, v in s.items()
        if k.startswith("graphed") and isinstance(v, dict)
    ]
    lines += [_run_line(label, r, s["eager"]["encoder_ms_total"]) for label, r in runs]
    return lines
