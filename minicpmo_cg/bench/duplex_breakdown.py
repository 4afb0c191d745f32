"""Where a graphed duplex chunk's time goes: the ``duplex`` scenario's per-phase breakdown.

:func:`phases` encodes one more warm session (the timed sessions' chunks, all replays) with CUDA
events recorded on the call's stream at the boundaries of a chunk's phases:

=========  =====================================================================================
prep       call start -> the streaming adapter's entry: ``get_audio_embedding_streaming`` before
           the encoder (lengths, reset check, the session's copy into the arena if needed)
adapter    adapter entry -> graph launch: the graph key, vLLM's manager, the mel's copy in
replay     graph launch -> graph end: the captured encoder on the GPU
output     graph end -> adapter exit: the output's clone
after      adapter exit -> call end: the session's copy-out, output lengths and slicing
=========  =====================================================================================

Each chunk starts on an idle device (synchronised before, as :class:`minicpmo_cg.measure.Timer`
does), so until the graph launch the GPU waits for the host and those events time the host; the
rest is GPU time. Nothing synchronises inside a chunk; the events are read back after the session.
The replay time per chunk is also fitted against the chunk's past length (least squares): the
slope is what attending to (and concatenating) the cached positions costs.

:func:`attention` times what grows with the past on its own: one chunk's worth of attention (one
SDPA call per layer, 50 queries over ``total`` keys in Whisper's widths) with the all-zero mask the
eager call passes and as the graph runs it (``streaming_audio.ZeroMaskPlan``: mask dropped, SDPA's
kernel pinned),
and the per-layer concatenation of past and new keys and values, each captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minicpmo_cg import duplex

PHASES = ("prep", "adapter", "replay", "output", "after")
#: Totals (past + chunk positions) the attention table covers: the first, a middle and the last chunk.
ATTENTION_TOTALS = (50, 750, 1450)
ATTENTION_REPLAYS = 20


class _Recorder:
    """Per-chunk CUDA events at the phase boundaries (six per chunk), recorded by wrappers."""

    def __init__(self) -> None:
        self.chunks: list[list[Any]] = []
        self.current: list[Any] | None = None
        self.replays = 0

    def start(self) -> None:
        self.current = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        self.chunks.append(self.current)
        self.mark(0)

    def mark(self, boundary: int) -> None:
        if self.current is not None:
            self.current[boundary].record()


class _TimedAdapter:
    """Stands in for the streaming adapter: marks its entry and exit."""

    def __init__(self, adapter: Any, recorder: _Recorder) -> None:
        self.adapter, self.recorder = adapter, recorder

    def __call__(self, *inputs: Any) -> torch.Tensor:
        self.recorder.mark(1)
        out = self.adapter(*inputs)
        self.recorder.mark(4)
        return out


def _wrap_replays(adapter: Any, recorder: _Recorder) -> list[Any]:
    """Mark the launch and end of every captured graph's replay; returns the wrapped graphs."""
    from minicpmo_cg.bench.memory import graph_metas

    wrapped = []
    for manager in adapter.graphs.values():
        for meta in graph_metas(manager):
            graph, replay = meta.graph, meta.graph.replay

            def timed(replay: Callable[[], None] = replay) -> None:
                recorder.mark(2)
                replay()
                recorder.mark(3)
                recorder.replays += 1

            graph.replay = timed
            wrapped.append(graph)
    return wrapped


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs`` (slope 0 when ``xs`` are all equal)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def summarize(per_chunk: list[list[float]], pasts: Sequence[int]) -> dict[str, Any]:
    """Median and p90 per phase, the replay against the past length, from ``per_chunk[i][phase]`` (ms)."""
    from minicpmo_cg.measure import summary

    out: dict[str, Any] = {"chunks": len(per_chunk)}
    for k, name in enumerate(PHASES):
        s = summary([c[k] for c in per_chunk])
        out[name] = {"median": s["median"], "p90": s["p90"]}
    totals = [sum(c) for c in per_chunk]
    out["total"] = {"median": statistics.median(totals), "p90": summary(totals)["p90"]}
    replay = [c[PHASES.index("replay")] for c in per_chunk]
    intercept, slope = fit(pasts, replay)
    by_past = {
        p: statistics.median([r for r, q in zip(replay, pasts, strict=True) if q == p]) for p in set(pasts)
    }
    out["replay_vs_past"] = {
        "intercept_ms": intercept,
        "us_per_past_position": slope * 1e3,
        "at_past": {
            str(p): by_past[p] for p in (min(by_past), sorted(by_past)[len(by_past) // 2], max(by_past))
        },
    }
    return out


def phases(ctx: Any, model: Any, adapter: Any, chunks: list[duplex.DuplexChunk]) -> dict[str, Any] | None:
    """Phase breakdown of one warm session of ``chunks`` (graphs captured already); None on CPU."""
    if ctx.cpu:
        return None
    recorder = _Recorder()
    wrapped = _wrap_replays(adapter, recorder)
    model._streaming_audio_encoder_graph = _TimedAdapter(adapter, recorder)
    session = duplex.DuplexSession()
    try:
        for chunk in chunks:
            torch.cuda.synchronize()
            recorder.start()
            session.encode(model, chunk)
            recorder.mark(len(PHASES))
        recorder.current = None
        torch.cuda.synchronize()
    finally:
        model._streaming_audio_encoder_graph = adapter
        for graph in wrapped:
            del graph.replay
    if recorder.replays != len(chunks):  # a chunk ran eagerly: its boundaries 2 and 3 were never recorded
        ctx.problems.append(f"duplex breakdown: {recorder.replays} replays for {len(chunks)} chunks")
        return None
    per_chunk = [[ev[k].elapsed_time(ev[k + 1]) for k in range(len(PHASES))] for ev in recorder.chunks]
    return summarize(per_chunk, duplex.past_lengths(len(chunks)))


def _graph_ms(fn: Callable[[], None]) -> float:
    """Median ms of ``fn``'s GPU work, captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: kernel selection, workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(ATTENTION_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def attention(ctx: Any, model: Any) -> dict[str, Any] | None:
    """One chunk's attention and K/V concatenation at each of :data:`ATTENTION_TOTALS`; None on CPU
    or without vllm-omni patch 0006's ``streaming_audio.ZeroMaskPlan``."""
    streaming_audio = getattr(sys.modules[type(model).__module__], "streaming_audio", None)
    if ctx.cpu or streaming_audio is None:
        return None
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    apm, n = model.apm, duplex.CHUNK_POSITIONS
    heads, layers, dtype = apm.config.encoder_attention_heads, len(apm.layers), apm.conv1.weight.dtype
    head_dim = apm.config.d_model // heads
    g = torch.Generator(device=ctx.device).manual_seed(0)
    rows = []
    for total in ATTENTION_TOTALS:
        q = torch.randn(1, heads, n, head_dim, generator=g, device=ctx.device, dtype=dtype)
        k, v = torch.randn(2, 1, heads, total, head_dim, generator=g, device=ctx.device, dtype=dtype)
        mask = torch.zeros(1, 1, n, total, device=ctx.device, dtype=dtype)
        plan = streaming_audio.zero_mask_plan(
            apm.config._attn_implementation,
            lambda t=total: streaming_audio.eager_sdpa_choice(apm, ctx.device, n, t),
        )

        def masked(q=q, k=k, v=v, mask=mask) -> None:
            for _ in range(layers):
                sdpa(q, k, v, attn_mask=mask, scale=1.0)

        def planned(q=q, k=k, v=v, mask=mask, plan=plan) -> None:
            if not plan.drop_mask:
                return masked()
            pin = contextlib.nullcontext() if plan.sdpa_backend is None else sdpa_kernel(plan.sdpa_backend)
            with pin:
                for _ in range(layers):
                    sdpa(q, k, v, scale=1.0)

        past, new = k[:, :, : total - n].contiguous(), k[:, :, total - n :].contiguous()

        def concat(past=past, new=new) -> None:
            for _ in range(2 * layers):
                torch.cat([past, new], dim=-2)

        backend = getattr(plan.sdpa_backend, "name", None)
        rows.append(
            {
                "total": total,
                "masked_ms": _graph_ms(masked),
                "graph_ms": _graph_ms(planned),
                "concat_ms": _graph_ms(concat),
                "plan": "mask kept" if not plan.drop_mask else f"mask dropped, {backend or 'no pin'}",
            }
        )
    return {"layers": layers, "queries": n, "rows": rows}


def format_lines(phase: dict[str, Any] | None, attn: dict[str, Any] | None) -> list[str]:
    """The report's breakdown lines (none when neither part ran)."""
    lines = []
    if phase:
        cells = "  ".join(f"{p} {phase[p]['median']:.3f}/{phase[p]['p90']:.3f}" for p in PHASES)
        lines.append(
            f"breakdown per graphed chunk, ms median/p90 over {phase['chunks']} chunks of a warm session "
            f"(CUDA events): {cells}  = {phase['total']['median']:.3f}/{phase['total']['p90']:.3f}"
        )
        fit_ = phase["replay_vs_past"]
        at = ", ".join(f"{p}: {ms:.3f}" for p, ms in fit_["at_past"].items())
        lines.append(
            f"  replay vs past length: {fit_['intercept_ms']:.3f} ms + {fit_['us_per_past_position']:.3f} us "
            f"per past position (least squares); median ms at past {at}"
        )
    if attn:
        cells = "; ".join(
            f"{r['total']} keys: masked {r['masked_ms']:.3f}, as graphed {r['graph_ms']:.3f} ({r['plan']}), "
            f"K/V concat {r['concat_ms']:.3f}"
            for r in attn["rows"]
        )
        lines.append(
            f"  attention alone, {attn['layers']} layers x {attn['queries']} queries, ms per chunk "
            f"(CUDA graph): {cells}"
        )
    return lines
