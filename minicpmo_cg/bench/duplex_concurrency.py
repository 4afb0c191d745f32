"""Scenario ``duplex_concurrency``: N duplex sessions sharing engine steps.

N = 1, 2, 4, 8, 16, 32 sessions (CPU dry run: 1, 2); per step every session sends one 1 s chunk,
framed as vllm-omni's duplex stage frames it (float32 mel, prefix 0 on a session's first chunk,
else 2; suffix 2), and every 5th step also a 448x448 camera frame (through
``get_vision_hidden_states``, as the stage encodes it, before its chunk). The sessions start
together, so their caches reset in the same step. Three ways to run a step, after the graphs they
use were captured at start-up (``startup_capture.capture_at_startup``) and a few warm-up steps:

- ``eager``: graphs off, one session's chunk after the other;
- ``per_session``: each chunk its own replay (``encoder_cuda_graph_duplex_batch=false``, the
  default path);
- ``batched``: (``encoder_cuda_graph_duplex_batch=true``, opt-in) the step's chunks in one call through ``duplex_batch.run_batched``, the path the
  model runner's batched preprocess takes (worker-thread coroutines, paged K/V, one graph per
  batch bucket), with the attention the device offers: vLLM's FlashAttention over the pages
  where its compiled op is registered, else the SDPA reference over the gathered pages (named,
  with the reason, in ``detail.attention`` and the table).

Per N and way: the step's audio encoder ms (``step_ms``: the chunks of the step, timed as one
call for ``batched`` and summed over the sessions' calls otherwise; frames apart) and the chunk
latency a session sees (its own call; for ``batched`` the step's call). ``per_session`` must equal
``eager`` bitwise and ``batched`` within ``GRAPH_REL_TOL`` (a problem otherwise).

Also the first session after a fresh start-up: a new model wiring, start-up capture (its graphs,
bytes and seconds), then one session's chunks of a whole cache cycle and more, each chunk timed
(worst and p90), on the default path (per-session replays; ``first_session`` in the JSON) and on
the batched path (batched steps of one session; under ``detail.first_session``); and the same
session without start-up capture (lazy captures) for comparison. Every way sets
``encoder_cuda_graph_duplex_batch`` explicitly, so the figures do not depend on its default.

JSON: ``{"sessions": {"8": {"step_ms": {"eager": .., "per_session": .., "batched": ..}}, ...},
"first_session": {"max_ms": .., "p90_ms": ..}, "detail": {"attention": {"name": .., "reason": ..}, ...}}``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from minicpmo_cg import duplex, standalone
from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import TARGETS, Ctx, audio_data, log
from minicpmo_cg.bench.memory import mib, release_memory
from minicpmo_cg.measure import graph_rel_tol, rel_diff, summary
from minicpmo_cg.vllm_config import duplex_vllm_config

SESSIONS = {"full": (1, 2, 4, 8, 16, 32), "quick": (1, 2, 4, 8, 16, 32), "cpu": (1, 2)}
STEPS = {"full": 12, "quick": 6, "cpu": 1}
WARMUP_STEPS = {"full": 3, "quick": 2, "cpu": 1}
#: chunks of the first session after a start-up: past one cache cycle (29 chunks), so it resets
FIRST_SESSION_CHUNKS = {"full": 40, "quick": 32, "cpu": 2}
FRAME_EVERY = 5
WAYS = ("eager", "per_session", "batched")
BATCH_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.duplex_batch"
STARTUP_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.startup_capture"


def _modules() -> tuple[Any, Any]:
    import importlib

    return importlib.import_module(BATCH_MODULE), importlib.import_module(STARTUP_MODULE)


def _streams(ctx: Ctx, sessions: int, chunks: int) -> list[list[duplex.DuplexChunk]]:
    """``sessions`` streams of ``chunks`` chunks of the shipped voices, each from its own offset."""
    frames = duplex.CHUNK_FRAMES
    mel = duplex.speech_mel(sessions * chunks + 1)
    return [
        duplex.frame_chunks(mel[:, k * chunks * frames :], chunks, device=ctx.device, dtype=torch.float32)
        for k in range(sessions)
    ]


def _frame(ctx: Ctx) -> dict[str, Any]:
    """A camera frame as the duplex stage passes it (CPU dry run: a random 4x4-patch slice)."""
    if ctx.cpu:
        pixels, tgt = [torch.rand((3, 14, 16 * 14), generator=ctx.rng) * 2 - 1], torch.tensor([[4, 4]])
    else:
        pixels, tgt = mi.process_images(mi.make_image_processor(), [mi.duplex_frame()])
    return duplex.stage_frame_data(pixels, tgt, device=ctx.device, dtype=ctx.dtype)


def _wire(ctx: Ctx, way: str, sessions: int, startup: bool) -> Any:
    """Wire the graphs ``way`` runs with and capture at start-up; returns start-up capture's report
    (None without graphs)."""
    _, startup_capture = _modules()
    config = duplex_vllm_config(ctx.vllm_config, max(2, sessions))
    release_memory()
    if way == "eager":
        standalone.wire_encoder_graphs(ctx.model, config, enabled=False)
        return None
    standalone.wire_encoder_graphs(
        ctx.model,
        config,
        enabled=True,
        backend=ctx.backend,
        duplex_batch=way == "batched",
        startup_capture=startup,
    )
    return startup_capture.capture_at_startup(ctx.model, config)


def _run_step(
    ctx: Ctx, way: str, live: list[duplex.DuplexSession], chunks: list[duplex.DuplexChunk], frame: Any
):
    """One step; returns ``(audio ms of the step, per-chunk latencies, outputs)``."""
    batch, _ = _modules()
    model = ctx.model
    if frame is not None:
        for _ in live:
            duplex.encode_frame(model, frame)
    if way == "batched":
        calls = [lambda s=s, c=c: s.encode(model, c) for s, c in zip(live, chunks, strict=True)]
        ms, outs = ctx.timer.timed(lambda: batch.run_batched(model, calls))
        return ms, [ms] * len(live), outs
    times, outs = [], []
    for s, c in zip(live, chunks, strict=True):
        ms, out = ctx.timer.timed(lambda s=s, c=c: s.encode(model, c))
        times.append(ms)
        outs.append(out)
    return sum(times), times, outs


def _sessions_row(ctx: Ctx, n: int, frame: Any) -> dict[str, Any]:
    steps, warmup = STEPS[ctx.mode], WARMUP_STEPS[ctx.mode]
    streams = _streams(ctx, n, steps + warmup)
    row: dict[str, Any] = {"step_ms": {}, "chunk_ms": {}, "step_ms_summary": {}, "startup": {}}
    outs: dict[str, list[list[torch.Tensor]]] = {}
    for way in WAYS:
        # the CPU dry run captures lazily here (a start-up walk of 30 chunks costs a minute there)
        report = _wire(ctx, way, n, startup=not ctx.cpu)
        if report is not None:
            row["startup"][way] = {"graphs": report.graphs, "bytes": report.total_bytes, "s": report.seconds}
        live = [duplex.DuplexSession() for _ in range(n)]
        step_times, chunk_times, way_outs = [], [], []
        for t in range(steps + warmup):
            frame_t = frame if t % FRAME_EVERY == 0 else None
            ms, latencies, step_outs = _run_step(ctx, way, live, [s[t] for s in streams], frame_t)
            if t >= warmup:
                step_times.append(ms)
                chunk_times += latencies
                way_outs.append(step_outs)
        row["step_ms"][way] = summary(step_times)["median"]
        row["step_ms_summary"][way] = summary(step_times)
        row["chunk_ms"][way] = summary(chunk_times)
        outs[way] = way_outs
        if way == "batched":
            encoder = ctx.model._duplex_batch
            row["batch_stats"] = encoder.stats()
            name, reason = encoder.attention_choice(ctx.device)
            row["attention"] = {"name": name, "reason": reason}
    row["parity"] = _parity(ctx, n, outs)
    standalone.wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    release_memory()
    return row


def _parity(ctx: Ctx, n: int, outs: dict[str, list[list[torch.Tensor]]]) -> dict[str, Any]:
    """per_session bitwise equal to eager; batched within GRAPH_REL_TOL (worst relative difference)."""
    tol = graph_rel_tol(ctx.dtype)
    pairs = [
        (e, p, b)
        for se, sp, sb in zip(outs["eager"], outs["per_session"], outs["batched"])
        for e, p, b in zip(se, sp, sb)
    ]
    per_session_bitwise = all(torch.equal(e, p) for e, p, _ in pairs)
    worst = max((rel_diff(e, b) for e, _, b in pairs), default=0.0)
    if not per_session_bitwise:
        ctx.problems.append(f"duplex_concurrency: {n} sessions, per-session graphs differ from eager")
    if worst > tol:
        ctx.problems.append(f"duplex_concurrency: {n} sessions, batched rel diff {worst:.3e} > {tol:.3e}")
    return {
        "per_session_bitwise": per_session_bitwise,
        "batched_worst_rel": worst,
        "batched_bitwise": all(torch.equal(e, b) for e, _, b in pairs),
        "tolerance": tol,
    }


def _first_session(ctx: Ctx, way: str, startup: bool) -> dict[str, Any]:
    """A fresh wiring (start-up capture or not), then one session's chunks, each timed."""
    batch, _ = _modules()
    report = _wire(
        ctx, way, 4, startup=startup
    )  # a deployment of duplex_max_sessions 4 (vllm-omni's default)
    chunks = _streams(ctx, 1, FIRST_SESSION_CHUNKS[ctx.mode])[0]
    session, times = duplex.DuplexSession(), []
    for chunk in chunks:
        if way == "batched":
            ms, _ = ctx.timer.timed(
                lambda c=chunk: batch.run_batched(ctx.model, [lambda: session.encode(ctx.model, c)])
            )
        else:
            ms, _ = ctx.timer.timed(lambda c=chunk: session.encode(ctx.model, c))
        times.append(ms)
    standalone.wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    release_memory()
    s = summary(times)
    out = {"max_ms": max(times), "p90_ms": s["p90"], "median_ms": s["median"], "chunks": len(times)}
    if report is not None and report.num_graphs:  # start-up capture ran
        out["startup"] = {"graphs": report.graphs, "bytes": report.total_bytes, "s": report.seconds}
    return out


HOST_CALLS = {"full": 20, "quick": 10, "cpu": 2}


def _host_ms(ctx: Ctx, call: Any) -> float:
    """Median host time of ``call()`` (ms) from an idle device: how long the call keeps the host,
    not the GPU; a call that reads a device value waits for the GPU and shows its span here."""
    times = []
    for _ in range(HOST_CALLS[ctx.mode]):
        ctx.timer.sync()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    ctx.timer.sync()
    return summary(times)["median"]


MISS_COUNTERS = ("ineligible_misses", "capacity_misses", "warmup_misses", "memory_misses")


def _graph_counts(adapter: Any) -> dict[str, int]:
    """An adapter's hit and miss counters (all 0 when it is off)."""
    keys = ("graph_hits", "graph_misses", *MISS_COUNTERS)
    stats = adapter.get_cumulative_stats() if adapter is not None else {}
    return {key: stats.get(key, 0) for key in keys}


def _host_row(ctx: Ctx, name: str, call: Any, adapter: Any) -> dict[str, Any]:
    """Host ms of ``call`` and whether every timed call replayed: ``replays`` and ``eager`` count
    the adapter's hits and misses over the timed calls, ``bypassed`` the calls that never reached
    the adapter (the model's own eager path). Host time of a call that did not replay measures
    the eager path, so any eager or bypassed call is a problem of the run."""
    before = _graph_counts(adapter())
    ms = _host_ms(ctx, call)
    delta = {key: value - before[key] for key, value in _graph_counts(adapter()).items()}
    calls = HOST_CALLS[ctx.mode]
    replays, eager = delta["graph_hits"], delta["graph_misses"]
    row = {"ms": ms, "calls": calls, "replays": replays, "eager": eager, "bypassed": calls - replays - eager}
    row["misses"] = {key: delta[key] for key in MISS_COUNTERS if delta[key]}
    if replays != calls:
        ctx.problems.append(
            f"duplex_concurrency: host time of {name}: {replays} of {calls} calls replayed "
            f"({eager} eager through the adapter {row['misses']}, {row['bypassed']} bypassed it)"
        )
    return row


def _host_times(ctx: Ctx) -> dict[str, Any]:
    """Host ms of the replaying stateless 1 s audio call (lengths on the host, as vLLM passes them),
    of a replaying duplex chunk (data built beforehand, as the stage moves its batch to the device
    before the call) and of a batched step of 4 sessions, each with the replays it made
    (:func:`_host_row`)."""
    batch, startup_capture = _modules()
    config = duplex_vllm_config(ctx.vllm_config, 4)
    release_memory()
    standalone.wire_encoder_graphs(
        ctx.model,
        config,
        enabled=True,
        backend=ctx.backend,
        admission="count",
        duplex_batch=True,
        startup_capture=True,  # explicit, as in _wire: the timed chunks must find their graphs
    )
    startup_capture.capture_at_startup(ctx.model, config)
    model = ctx.model
    clip = audio_data(ctx, duplex.CHUNK_FRAMES)
    for _ in range(3):  # warmup, capture, replay
        model.get_audio_hidden_states(clip)
    chunks = _streams(ctx, 4, 2)
    data = [[(c.data, c.prefix_extra_frames) for c in s] for s in chunks]
    sessions = [duplex.DuplexSession() for _ in range(4)]

    def chunk(session: duplex.DuplexSession, item: tuple[dict, int]) -> None:
        """``item`` at the session's past length, which grows by a chunk call after call (the
        cache is updated in place); start-up capture took a graph for every past length."""
        previous, model.audio_past_key_values = model.audio_past_key_values, session.cache
        try:
            model.get_audio_embedding_streaming(
                item[0], use_extra_context=True, prefix_extra_frames=item[1], suffix_extra_frames=2
            )
        finally:
            model.audio_past_key_values = previous

    for s, c in zip(sessions, chunks, strict=True):  # each session's first chunk; then its second, repeatedly
        s.encode(model, c[0])
    out = {
        "audio_1s_call": _host_row(
            ctx,
            "the 1 s audio call",
            lambda: model.get_audio_hidden_states(clip),
            lambda: model._audio_encoder_graph,
        ),
        "duplex_chunk": _host_row(
            ctx,
            "a duplex chunk",
            lambda: chunk(sessions[0], data[0][1]),
            lambda: model._streaming_audio_encoder_graph,
        ),
        "batched_step_4": _host_row(
            ctx,
            "a batched step of 4 sessions",
            lambda: batch.run_batched(
                model, [lambda s=s, d=d[1]: chunk(s, d) for s, d in zip(sessions, data)]
            ),
            lambda: model._duplex_batch.graph,
        ),
    }
    standalone.wire_encoder_graphs(model, ctx.vllm_config, enabled=False)
    release_memory()
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    frame = _frame(ctx)
    rows = {}
    for n in SESSIONS[ctx.mode]:
        log(f"duplex_concurrency: {n} session(s) ...")
        rows[str(n)] = _sessions_row(ctx, n, frame)
    log("duplex_concurrency: the first session after a fresh start-up ...")
    # the default path (per-session replays) first; the batched path's only on a GPU (the dry run
    # walks start-up capture once)
    first = {"per_session": _first_session(ctx, "per_session", startup=True)}
    if not ctx.cpu:
        first["batched"] = _first_session(ctx, "batched", startup=True)
    first["per_session_lazy"] = _first_session(ctx, "per_session", startup=False)
    log("duplex_concurrency: host time of the replaying calls ...")
    host = _host_times(ctx)
    return {
        "sessions": {n: {"step_ms": row["step_ms"]} for n, row in rows.items()},
        # the default path's (per_session); the batched path's under detail.first_session
        "first_session": {"max_ms": first["per_session"]["max_ms"], "p90_ms": first["per_session"]["p90_ms"]},
        "detail": {
            "attention": next(iter(rows.values()))["attention"],
            "rows": rows,
            "first_session": first,
            "host_ms": {name: row["ms"] for name, row in host.items()},
            "host_calls": {name: {k: v for k, v in row.items() if k != "ms"} for name, row in host.items()},
            "steps": STEPS[ctx.mode],
            "frame_every": FRAME_EVERY,
        },
    }


def missed_targets(s: dict[str, Any]) -> list[str]:
    """The issue's targets this run misses (sessions rows that were run)."""
    missed, sessions = [], s["sessions"]
    for n, key in (("8", "duplex_batch_8_step_ms"), ("32", "duplex_batch_32_step_ms")):
        if n in sessions and sessions[n]["step_ms"]["batched"] > TARGETS[key]:
            missed.append(
                f"{n} sessions batched {sessions[n]['step_ms']['batched']:.2f} ms > {TARGETS[key]:g} ms"
            )
    single = s["detail"]["rows"].get("1", {}).get("chunk_ms", {}).get("per_session", {}).get("median")
    if single is not None and single > TARGETS["duplex_sessions_1_chunk_ms"]:
        missed.append(f"1 session {single:.2f} ms per chunk > {TARGETS['duplex_sessions_1_chunk_ms']:g} ms")
    for call in ("audio_1s_call", "duplex_chunk"):
        host = s["detail"].get("host_ms", {}).get(call)
        if host is not None and host > TARGETS["audio_call_host_ms"]:
            missed.append(f"{call} host time {host:.3f} ms > {TARGETS['audio_call_host_ms']:g} ms")
    if s["first_session"]["max_ms"] > TARGETS["duplex_first_session_max_ms"]:
        missed.append(
            f"first session worst chunk {s['first_session']['max_ms']:.2f} ms > "
            f"{TARGETS['duplex_first_session_max_ms']:g} ms"
        )
    return missed


def format_section(s: dict[str, Any]) -> list[str]:
    detail = s["detail"]
    lines = [
        (
            f"\n-- duplex concurrency: N sessions sharing steps; per step each a 1 s chunk (a camera frame every "
            f"{detail['frame_every']}th step), {detail['steps']} timed steps; audio encoder ms per step (median)"
        ),
        f"{'sessions':>8s}{'eager':>10s}{'per-session':>13s}{'batched':>10s}{'x vs per-s.':>12s}"
        f"{'chunk ms (p-s / b)':>22s}{'batched rel diff':>18s}",
    ]
    attention = detail.get("attention")  # (a result written before the attention was recorded has none)
    if attention:
        lines.insert(1, f"batched steps' attention: {attention['name']} ({attention['reason']})")
    for n, row in detail["rows"].items():
        st, ch, par = row["step_ms"], row["chunk_ms"], row["parity"]
        ratio = st["per_session"] / st["batched"] if st["batched"] else float("nan")
        lines.append(
            f"{n:>8s}{st['eager']:10.2f}{st['per_session']:13.2f}{st['batched']:10.2f}{ratio:12.2f}"
            f"{ch['per_session']['median']:11.2f} / {ch['batched']['median']:8.2f}{par['batched_worst_rel']:18.2e}"
        )
    for way, f in detail["first_session"].items():
        start = f.get("startup")
        startup = (
            f"; start-up capture {sum(start['graphs'].values())} graphs {start['graphs']}, {mib(start['bytes'])} MiB, "
            f"{start['s']:.2f} s"
            if start
            else "; no start-up capture"
        )
        lines.append(
            f"first session after start-up ({way}): worst chunk {f['max_ms']:.2f} ms, p90 {f['p90_ms']:.2f} ms, "
            f"median {f['median_ms']:.2f} ms over {f['chunks']} chunks{startup}"
        )
    host, calls = detail.get("host_ms"), detail.get("host_calls", {})

    def replayed(name: str) -> str:
        c = calls.get(name)  # (a result written before the replays were counted has none)
        return f" ({c['replays']}/{c['calls']} replayed)" if c else ""

    if host:
        lines.append(
            "host ms of a replaying call (device idle before it): "
            + ", ".join(f"{name} {ms:.3f}{replayed(name)}" for name, ms in host.items())
        )
    missed = missed_targets(s)
    lines.append("targets: " + ("all MET" if not missed else "MISSED: " + "; ".join(missed)))
    return lines
