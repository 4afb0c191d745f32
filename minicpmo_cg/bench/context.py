"""What every benchmark scenario uses: the run profile, the context and inputs recorded at the
model's call sites."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minicpmo_cg.measure import Timer, summary

ROTATE = 4  # distinct pre-made inputs per shape
TARGETS = {
    # Printed next to the values (not asserted; the exit status ignores them).
    # offline mix: eager encoder time / admission=cost's, captures included, at least
    "offline_cost_vs_eager": 1.0,
    # streaming session: admission=cost's hit rate after the warm-up seconds, at least
    "streaming_hit_rate_after_warmup": 0.99,
    # streaming session: admission=cost's speedup / admission=count's, at least (2% run-to-run noise)
    "streaming_cost_vs_count": 0.98,
    # per shape: graphed / eager latency, at least
    "vision_1_slice_speedup": 2.0,
    "audio_1s_speedup": 3.0,
    "duplex_chunk_ms": 2.0,
    # N duplex sessions sharing steps (duplex_concurrency): the streaming audio forward's ms per step at
    # most, at 1, 8 and 32 sessions; each at most this many times the plain CUDA graph of the same fused
    # Whisper stack at batch N (the floor); host ms per step at most, at every N; the first chunk of the
    # first session after a start-up at most (ms)
    "duplex_step_ms": {1: 1.6, 8: 3.0, 32: 6.0},
    "duplex_step_vs_floor": 1.3,
    "duplex_step_host_ms": 0.3,
    "duplex_first_chunk_ms": 2.5,
    # the replaying stateless 1 s audio call and duplex chunk: host time at most (ms)
    "audio_call_host_ms": 0.3,
    "duplex_session_speedup": 3.0,
    # the whole image call, graphed, default (SDPA) attention and fused layers: at most (ms, MiB)
    "vision_path_1_slice_ms": 2.8,
    "vision_path_10_slices_ms": 25.0,
    "vision_path_1_slice_graph_mib": 64.0,
    # a 1 s stateless audio call (the captured region: Whisper, projection, pooling), graphed: at most (ms)
    "audio_1s_graphed_ms": 1.5,
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclass
class Profile:
    """Repetition counts for one mode (full, quick, cpu)."""

    name: str
    warmup: int
    min_runs: int
    max_runs: int
    target_ms: float  # time budget per (shape, mode) measurement

    def runs_for(self, per_call_ms: float) -> int:
        if per_call_ms <= 0:
            return self.max_runs
        return max(self.min_runs, min(self.max_runs, int(self.target_ms / per_call_ms)))


PROFILES = {
    "full": Profile("full", warmup=5, min_runs=15, max_runs=60, target_ms=1500),
    "quick": Profile("quick", warmup=2, min_runs=5, max_runs=15, target_ms=300),
    "cpu": Profile("cpu", warmup=1, min_runs=2, max_runs=3, target_ms=50),
}


def measure_calls(timer: Timer, fn: Callable[[int], Any], profile: Profile) -> dict[str, float]:
    """Warm up, size the run from the warm-up cost, time it; ``fn(i)`` uses input ``i % ROTATE``."""
    warm = timer.series(fn, profile.warmup)
    n = profile.runs_for(statistics.median(warm) if warm else 0.0)
    return summary(timer.series(fn, n))


@dataclass
class Ctx:
    """One benchmark run: device, dtype, profile, the model and the adapter package."""

    device: torch.device
    dtype: torch.dtype
    profile: Profile
    timer: Timer
    model: Any
    vllm_config: Any
    adapter_mod: Any
    rng: torch.Generator
    #: the adapters' device seam: None = the adapter's CUDA backend; a ``CpuGraphBackend`` for ``--allow-cpu``
    backend: Any = None
    problems: list[str] = field(default_factory=list)
    #: the keyword arguments ``model`` was built with (:func:`minicpmo_cg.standalone.build_thinker_encoders`)
    build_args: dict[str, Any] = field(default_factory=dict)

    def build_model(self, **overrides: Any) -> Any:
        """Another model from the project's builder, as ``model`` was built but for ``overrides``
        (e.g. ``vision_attn="eager"``); the same seed gives the same weights."""
        from minicpmo_cg import standalone

        return standalone.build_thinker_encoders(**{**self.build_args, **overrides})

    @property
    def cpu(self) -> bool:
        return self.device.type != "cuda"

    @property
    def mode(self) -> str:
        """``full``, ``quick`` or ``cpu`` (the profile's name)."""
        return self.profile.name

    def new_adapter(self, forward: Callable[..., torch.Tensor], name: str, **options: Any) -> Any:
        """An adapter for a scenario that measures captured graphs (per shape)."""
        options.setdefault("backend", self.backend)
        options.setdefault("admission", "count")
        return self.adapter_mod.EncoderCudaGraph(forward, self.vllm_config, name=name, **options)


class _Recorder:
    """Stands in for an adapter at a call site: records the captured region's inputs, runs it eagerly."""

    def __init__(self, forward: Callable[..., torch.Tensor]) -> None:
        self.forward = forward
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *inputs: Any) -> torch.Tensor:
        self.calls.append(inputs)
        return self.forward(*inputs)


def vision_data(ctx: Ctx, grids: list[tuple[int, int]]) -> dict[str, Any]:
    """A ``get_vision_hidden_states`` argument with random pixels for slices of the given patch grids."""
    pixel_values = [
        (torch.rand((3, 14, h * w * 14), generator=ctx.rng) * 2 - 1).to(ctx.device, ctx.dtype)
        for h, w in grids
    ]
    return {
        "pixel_values": pixel_values,
        "tgt_sizes": torch.tensor(grids, dtype=torch.int32, device=ctx.device),
    }


def audio_data(ctx: Ctx, frames: int) -> dict[str, Any]:
    """A ``get_audio_hidden_states`` argument: one clip of ``frames`` random log-mel frames (its
    length on the host, as vLLM hands it over)."""
    feats = (torch.randn((1, 80, frames), generator=ctx.rng) * 0.5).to(ctx.device, ctx.dtype)
    return {"audio_features": feats, "audio_feature_lens": [torch.tensor([frames], dtype=torch.int64)]}


def record_inputs(ctx: Ctx, modality: str, data: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The captured region's inputs as MiniCPM-o's call site builds them for ``data``."""
    model = ctx.model
    if modality == "vision":
        owner, attr, forward, call = (
            model.vpm,
            "_encoder_graph",
            model._encode_images,  # the whole image call: pixels to resampler output
            model.get_vision_hidden_states,
        )
    else:
        owner, attr, forward, call = (
            model,
            "_audio_encoder_graph",
            model._encode_audio_features,
            model.get_audio_hidden_states,
        )
    rec = _Recorder(forward)
    saved = owner.__dict__.get(attr)
    setattr(owner, attr, rec)
    try:
        call(data)
    finally:
        setattr(owner, attr, saved)
    return rec.calls


def describe_inputs(inputs: tuple[Any, ...]) -> list[Any]:
    return [None if x is None else [list(x.shape), str(x.dtype).replace("torch.", "")] for x in inputs]


def call_site(ctx: Ctx, modality: str) -> Callable[[dict[str, Any]], Any]:
    """The model's call site for ``modality`` (``vision`` or ``audio``)."""
    return ctx.model.get_vision_hidden_states if modality == "vision" else ctx.model.get_audio_hidden_states
