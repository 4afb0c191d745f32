"""Fused vs unfused encoder layers, and where a graphed call's GPU time goes, kernel by kernel."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from minicpmo_cg.bench.context import Ctx

#: the modules whose ``_fused_layers`` flag ``fused_layers.configure_fused_layers`` sets
FUSED_MODULES = ("vpm", "resampler", "apm")
#: kernels kept per profile
TOP_KERNELS = 15
#: profiled calls (their times are divided by it), by mode
PROFILE_CALLS = {"full": 5, "quick": 3, "cpu": 1}


def layers_label(model: Any, module: str) -> str:
    """``"fused"`` or ``"unfused"``: what ``model.<module>`` runs now."""
    return "fused" if getattr(getattr(model, module, None), "_fused_layers", False) else "unfused"


@contextlib.contextmanager
def fused_layers(model: Any, on: bool) -> Iterator[None]:
    """The fused layers of every encoder of ``model`` on (as configured) or off for the block."""
    saved = {name: getattr(model, name)._fused_layers for name in FUSED_MODULES if _has_flag(model, name)}
    try:
        if not on:
            for name in saved:
                getattr(model, name)._fused_layers = False
        yield
    finally:
        for name, value in saved.items():
            getattr(model, name)._fused_layers = value


def _has_flag(model: Any, name: str) -> bool:
    return hasattr(getattr(model, name, None), "_fused_layers")


def kernel_profile(ctx: Ctx, call: Callable[[], Any], calls: int | None = None) -> dict[str, Any]:
    """The kernels of ``call`` by GPU time (operators by CPU time on a CPU run)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    calls = calls or PROFILE_CALLS[ctx.mode]
    activities = [ProfilerActivity.CPU] if ctx.cpu else [ProfilerActivity.CUDA]
    call()
    ctx.timer.sync()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        ctx.timer.sync()
    rows = []
    for event in prof.key_averages():
        if ctx.cpu:
            us = event.self_cpu_time_total
        elif event.device_type == DeviceType.CUDA:
            us = getattr(event, "self_device_time_total", None) or event.device_time_total
        else:
            continue
        if us > 0:
            rows.append({"name": event.key, "us": us / calls, "count": event.count / calls})
    rows.sort(key=lambda row: -row["us"])
    return {
        "unit": "cpu_us" if ctx.cpu else "gpu_us",
        "calls": calls,
        "total_us": sum(row["us"] for row in rows),
        "kernels": rows[:TOP_KERNELS],
    }


def format_kernels(title: str, profile: dict[str, Any] | None, width: int = 84) -> list[str]:
    """The profile as lines: a header with the total, then one line per kernel."""
    if not profile:
        return []
    unit = "GPU" if profile["unit"] == "gpu_us" else "CPU"
    lines = [f"--- kernels: {title}, {unit} us per call (total {profile['total_us']:.1f}) ---"]
    for row in profile["kernels"]:
        name = row["name"] if len(row["name"]) <= width else row["name"][: width - 3] + "..."
        lines.append(f"  {row['us']:9.1f} us {row['count']:6.1f}x  {name}")
    return lines
