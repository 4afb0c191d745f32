"""Scenario ``streaming``: a duplex-style session, one 448x448 frame and one 1 s speech chunk per
second, eager vs graphed through the patched call sites (captures are paid inside the session)."""

from __future__ import annotations

from typing import Any

import torch

from minicpmo_cg import inputs as mi
from minicpmo_cg.bench.context import Ctx, audio_data, vision_data
from minicpmo_cg.bench.session import Events, format_sessions, run_session, warm_call_sites

STREAM_SECONDS = {"full": 120, "quick": 30, "cpu": 6}


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
            lens = [torch.tensor([mel.shape[-1]], dtype=torch.int64, device=ctx.device)]
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


def run(ctx: Ctx) -> dict[str, Any]:
    seconds = STREAM_SECONDS[ctx.mode]
    events, source = _events(ctx, seconds)
    warm_call_sites(ctx, events)
    eager = run_session(ctx, events, graphed=False)
    graphed = run_session(ctx, events, graphed=True)
    return {
        "seconds": seconds,
        "events": len(events),
        "source": source,
        "eager": eager,
        "graphed": graphed,
        "speedup": eager["encoder_ms_total"] / graphed["encoder_ms_total"]
        if graphed["encoder_ms_total"]
        else None,
    }


def format_section(s: dict[str, Any]) -> list[str]:
    return format_sessions("streaming session", f"{s['seconds']} s simulated, {s['events']} calls", s)
