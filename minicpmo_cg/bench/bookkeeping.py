"""Scenario ``bookkeeping``: the adapter's host cost per call on the hit path and on every miss path."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from minicpmo_cg.bench.context import TARGETS, Ctx, Profile
from minicpmo_cg.bench.cpu_backend import CpuGraphBackend, fixed_free_bytes
from minicpmo_cg.bench.memory import graph_metas

METHOD = (
    "host perf_counter per call, median over batches; misses: adapter(x) - forward(x) with a no-op forward; "
    "hit: adapter(x) - (copy into the captured input buffer + graph.replay() + output clone) "
    "on the same graph, split into vLLM's manager (manager.execute - bare) and the adapter's own part"
)
#: Scripted host and GPU time of a no-op forward for the CPU dry run's cost rule (ms): microseconds,
#: as the CUDA backend measures one, so the rule declines it (a replay could not save anything).
NOOP_MS = 0.001


def host_us_per_call(fn: Callable[[], Any], prof: Profile, sync: Callable[[], None]) -> float:
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


def _hit_path(ctx: Ctx, x: torch.Tensor) -> dict[str, float]:
    """A tiny captured forward: adapter call vs manager.execute vs bare copy + replay + clone."""
    prof, sync = ctx.profile, ctx.timer.sync

    def tiny(a: torch.Tensor, m: Any) -> torch.Tensor:
        return a * 2

    hit = ctx.new_adapter(tiny, "bench-bk-hit", max_graphs=1, min_capture_calls=2, min_free_bytes=0)
    hit(x, None)
    hit(x, None)  # captured
    manager = next(iter(hit.graphs.values()))
    metas = graph_metas(manager)
    t_adapter = host_us_per_call(lambda: hit(x, None), prof, sync)
    t_manager = host_us_per_call(lambda: manager.execute({"0": x}), prof, sync)
    if metas:
        meta = metas[0]
        buf = meta.input_buffers["0"]

        def bare() -> torch.Tensor:
            buf.copy_(x)
            meta.graph.replay()
            return meta.output_buffer.clone()

        t_bare = host_us_per_call(bare, prof, sync)
    else:  # CPU dry run: no graph; the "bare" cost is the forward itself
        t_bare = host_us_per_call(lambda: tiny(x, None), prof, sync)
    return {
        "adapter_call_us": t_adapter,
        "manager_execute_us": t_manager,
        "bare_replay_us": t_bare,
        "bookkeeping_us": t_adapter - t_bare,
        "adapter_own_us": t_adapter - t_manager,
        "vllm_manager_us": t_manager - t_bare,
    }


def _counter(adapter: Any, name: str) -> int:
    """A counter of either stats method (``warmup_misses``, ``declined_misses``, ...)."""
    stats = adapter.get_cumulative_stats()
    return stats[name] if name in stats else adapter.get_detailed_stats()[name]


def _miss(ctx: Ctx, adapter: Any, call: Callable[[], Any], expect: str, t_forward: float) -> dict[str, Any]:
    """Host cost of calls that must all be counted as ``expect`` misses."""
    call()  # first sighting / priming
    before = _counter(adapter, expect)
    t = host_us_per_call(call, ctx.profile, ctx.timer.sync)
    grew = _counter(adapter, expect) - before
    return {"call_us": t, "bookkeeping_us": t - t_forward, "counted_as": expect, "count_grew": grew > 0}


def profiling_config(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` that looks like vLLM's start-up memory profiling to the
    adapter: its own ``cache_config`` with ``num_gpu_blocks`` None (the KV cache not sized yet)."""
    config = copy.copy(vllm_config)
    cache_config = copy.copy(vllm_config.cache_config)
    cache_config.num_gpu_blocks = None
    object.__setattr__(config, "cache_config", cache_config)
    return config


def _admission_cases(ctx: Ctx, noop: Callable[..., torch.Tensor]) -> list[tuple[str, Any, str]]:
    """``(kind, adapter, expected counter)`` of the miss kinds added by cost admission, the byte
    budget and the profiling guard."""
    new = ctx.new_adapter
    # a no-op forward saves nothing when replayed: the cost rule declines it
    noop_backend = (
        CpuGraphBackend(host_ms=NOOP_MS, busy_ms_per_item=NOOP_MS, clock=ctx.backend.clock)
        if ctx.cpu
        else ctx.real_backend()
    )
    declined = new(noop, "bench-bk-declined", admission="cost", min_free_bytes=0, backend=noop_backend)
    budget = new(noop, "bench-bk-budget", min_free_bytes=0, max_bytes=1)
    profile = ctx.adapter_mod.EncoderCudaGraph(
        noop, profiling_config(ctx.vllm_config), name="bench-bk-profile", backend=ctx.backend
    )
    return [
        ("declined (cost rule)", declined, "declined_misses"),
        ("budget (max_bytes)", budget, "budget_misses"),
        ("profile (start-up profiling)", profile, "profile_misses"),
    ]


def _miss_paths(ctx: Ctx, x: torch.Tensor, noop: Callable[..., torch.Tensor], t_forward: float) -> dict:
    """Every miss kind, each with an adapter configured so that its calls land on it."""
    new = ctx.new_adapter
    ineligible = new(noop, "bench-bk-ineligible")
    # (kind, adapter, input, grad enabled, expected counter)
    cases: list[tuple[str, Any, torch.Tensor, bool, str]] = [
        ("ineligible (autograd on)", ineligible, x, True, "ineligible_misses")
    ]
    if not ctx.cpu:
        cases.append(("ineligible (CPU tensor)", ineligible, x.cpu(), False, "ineligible_misses"))
    warmup = new(noop, "bench-bk-warmup", max_graphs=4, min_capture_calls=10**9)
    cases.append(("warmup", warmup, x, False, "warmup_misses"))
    cases.append(("capacity", new(noop, "bench-bk-capacity", max_graphs=0), x, False, "capacity_misses"))
    if not ctx.cpu:
        real = new(noop, "bench-bk-memory", min_capture_calls=2, min_free_bytes=1 << 62)
        cases.append(("memory (cudaMemGetInfo)", real, x, False, "memory_misses"))
    injected = new(
        noop,
        "bench-bk-memory0",
        min_capture_calls=2,
        min_free_bytes=1,
        backend=fixed_free_bytes(ctx.real_backend(), 0),
    )
    cases.append(("memory (injected reading)", injected, x, False, "memory_misses"))
    cases += [(kind, adapter, x, False, expect) for kind, adapter, expect in _admission_cases(ctx, noop)]
    misses: dict[str, Any] = {}
    for kind, adapter, arg, grad, expect in cases:
        with torch.enable_grad() if grad else contextlib.nullcontext():
            misses[kind] = _miss(ctx, adapter, lambda a=adapter, v=arg: a(v, None), expect, t_forward)
        if not misses[kind]["count_grew"]:
            ctx.problems.append(f"bookkeeping {kind}: calls were not counted as {expect}")
    return misses


def run(ctx: Ctx) -> dict[str, Any]:
    x = torch.randn((1, 16, 64), generator=ctx.rng).to(ctx.device, ctx.dtype)
    out = torch.empty((1, 16, 64), device=ctx.device, dtype=ctx.dtype)

    def noop(a: torch.Tensor, m: Any) -> torch.Tensor:
        return out

    res: dict[str, Any] = {"method": METHOD, "hit": _hit_path(ctx, x)}
    t_forward = host_us_per_call(lambda: noop(x, None), ctx.profile, ctx.timer.sync)
    res["forward_direct_us"] = t_forward
    res["misses"] = _miss_paths(ctx, x, noop, t_forward)
    return res


def format_section(bk: dict[str, Any]) -> list[str]:
    h = bk["hit"]
    hit_goal, miss_goal = TARGETS["hit_bookkeeping_us"], TARGETS["bookkeeping_us"]
    goals = f"targets: hit <= {hit_goal:.0f} us, misses < {miss_goal:.0f} us"
    title = f"adapter bookkeeping per call (us, host; {goals})"
    lines = [
        f"\n-- {title}",
        (
            f"hit: adapter call {h['adapter_call_us']:.1f} = "
            f"bare copy+replay+clone {h['bare_replay_us']:.1f} + bookkeeping {h['bookkeeping_us']:.1f} "
            f"(vLLM manager {h['vllm_manager_us']:.1f} + adapter {h['adapter_own_us']:.1f}) "
            f"{'ok' if h['bookkeeping_us'] <= hit_goal else 'MISS'}"
        ),
    ]
    for kind, m in bk["misses"].items():
        ok = "ok" if m["bookkeeping_us"] < miss_goal else "MISS"
        lines.append(
            f"miss {kind:28s} {m['bookkeeping_us']:7.2f} {ok}"
            f"   (call {m['call_us']:.2f}, forward alone {bk['forward_direct_us']:.2f})"
        )
    return lines
