"""The graph-vs-eager tolerance and the comparisons of a graphed output with the eager one."""

from __future__ import annotations

from typing import Any

#: Largest accepted ``max|graphed - eager|``, relative to ``max|eager|``, by dtype name. A replay
#: runs the eager call's kernels, so 0 is expected; the margin covers a library picking another
#: kernel variant under capture (one bfloat16 rounding step, 2**-8), far below a real fault's O(1).
GRAPH_REL_TOL: dict[str, float] = {"bfloat16": 2.0**-8, "float32": 1e-4}


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
    """Whether every element of a tensor or a list of tensors is finite (the demo's check)."""
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
    import math

    rel = rel_diff(eager, graphed)
    return math.isfinite(rel) and rel <= graph_rel_tol(dtype), rel


