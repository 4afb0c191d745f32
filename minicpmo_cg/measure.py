"""Timing, statistics, versions and the graph-vs-eager tolerance, shared by every measurement and
comparison.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from minicpmo_cg.tolerance import (
    GRAPH_REL_TOL,
    all_finite,
    graph_rel_tol,
    max_abs,
    max_abs_diff,
    output_shape,
    rel_diff,
    within_graph_tolerance,
)

__all__ = [
    "GRAPH_REL_TOL",
    "VERSIONED",
    "Timer",
    "all_finite",
    "graph_rel_tol",
    "max_abs",
    "max_abs_diff",
    "median",
    "output_shape",
    "rel_diff",
    "summary",
    "versions",
    "within_graph_tolerance",
]

#: Distributions whose versions go into every report.
VERSIONED = ("vllm", "vllm-omni", "transformers")


class Timer:
    """Latency of one call in milliseconds."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        """Wait for the device (no-op on CPU)."""
        if self.cuda:
            import torch

            torch.accelerator.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn()`` once; return ``(milliseconds, its output)``."""
        if self.cuda:
            self.sync()
            self.start.record()
            out = fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Run ``fn()`` once; return its latency in milliseconds."""
        return self.timed(fn)[0]

    def repeat(self, fn: Callable[[], Any], n: int) -> tuple[list[float], Any]:
        """Run ``fn()`` ``n`` times; return the per-call milliseconds and the last output."""
        times: list[float] = []
        out = None
        for _ in range(n):
            ms, out = self.timed(fn)
            times.append(ms)
        return times, out

    def series(self, fn: Callable[[int], Any], n: int) -> list[float]:
        """Milliseconds of ``fn(0)``, ``fn(1)``, ... ``fn(n - 1)``."""
        return [self(lambda i=i: fn(i)) for i in range(n)]

    def wall_ms(self, fn: Callable[[], Any]) -> float:
        """Host wall time of ``fn()`` between two device synchronizations, in milliseconds."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def summary(values: Sequence[float]) -> dict[str, float]:
    """``median``, ``p90`` (nearest rank), ``min`` and ``n`` of latencies (NaN when empty)."""
    if not values:
        return {"median": math.nan, "p90": math.nan, "min": math.nan, "n": 0}
    s = sorted(values)
    return {
        "median": statistics.median(s),
        "p90": s[max(0, math.ceil(0.9 * len(s)) - 1)],
        "min": s[0],
        "n": len(s),
    }


def versions() -> dict[str, str]:
    """Installed versions of torch and :data:`VERSIONED` (``"not installed"`` when absent)."""
    import torch

    out = {"torch": torch.__version__}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
