"""Scenario ``duplex_concurrency``: N duplex sessions sharing engine steps, one interleaved run."""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from minicpmo_cg import duplex, standalone
from minicpmo_cg.bench.context import TARGETS, Ctx, log
from minicpmo_cg.bench.memory import mib, release_memory
from minicpmo_cg.measure import summary
from minicpmo_cg.vllm_config import duplex_vllm_config

SESSIONS = {"full": (1, 2, 4, 8, 16, 32), "quick": (1, 2, 4, 8, 16, 32), "cpu": (1, 2)}
STEPS = {"full": 20, "quick": 8, "cpu": 2}
WARMUP_STEPS = {"full": 3, "quick": 2, "cpu": 1}
FIRST_CHUNKS = {"full": 5, "quick": 3, "cpu": 2}
STARTUP_SESSIONS = 32
WAYS = ("eager", "paged", "floor")
MODULES = "vllm_omni.model_executor.models.minicpmo_4_5."


def _module(name: str) -> Any:
    return importlib.import_module(MODULES + name)


def _streams(sessions: int, chunks: int) -> list[list[duplex.DuplexChunk]]:
    """``sessions`` streams of ``chunks`` host chunks of the shipped voices, each from its own offset."""
    frames = duplex.CHUNK_FRAMES
    mel = duplex.speech_mel(sessions * chunks + 1)
    return [duplex.frame_chunks(mel[:, k * chunks * frames :], chunks) for k in range(sessions)]


def _timed(ctx: Ctx, fn: Any) -> tuple[float, float, Any]:
    """``(ms of the call's span, ms the host spent in it, its output)``, the device idle before it."""
    ctx.timer.sync()
    if ctx.cpu:
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    out = fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host, out


def _floor(ctx: Ctx, rows: int) -> Any:
    """A call replaying a plain CUDA graph of the fused Whisper layers, projection and pooling over
    ``rows`` rows of one chunk, no cache (CPU: the same, eagerly)."""
    model, fused = ctx.model, _module("fused_layers")
    apm = model.apm
    chunk = duplex.CHUNK_POSITIONS
    hidden = torch.randn((rows, chunk, apm.config.d_model), generator=ctx.rng).to(
        ctx.device, apm.conv1.weight.dtype
    )

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            out, _ = fused.whisper_encode_layers(apm, hidden, None)
            embeds = model.audio_projection_layer(out)
            return model.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2)

    if ctx.cpu:
        return forward
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def _sessions_row(ctx: Ctx, n: int, paged: Any) -> dict[str, Any]:
    """``n`` sessions, the three ways interleaved step by step."""
    sa = _module("streaming_audio")
    steps, warmup = STEPS[ctx.mode], WARMUP_STEPS[ctx.mode]
    streams = _streams(n, steps + warmup)
    eager = sa.StreamingAudioEncoder(ctx.model, None, n, paged.chunk)
    floor = _floor(ctx, n)
    caches = {"eager": [None] * n, "paged": [None] * n}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    host, bitwise = [], True
    for t in range(steps + warmup):
        outs = {}
        for way, encoder in (("eager", eager), ("paged", paged)):
            chunks = [
                sa.StreamingAudioChunk(s[t].features, s[t].prefix_extra_frames, c)
                for s, c in zip(streams, caches[way], strict=True)
            ]
            with torch.inference_mode():
                ms, host_ms, out = _timed(ctx, lambda e=encoder, c=chunks: e.encode(c))
            caches[way] = [cache for _, cache in out]
            outs[way] = [embeds for embeds, _ in out]
            if t >= warmup:
                times[way].append(ms)
                if way == "paged":
                    host.append(host_ms)
        ms, _, _ = _timed(ctx, floor)
        if t >= warmup:
            times["floor"].append(ms)
        bitwise &= all(torch.equal(a, b) for a, b in zip(outs["eager"], outs["paged"], strict=True))
    for way in ("eager", "paged"):
        for cache in caches[way]:
            sa.release_cache(cache)
    if not bitwise:
        ctx.problems.append(
            f"duplex_concurrency: {n} sessions, the graphed steps differ from the eager forward"
        )
    return {
        "step_ms": {way: summary(times[way])["median"] for way in WAYS},
        "step_ms_summary": {way: summary(times[way]) for way in WAYS},
        "host_ms": summary(host)["median"],
        "bitwise": bitwise,
    }


def _first_session(ctx: Ctx) -> dict[str, Any]:
    """A fresh wiring and start-up capture, then the first chunks of the first session after it."""
    config = duplex_vllm_config(ctx.vllm_config, STARTUP_SESSIONS)
    release_memory()
    standalone.wire_encoder_graphs(ctx.model, config, enabled=True, backend=ctx.backend, startup_capture=True)
    report = _module("startup_capture").capture_at_startup(ctx.model, config)
    chunks = duplex.frame_chunks(
        duplex.speech_mel(FIRST_CHUNKS[ctx.mode]), FIRST_CHUNKS[ctx.mode], device=ctx.device
    )
    session = duplex.DuplexSession()
    with torch.inference_mode():
        times = [ctx.timer.timed(lambda c=c: session.encode(ctx.model, c))[0] for c in chunks]
    session.close()
    return {
        "chunk_ms": times,
        "startup": {
            "s": report.seconds,
            "bytes": report.total_bytes,
            "graphs": report.graphs,
            "pool_bytes": report.pool_bytes,
            "stopped": report.stopped,
        },
    }


def run(ctx: Ctx) -> dict[str, Any]:
    log("duplex_concurrency: start-up capture and the first session after it ...")
    first = _first_session(ctx)
    paged = ctx.model._streaming_audio  # the deployment's encoder: pool and bucket graphs from start-up
    rows = {}
    for n in SESSIONS[ctx.mode]:
        log(f"duplex_concurrency: {n} session(s) ...")
        rows[str(n)] = _sessions_row(ctx, n, paged)
    stats = paged.graph.get_cumulative_stats() if paged.graph is not None else {}
    standalone.wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    release_memory()
    return {
        "sessions": {n: {"step_ms": row["step_ms"], "host_ms": row["host_ms"]} for n, row in rows.items()},
        "first_chunk_ms": first["chunk_ms"][0],
        "startup": first["startup"],
        "detail": {
            "rows": rows,
            "first_chunks_ms": first["chunk_ms"],
            "graph_stats": {k: stats.get(k) for k in ("num_graphs", "graph_hits", "graph_misses")},
            "attention": paged.attention,
            "row_plan": paged.pool.row_plan.describe() if paged.pool.row_plan else None,
            "steps": STEPS[ctx.mode],
        },
    }


def missed_targets(s: dict[str, Any]) -> list[str]:
    """The issue's targets this run misses."""
    missed, sessions = [], s["sessions"]
    for n, goal in TARGETS["duplex_step_ms"].items():
        row = sessions.get(str(n))
        if row is not None and row["step_ms"]["paged"] > goal:
            missed.append(f"{n} sessions {row['step_ms']['paged']:.2f} ms per step > {goal:g} ms")
    ratio = TARGETS["duplex_step_vs_floor"]
    for n, row in sessions.items():
        step = row["step_ms"]
        if step["paged"] > ratio * step["floor"]:
            missed.append(f"{n} sessions {step['paged']:.2f} ms > {ratio:g} x floor {step['floor']:.2f} ms")
        if row["host_ms"] > TARGETS["duplex_step_host_ms"]:
            missed.append(
                f"{n} sessions host {row['host_ms']:.3f} ms per step > {TARGETS['duplex_step_host_ms']:g} ms"
            )
    if s["first_chunk_ms"] > TARGETS["duplex_first_chunk_ms"]:
        missed.append(
            f"first chunk after start-up {s['first_chunk_ms']:.2f} ms > {TARGETS['duplex_first_chunk_ms']:g} ms"
        )
    return missed


def format_section(s: dict[str, Any]) -> list[str]:
    detail, start = s["detail"], s["startup"]
    lines = [
        f"\n-- duplex concurrency: N sessions sharing steps, each a 1 s chunk per step, {detail['steps']} timed "
        "steps, the ways interleaved; audio encoder ms per step (median)",
        f"attention {detail['attention']}; exact rows: {detail['row_plan']}",
        f"{'sessions':>8s}{'eager':>10s}{'paged':>10s}{'floor':>10s}{'x floor':>9s}{'host ms':>9s}{'bitwise':>9s}",
    ]
    for n, row in detail["rows"].items():
        st = row["step_ms"]
        ratio = st["paged"] / st["floor"] if st["floor"] else float("nan")
        lines.append(
            f"{n:>8s}{st['eager']:10.2f}{st['paged']:10.2f}{st['floor']:10.2f}{ratio:9.2f}{row['host_ms']:9.3f}"
            f"{'yes' if row['bitwise'] else 'NO':>9s}"
        )
    lines.append(
        f"start-up capture: {start['graphs']} in {start['s']:.2f} s, {mib(start['bytes'])} MiB ({start['bytes']} bytes, "
        f"pages {mib(start['pool_bytes'])} MiB); first session's chunks after it: "
        + ", ".join(f"{ms:.2f}" for ms in detail["first_chunks_ms"])
        + " ms"
    )
    missed = missed_targets(s)
    lines.append("targets: " + ("all MET" if not missed else "MISSED: " + "; ".join(missed)))
    return lines
