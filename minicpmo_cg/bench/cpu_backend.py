"""The CPU stand-in for graph capture used by ``--allow-cpu`` (and only there).

It lets the real adapter treat CPU tensors as eligible and "capture" an eager stand-in, so the
benchmark's own logic (recording, admission through the adapter's real ``CaptureAdmission``,
stats, memory and table code) runs end to end on a machine without CUDA. It replaces, for the
duration of a ``with`` block, the adapter's device eligibility, replay stream, capture and free
memory reading; everything CUDA-specific about the CPU dry run lives in this one class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch


class _EagerManager:
    """Looks like a captured vLLM manager; ``execute`` runs the forward eagerly."""

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


def _eligible_device(inputs: Sequence[Any]) -> torch.device | None:
    """The adapter's eligibility rule with any device accepted (CPU included)."""
    tensors = [x for x in inputs if x is not None]
    if not tensors or not all(torch.is_tensor(x) for x in tensors) or torch.is_grad_enabled():
        return None
    devices = {x.device for x in tensors}
    return devices.pop() if len(devices) == 1 else None


class CpuGraphBackend:
    """Context manager: the adapter module's CUDA plumbing replaced by eager CPU stand-ins.

    Args:
        adapter_module: the installed ``...minicpmo_4_5.encoder_cuda_graph`` module; restored on exit.
    """

    _METHODS = ("_eligible_device", "_replay_stream", "_capture_graph")

    def __init__(self, adapter_module: Any) -> None:
        self.mod = adapter_module
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        cls = self.mod.EncoderCudaGraph

        def capture_graph(self_, output_shape, inputs, device, replay_stream):
            return _EagerManager(self_.forward, len(inputs))

        self.saved = {name: cls.__dict__[name] for name in self._METHODS}
        self.saved["_default_free_memory"] = self.mod._default_free_memory
        cls._eligible_device = staticmethod(_eligible_device)
        cls._replay_stream = staticmethod(lambda device: _FakeStream())
        cls._capture_graph = capture_graph
        self.mod._default_free_memory = lambda device: 1 << 62

    def __exit__(self, *exc: object) -> None:
        cls = self.mod.EncoderCudaGraph
        for name in self._METHODS:
            setattr(cls, name, self.saved[name])
        self.mod._default_free_memory = self.saved["_default_free_memory"]
