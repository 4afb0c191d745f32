#!/usr/bin/env python3
"""Benchmark MiniCPM-o 4.5's encoder CUDA graph adapter: eager vs graphed, capture cost,
graph memory, adapter bookkeeping, two traffic replays and shared vs separate graph pools.

Runs on a CUDA GPU (through ``tools/gpu/run.sh LANE bench`` on the offline GPU host). The
encoders are vllm-omni's own classes at the checkpoint's dimensions with random bf16 weights
(:func:`minicpmo_cg.standalone.build_thinker_encoders`); the adapter is the patched
``vllm_omni...minicpmo_4_5.encoder_cuda_graph.EncoderCudaGraph``.

Sections (``--only`` selects some; default all):

``vision`` / ``audio``
    Per input shape: eager vs graphed latency of the captured region (SigLIP stack + post-LN;
    Whisper + projection + 5x pooling), capture cost, graph memory. Inputs are recorded from the
    model's own call sites (``get_vision_hidden_states`` / ``get_audio_hidden_states``), so
    hidden states, padding masks and the chunked audio mask are exactly what MiniCPM-o builds.
    Each timed call rotates among ``ROTATE`` pre-made inputs of the same shape (a replay reads
    fresh data, not a cached buffer). Latency: ``torch.cuda.synchronize()``, CUDA event, call,
    CUDA event; median and p90 over n calls after a warm-up (n adapts to the call's cost).
    Memory per graph (each shape gets its own adapter with ``share_pools=False``, so its pool is
    its own): ``pool`` = bytes of the CUDA caching-allocator segments of the graph's private pool
    (``torch.cuda.memory_snapshot()``, ``segment_pool_id``); ``static`` = the manager's input
    buffers + output buffer (allocated outside the graph); plus the allocated/reserved deltas
    around the capturing call.
``bookkeeping``
    Host cost of the adapter per call, with a no-op forward returning a preallocated tensor. Hit
    path: a tiny captured forward; ``adapter(x)`` minus ``copy + graph.replay() + clone`` on the
    same captured graph (what any replay must do), split into the adapter's own part
    (``adapter(x)`` - ``manager.execute``) and vLLM's manager part. Miss paths (ineligible:
    autograd on / CPU tensor; warmup; capacity; memory floor with the real ``cudaMemGetInfo``
    and with an injected reading): ``adapter(x)`` minus calling the forward directly. Host time
    (``perf_counter``) per call, median over batches of calls.
``streaming``
    A duplex-style session: one 448x448 frame per second (one 32x32 slice) and one 1 s speech
    chunk per second for 120 s of simulated time, interleaved, through the patched call sites,
    eager vs graphed (default adapter options; captures happen inside the session and are paid
    there). Hit rate, misses by kind, graph memory, total encoder time.
``offline``
    Real photos (``skimage.data``) through MiniCPM-o's own slicer, random order with repeats;
    same report. Default options (4 graphs per encoder) and, in full mode, 16 graphs.
``pools``
    The same shapes captured with ``share_pools`` True and False: total pool bytes, reserved
    delta and replay latency per shape.

Targets printed next to the values (not asserted): graphed/eager >= 2x for one image slice,
>= 3x for a 1 s audio chunk, bookkeeping < 20 us per call.

Usage::

    python benchmarks/encoder_cuda_graph_bench.py [--quick] [--only vision,audio,...] [--json PATH]
    python benchmarks/encoder_cuda_graph_bench.py --allow-cpu --quick   # logic dry run, tiny shapes

Without CUDA it exits with status 2 unless ``--allow-cpu``: then it runs every section on tiny
shapes with 2+2 encoder layers, and a CPU stand-in for graph capture (``_CpuGraphShim``: the
adapter's real admission policy, eager "replays"); only the logic is exercised, the numbers mean
nothing. Exit status: 0 done (targets are reported, not enforced), 1 a graphed output differed
from eager or a section failed, 2 usage/environment error.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: minicpmo_cg is in the repo root
    sys.path.insert(len(sys.path), str(REPO))

import torch

SECTIONS = ("vision", "audio", "bookkeeping", "streaming", "offline", "pools")
ROTATE = 4  # distinct pre-made inputs per shape
MIB = 1 << 20
TARGETS = {
    "vision_1_slice_speedup": 2.0,
    "audio_1s_speedup": 3.0,
    "bookkeeping_us": 20.0,
}

# name, slices as (h, w) patch grids. 32x32 = one 448x448 slice = 1024 patches.
VISION_SHAPES: list[tuple[str, list[tuple[int, int]]]] = [
    ("1 slice 32x32", [(32, 32)]),
    ("2 slices 32x32", [(32, 32)] * 2),
    ("4 slices 32x32", [(32, 32)] * 4),
    ("9+1 slices 32x32", [(32, 32)] * 10),
    ("28x36 + 32x32 (padded)", [(28, 36), (32, 32)]),
    ("21x48 + 28x36 + 26x39 (padded)", [(21, 48), (28, 36), (26, 39)]),
]
# name, mel frames (100 per second)
AUDIO_SHAPES: list[tuple[str, int]] = [("1 s chunk", 100), ("5 s chunk", 500), ("30 s chunk", 3000)]
# --allow-cpu: tiny stand-ins with the same structure
CPU_VISION_SHAPES = [
    ("1 slice 4x4", [(4, 4)]),
    ("2 slices 4x4", [(4, 4)] * 2),
    ("3x4 + 4x4 (padded)", [(3, 4), (4, 4)]),
]
CPU_AUDIO_SHAPES = [("0.2 s chunk", 20), ("0.4 s chunk", 40)]

STREAM_SECONDS = {"full": 120, "quick": 30, "cpu": 6}
OFFLINE_REQUESTS = {"full": 48, "quick": 16, "cpu": 8}
OFFLINE_PHOTOS = ("chelsea", "astronaut", "rocket", "coffee", "hubble_deep_field", "retina")
OFFLINE_WEIGHTS = (6, 4, 3, 2, 2, 1)  # popularity: repeats are common, a few shapes are rare


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Run profile and timing
# ------------------------------------------------------------------------------------------------


@dataclass
class Profile:
    """Repetition counts for one mode (full, quick, cpu)."""

    name: str
    warmup: int
    min_runs: int
    max_runs: int
    target_ms: float  # time budget per (shape, mode) measurement
    bk_batch: int  # bookkeeping: calls per batch
    bk_batches: int  # bookkeeping: batches

    def runs_for(self, per_call_ms: float) -> int:
        if per_call_ms <= 0:
            return self.max_runs
        return max(self.min_runs, min(self.max_runs, int(self.target_ms / per_call_ms)))


PROFILES = {
    "full": Profile("full", warmup=5, min_runs=15, max_runs=60, target_ms=1500, bk_batch=200, bk_batches=15),
    "quick": Profile("quick", warmup=2, min_runs=5, max_runs=15, target_ms=300, bk_batch=100, bk_batches=5),
    "cpu": Profile("cpu", warmup=1, min_runs=2, max_runs=3, target_ms=50, bk_batch=20, bk_batches=3),
}


class Timer:
    """Latency of one call: CUDA events after a synchronize on CUDA, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` once; return its latency in ms."""
        if self.cuda:
            torch.cuda.synchronize()
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def series(self, fn: Callable[[int], Any], n: int) -> list[float]:
        return [self(lambda i=i: fn(i)) for i in range(n)]


def summary(values: Sequence[float]) -> dict[str, float]:
    """median, p90, min, n of a list of latencies."""
    if not values:
        return {"median": float("nan"), "p90": float("nan"), "min": float("nan"), "n": 0}
    s = sorted(values)
    return {
        "median": statistics.median(s),
        "p90": s[max(0, math.ceil(0.9 * len(s)) - 1)],
        "min": s[0],
        "n": len(s),
    }


def measure(timer: Timer, fn: Callable[[int], Any], profile: Profile) -> dict[str, float]:
    """Warm up, size the run from the warm-up cost, time it; ``fn(i)`` uses input ``i % ROTATE``."""
    warm = timer.series(fn, profile.warmup)
    n = profile.runs_for(statistics.median(warm) if warm else 0.0)
    return summary(timer.series(fn, n))


# ------------------------------------------------------------------------------------------------
# Memory accounting
# ------------------------------------------------------------------------------------------------


def _graph_metas(manager: Any) -> list[Any]:
    """The per-graph metadata objects (``input_buffers``, ``output_buffer``, ``graph``) of a vLLM manager."""
    found = []
    for path_graphs in getattr(manager, "budget_graphs", {}).values():
        values = path_graphs.values() if isinstance(path_graphs, dict) else [path_graphs]
        found += [m for m in values if hasattr(m, "graph") and hasattr(m, "output_buffer")]
    return found


def static_bytes(manager: Any) -> int:
    """Input buffers + output buffer of every graph of ``manager`` (allocated outside the graphs)."""
    total = 0
    for meta in _graph_metas(manager):
        total += sum(t.numel() * t.element_size() for t in meta.input_buffers.values() if torch.is_tensor(t))
        total += meta.output_buffer.numel() * meta.output_buffer.element_size()
    return total


def _pool_key(handle: Any) -> Any:
    return tuple(handle) if isinstance(handle, (tuple, list)) else handle


def pool_bytes(pools: set[Any]) -> int | None:
    """Reserved bytes of the caching-allocator segments that belong to ``pools`` (None: unknown)."""
    if not pools or not torch.cuda.is_available():
        return 0 if not pools else None
    try:
        try:
            snapshot = torch.cuda.memory_snapshot(include_traces=False)  # torch >= 2.10: no trace entries
        except TypeError:
            snapshot = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001 - memory accounting must never fail the benchmark
        return None
    if snapshot and not any("segment_pool_id" in seg for seg in snapshot):
        return None  # this torch does not say which pool a segment belongs to
    return sum(
        int(seg.get("total_size", 0)) for seg in snapshot if _pool_key(seg.get("segment_pool_id")) in pools
    )


def adapter_pools(adapters: Sequence[Any]) -> set[Any]:
    return {
        _pool_key(m.graph_pool)
        for a in adapters
        if a is not None
        for m in a.graphs.values()
        if getattr(m, "graph_pool", None) is not None
    }


def graph_memory(adapters: Sequence[Any]) -> dict[str, Any]:
    """Pool bytes (distinct pools of all graphs of ``adapters``) and static buffer bytes."""
    adapters = [a for a in adapters if a is not None]
    pools = adapter_pools(adapters)
    return {
        "graphs": sum(len(a.graphs) for a in adapters),
        "pools": len(pools),
        "pool_bytes": pool_bytes(pools),
        "static_bytes": sum(static_bytes(m) for a in adapters for m in a.graphs.values()),
    }


def mem_state() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {"allocated": 0, "reserved": 0}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def release_memory() -> None:
    """Free dropped graphs/buffers before a memory measurement (CUDA only; gc.collect costs ~0.3 s)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / MIB:.1f}"


# ------------------------------------------------------------------------------------------------
# CPU stand-in for graph capture (--allow-cpu only)
# ------------------------------------------------------------------------------------------------


class _EagerManager:
    """Looks like a captured vLLM manager; ``execute`` runs the forward eagerly (CPU dry run)."""

    graph_pool = None
    budget_graphs: ClassVar[dict] = {}

    def __init__(self, forward: Callable[..., torch.Tensor], arity: int) -> None:
        self.forward, self.arity = forward, arity
        self.graph_hits = self.graph_misses = 0

    def execute(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.graph_hits += 1
        return [self.forward(*(values.get(str(i)) for i in range(self.arity)))]


class _FakeStream:
    cuda_stream = 0


class _CpuGraphShim:
    """Context manager: let the real adapter treat CPU tensors as eligible and "capture" eagerly.

    Only for ``--allow-cpu``, so the benchmark's own logic (recording, admission through the
    adapter's real :class:`CaptureAdmission`, stats, memory and table code) runs end to end on a
    machine without CUDA. Restores the adapter module on exit.
    """

    def __init__(self, adapter_module: Any) -> None:
        self.mod = adapter_module
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _CpuGraphShim:
        cls = self.mod.EncoderCudaGraph

        def eligible(inputs: Sequence[Any]) -> torch.device | None:
            tensors = [x for x in inputs if x is not None]
            if not tensors or not all(torch.is_tensor(x) for x in tensors) or torch.is_grad_enabled():
                return None
            devices = {x.device for x in tensors}
            return devices.pop() if len(devices) == 1 else None

        def capture_graph(self_, output_shape, inputs, device, replay_stream):
            return _EagerManager(self_.forward, len(inputs))

        self.saved = {
            "_eligible_device": cls.__dict__["_eligible_device"],
            "_replay_stream": cls.__dict__["_replay_stream"],
            "_capture_graph": cls.__dict__["_capture_graph"],
            "_default_free_memory": self.mod._default_free_memory,
        }
        cls._eligible_device = staticmethod(eligible)
        cls._replay_stream = staticmethod(lambda device: _FakeStream())
        cls._capture_graph = capture_graph
        self.mod._default_free_memory = lambda device: 1 << 62
        return self

    def __exit__(self, *exc: object) -> None:
        cls = self.mod.EncoderCudaGraph
        for name in ("_eligible_device", "_replay_stream", "_capture_graph"):
            setattr(cls, name, self.saved[name])
        self.mod._default_free_memory = self.saved["_default_free_memory"]


# ------------------------------------------------------------------------------------------------
# Model, inputs recorded at the call sites
# ------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    device: torch.device
    dtype: torch.dtype
    profile: Profile
    timer: Timer
    model: Any
    vllm_config: Any
    adapter_mod: Any
    rng: torch.Generator
    results: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def cpu(self) -> bool:
        return self.device.type != "cuda"

    def new_adapter(self, forward: Callable[..., torch.Tensor], name: str, **options: Any) -> Any:
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
    """A ``get_audio_hidden_states`` argument: one clip of ``frames`` random log-mel frames."""
    feats = (torch.randn((1, 80, frames), generator=ctx.rng) * 0.5).to(ctx.device, ctx.dtype)
    return {
        "audio_features": feats,
        "audio_feature_lens": [torch.tensor([frames], dtype=torch.int64, device=ctx.device)],
    }


def record_inputs(ctx: Ctx, modality: str, data: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The captured region's inputs as MiniCPM-o's call site builds them for ``data``."""
    model = ctx.model
    if modality == "vision":
        rec = _Recorder(model.vpm._encode_last_hidden_state)
        saved = model.vpm.__dict__.get("_encoder_graph")
        model.vpm._encoder_graph = rec
        try:
            model.get_vision_hidden_states(data)
        finally:
            model.vpm._encoder_graph = saved
    else:
        rec = _Recorder(model._encode_audio_features)
        saved = model.__dict__.get("_audio_encoder_graph")
        model._audio_encoder_graph = rec
        try:
            model.get_audio_hidden_states(data)
        finally:
            model._audio_encoder_graph = saved
    return rec.calls


def describe_inputs(inputs: tuple[Any, ...]) -> list[Any]:
    return [None if x is None else [list(x.shape), str(x.dtype).replace("torch.", "")] for x in inputs]


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    scale = b.abs().max().item() or 1.0
    return (a - b).abs().max().item() / scale


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------


def bench_shape(
    ctx: Ctx, encoder: str, name: str, forward: Callable[..., torch.Tensor], rotation: list[tuple[Any, ...]]
) -> dict[str, Any]:
    """Eager vs graphed latency, capture cost and graph memory of one input shape."""
    timer, prof = ctx.timer, ctx.profile
    row: dict[str, Any] = {"encoder": encoder, "name": name, "inputs": describe_inputs(rotation[0])}
    row["eager_ms"] = measure(timer, lambda i: forward(*rotation[i % len(rotation)]), prof)

    release_memory()
    adapter = ctx.new_adapter(
        forward, f"bench-{encoder}", max_graphs=1, min_capture_calls=2, share_pools=False
    )
    adapter(*rotation[0])  # first sighting: warmup miss (eager)
    before = mem_state()
    row["capture_call_ms"] = timer(lambda: adapter(*rotation[1]))  # second sighting: capture + replay
    after = mem_state()
    stats = adapter.get_cumulative_stats()
    if stats["num_graphs"] != 1:
        ctx.problems.append(f"{encoder} {name}: expected 1 graph after the capturing call, got {stats}")
    mem = graph_memory([adapter])
    row.update(
        pool_bytes=mem["pool_bytes"],
        static_bytes=mem["static_bytes"],
        allocated_delta_bytes=after["allocated"] - before["allocated"],
        reserved_delta_bytes=after["reserved"] - before["reserved"],
    )
    row["graph_ms"] = measure(timer, lambda i: adapter(*rotation[i % len(rotation)]), prof)
    row["speedup"] = (
        row["eager_ms"]["median"] / row["graph_ms"]["median"] if row["graph_ms"]["median"] else None
    )
    row["capture_extra_ms"] = row["capture_call_ms"] - row["eager_ms"]["median"]
    # graphed output == eager output on a fresh input (same kernels: expected exactly 0)
    probe = rotation[-1]
    row["max_rel_diff"] = max_rel_diff(adapter(*probe), forward(*probe))
    if not math.isfinite(row["max_rel_diff"]) or row["max_rel_diff"] > 2.0**-6:
        ctx.problems.append(
            f"{encoder} {name}: graphed output differs from eager by {row['max_rel_diff']:.3g} (relative)"
        )
    row["stats"] = adapter.get_cumulative_stats()
    return row  # the adapter (and its graph) goes with this frame; the next shape releases memory first


def section_vision(ctx: Ctx) -> list[dict[str, Any]]:
    rows = []
    shapes = CPU_VISION_SHAPES if ctx.cpu else VISION_SHAPES
    for name, grids in shapes:
        rotation = [c for _ in range(ROTATE) for c in record_inputs(ctx, "vision", vision_data(ctx, grids))]
        if len(rotation) != ROTATE:  # one encoder call per get_vision_hidden_states call expected
            raise RuntimeError(f"vision {name}: the call site split the slices into several chunks")
        log(f"vision {name}: inputs {describe_inputs(rotation[0])}")
        rows.append(bench_shape(ctx, "vision", name, ctx.model.vpm._encode_last_hidden_state, rotation))
        del rotation
    return rows


def section_audio(ctx: Ctx) -> list[dict[str, Any]]:
    rows = []
    shapes = CPU_AUDIO_SHAPES if ctx.cpu else AUDIO_SHAPES
    for name, frames in shapes:
        rotation = [c for _ in range(ROTATE) for c in record_inputs(ctx, "audio", audio_data(ctx, frames))]
        log(f"audio {name}: inputs {describe_inputs(rotation[0])}")
        rows.append(bench_shape(ctx, "audio", name, ctx.model._encode_audio_features, rotation))
        del rotation
    return rows


def _host_us_per_call(fn: Callable[[], Any], prof: Profile, sync: Callable[[], None]) -> float:
    """Median over batches of the host time per call (us); the device is synced between batches."""
    for _ in range(max(10, prof.bk_batch // 10)):
        fn()
    sync()
    per_call = []
    for _ in range(prof.bk_batches):
        t0 = time.perf_counter()
        for _ in range(prof.bk_batch):
            fn()
        per_call.append((time.perf_counter() - t0) / prof.bk_batch * 1e6)
        sync()
    return statistics.median(per_call)


def section_bookkeeping(ctx: Ctx) -> dict[str, Any]:
    prof, dev = ctx.profile, ctx.device
    sync = ctx.timer.sync
    x = torch.randn((1, 16, 64), generator=ctx.rng).to(dev, ctx.dtype)
    out = torch.empty((1, 16, 64), device=dev, dtype=ctx.dtype)

    def noop(a: torch.Tensor, m: Any) -> torch.Tensor:
        return out

    def tiny(a: torch.Tensor, m: Any) -> torch.Tensor:
        return a * 2

    res: dict[str, Any] = {
        "method": (
            "host perf_counter per call, median over batches; misses: adapter(x) - forward(x) with a no-op forward; "
            "hit: adapter(x) - (copy into the captured input buffer + graph.replay() + output clone) on the same graph"
        )
    }

    # --- hit path
    hit = ctx.new_adapter(tiny, "bench-bk-hit", max_graphs=1, min_capture_calls=2, min_free_bytes=0)
    hit(x, None)
    hit(x, None)  # captured
    manager = next(iter(hit.graphs.values()))
    metas = _graph_metas(manager)
    t_adapter = _host_us_per_call(lambda: hit(x, None), prof, sync)
    t_manager = _host_us_per_call(lambda: manager.execute({"0": x}), prof, sync)
    if metas:
        meta = metas[0]
        buf = meta.input_buffers["0"]

        def bare() -> torch.Tensor:
            buf.copy_(x)
            meta.graph.replay()
            return meta.output_buffer.clone()

        t_bare = _host_us_per_call(bare, prof, sync)
    else:  # CPU dry run: no graph; the "bare" cost is the forward itself
        t_bare = _host_us_per_call(lambda: tiny(x, None), prof, sync)
    res["hit"] = {
        "adapter_call_us": t_adapter,
        "manager_execute_us": t_manager,
        "bare_replay_us": t_bare,
        "bookkeeping_us": t_adapter - t_bare,
        "adapter_own_us": t_adapter - t_manager,
        "vllm_manager_us": t_manager - t_bare,
    }
    # --- miss paths (no-op forward)
    t_forward = _host_us_per_call(lambda: noop(x, None), prof, sync)
    res["forward_direct_us"] = t_forward
    misses: dict[str, Any] = {}

    def miss(kind: str, adapter: Any, call: Callable[[], Any], expect: str) -> None:
        call()  # first sighting / priming
        before = adapter.get_cumulative_stats()[expect]
        t = _host_us_per_call(call, prof, sync)
        grew = adapter.get_cumulative_stats()[expect] - before
        misses[kind] = {
            "call_us": t,
            "bookkeeping_us": t - t_forward,
            "counted_as": expect,
            "count_grew": grew > 0,
        }
        if grew <= 0:
            ctx.problems.append(f"bookkeeping {kind}: calls were not counted as {expect}")

    a = ctx.new_adapter(noop, "bench-bk-ineligible")
    with torch.enable_grad():
        miss("ineligible (autograd on)", a, lambda: a(x, None), "ineligible_misses")
    if not ctx.cpu:
        x_cpu = x.cpu()
        miss("ineligible (CPU tensor)", a, lambda: a(x_cpu, None), "ineligible_misses")
    a = ctx.new_adapter(noop, "bench-bk-warmup", max_graphs=4, min_capture_calls=10**9)
    miss("warmup", a, lambda: a(x, None), "warmup_misses")
    a = ctx.new_adapter(noop, "bench-bk-capacity", max_graphs=0)
    miss("capacity", a, lambda: a(x, None), "capacity_misses")
    if not ctx.cpu:
        a = ctx.new_adapter(noop, "bench-bk-memory", min_capture_calls=2, min_free_bytes=1 << 62)
        miss("memory (cudaMemGetInfo)", a, lambda: a(x, None), "memory_misses")
    a = ctx.new_adapter(
        noop, "bench-bk-memory0", min_capture_calls=2, min_free_bytes=1, free_memory_fn=lambda d: 0
    )
    miss("memory (injected reading)", a, lambda: a(x, None), "memory_misses")
    res["misses"] = misses
    return res


def _session(
    ctx: Ctx, events: list[tuple[str, dict[str, Any]]], graphed: bool, **options: Any
) -> dict[str, Any]:
    """Run ``events`` (modality, call-site data) through the model; graphs wired or not."""
    from minicpmo_cg.standalone import audio_graph, vision_graph, wire_encoder_graphs

    model = ctx.model
    release_memory()
    before = mem_state()
    # every option explicit: wire_encoder_graphs leaves earlier sessions' keys on model.config
    defaults = ctx.adapter_mod.EncoderCudaGraphOptions()
    full = {
        k: getattr(defaults, k) for k in ("max_graphs", "min_capture_calls", "min_free_bytes", "share_pools")
    }
    full.update(options)
    wire_encoder_graphs(model, ctx.vllm_config, enabled=graphed, **full)
    per: dict[str, list[float]] = {"vision": [], "audio": []}
    t_start = time.perf_counter()
    for modality, data in events:
        fn = model.get_vision_hidden_states if modality == "vision" else model.get_audio_hidden_states
        per[modality].append(ctx.timer(lambda fn=fn, data=data: fn(data)))
    wall = (time.perf_counter() - t_start) * 1e3
    after = mem_state()
    adapters = {"vision": vision_graph(model), "audio": audio_graph(model)}
    res: dict[str, Any] = {
        "graphed": graphed,
        "options": full,
        "encoder_ms_total": sum(per["vision"]) + sum(per["audio"]),
        "wall_ms": wall,
        "per_modality": {k: {"calls": len(v), "total_ms": sum(v), **summary(v)} for k, v in per.items() if v},
        "reserved_delta_bytes": after["reserved"] - before["reserved"],
    }
    if graphed:
        res["stats"] = {k: a.get_cumulative_stats() for k, a in adapters.items() if a is not None}
        res["memory"] = graph_memory(list(adapters.values()))
        total = sum(s["graph_hits"] + s["graph_misses"] for s in res["stats"].values())
        res["hit_rate"] = sum(s["graph_hits"] for s in res["stats"].values()) / total if total else 0.0
    wire_encoder_graphs(model, ctx.vllm_config, enabled=False)  # drop the adapters (and their graphs)
    del adapters
    release_memory()
    return res


def _warm_call_sites(ctx: Ctx, events: list[tuple[str, dict[str, Any]]]) -> None:
    from minicpmo_cg.standalone import wire_encoder_graphs

    wire_encoder_graphs(ctx.model, ctx.vllm_config, enabled=False)
    seen = set()
    for modality, data in events:
        if modality not in seen:
            seen.add(modality)
            (
                ctx.model.get_vision_hidden_states
                if modality == "vision"
                else ctx.model.get_audio_hidden_states
            )(data)
    ctx.timer.sync()


def section_streaming(ctx: Ctx, mode: str) -> dict[str, Any]:
    from minicpmo_cg import inputs as mi

    seconds = STREAM_SECONDS[mode]
    processor = mi.make_image_processor()
    if ctx.cpu:
        frame_grid = [(4, 4)]
        frames = [vision_data(ctx, frame_grid) for _ in range(seconds)]
        chunks = [audio_data(ctx, 20) for _ in range(4)]
        source = "random 4x4-patch frames, random 0.2 s mel chunks (CPU dry run)"
    else:
        # one real 448x448 frame through the slicer (1 slice of 32x32), then per-second variations
        pv, tgt = mi.process_images(processor, [mi.duplex_frame()])
        if len(pv) != 1:
            raise RuntimeError(f"duplex frame sliced into {len(pv)} slices (expected 1)")
        base = pv[0]
        frames = []
        for t in range(seconds):
            noise = torch.randn(base.shape, generator=ctx.rng) * 0.02
            frames.append(
                {
                    "pixel_values": [(base + noise).clamp(-1, 1).to(ctx.device, ctx.dtype)],
                    "tgt_sizes": tgt.to(ctx.device),
                }
            )
        # real speech cut into 1 s chunks (100 mel frames each), cycled
        extractor = mi.make_feature_extractor()
        chunks = []
        for stem in ("default_female", "default_male"):
            wav = mi.load_wav_16k(mi.voice_file(stem))
            for s in range(int(len(wav) // mi.SAMPLING_RATE)):
                mel = mi.mel_features(extractor, wav[s * mi.SAMPLING_RATE : (s + 1) * mi.SAMPLING_RATE])
                chunks.append(
                    {
                        "audio_features": mel[None].to(ctx.device, ctx.dtype),
                        "audio_feature_lens": [
                            torch.tensor([mel.shape[-1]], dtype=torch.int64, device=ctx.device)
                        ],
                    }
                )
        source = f"1 frame/s: skimage coffee 448x448 crop + noise; 1 s chunks of the shipped voices ({len(chunks)} distinct)"
    events: list[tuple[str, dict[str, Any]]] = []
    for t in range(seconds):
        events.append(("vision", frames[t]))
        events.append(("audio", chunks[t % len(chunks)]))
    _warm_call_sites(ctx, events)
    eager = _session(ctx, events, graphed=False)
    graphed = _session(ctx, events, graphed=True)
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


def section_offline(ctx: Ctx, mode: str) -> dict[str, Any]:
    from minicpmo_cg import inputs as mi

    n = OFFLINE_REQUESTS[mode]
    rnd = random.Random(1234)
    if ctx.cpu:
        grids = {"a": [(4, 4)], "b": [(3, 4), (4, 4)], "c": [(4, 4)] * 3, "d": [(2, 4)]}
        names = list(grids)
        datas = {k: vision_data(ctx, g) for k, g in grids.items()}
        describe = {k: f"{len(g)} slice(s) {g}" for k, g in grids.items()}
        weights = (4, 3, 2, 1)
    else:
        processor = mi.make_image_processor()
        items = {p: mi.vision_input(processor, p, [p]) for p in OFFLINE_PHOTOS}
        names = list(OFFLINE_PHOTOS)
        datas = {p: it.data(ctx.device, ctx.dtype) for p, it in items.items()}
        describe = {
            p: f"{it.source}: {it.num_slices} slice(s), tgt {it.tgt_sizes.tolist()}"
            for p, it in items.items()
        }
        weights = OFFLINE_WEIGHTS
    order = rnd.choices(names, weights=weights, k=n)
    events = [("vision", datas[p]) for p in order]
    _warm_call_sites(ctx, events)
    res: dict[str, Any] = {
        "requests": n,
        "order": order,
        "inputs": describe,
        "eager": _session(ctx, events, graphed=False),
    }
    res["graphed_default"] = _session(ctx, events, graphed=True)
    if mode == "full" or ctx.cpu:
        res["graphed_16"] = _session(ctx, events, graphed=True, max_graphs=16)
    return res


def section_pools(ctx: Ctx) -> dict[str, Any]:
    vision_shapes = CPU_VISION_SHAPES if ctx.cpu else VISION_SHAPES[:3] + VISION_SHAPES[4:5]
    audio_shapes = CPU_AUDIO_SHAPES if ctx.cpu else AUDIO_SHAPES[:2]
    shapes = [("vision", n, record_inputs(ctx, "vision", vision_data(ctx, g))[0]) for n, g in vision_shapes]
    shapes += [("audio", n, record_inputs(ctx, "audio", audio_data(ctx, f))[0]) for n, f in audio_shapes]
    forwards = {"vision": ctx.model.vpm._encode_last_hidden_state, "audio": ctx.model._encode_audio_features}
    out: dict[str, Any] = {"shapes": [f"{e} {n}" for e, n, _ in shapes]}
    prof = ctx.profile
    for share in (True, False):
        release_memory()
        before = mem_state()
        adapters = {
            e: ctx.new_adapter(forwards[e], f"bench-pools-{e}", max_graphs=16, share_pools=share)
            for e in forwards
        }
        t0 = time.perf_counter()
        for e, _, inp in shapes:
            adapters[e](*inp)
            adapters[e](*inp)  # captures
        ctx.timer.sync()
        capture_s = time.perf_counter() - t0
        after = mem_state()
        lat = {}
        for e, n, inp in shapes:
            lat[f"{e} {n}"] = measure(ctx.timer, lambda i, a=adapters[e], inp=inp: a(*inp), prof)
        mem = graph_memory(list(adapters.values()))
        out["shared" if share else "separate"] = {
            **mem,
            "reserved_delta_bytes": after["reserved"] - before["reserved"],
            "allocated_delta_bytes": after["allocated"] - before["allocated"],
            "capture_all_s": capture_s,
            "graph_ms": lat,
        }
        adapters = {}  # drop the graphs before the other variant is measured
        release_memory()
    return out


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _fmt_ms(s: dict[str, float]) -> str:
    return f"{s['median']:8.3f} {s['p90']:8.3f}"


def print_report(res: dict[str, Any]) -> None:
    meta = res["meta"]
    print("=== RESULTS: encoder CUDA graph benchmark ===")
    print(
        f"device {meta['device_name']} | torch {meta['torch']} | vllm {meta['vllm']} | vllm-omni {meta['vllm_omni']} "
        f"| {meta['dtype']} | mode {meta['mode']} | model {meta['model']}"
    )
    if meta["mode"] == "cpu":
        print("CPU DRY RUN (--allow-cpu): tiny shapes, eager stand-in for capture; numbers are meaningless")
    shapes = res.get("vision", []) + res.get("audio", [])
    if shapes:
        print("\n-- per shape: captured region, eager vs graphed (ms: median p90), capture, memory per graph")
        print(
            f"{'encoder':7s} {'shape':32s} {'eager med   p90':>17s} {'graph med   p90':>17s} {'x':>6s} "
            f"{'target':>7s} {'capture':>8s} {'pool MiB':>9s} {'static MiB':>10s} {'rel diff':>8s}"
        )
        for r in shapes:
            target = ""
            if r["encoder"] == "vision" and r["name"].startswith("1 slice"):
                target = f">={TARGETS['vision_1_slice_speedup']:.0f}x"
            if r["encoder"] == "audio" and r["name"].startswith(("1 s", "0.2 s")):
                target = f">={TARGETS['audio_1s_speedup']:.0f}x"
            if target:
                goal = TARGETS["vision_1_slice_speedup" if r["encoder"] == "vision" else "audio_1s_speedup"]
                target += " ok" if (r["speedup"] or 0) >= goal else " MISS"
            print(
                f"{r['encoder']:7s} {r['name']:32s} {_fmt_ms(r['eager_ms'])} {_fmt_ms(r['graph_ms'])} "
                f"{r['speedup'] or float('nan'):6.2f} {target:>7s} {r['capture_call_ms']:8.1f} "
                f"{mib(r['pool_bytes']):>9s} {mib(r['static_bytes']):>10s} {r['max_rel_diff']:8.1e}"
            )
        print(
            "  capture = the capturing call (manager setup + warm-up forward + capture + first replay), ms; "
            "pool = the graph's private pool segments; static = manager input + output buffers"
        )
    bk = res.get("bookkeeping")
    if bk:
        h = bk["hit"]
        goal = TARGETS["bookkeeping_us"]
        print(f"\n-- adapter bookkeeping per call (us, host; target < {goal:.0f} us)")
        print(
            f"hit: adapter call {h['adapter_call_us']:.1f} = bare copy+replay+clone {h['bare_replay_us']:.1f} "
            f"+ vLLM manager {h['vllm_manager_us']:.1f} + adapter own {h['adapter_own_us']:.1f} "
            f"-> bookkeeping {h['bookkeeping_us']:.1f} {'ok' if h['bookkeeping_us'] < goal else 'MISS'} "
            f"(adapter own {'ok' if h['adapter_own_us'] < goal else 'MISS'})"
        )
        for kind, m in bk["misses"].items():
            print(
                f"miss {kind:28s} {m['bookkeeping_us']:7.2f} {'ok' if m['bookkeeping_us'] < goal else 'MISS'}"
                f"   (call {m['call_us']:.2f}, forward alone {bk['forward_direct_us']:.2f})"
            )
    for key, title in (("streaming", "streaming session"), ("offline", "offline photo mix")):
        s = res.get(key)
        if not s:
            continue
        extra = (
            f"{s['seconds']} s simulated, {s['events']} calls"
            if key == "streaming"
            else f"{s['requests']} requests"
        )
        print(f"\n-- {title} ({extra}); encoder ms = sum of per-call latencies at the call sites")
        runs = [("eager", s["eager"])] + [
            (k.replace("graphed_", "graphed max_graphs="), v)
            for k, v in s.items()
            if k.startswith("graphed") and isinstance(v, dict)
        ]
        for label, r in runs:
            line = f"{label:22s} encoder {r['encoder_ms_total']:9.1f} ms"
            for mod, pm in r["per_modality"].items():
                line += f" | {mod} med {pm['median']:.2f} p90 {pm['p90']:.2f}"
            if r["graphed"]:
                st = r["stats"]
                misses = {
                    k: sum(v[k] for v in st.values())
                    for k in ("warmup_misses", "capacity_misses", "memory_misses", "ineligible_misses")
                }
                mem = r["memory"]
                line += (
                    f" | hit rate {r['hit_rate']:.1%} graphs {mem['graphs']} misses "
                    + " ".join(f"{k.split('_')[0]} {v}" for k, v in misses.items())
                    + f" | graph mem {mib((mem['pool_bytes'] or 0) + mem['static_bytes'])} MiB"
                    + f" | x{s['eager']['encoder_ms_total'] / r['encoder_ms_total']:.2f}"
                )
            print(line)
    p = res.get("pools")
    if p:
        print("\n-- share_pools: same shapes captured into shared vs separate pools")
        for k in ("shared", "separate"):
            r = p[k]
            print(
                f"{k:9s} graphs {r['graphs']:2d} pools {r['pools']:2d} pool {mib(r['pool_bytes'])} MiB "
                f"static {mib(r['static_bytes'])} MiB reserved +{mib(r['reserved_delta_bytes'])} MiB "
                f"capture {r['capture_all_s']:.2f} s"
            )
        for shape in p["shapes"]:
            a, b = p["shared"]["graph_ms"][shape], p["separate"]["graph_ms"][shape]
            print(f"  {shape:40s} graph ms shared {a['median']:8.3f} separate {b['median']:8.3f}")
    if res["problems"]:
        print("\nPROBLEMS:")
        for prob in res["problems"]:
            print(f"  {prob}")
    print(f"\nelapsed {res['meta']['elapsed_s']:.0f} s; sections {', '.join(res['meta']['sections'])}")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter streaming session")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SECTION[,SECTION]",
        help=f"run only these sections ({', '.join(SECTIONS)}); repeatable",
    )
    ap.add_argument("--json", metavar="PATH", help="write all numbers as JSON")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA: logic dry run on tiny shapes (numbers are meaningless)",
    )
    ap.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when available; cpu forces the --allow-cpu dry run even on a GPU host",
    )
    ap.add_argument("--reduced", action="store_true", help="2 vision + 2 audio layers (full widths)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    only = [s.strip() for item in args.only for s in item.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in only] if only else list(SECTIONS)
    return args


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist, key in (("vllm", "vllm"), ("vllm-omni", "vllm_omni"), ("transformers", "transformers")):
        try:
            out[key] = md.version(dist)
        except md.PackageNotFoundError:
            out[key] = "missing"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        print("encoder_cuda_graph_bench: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if not cuda and not args.allow_cpu:
        print(
            "encoder_cuda_graph_bench: needs a CUDA GPU (CUDA graphs are what it measures). "
            "Run it on the GPU host: bash tools/gpu/run.sh LANE bench. "
            "For a logic dry run on tiny shapes here: --allow-cpu --quick.",
            file=sys.stderr,
        )
        return 2
    mode = "cpu" if not cuda else ("quick" if args.quick else "full")
    profile = PROFILES[mode]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    t_start = time.perf_counter()
    try:
        import vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph as adapter_mod
        from minicpmo_cg import standalone
        from minicpmo_cg.vllm_config import standalone_vllm_config
    except ImportError as exc:
        print(
            f"encoder_cuda_graph_bench: cannot import the patched vllm-omni / minicpmo_cg: {exc}",
            file=sys.stderr,
        )
        return 2
    reduced = args.reduced or mode == "cpu"
    log(f"building encoders ({'reduced' if reduced else 'full'}, {dtype}, {device}) ...")
    model = standalone.build_thinker_encoders(
        device=device, dtype=dtype, reduced=reduced, seed=args.seed, progress=True
    )
    if not standalone.has_graph_wiring(model):
        print(f"encoder_cuda_graph_bench: {standalone.PATCH_HINT}", file=sys.stderr)
        return 2
    info = model.build_info
    ctx = Ctx(
        device=device,
        dtype=dtype,
        profile=profile,
        timer=Timer(device),
        model=model,
        vllm_config=standalone_vllm_config(),
        adapter_mod=adapter_mod,
        rng=torch.Generator().manual_seed(args.seed),
    )
    res: dict[str, Any] = {
        "meta": {
            "mode": mode,
            "sections": args.sections,
            "dtype": str(dtype).replace("torch.", ""),
            "device_name": torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            **_versions(),
            "model": f"{info.vision_layers}+{info.audio_layers} layers, vision attn {info.vision_attn}, "
            f"audio attn {info.audio_attn}, {info.num_params / 1e6:.0f} M params",
            "rotate": ROTATE,
            "profile": profile.__dict__,
        },
        "targets": TARGETS,
    }
    shim = _CpuGraphShim(adapter_mod) if mode == "cpu" else contextlib.nullcontext()
    failed = False
    with shim, torch.inference_mode():
        for section in args.sections:
            t0 = time.perf_counter()
            log(f"section {section} ...")
            try:
                if section == "vision":
                    res["vision"] = section_vision(ctx)
                elif section == "audio":
                    res["audio"] = section_audio(ctx)
                elif section == "bookkeeping":
                    res["bookkeeping"] = section_bookkeeping(ctx)
                elif section == "streaming":
                    res["streaming"] = section_streaming(ctx, mode)
                elif section == "offline":
                    res["offline"] = section_offline(ctx, mode)
                elif section == "pools":
                    res["pools"] = section_pools(ctx)
            except Exception as exc:  # noqa: BLE001 - report, keep the other sections
                failed = True
                traceback.print_exc()
                ctx.problems.append(f"section {section} failed: {type(exc).__name__}: {exc}")
            log(f"section {section}: {time.perf_counter() - t0:.1f} s")
    res["problems"] = ctx.problems
    res["meta"]["elapsed_s"] = time.perf_counter() - t_start
    print_report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        log(f"wrote {args.json}")
    return 1 if failed or ctx.problems else 0


if __name__ == "__main__":
    sys.exit(main())
