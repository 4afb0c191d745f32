"""Timing, statistics, versions and the graph-vs-eager tolerance, shared by every measurement and
comparison.

The tolerance (:data:`GRAPH_REL_TOL`) is stated here and nowhere else: every comparison of a
graphed output with the eager one imports it.

``torch`` is imported inside the functions that need it, so importing this module is cheap.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

#: Largest accepted ``max|graphed - eager|``, relative to ``max|eager|``, by dtype name.
#:
#: A replay runs the very kernels the eager call runs, on the same shapes and weights, so the
#: difference is expected to be exactly 0, and every GPU run so far measured 0. The margin
#: leaves room for one thing only: a library choosing another kernel variant (or split-K
#: order) while a stream is captured, which changes the float32 accumulation order and can
#: move a bfloat16 output by one rounding step of its magnitude, 2**-8. float32 outputs get
#: 1e-4, far above float32 rounding and far below what a real fault produces (stale inputs, a
#: wrong mask or another graph's buffers move the output by O(1) of its magnitude).
GRAPH_REL_TOL: dict[str, float] = {"bfloat16": 2.0**-8, "float32": 1e-4}

#: Distributions whose versions go into every report.
VERSIONED = ("vllm", "vllm-omni", "transformers")


def graph_rel_tol(dtype: Any) -> float:
    """:data:`GRAPH_REL_TOL` of ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``).

    Raises:
        KeyError: no tolerance is stated for that dtype.
    """
    name = str(dtype).removeprefix("torch.")
    try:
        return GRAPH_REL_TOL[name]
    except KeyError:
        raise KeyError(f"no graph-vs-eager tolerance for dtype {name!r}; stated for {sorted(GRAPH_REL_TOL)}")


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def output_shape(out: Any) -> str:
    """``(3, 64, 4096)`` for a tensor, ``(77, 4096)+(90, 4096)`` for a list of tensors."""
    return "+".join(str(tuple(t.shape)) for t in _as_list(out))


def max_abs(out: Any) -> float:
    """``max |out|`` over a tensor or a list of tensors (0 for empty tensors)."""
    return max(float(t.detach().float().abs().max()) if t.numel() else 0.0 for t in _as_list(out))


def all_finite(out: Any) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in _as_list(out))


def max_abs_diff(eager: Any, graphed: Any) -> float:
    """``max |eager - graphed|`` over matching tensors or lists of tensors, computed in float32.

    Raises:
        RuntimeError: the shapes differ.
    """
    la, lb = _as_list(eager), _as_list(graphed)
    if len(la) != len(lb) or any(x.shape != y.shape for x, y in zip(la, lb)):
        raise RuntimeError(f"graphed output shape {output_shape(graphed)} != eager {output_shape(eager)}")
    return max(float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(la, lb))


def rel_diff(eager: Any, graphed: Any) -> float:
    """``max|eager - graphed| / max|eager|`` (the absolute difference when ``eager`` is all zeros)."""
    scale = max_abs(eager)
    diff = max_abs_diff(eager, graphed)
    return diff / scale if scale else diff


def within_graph_tolerance(eager: Any, graphed: Any, dtype: Any) -> tuple[bool, float]:
    """``(ok, relative difference)`` of a graphed output against the eager one (:data:`GRAPH_REL_TOL`)."""
    rel = rel_diff(eager, graphed)
    return math.isfinite(rel) and rel <= graph_rel_tol(dtype), rel


class Timer:
    """Latency of one call in milliseconds.

    CUDA: synchronize the device, record a start event, call, record an end event and wait for
    it; the elapsed event time covers the call's GPU work and any host gaps inside it. CPU:
    ``time.perf_counter`` around the call.
    """

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
