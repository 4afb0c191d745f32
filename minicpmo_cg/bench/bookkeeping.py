"""Scenario ``bookkeeping``: the adapter's host cost per call on the hit path and on every miss path."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from minicpmo_cg.bench.context import TARGETS, Ctx, Profile
from minicpmo_cg.bench.cpu_backend import fixed_free_bytes
from minicpmo_cg.bench.memory import graph_metas

METHOD = (
    "host perf_counter per call, median over batches; misses: adapter(x) - forward(x) with a no-op forward; "
    "hit: adapter(x) - (copy into the captured input buffer + graph.replay() + output clone) "
    "on the same graph"
)


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


def _miss(ctx: Ctx, adapter: Any, call: Callable[[], Any], expect: str, t_forward: float) -> dict[str, Any]:
    """Host cost of calls that must all be counted as ``expect`` misses."""
    call()  # first sighting / priming
    before = adapter.get_cumulative_stats()[expect]
    t = host_us_per_call(call, ctx.profile, ctx.timer.sync)
    grew = adapter.get_cumulative_stats()[expect] - before
    return {"call_us": t, "bookkeeping_us": t - t_forward, "counted_as": expect, "count_grew": grew > 0}


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
    goal = TARGETS["bookkeeping_us"]
    lines = [
        f"\n-- adapter bookkeeping per call (us, host; target < {goal:.0f} us)",
        (
            f"hit: adapter call {h['adapter_call_us']:.1f} = "
            f"bare copy+replay+clone {h['bare_replay_us']:.1f} "
            f"+ vLLM manager {h['vllm_manager_us']:.1f} + adapter own {h['adapter_own_us']:.1f} "
            f"-> bookkeeping {h['bookkeeping_us']:.1f} {'ok' if h['bookkeeping_us'] < goal else 'MISS'} "
            f"(adapter own {'ok' if h['adapter_own_us'] < goal else 'MISS'})"
        ),
    ]
    for kind, m in bk["misses"].items():
        lines.append(
            f"miss {kind:28s} {m['bookkeeping_us']:7.2f} {'ok' if m['bookkeeping_us'] < goal else 'MISS'}"
            f"   (call {m['call_us']:.2f}, forward alone {bk['forward_direct_us']:.2f})"
        )
    return lines
