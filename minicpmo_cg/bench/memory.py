"""Graph memory accounting: pool segments, static buffers and allocator deltas."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch

MIB = 1 << 20


def graph_metas(manager: Any) -> list[Any]:
    """The per-graph metadata objects (``input_buffers``, ``output_buffer``, ``graph``) of a vLLM manager."""
    found = []
    for path_graphs in getattr(manager, "budget_graphs", {}).values():
        values = path_graphs.values() if isinstance(path_graphs, dict) else [path_graphs]
        found += [m for m in values if hasattr(m, "graph") and hasattr(m, "output_buffer")]
    return found


def static_bytes(manager: Any) -> int:
    """Input buffers + output buffer of every graph of ``manager`` (allocated outside the graphs)."""
    total = 0
    for meta in graph_metas(manager):
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
