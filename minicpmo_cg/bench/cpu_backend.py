"""The CPU stand-in for graph capture used by ``--allow-cpu`` (and only there).

A device backend for the adapter's seam (``EncoderGraphBackend`` in the adapter module: eligible
device, replay stream, free bytes, capture) that treats tensors on any device as eligible and
"captures" an eager stand-in, so the benchmark's own logic (recording, admission through the
adapter's real ``CaptureAdmission``, stats, memory and table code) runs end to end on a machine
without CUDA. Everything CUDA-specific about the CPU dry run lives in this module; the adapter is
used unmodified, with this object passed as its ``backend``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minicpmo_cg.standalone import ADAPTER_MODULE


class _EagerGraph:
    """Looks like a captured vLLM manager (``ReplayableGraph``); ``execute`` runs the forward eagerly."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.graph_hits = self.graph_misses = 0

    def execute(self, mm_kwargs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.graph_hits += 1
        return [self.encoder.encoder_eager_forward(mm_kwargs)]


class _CpuMeasurement:
    """An eager call's measurement on CPU: the host time, and a GPU time scripted from it."""

    def __init__(self, host_ms: float, gpu_share: float) -> None:
        self.host_ms = host_ms
        self.peak_bytes = 0
        self._gpu_ms = host_ms * gpu_share

    def gpu_ms(self) -> float:
        return self._gpu_ms


class CpuGraphBackend:
    """The adapter's device seam with any device accepted and eager "replays".

    Args:
        free_bytes: the free-memory reading the memory floor sees (default: plenty).
        gpu_share: the "GPU time" of an eager call as a share of its host time; the default makes
            every call look launch-bound, so cost-aware admission captures as it would for the small
            calls graphs are for (a CPU has no GPU time to measure).
    """

    def __init__(self, free_bytes: int = 1 << 62, gpu_share: float = 0.1) -> None:
        self._free_bytes = free_bytes
        self._gpu_share = gpu_share

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

    def measure_eager(
        self, device: torch.device, call: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, Any]:
        start = time.perf_counter()
        out = call()
        return out, _CpuMeasurement((time.perf_counter() - start) * 1e3, self._gpu_share)

    def capture(self, encoder: Any, vllm_config: Any, device: torch.device, pool: Any | None) -> Any:
        captured = importlib.import_module(ADAPTER_MODULE).CapturedGraph
        pool = pool if pool is not None else object()
        return captured(_EagerGraph(encoder), pool, 0, encoder.static_bytes)


def fixed_free_bytes(backend: Any, free_bytes: int) -> Any:
    """``backend`` with its free-memory reading replaced by ``free_bytes`` (memory-miss scenarios)."""

    class _Fixed(type(backend)):
        def free_bytes(self, device: torch.device) -> int:
            return free_bytes

    fixed = _Fixed.__new__(_Fixed)
    fixed.__dict__.update(backend.__dict__)
    return fixed
