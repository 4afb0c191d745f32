"""Scenario ``streaming``: a duplex-style session, one 448x448 frame and one 1 s speech chunk per
second, eager vs graphed with ``admission="count"`` and ``"cost"`` side by side through the patched
call sites (captures are paid inside the session)."""

from __future__ import annotations

from typing import Any

import torch

from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import TARGETS, Ctx, audio_data, vision_data
from minicpmo_cg.bench.session import Events, compare_admissions, format_sessions, verdict

STREAM_SECONDS = {"full": 120, "quick": 30, "cpu": 6}
#: The session's first seconds, left out of the hit rate after warm-up (each shape's first sightings
#: and captures happen here).
WARMUP_SECONDS = {"full": 10, "quick": 10, "cpu": 2}


def _frames(ctx: Ctx, seconds: int) -> list[dict[str, Any]]:
    """One real 448x448 frame through the slicer (1 slice of 32x32), plus noise per second."""
    pv, tgt = mi.process_images(mi.make_image_processor(), [mi.duplex_frame()])
    if len(pv) != 1:
        raise RuntimeError(f"duplex frame sliced into {len(pv)} slices (expected 1)")
    base = pv[0]
    frames = []
    for _ in range(seconds):
        noise = torch.randn(base.shape, generator=ctx.rng) * 0.02
        frames.append(
            {
                "pixel_values": [(base + noise).clamp(-1, 1).to(ctx.device, ctx.dtype)],
                "tgt_sizes": tgt.to(ctx.device),
            }
        )
    return frames


def _speech_chunks(ctx: Ctx) -> list[dict[str, Any]]:
    """The shipped voices cut into 1 s chunks (100 mel frames each)."""
    extractor = mi.make_feature_extractor()
    chunks = []
    for stem in ("default_female", "default_male"):
        wav = mi.load_wav_16k(mi.voice_file(stem))
        for s in range(int(len(wav) // mi.SAMPLING_RATE)):
            mel = mi.mel_features(extractor, wav[s * mi.SAMPLING_RATE : (s + 1) * mi.SAMPLING_RATE])
            lens = [torch.tensor([mel.shape[-1]], dtype=torch.int64)]  # on the host, as vLLM passes it
            chunks.append({"audio_features": mel[None].to(ctx.device, ctx.dtype), "audio_feature_lens": lens})
    return chunks


def _events(ctx: Ctx, seconds: int) -> tuple[Events, str]:
    if ctx.cpu:
        frames = [vision_data(ctx, [(4, 4)]) for _ in range(seconds)]
        chunks = [audio_data(ctx, 20) for _ in range(4)]
        source = "random 4x4-patch frames, random 0.2 s mel chunks (CPU dry run)"
    else:
        frames, chunks = _frames(ctx, seconds), _speech_chunks(ctx)
        source = (
            "1 frame/s: skimage coffee 448x448 crop + noise; "
            f"1 s chunks of the shipped voices ({len(chunks)} distinct)"
        )
    events: Events = []
    for t in range(seconds):
        events.append(("vision", frames[t]))
        events.append(("audio", chunks[t % len(chunks)]))
    return events, source


def targets(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue targets of the session: ``cost`` hits >= 99% of calls after warm-up, and its speedup
    is no worse than ``count``'s (within the run-to-run noise allowed by ``TARGETS``)."""
    cost, count = runs["cost"], runs["count"]
    goal, noise = TARGETS["streaming_hit_rate_after_warmup"], TARGETS["streaming_cost_vs_count"]
    late = cost["hit_rate_after_warmup"]
    cost_x, count_x = cost["vs_eager"] or 0.0, count["vs_eager"] or 0.0
    return [
        verdict(
            f"admission=cost hit rate after warm-up >= {goal:.0%}",
            "-" if late is None else f"{late:.1%}",
            late is not None and late >= goal,
        ),
        verdict(
            f"admission=cost speedup >= admission=count's (x{noise:.2f} of it: run-to-run noise)",
            f"x{cost_x:.3f} vs x{count_x:.3f}",
            cost_x >= noise * count_x,
        ),
    ]


def run(ctx: Ctx) -> dict[str, Any]:
    seconds, warmup = STREAM_SECONDS[ctx.mode], WARMUP_SECONDS[ctx.mode]
    events, source = _events(ctx, seconds)
    runs = compare_admissions(ctx, events, warmup_events=2 * warmup)  # two calls per second
    return {
        "seconds": seconds,
        "warmup_seconds": warmup,
        "events": len(events),
        "source": source,
        "runs": runs,
        "targets": targets(runs),
    }


def format_section(s: dict[str, Any]) -> list[str]:
    extra = f"{s['seconds']} s simulated, {s['events']} calls, warm-up {s['warmup_seconds']} s"
    return format_sessions("streaming session", extra, s)
