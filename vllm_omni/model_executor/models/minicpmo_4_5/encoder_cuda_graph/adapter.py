# SPDX-License-Identifier: Apache-2.0
"""The callable adapter :class:`EncoderCudaGraph`: replays an encoder call from a CUDA graph."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger

from .admission import (
    MISS_KINDS,
    Admission,
    CaptureAdmission,
    CaptureCostModel,
    CostVerdict,
    _KeyRecord,
    in_memory_profiling,
)
from .backend import CudaGraphBackend, EncoderGraphBackend, ReplayableGraph, _require_capture_error_mode
from .options import EncoderCudaGraphOptions
from .shapes import ExactShapeEncoder, GraphKey, _describe, _is_static, _tensor_entries


logger = init_logger(__name__)

__all__ = ["EncoderCudaGraph", "EncoderCudaGraphCaptureFailedError", "GraphInfo"]


class EncoderCudaGraphCaptureFailedError(RuntimeError):
    """Raised by every call after a capture failed (the fatal contract)."""


@dataclass(frozen=True)
class GraphInfo:
    """Bytes and capture time of one graph (measured at capture, through the backend)."""

    pool_bytes: int
    static_bytes: int
    capture_ms: float

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.static_bytes


#: Granularity of the CUDA caching allocator's segments (its small-segment size and large-size rounding).
_SEGMENT_BYTES = 2 << 20

#: Buffer keys of positional inputs (``ExactShapeEncoder.keys``), prebuilt for the hit path.
_BUFFER_KEYS = tuple(str(i) for i in range(64))


_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
    ("_global_backward_hooks", "register_module_full_backward_hook"),
)
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class EncoderCudaGraph:
    """Replay an encoder call from a CUDA graph captured for its exact input shapes.

    ``adapter(*inputs)`` returns what ``forward(*inputs)`` returns, as a fresh tensor (replays are
    cloned). The key is the replay stream, the device and, per positional input, ``(shape, dtype)``
    or None; values and strides are not part of it. A call runs ``forward`` eagerly when it is
    ineligible (autograd or CUDA autocast on, inputs the backend refuses, a capture in progress), during
    vLLM's start-up profiling, or when admission defers it. A replay runs the recorded GPU work only:
    ``forward`` must have no Python side effects, and module hooks found at a capture turn the adapter
    eager for good. If a capture raises, the exception propagates and every later call raises
    :class:`EncoderCudaGraphCaptureFailedError` without CUDA work.

    Args:
        forward: the eager encoder, ``forward(*inputs) -> Tensor``; capturable (no host syncs, no
            data-dependent shapes) and free of Python side effects.
        vllm_config: the engine's ``VllmConfig``; copied per capture, never mutated.
        max_graphs, min_capture_calls, min_free_bytes, share_pools, admission, max_bytes,
            log_interval_s: see :class:`EncoderCudaGraphOptions`.
        name: encoder name for logs (``"vision"``, ``"audio"``).
        captured_modules: the modules ``forward`` calls, dotted names relative to the module owning
            the bound method ``forward`` (checked for hooks); None: the owner's whole tree.
        backend: the device seam, :class:`CudaGraphBackend` by default; the attribute ``backend``
            may be replaced before the first call (a test's CPU backend).

    Raises:
        HfOverridesError: (a ``ValueError``) invalid option values.
        RuntimeError: vLLM's ``EncoderCudaGraphManager`` cannot capture in
            :data:`CAPTURE_ERROR_MODE` (a vLLM without its ``capture_error_mode``).
    """

    #: A memory-floor or byte-budget deferral warns the first time and then every this many.
    MEMORY_WARNING_EVERY = 100
    #: Hooks named in the hooks warning (the rest are counted).
    HOOKS_NAMED = 5
    #: Eager calls measured per key (the cost rule uses their medians).
    MAX_SAMPLES = 3

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        vllm_config: Any,
        *,
        max_graphs: int = 4,
        min_capture_calls: int = 2,
        min_free_bytes: int = 1 << 30,
        share_pools: bool = True,
        admission: str = "cost",
        max_bytes: int = 0,
        log_interval_s: float = 60.0,
        name: str = "encoder",
        captured_modules: Sequence[str] | None = None,
        backend: EncoderGraphBackend | None = None,
    ) -> None:
        _require_capture_error_mode()
        self.options = EncoderCudaGraphOptions(
            max_graphs=max_graphs,
            min_capture_calls=min_capture_calls,
            min_free_bytes=min_free_bytes,
            share_pools=share_pools,
            admission=admission,
            max_bytes=max_bytes,
            log_interval_s=log_interval_s,
        )
        self.forward = forward
        self.vllm_config = vllm_config
        self.name = name
        self.captured_modules = None if captured_modules is None else tuple(captured_modules)
        self.backend: EncoderGraphBackend = backend if backend is not None else CudaGraphBackend()
        self.admission = CaptureAdmission(max_graphs, min_capture_calls)
        self.cost_model = CaptureCostModel()
        # key -> replayable graph (a vLLM manager) holding the key's single graph
        self.graphs: dict[GraphKey, ReplayableGraph] = {}
        # key -> bytes and capture time of its graph
        self.graph_info: dict[GraphKey, GraphInfo] = {}
        # key -> what the key's eager calls showed, for keys in the admission history
        self._records: dict[GraphKey, _KeyRecord] = {}
        # (device, replay stream id) -> the backend's pool, with share_pools
        self._capture_pools: dict[tuple[torch.device, Hashable], Any] = {}
        # "TypeName: message" of the capture that failed; the exception itself is not kept, since its
        # traceback would hold the failed capture's buffers (and their graph pool) for good
        self._failure: str | None = None
        self._eager_reason: str | None = None
        self._deferrals: Counter[str] = Counter()
        self._cap_logged = False
        self._profiling_over = False
        self._calls = 0  # eligible calls: the clock of the cost rule's rates
        self._held_calls = 0
        self._measure = admission == "cost" or max_bytes > 0
        self._log_interval = float(log_interval_s)
        self._next_log = time.monotonic() + self._log_interval

    @property
    def capture_failed(self) -> bool:
        return self._failure is not None

    @property
    def eager_reason(self) -> str | None:
        """Why this adapter turned eager for good (hooks found at capture), or None."""
        return self._eager_reason

    @property
    def graph_bytes(self) -> int:
        """Bytes held by this adapter's graphs (pool growth + static buffers, measured at capture)."""
        return sum(info.total_bytes for info in self.graph_info.values())

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if self._failure is not None:
            raise EncoderCudaGraphCaptureFailedError(
                f"{self.name} encoder CUDA graph capture failed earlier "
                f"({self._failure}); this adapter is unusable. "
                "Restart the worker, optionally with --hf-overrides "
                "'{\"encoder_cuda_graph\": false}' to run the encoders eagerly."
            )
        if self._log_interval and time.monotonic() >= self._next_log:
            self._log_progress()
        device = None
        if self._eager_reason is None and not torch.is_grad_enabled():
            device = self.backend.eligible_device(inputs)
        if device is None:
            self.admission.record_ineligible()
            return self.forward(*inputs)
        try:
            entries = tuple([None if x is None else (x.shape, x.dtype) for x in inputs])
        except AttributeError:  # an input that is neither a tensor nor None
            self.admission.record_ineligible()
            return self.forward(*inputs)
        self._calls += 1
        key: GraphKey = (self.backend.replay_stream(device), device, entries)
        manager = self.graphs.get(key)
        if manager is not None:  # hit: the common case, kept to one lookup
            return manager.execute({_BUFFER_KEYS[i]: x for i, x in enumerate(inputs) if x is not None})[0]
        return self._miss(key, inputs, device)

    def get_cumulative_stats(self) -> dict[str, Any]:
        """Counters since construction (never reset), per adapter.

        Returns:
            dict with exactly :data:`STATS_KEYS` (the design overview's Stats); ``graph_misses``
            counts every miss kind of :data:`MISS_KINDS` plus any counted by vLLM's managers.
        """
        hits = sum(m.graph_hits for m in self.graphs.values())
        misses = self.admission.total_misses() + sum(m.graph_misses for m in self.graphs.values())
        total = hits + misses
        m = self.admission.misses
        return {
            "graph_hits": hits,
            "graph_misses": misses,
            "hit_rate": hits / total if total else 0.0,
            "num_graphs": len(self.graphs),
            "ineligible_misses": m["ineligible"],
            "capacity_misses": m["capacity"],
            "warmup_misses": m["warmup"],
            "memory_misses": m["memory"],
            "capture_failures": int(self._failure is not None),
        }

    def get_detailed_stats(self) -> dict[str, Any]:
        """What :meth:`get_cumulative_stats` leaves out, since construction.

        Returns:
            dict with ``admission``, ``declined_misses``, ``held_calls``, ``budget_misses``,
            ``profile_misses``, ``graph_bytes``, ``max_bytes`` and ``graphs``: per graph in capture
            order its ``inputs``, ``hits``, ``bytes`` (``pool_bytes`` + ``static_bytes``) and ``capture_ms``.
        """
        m = self.admission.misses
        graphs = [
            {
                "inputs": _describe(key),
                "hits": self.graphs[key].graph_hits,
                "bytes": info.total_bytes,
                "pool_bytes": info.pool_bytes,
                "static_bytes": info.static_bytes,
                "capture_ms": info.capture_ms,
            }
            for key, info in self.graph_info.items()
            if key in self.graphs
        ]
        return {
            "admission": self.options.admission,
            "declined_misses": m["declined"],
            "held_calls": self._held_calls,
            "budget_misses": m["budget"],
            "profile_misses": m["profile"],
            "graph_bytes": self.graph_bytes,
            "max_bytes": self.options.max_bytes,
            "graphs": graphs,
        }

    def _miss(self, key: GraphKey, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        if not self._profiling_over and self._in_profile_run():
            self.admission.record_miss("profile")
            return self.forward(*inputs)
        # Never captured, so the hit path needs no check: more inputs than buffer keys, or an input
        # that has a shape and a dtype but is no tensor (e.g. a NumPy array).
        if len(inputs) > len(_BUFFER_KEYS) or any(map(_is_static, inputs)):
            self.admission.record_ineligible()
            return self.forward(*inputs)
        decision = self.admission.admit(key)
        if decision is Admission.CAPACITY:
            self._log_cap_once()
            return self.forward(*inputs)
        record = self._sighting(key)
        if decision is Admission.CAPTURE:
            deferral = self._deferral(key, record, device)
            if deferral is None:
                if self._capture(key, record, inputs, device):
                    # the capturing call is served by the new graph's first replay
                    return self._replay(self.graphs[key], inputs)
                self.admission.record_ineligible()  # refused (hooks): eager from now on
                return self.forward(*inputs)
            self.admission.record_miss(deferral)
        return self._run_eager(record, inputs, device)

    def _in_profile_run(self) -> bool:
        if in_memory_profiling(self.vllm_config):
            if not self.admission.misses["profile"]:
                logger.info(
                    "%s encoder call during vLLM's start-up memory profiling (KV cache not sized yet): "
                    "runs eagerly and does not count toward CUDA graph admission",
                    self.name,
                )
            return True
        self._profiling_over = True
        return False

    def _sighting(self, key: GraphKey) -> _KeyRecord:
        record = self._records.get(key)
        if record is None or self.admission.history.get(key) == 1:
            record = self._records[key] = _KeyRecord(first_call=self._calls)
            # keep records only for keys still in the admission history
            if len(self._records) > len(self.admission.history):
                for stale in [k for k in self._records if k not in self.admission.history]:
                    del self._records[stale]
        record.sightings += 1
        record.last_call = self._calls
        return record

    def _run_eager(self, record: _KeyRecord, inputs: Sequence[Any], device: torch.device) -> torch.Tensor:
        """The eager forward: held once when the cost rule asked for it, else measured while the key
        has fewer than :attr:`MAX_SAMPLES` unheld samples."""
        if record.hold_ms > 0:
            self._held_calls += 1
            out, record.held = self.backend.measure_eager(
                device, lambda: self.forward(*inputs), record.hold_ms
            )
            record.hold_ms = 0.0
        elif self._measure and len(record.measurements) < self.MAX_SAMPLES:
            out, measurement = self.backend.measure_eager(device, lambda: self.forward(*inputs))
            record.measurements.append(measurement)
        else:
            out = self.forward(*inputs)
        if record.output is None:
            record.output = (out.shape, out.dtype)
        return out

    def _deferral(self, key: GraphKey, record: _KeyRecord, device: torch.device) -> str | None:
        if record.output is None:
            # no eager call of the key has returned (each one raised): its output's shape and dtype,
            # which the capture and the byte estimate need, are not known yet
            return "warmup"
        if self.options.admission == "cost":
            verdict = record.verdict = self._cost_verdict(key, record)
            if verdict is None:
                return "warmup"  # no measurement read back yet
            if not verdict.capture:
                if verdict.hold_ms > 0:  # the rule needs the GPU's busy time: hold this call once
                    if record.held is None:
                        record.hold_ms = verdict.hold_ms
                    return "warmup"
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "%s encoder CUDA graph for inputs %s declined: %s",
                        self.name,
                        _describe(key),
                        verdict.describe(),
                    )
                return "declined"
        if self.options.max_bytes and self._over_budget(key, record):
            return "budget"
        if self._below_memory_floor(device):
            return "memory"
        return None

    def _cost_verdict(self, key: GraphKey, record: _KeyRecord) -> CostVerdict | None:
        samples = record.samples()
        if not any(s.gpu_ms is not None for s in samples):
            return None
        return self.cost_model.decide(
            samples,
            sightings=record.sightings,
            first_call=record.first_call,
            last_call=record.last_call,
            calls=self._calls,
            graph_bytes=self._estimate_bytes(key, record),
        )

    def _estimate_bytes(self, key: GraphKey, record: _KeyRecord) -> int:
        shape, dtype = record.output
        static = math.prod(shape) * dtype.itemsize
        static += sum(math.prod(s) * d.itemsize for s, d in _tensor_entries(key))
        peak = max((m.peak_bytes for m in record.taken()), default=0)
        return -(-peak // _SEGMENT_BYTES) * _SEGMENT_BYTES + static

    def _over_budget(self, key: GraphKey, record: _KeyRecord) -> bool:
        estimate, held = self._estimate_bytes(key, record), self.graph_bytes
        if held + estimate <= self.options.max_bytes:
            return False
        self._warn_deferral(
            "budget",
            "%s encoder CUDA graph capture for inputs %s deferred (%d time(s) so far): its graph would "
            "hold about %s on top of %s, passing encoder_cuda_graph_max_bytes=%d; the call runs eagerly.",
            self.name,
            _describe(key),
            self._deferrals["budget"] + 1,
            _mib(estimate),
            _mib(held),
            self.options.max_bytes,
        )
        return True

    def _below_memory_floor(self, device: torch.device) -> bool:
        floor = self.options.min_free_bytes
        if not floor:
            return False
        free = self.backend.free_bytes(device)
        if free >= floor:
            return False
        self._warn_deferral(
            "memory",
            "%s encoder CUDA graph capture deferred (%d time(s) so far): %d bytes free on %s, "
            "below encoder_cuda_graph_min_free_bytes=%d; the call runs eagerly. Free device memory, "
            "lower encoder_cuda_graph_min_free_bytes, or set it to 0 to disable the floor.",
            self.name,
            self._deferrals["memory"] + 1,
            free,
            device,
            floor,
        )
        return True

    def _warn_deferral(self, kind: str, msg: str, *args: Any) -> None:
        self._deferrals[kind] += 1
        count = self._deferrals[kind]
        if count == 1 or count % self.MEMORY_WARNING_EVERY == 0:
            logger.warning(msg, *args)

    def _log_cap_once(self) -> None:
        if self._cap_logged:
            return
        self._cap_logged = True
        if self.options.max_graphs == 0:
            logger.info("%s encoder CUDA graphs disabled (encoder_cuda_graph_max_graphs=0)", self.name)
        else:
            logger.warning(
                "%s encoder CUDA graph cap reached (%d graphs); new shapes run eagerly for the "
                "lifetime of the model (raise encoder_cuda_graph_max_graphs to capture more)",
                self.name,
                self.options.max_graphs,
            )

    def _log_progress(self) -> None:
        self._next_log = time.monotonic() + self._log_interval
        stats = self.get_cumulative_stats()
        total = stats["graph_hits"] + stats["graph_misses"]
        if not total:
            return
        misses = ", ".join(f"{kind} {n}" for kind in MISS_KINDS if (n := self.admission.misses[kind]))
        logger.info(
            "%s encoder CUDA graphs: hit rate %.1f%% (%d of %d calls), %d graph(s) holding %s; "
            "misses: %s (admission=%s)",
            self.name,
            100.0 * stats["hit_rate"],
            stats["graph_hits"],
            total,
            stats["num_graphs"],
            _mib(self.graph_bytes),
            misses or "none",
            self.options.admission,
        )

    @staticmethod
    def _replay(manager: ReplayableGraph, inputs: Sequence[Any]) -> torch.Tensor:
        return manager.execute(
            {_BUFFER_KEYS[i]: x for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
        )[0]

    def _capture(
        self,
        key: GraphKey,
        record: _KeyRecord,
        inputs: Sequence[Any],
        device: torch.device,
        log_level: int = logging.INFO,
    ) -> bool:
        if self._refuse_if_hooked("before"):
            return False
        start = time.perf_counter()
        pool_key = (device, key[0])
        pool = self._capture_pools.get(pool_key) if self.options.share_pools else None
        try:
            encoder = ExactShapeEncoder(self.forward, inputs, *record.output)
            captured = self.backend.capture(encoder, self.vllm_config, device, pool)
        except BaseException as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            self.admission.record_failure()
            self._records.clear()
            logger.error(
                "%s encoder CUDA graph capture failed for input shapes %s; the adapter is now "
                "unusable and later calls raise. Restart the worker, optionally with "
                "--hf-overrides '{\"encoder_cuda_graph\": false}'.",
                self.name,
                _describe(key),
            )
            raise
        capture_ms = (time.perf_counter() - start) * 1e3
        if self.options.share_pools:
            self._capture_pools[pool_key] = captured.pool
        if self._refuse_if_hooked("during"):  # the captured forward registered hooks itself
            return False
        # Registered only after a complete capture: a failure leaves no half-registered graph.
        self.graphs[key] = captured.graph
        self.graph_info[key] = GraphInfo(captured.pool_bytes, captured.static_bytes, capture_ms)
        self.admission.record_captured(key)
        self._records.pop(key, None)
        self._log_capture(key, record.verdict, self.graph_info[key], log_level)
        return True

    def _log_capture(self, key: GraphKey, verdict: CostVerdict | None, info: GraphInfo, level: int) -> None:
        if verdict is not None:
            self.cost_model.record_capture(verdict.capture_ms, info.capture_ms)
        logger.log(
            level,
            # the first literal is the prefix that log readers match
            "Captured %s encoder CUDA graph %d/%d for inputs %s in %.1f ms"
            ": %s (pool +%s, static %s); %s graphs hold %s%s",
            self.name,
            len(self.graphs),
            self.options.max_graphs,
            _describe(key),
            info.capture_ms,
            _mib(info.total_bytes),
            _mib(info.pool_bytes),
            _mib(info.static_bytes),
            self.name,
            _mib(self.graph_bytes),
            "" if verdict is None else f" ({verdict.describe()})",
        )

    def _refuse_if_hooked(self, when: str) -> bool:
        hooks = list(self._hooks_in_captured_region())
        if not hooks:
            return False
        shown = ", ".join(hooks[: self.HOOKS_NAMED]) + (
            f" (+{len(hooks) - self.HOOKS_NAMED} more)" if len(hooks) > self.HOOKS_NAMED else ""
        )
        self._eager_reason = f"module hooks in the captured region: {shown}"
        self.admission.record_failure()
        self._records.clear()
        logger.warning(
            "%s encoder CUDA graphs turned off: hooks found %s capture on %s. A CUDA graph replay "
            "skips Python hooks, so this encoder now runs eagerly (hooks run as registered). To use "
            "graphs, remove the hooks before the model serves (vLLM's --enable-layerwise-nvtx-tracing "
            "adds them to every module); to silence this, pass --hf-overrides "
            "'{\"encoder_cuda_graph\": false}'.",
            self.name,
            when,
            shown,
        )
        return True

    def _hooks_in_captured_region(self) -> Iterator[str]:
        from torch.nn.modules import module as torch_module

        for attr, register in _GLOBAL_HOOKS:
            if getattr(torch_module, attr, None):
                yield f"every module (torch.nn.modules.module.{register})"
        for name, module in self._captured_module_tree():
            kinds = [
                kind.strip("_").replace("_hooks", "") for kind in _MODULE_HOOKS if getattr(module, kind, None)
            ]
            if kinds:
                yield f"{name} ({'/'.join(kinds)} hook)"

    def _captured_module_tree(self) -> Iterator[tuple[str, nn.Module]]:
        owner = (
            self.forward if isinstance(self.forward, nn.Module) else getattr(self.forward, "__self__", None)
        )
        if not isinstance(owner, nn.Module):
            return
        owner_name = type(owner).__name__
        if self.captured_modules is None:
            yield from owner.named_modules(prefix=owner_name)
            return
        for sub in self.captured_modules:
            yield from owner.get_submodule(sub).named_modules(prefix=f"{owner_name}.{sub}")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"
