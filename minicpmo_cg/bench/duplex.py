"""Scenario ``duplex``: what a duplex session encodes, eager vs graphed in one run."""

from __future__ import annotations

from typing import Any

import torch

from minicpmo_cg import duplex, standalone
from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import TARGETS, Ctx, log
from minicpmo_cg.bench.kernels import format_kernels, fused_layers, kernel_profile, layers_label
from minicpmo_cg.bench.memory import graph_memory, mem_state, mib, release_memory
from minicpmo_cg.measure import summary

DUPLEX_SECONDS = {"full": 120, "quick": 60, "cpu": 30}
WARMUP_CHUNKS = 4
#: chunks of the fused-vs-unfused comparison (one past length each), by mode
LAYERS_CHUNKS = {"full": 12, "quick": 8, "cpu": 3}


def _frames(ctx: Ctx, seconds: int) -> tuple[list[dict], str]:
    """One camera frame per second as the duplex stage passes it, and where they come from: a real
    448x448 frame through the slicer (one 32x32 slice) with a little noise per second (CPU dry run:
    random 4x4-patch slices)."""
    if ctx.cpu:
        pixels = [[torch.rand((3, 14, 16 * 14), generator=ctx.rng) * 2 - 1] for _ in range(seconds)]
        tgt = torch.tensor([[4, 4]])
        source = f"{seconds} random one-slice frames of 4x4 patches (CPU dry run)"
    else:
        pv, tgt = mi.process_images(mi.make_image_processor(), [mi.duplex_frame()])
        if len(pv) != 1:
            raise RuntimeError(f"duplex frame sliced into {len(pv)} slices (expected 1)")
        noise = [torch.randn(pv[0].shape, generator=ctx.rng) * 0.02 for _ in range(seconds)]
        pixels = [[(pv[0] + n).clamp(-1, 1)] for n in noise]
        source = f"{seconds} camera frames (448x448 coffee crop + noise, one 32x32 slice)"
    frames = [duplex.stage_frame_data(p, tgt, device=ctx.device, dtype=ctx.dtype) for p in pixels]
    return frames, f"{source}, int64 tgt_sizes, under torch.no_grad"


def _session(ctx: Ctx, chunks: list[duplex.DuplexChunk], frames: list[dict] | None = None) -> dict:
    """Encode ``chunks`` in one new session, each after its second's frame when ``frames`` are given;
    per-chunk and per-frame ms, outputs and the session cache's peak bytes."""
    session = duplex.DuplexSession()
    times, outs, peak, frame_ms, frame_outs = [], [], 0, [], []
    for i, chunk in enumerate(chunks):
        if frames is not None:
            ms, out = ctx.timer.timed(lambda frame=frames[i]: duplex.encode_frame(ctx.model, frame))
            frame_ms.append(ms)
            frame_outs.append(out)
        ms, out = ctx.timer.timed(lambda chunk=chunk: session.encode(ctx.model, chunk))
        times.append(ms)
        outs.append(out)
        peak = max(peak, duplex.cache_bytes(session.cache))
    session.close()
    return {
        "ms": times,
        "outs": outs,
        "cache_peak_bytes": peak,
        "frame_ms": frame_ms,
        "frame_outs": frame_outs,
    }


def _interleaved(ctx: Ctx, runs: list[list[duplex.DuplexChunk]]) -> dict:
    """Sessions encoded alternately, chunk by chunk; per-chunk ms over all and outputs per session."""
    sessions = [duplex.DuplexSession() for _ in runs]
    outs: list[list[torch.Tensor]] = [[] for _ in runs]
    times = []
    for i in range(max(len(r) for r in runs)):
        for k, chunks in enumerate(runs):
            if i < len(chunks):
                ms, out = ctx.timer.timed(lambda k=k, c=chunks[i]: sessions[k].encode(ctx.model, c))
                times.append(ms)
                outs[k].append(out)
    for session in sessions:
        session.close()
    return {"ms": times, "outs": outs}


def _mismatches(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[tuple[int, float]]:
    """``(chunk, max|diff|)`` of the chunks that are not bitwise equal."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape or not torch.equal(g, w):
            diff = float((g.float() - w.float()).abs().max()) if g.shape == w.shape else float("nan")
            bad.append((i, diff))
    return bad


def _timing(times: list[float]) -> dict[str, Any]:
    return {**summary(times), "max": max(times), "session_ms": sum(times)}


def _session_ms(run: dict) -> float:
    """The session's encoder time: its frames and its chunks."""
    return sum(run["ms"]) + sum(run["frame_ms"])


def _memory(ctx: Ctx, adapter: Any, seconds: int, reserved_delta: int) -> dict[str, Any]:
    """Graph memory in total: the K/V pages, the graphs' static buffers and pool."""
    mem = graph_memory([adapter])
    pool = ctx.model._streaming_audio._pool
    pages = 0 if pool is None else pool.nbytes
    apm = ctx.model.apm
    per_position = len(apm.layers) * 2 * apm.config.d_model * apm.conv1.weight.element_size()
    return {
        **mem,
        "pages_bytes": pages,
        "total_bytes": pages + mem["static_bytes"] + (mem["pool_bytes"] or 0),
        "reserved_delta_bytes": reserved_delta,
        "kv_bytes_per_position": per_position,
    }


def _two_sessions(ctx: Ctx) -> Any:
    """The run's config as a duplex deployment of two sessions (the interleaved run's K/V pages)."""
    from minicpmo_cg.vllm_config import duplex_vllm_config

    return duplex_vllm_config(ctx.vllm_config, 2)


def _graphed(
    ctx: Ctx, main: list[duplex.DuplexChunk], other: list[duplex.DuplexChunk], frames: list[dict]
) -> dict:
    """Cold session, the next session's first chunk, warm session, two interleaved sessions."""
    model = ctx.model
    release_memory()
    before = mem_state()
    standalone.wire_encoder_graphs(model, _two_sessions(ctx), enabled=True, backend=ctx.backend)
    adapter = standalone.streaming_audio_graph(model)
    vision = standalone.vision_graph(model)
    if adapter is None or vision is None:
        raise RuntimeError(
            "the patched model built no streaming audio or vision adapter (vllm-omni patches 0006, 0005?)"
        )
    try:
        log("duplex: graphed cold session ...")
        cold = _session(ctx, main, frames)
        # the next session's first chunk: the first-chunk form is captured at its second sighting
        cold["next_first_ms"] = _session(ctx, main[:1])["ms"][0]
        after = mem_state()
        log("duplex: graphed warm session ...")
        warm = _session(ctx, main, frames)
        half = len(other)
        log(f"duplex: two interleaved sessions of {half} chunks ...")
        inter = _interleaved(ctx, [main[:half], other])
        stats = adapter.get_cumulative_stats()
        memory = _memory(ctx, adapter, len(main), after["reserved"] - before["reserved"])
        cap, admission = adapter.options.max_graphs, adapter.get_detailed_stats()["admission"]
        vision_stats = {**vision.get_cumulative_stats(), **vision.get_detailed_stats()}
    finally:
        standalone.wire_encoder_graphs(model, _two_sessions(ctx), enabled=False)  # drop the graphs
        release_memory()
    return {
        "cold": cold,
        "warm": warm,
        "interleaved": inter,
        "stats": stats,
        "memory": memory,
        "cap": cap,
        "admission": admission,
        "vision": vision_stats,
    }


def _eager(
    ctx: Ctx, main: list[duplex.DuplexChunk], other: list[duplex.DuplexChunk], frames: list[dict]
) -> dict:
    standalone.wire_encoder_graphs(ctx.model, _two_sessions(ctx), enabled=False)
    _session(ctx, main[:WARMUP_CHUNKS], frames)  # lazy setup out of the timed session
    log("duplex: eager session ...")
    eager = _session(ctx, main, frames)
    eager["other_outs"] = _session(ctx, other)["outs"]
    return eager


def _checks(ctx: Ctx, eager: dict, graphed: dict) -> dict[str, bool]:
    half = len(eager["other_outs"])
    pairs = {
        "cold": (graphed["cold"]["outs"], eager["outs"]),
        "warm": (graphed["warm"]["outs"], eager["outs"]),
        "interleaved_a": (graphed["interleaved"]["outs"][0], eager["outs"][:half]),
        "interleaved_b": (graphed["interleaved"]["outs"][1], eager["other_outs"]),
        "frames_cold": (graphed["cold"]["frame_outs"], eager["frame_outs"]),
        "frames_warm": (graphed["warm"]["frame_outs"], eager["frame_outs"]),
    }
    bitwise = {}
    for name, (got, want) in pairs.items():
        bad = _mismatches(got, want)
        bitwise[name] = not bad
        if bad:
            ctx.problems.append(f"duplex: {name} session differs from eager at (chunk, max|diff|) {bad[:5]}")
    return bitwise


def _layers_run(ctx: Ctx, chunks: list[duplex.DuplexChunk], profile: bool) -> dict[str, Any]:
    """``chunks`` eagerly, then graphed with fresh adapters (a session to see each past length, one to
    capture it, a warm one to time): warm times, bitwise check, optionally the warm session's kernels."""
    model = ctx.model
    standalone.wire_encoder_graphs(model, _two_sessions(ctx), enabled=False)
    eager = _session(ctx, chunks)
    release_memory()
    standalone.wire_encoder_graphs(model, _two_sessions(ctx), enabled=True, backend=ctx.backend)
    try:
        for _ in range(2):
            _session(ctx, chunks)
        warm = _session(ctx, chunks)
        result: dict[str, Any] = {
            "graphed_warm": _timing(warm["ms"]),
            "eager": _timing(eager["ms"]),
            "bitwise": not _mismatches(warm["outs"], eager["outs"]),
        }
        if profile:
            kernels = kernel_profile(ctx, lambda: _session(ctx, chunks), calls=1)
            for row in kernels["kernels"]:
                row["us"] /= len(chunks)
                row["count"] /= len(chunks)
            kernels["total_us"] /= len(chunks)
            kernels["per"] = f"chunk (mean of a warm session of {len(chunks)})"
            result["kernels"] = kernels
    finally:
        standalone.wire_encoder_graphs(model, _two_sessions(ctx), enabled=False)
        release_memory()
    return result


def layers_comparison(ctx: Ctx, main: list[duplex.DuplexChunk]) -> dict[str, Any]:
    """Graphed warm chunks with Whisper's fused layers and without them, on the session's first
    :data:`LAYERS_CHUNKS` chunks; an empty dict where the model has no fused Whisper layers."""
    if layers_label(ctx.model, "apm") != "fused":
        return {}
    chunks = main[: LAYERS_CHUNKS[ctx.mode]]
    out = {}
    for label, on in (("fused", True), ("unfused", False)):
        log(f"duplex: {len(chunks)} chunks, {label} layers, eager and graphed ...")
        with fused_layers(ctx.model, on):
            out[label] = _layers_run(ctx, chunks, profile=on)
        if not out[label]["bitwise"]:
            ctx.problems.append(f"duplex: graphed chunks with {label} layers differ from their eager session")
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    seconds = DUPLEX_SECONDS[ctx.mode]
    dtype = torch.float32  # the duplex stage feeds the processor's float32 mel; the encoder casts it
    mel = duplex.speech_mel(seconds + seconds // 2)
    main = duplex.frame_chunks(
        mel[:, : seconds * duplex.CHUNK_FRAMES + 2], seconds, device=ctx.device, dtype=dtype
    )
    other = duplex.frame_chunks(
        mel[:, seconds * duplex.CHUNK_FRAMES :], seconds // 2, device=ctx.device, dtype=dtype
    )
    frames, frames_source = _frames(ctx, seconds)
    eager = _eager(ctx, main, other, frames)
    graphed = _graphed(ctx, main, other, frames)
    bitwise = _checks(ctx, eager, graphed)
    layers = layers_comparison(ctx, main)
    e, w = _timing(eager["ms"]), _timing(graphed["warm"]["ms"])
    session = {
        "eager": _session_ms(eager),
        "warm": _session_ms(graphed["warm"]),
        "cold": _session_ms(graphed["cold"]),
    }
    return {
        "seconds": seconds,
        "resets_before_chunks": [i for i, past in enumerate(duplex.past_lengths(seconds)) if i and past == 0],
        "source": f"shipped voices, {seconds} x 1 s chunks (+ {seconds // 2} for the second session)",
        "frames": frames_source,
        "eager": e,
        "graphed_warm": w,
        "graphed_cold": _timing(graphed["cold"]["ms"]),
        "graphed_interleaved": _timing(graphed["interleaved"]["ms"]),
        "frame_eager": _timing(eager["frame_ms"]),
        "frame_graphed_warm": _timing(graphed["warm"]["frame_ms"]),
        "frame_graphed_cold": _timing(graphed["cold"]["frame_ms"]),
        "session_ms": session,
        "session_speedup": session["eager"] / session["warm"] if session["warm"] else None,
        "cold_session_speedup": session["eager"] / session["cold"],
        "audio_session_speedup": e["session_ms"] / w["session_ms"] if w["session_ms"] else None,
        "next_session_first_chunk_ms": graphed["cold"]["next_first_ms"],
        "median_speedup": e["median"] / w["median"] if w["median"] else None,
        "stats": graphed["stats"],
        "cap": graphed["cap"],
        "admission": graphed["admission"],
        "vision": graphed["vision"],
        "memory": graphed["memory"],
        "session_cache_peak_bytes": {
            "eager": eager["cache_peak_bytes"],
            "graphed": graphed["warm"]["cache_peak_bytes"],
        },
        "bitwise": bitwise,
        "layers": layers,
    }


def _row(label: str, t: dict[str, Any], note: str = "") -> str:
    return f"{label:26s}{t['median']:8.2f}{t['p90']:8.2f}{t['max']:8.2f}{t['session_ms']:12.1f}" + (
        f"  {note}" if note else ""
    )


def _frame_lines(s: dict[str, Any]) -> list[str]:
    vs = s["vision"]
    return [
        f"camera frames: {s['frames']}; ms per frame at the call site (get_vision_hidden_states)",
        _row("frame eager", s["frame_eager"]),
        _row("frame graphed (warm)", s["frame_graphed_warm"]),
        _row("frame graphed (cold)", s["frame_graphed_cold"], "warmups + capture"),
        (
            f"vision graphs {vs['num_graphs']} (admission {vs['admission']}), hits {vs['graph_hits']}, misses: "
            f"warmup {vs['warmup_misses']} declined {vs['declined_misses']}; {mib(vs['graph_bytes'])} MiB"
        ),
    ]


def format_section(s: dict[str, Any]) -> list[str]:
    mem, st, peak, total = s["memory"], s["stats"], s["session_cache_peak_bytes"], s["session_ms"]
    lines = [
        (
            f"\n-- duplex session: a frame and a 1 s chunk a second; audio: get_audio_embedding_streaming, "
            f"{s['source']}; cache resets before chunks {s['resets_before_chunks']}; ms per chunk at the call site"
        ),
        f"{'path':26s}{'median':>8s}{'p90':>8s}{'max':>8s}{'session ms':>12s}",
        _row("eager", s["eager"]),
        _row("graphed (warm session)", s["graphed_warm"], f"x{s['audio_session_speedup']:.2f} chunks"),
        _row(
            "graphed (cold session)",
            s["graphed_cold"],
            f"warmups + captures; the next session's first chunk "
            f"{s['next_session_first_chunk_ms']:.2f} ms (captures its form)",
        ),
        _row("graphed (2 interleaved)", s["graphed_interleaved"], "both sessions' chunks"),
        (
            f"graphs {st['num_graphs']} (cap {s['cap']}, admission {s['admission']}), hits {st['graph_hits']}, "
            f"misses: warmup {st['warmup_misses']} capacity {st['capacity_misses']} memory {st['memory_misses']} "
            f"ineligible {st['ineligible_misses']}"
        ),
        *_frame_lines(s),
        (
            f"session encoder time (frames + chunks): eager {total['eager']:.1f} ms, graphed warm "
            f"{total['warm']:.1f} ms (x{s['session_speedup']:.2f}), cold {total['cold']:.1f} ms "
            f"(x{s['cold_session_speedup']:.2f})"
        ),
        (
            f"audio graph memory in total {mib(mem['total_bytes'])} MiB: K/V pages {mib(mem['pages_bytes'])} "
            f"+ static buffers {mib(mem['static_bytes'])} + pool {mib(mem['pool_bytes'])} (reserved +"
            f"{mib(mem['reserved_delta_bytes'])} over the cold session, frames' graph included)"
        ),
        (
            f"per session: own KV cache peak {mib(peak['graphed'])} MiB graphed vs {mib(peak['eager'])} MiB "
            f"eager (+{mib(peak['graphed'] - peak['eager'])} MiB of graph memory per session)"
        ),
        "bitwise vs eager: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in s["bitwise"].items()),
    ]
    layers = s.get("layers") or {}
    for label in ("fused", "unfused"):
        if label in layers:
            run = layers[label]
            lines.append(
                _row(
                    f"{label} layers, warm",
                    run["graphed_warm"],
                    f"eager {run['eager']['median']:.2f} ms; bitwise {'yes' if run['bitwise'] else 'NO'}",
                )
            )
    lines += format_kernels("duplex chunk, graphed, fused layers", layers.get("fused", {}).get("kernels"))
    goal_ms, goal_x = TARGETS["duplex_chunk_ms"], TARGETS["duplex_session_speedup"]
    med, speedup = s["graphed_warm"]["median"], s["session_speedup"] or 0.0
    lines.append(
        f"targets: graphed median <= {goal_ms:g} ms per 1 s chunk: {'MET' if med <= goal_ms else 'MISSED'} "
        f"({med:.2f}); session encoder time (frames + chunks) >= {goal_x:g}x lower: "
        f"{'MET' if speedup >= goal_x else 'MISSED'} (x{speedup:.2f})"
    )
    return lines
