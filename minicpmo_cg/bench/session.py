"""A sequence of calls through the model's patched call sites, eagerly and graphed under each
admission rule: what the ``streaming`` and ``offline`` scenarios replay, and how their sections
(runs side by side, graphs, targets) are printed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from minicpmo_cg.bench.context import Ctx, call_site
from minicpmo_cg.bench.memory import graph_memory, mem_state, mib, release_memory
from minicpmo_cg.measure import summary
from minicpmo_cg.standalone import audio_graph, vision_graph, wire_encoder_graphs

Events = list[tuple[str, dict[str, Any]]]  # (modality, call-site data)

#: The graphed runs every session scenario compares with eager: run key -> adapter options.
ADMISSION_RUNS: dict[str, dict[str, Any]] = {"count": {"admission": "count"}, "cost": {"admission": "cost"}}

#: Miss kinds of the adapter's stats (``<kind>_misses`` in ``get_cumulative_stats`` or
#: ``get_detailed_stats``), in report order.
MISS_KINDS = ("warmup", "declined", "capacity", "budget", "memory", "ineligible", "profile")


def _full_options(ctx: Ctx, options: dict[str, Any]) -> dict[str, Any]:
    """Every adapter option explicit: wire_encoder_graphs leaves earlier sessions' keys on model.config."""
    defaults = ctx.adapter_mod.EncoderCudaGraphOptions()
    full = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults) if f.name != "enabled"}
    full.update(options)
    return full


def run_label(options: dict[str, Any] | None) -> str:
    """``eager`` or ``admission=cost`` / ``admission=cost max_graphs=16`` for a graphed run's options."""
    if options is None:
        return "eager"
    rest = " ".join(f"{k}={v}" for k, v in options.items() if k != "admission")
    return f"admission={options.get('admission', 'cost')}" + (f" {rest}" if rest else "")


def _adapters(ctx: Ctx) -> dict[str, Any]:
    found = {"vision": vision_graph(ctx.model), "audio": audio_graph(ctx.model)}
    return {k: a for k, a in found.items() if a is not None}


def _hits_and_calls(stats: dict[str, dict[str, Any]]) -> tuple[int, int]:
    hits = sum(s["graph_hits"] for s in stats.values())
    return hits, hits + sum(s["graph_misses"] for s in stats.values())


def graph_results(adapters: dict[str, Any], at_warmup: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A graphed run's figures from its adapters' stats."""
    stats = {k: a.get_cumulative_stats() for k, a in adapters.items()}
    detail = {k: a.get_detailed_stats() for k, a in adapters.items()}
    hits, calls = _hits_and_calls(stats)
    late_rate = None
    if at_warmup is not None:
        hits0, calls0 = _hits_and_calls(at_warmup)
        late_rate = (hits - hits0) / (calls - calls0) if calls > calls0 else None
    return {
        "stats": stats,
        "detail": detail,
        "hit_rate": hits / calls if calls else 0.0,
        "hit_rate_after_warmup": late_rate,
        "graphs": sum(s["num_graphs"] for s in stats.values()),
        "graph_bytes": sum(d["graph_bytes"] for d in detail.values()),
        "misses": {
            kind: sum({**stats[k], **detail[k]}[f"{kind}_misses"] for k in adapters) for kind in MISS_KINDS
        },
        "held_calls": sum(d["held_calls"] for d in detail.values()),
        "memory": graph_memory(list(adapters.values())),
    }


def run_session(
    ctx: Ctx, events: Events, options: dict[str, Any] | None, warmup_events: int = 0
) -> dict[str, Any]:
    """Run ``events`` through the model, eagerly (``options`` None) or graphed with ``options``."""
    graphed = options is not None
    release_memory()
    before = mem_state()
    full = _full_options(ctx, options or {})
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=graphed, backend=ctx.backend, **full)
    adapters = _adapters(ctx)
    per: dict[str, list[float]] = {"vision": [], "audio": []}
    at_warmup = None
    t_start = time.perf_counter()
    for i, (modality, data) in enumerate(events):
        if graphed and warmup_events and i == warmup_events:
            at_warmup = {k: a.get_cumulative_stats() for k, a in adapters.items()}
        fn = call_site(ctx, modality)
        per[modality].append(ctx.timer(lambda fn=fn, data=data: fn(data)))
    wall = (time.perf_counter() - t_start) * 1e3
    after = mem_state()
    res: dict[str, Any] = {
        "label": run_label(options),
        "graphed": graphed,
        "options": full if graphed else {},
        "encoder_ms_total": sum(per["vision"]) + sum(per["audio"]),
        "wall_ms": wall,
        "per_modality": {k: {"calls": len(v), "total_ms": sum(v), **summary(v)} for k, v in per.items() if v},
        "reserved_delta_bytes": after["reserved"] - before["reserved"],
    }
    if graphed:
        res.update(graph_results(adapters, at_warmup))
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)  # drop the adapters (and their graphs)
    release_memory()
    return res


def warm_call_sites(ctx: Ctx, events: Events) -> None:
    """Pay one-time costs before the timed runs, so that no run carries them."""
    firsts: dict[str, dict[str, Any]] = {}
    for modality, data in events:
        firsts.setdefault(modality, data)
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    for modality, data in firsts.items():
        call_site(ctx, modality)(data)
    options = _full_options(ctx, {"admission": "count"})
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=True, backend=ctx.backend, **options)
    for modality, data in firsts.items():
        for _ in range(options["min_capture_calls"]):
            call_site(ctx, modality)(data)
    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    release_memory()
    ctx.timer.sync()


def compare_admissions(
    ctx: Ctx, events: Events, warmup_events: int = 0, extra: Sequence[tuple[str, dict[str, Any]]] = ()
) -> dict[str, dict[str, Any]]:
    """Eager, then graphed under each rule of :data:`ADMISSION_RUNS` and the ``extra`` runs."""
    warm_call_sites(ctx, events)
    runs = {"eager": run_session(ctx, events, None)}
    for key, options in (*ADMISSION_RUNS.items(), *extra):
        runs[key] = run_session(ctx, events, options, warmup_events)
    eager_ms = runs["eager"]["encoder_ms_total"]
    for r in runs.values():
        r["vs_eager"] = eager_ms / r["encoder_ms_total"] if r["encoder_ms_total"] else None
    return runs


def verdict(target: str, measured: str, ok: bool) -> dict[str, Any]:
    """One evaluated target: what it asks, the measured value as printed, and whether it is met."""
    return {"target": target, "measured": measured, "ok": bool(ok)}


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def _times(r: dict[str, Any]) -> str:
    return f"x{r['vs_eager']:.2f}" if r["vs_eager"] is not None else "n/a"


TABLE_HEAD = (
    f"{'run':32s} {'encoder ms':>10s} {'vs eager':>8s} {'hit rate':>8s} {'after warm-up':>13s} "
    f"{'graphs':>6s} {'graph MiB':>9s} {'alloc MiB':>9s} {'declined':>8s}  other misses"
)

TABLE_NOTE = (
    "  graph MiB: the adapters' accounts (get_detailed_stats); "
    "alloc MiB: the allocator's pool segments + static buffers"
)


def _run_row(r: dict[str, Any]) -> str:
    row = f"{r['label']:32s} {r['encoder_ms_total']:10.1f} {_times(r):>8s}"
    if not r["graphed"]:
        return row
    mem = r["memory"]
    alloc = None if mem["pool_bytes"] is None else mem["pool_bytes"] + mem["static_bytes"]
    other = ", ".join(
        f"{k} {n}" + (f" ({r['held_calls']} held)" if k == "warmup" and r.get("held_calls") else "")
        for k, n in r["misses"].items()
        if n and k != "declined"
    )
    return row + (
        f" {_pct(r['hit_rate']):>8s} {_pct(r['hit_rate_after_warmup']):>13s} {r['graphs']:6d} "
        f"{mib(r['graph_bytes']):>9s} {mib(alloc):>9s} {r['misses']['declined']:8d}  {other or 'none'}"
    )


def _graph_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for encoder, detail in r.get("detail", {}).items():
        for i, g in enumerate(detail["graphs"], 1):
            lines.append(
                f"  {r['label']} {encoder} graph {i}: inputs {g['inputs']}: {g['hits']} hits, "
                f"{mib(g['bytes'])} MiB (pool {mib(g['pool_bytes'])} + static {mib(g['static_bytes'])}), "
                f"capture {g['capture_ms']:.1f} ms"
            )
    return lines


def format_sessions(title: str, extra: str, s: dict[str, Any]) -> list[str]:
    """A scenario's runs side by side, per-call latencies, every graph, and the targets."""
    runs = s["runs"]
    lines = [
        f"\n-- {title} ({extra}); encoder ms = sum of the call sites' latencies, captures included",
        TABLE_HEAD,
        *(_run_row(r) for r in runs.values()),
        TABLE_NOTE,
        "  per call ms (median / p90): "
        + " | ".join(
            f"{key} "
            + " ".join(f"{m} {pm['median']:.2f}/{pm['p90']:.2f}" for m, pm in r["per_modality"].items())
            for key, r in runs.items()
        ),
    ]
    for r in runs.values():
        lines += _graph_lines(r)
    lines += [
        f"  target {'ok  ' if t['ok'] else 'MISS'} {t['target']}: {t['measured']}" for t in s["targets"]
    ]
    return lines
