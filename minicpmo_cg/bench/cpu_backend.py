"""The CPU stand-in for graph capture used by ``--allow-cpu`` (and only there).

A device backend for the adapter's seam (``EncoderGraphBackend`` in the adapter module: eligible
device, replay stream, free bytes, capture) that treats tensors on any device as eligible and
"captures" an eager stand-in, so the benchmark's own logic (recording, admission through the
adapter's real ``CaptureAdmission``, stats, memory and table code) runs end to end on a machine
without CUDA. Everything CUDA-specific about the CPU dry run lives in this module; the adapter is
used unmodified, with this object passed as its ``backend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class _EagerGraph:
    """Looks like a captured vLLM manager (``ReplayableGraph``); ``execute`` runs the forward eagerly."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.graph_hits = self.graph_misses = 0

    def execute(self, mm_kwargs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.graph_hits += 1
        return [self.encoder.encoder_eager_forward(mm_kwargs)]


class CpuGraphBackend:
    """The adapter's device seam with any device accepted and eager "replays".

    Args:
        free_bytes: the free-memory reading the memory floor sees (default: plenty).
    """

    def __init__(self, free_bytes: int = 1 << 62) -> None:
        self._free_bytes = free_bytes

    def eligible_device(self, inputs: Sequence[Any]) -> torch.device | None:
        tensors = [x for x in inputs if torch.is_tensor(x)]  # None and static arguments do not count
        if not tensors:
            return None
        devices = {x.device for x in tensors}
        return devices.pop() if len(devices) == 1 else None

    def replay_stream(self, device: torch.device) -> int:
        return 0

    def free_bytes(self, device: torch.device) -> int:
        return self._free_bytes

    def capture(
        self, encoder: Any, vllm_config: Any, device: torch.device, pool: Any | None
    ) -> tuple[Any, Any]:
        return _EagerGraph(encoder), pool if pool is not None else object()


def fixed_free_bytes(backend: Any, free_bytes: int) -> Any:
    """``backend`` with its free-memory reading replaced by ``free_bytes`` (memory-miss scenarios)."""

    class _Fixed(type(backend)):
        def free_bytes(self, device: torch.device) -> int:
            return free_bytes

    fixed = _Fixed.__new__(_Fixed)
    fixed.__dict__.update(backend.__dict__)
    return fixed
