"""Fixtures for the adapter tests: the adapter package as vllm-omni imports it, a CPU device
backend for the adapter's seam, and log capture for vLLM's loggers."""

from __future__ import annotations

import contextlib
import importlib

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import logs

MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"
REPO_ADAPTER = (
    Path(__file__).resolve().parents[4] / "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph"
)


def _sources(package: Path) -> dict[str, str]:
    """sha256 of every module of the adapter package ``package``, by file name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(package.glob("*.py"))}


def _source_adapter_in_place() -> None:
    """Where the adapter is installed beside vllm-omni's model file, the installed modules must equal
    the source tree's (a stale install fails loudly instead of testing old code); where it is not
    installed, the source tree's package is loaded under its in-tree name."""
    spec = importlib.util.find_spec(MODULE)
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent
        have, want = _sources(installed), _sources(REPO_ADAPTER)
        if have != want:
            names = sorted(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
            pytest.fail(
                f"installed adapter {installed} differs from {REPO_ADAPTER} in {', '.join(names)}: "
                "reinstall it from the source tree"
            )
        return
    importlib.import_module("vllm_omni.model_executor.models.minicpmo_4_5")
    sibling = MODULE.rsplit(".", 1)[0] + ".siglip_attention"  # the options registry reads its key from it
    if importlib.util.find_spec(sibling) is None:
        spec = importlib.util.spec_from_file_location(sibling, REPO_ADAPTER.parent / "siglip_attention.py")
        sys.modules[sibling] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[sibling])
    spec = importlib.util.spec_from_file_location(
        MODULE, REPO_ADAPTER / "__init__.py", submodule_search_locations=[str(REPO_ADAPTER)]
    )
    sys.modules[MODULE] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[MODULE])


@pytest.fixture(scope="session")
def ecg():
    """The adapter package under its in-tree name; its modules are attributes of the package
    (``ecg.backend``, ``ecg.adapter``, ...)."""
    _source_adapter_in_place()
    return importlib.import_module(MODULE)


@pytest.fixture(scope="session")
def vllm_config():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return standalone_vllm_config()


class StaticBufferGraph:
    """A CPU stand-in for vLLM's captured manager that keeps its data flow.

    Built as ``EncoderCudaGraphManager`` builds a graph: the static input buffers
    come from the encoder's ``prepare_encoder_cudagraph_capture_inputs``, called in
    whatever autograd mode the capturing call runs in, and the output buffer is
    allocated under ``inference_mode``. ``execute`` copies the inputs into the
    buffers with the encoder's padding logics (in the caller's mode), recomputes the
    output into the buffer under ``inference_mode`` (a replay writes it outside
    autograd) and returns the encoder's post-processed clone.
    """

    graph_pool = None

    def __init__(self, encoder, device):
        self.encoder = encoder
        self.config = encoder.get_encoder_cudagraph_config()
        capture = encoder.prepare_encoder_cudagraph_capture_inputs(
            encoder.tokens, 1, 0, device, encoder.dtype
        )
        self.input_buffers = capture.values
        with torch.inference_mode():
            self.output_buffer = torch.empty_like(encoder.encoder_cudagraph_forward(dict(self.input_buffers)))
        self.graph_hits = 0
        self.graph_misses = 0

    def execute(self, mm_kwargs):
        replay = self.encoder.prepare_encoder_cudagraph_replay_buffers(mm_kwargs, 1, 0)
        for key, buf in self.input_buffers.items():
            self.config.padding_logics[key](buf, replay.values[key])
        with torch.inference_mode():
            self.output_buffer.copy_(self.encoder.encoder_cudagraph_forward(dict(self.input_buffers)))
        self.graph_hits += 1
        dest = {}
        self.encoder.postprocess_encoder_output({"default": self.output_buffer}, [0], [1], dest, clone=True)
        return [dest[0]]


class CpuMeasurement:
    """A scripted eager-call measurement; ``sample()`` is None while ``backend.ready`` is False."""

    def __init__(self, backend, host_ms, gpu_ms, busy_ms, hold_ms, peak_bytes):
        self.backend = backend
        self.host_ms = host_ms
        self.peak_bytes = peak_bytes
        self._times = (gpu_ms, busy_ms, hold_ms)

    def sample(self):
        if not self.backend.ready:
            return None
        gpu_ms, busy_ms, hold_ms = self._times
        return importlib.import_module(MODULE).EagerCallSample(self.host_ms, gpu_ms, busy_ms, hold_ms)


class CpuGraphBackend:
    """The adapter's device seam on CPU: CPU tensors are eligible, measurements and captures scripted.

    Records every capture as ``(output shape, [input shape or None])`` in ``captures``
    (and the captured ``ExactShapeEncoder`` in ``encoders``), every device asked for free
    memory in ``devices_asked``, the output shape of every measured eager call in
    ``measured`` and the hold of every held one in ``holds``. Only tensor inputs count for
    eligibility (None and other inputs do not).

    Args:
        free: free bytes reported, or a callable returning them (default: plenty).
        fail_with: an exception every capture raises.
        timing: ``(host_ms, gpu_ms[, busy_ms])`` of every measured eager call, or a callable
            ``timing(output)`` returning one; default a launch-bound 10 ms call. Without
            ``busy_ms`` the GPU idles while the host enqueues and works the rest of the span:
            ``busy_ms = max(0, gpu_ms - host_ms)``.
        busy_needs_hold: False: every measurement shows the busy time (a backend that times the
            GPU's work). True: as on CUDA, an unheld call shows its span only, and a call held
            ``hold`` ms shows ``busy_ms = max(busy, gpu_ms - hold)`` (the GPU catches up with
            the host when the hold is shorter than its idle time) and no span.
        peak_bytes: peak allocation delta reported per measured call, or ``peak_bytes(output)``.
        pool_bytes: pool growth reported per capture, or ``pool_bytes(encoder)``.
        ready: whether GPU times can be read back (settable later: ``backend.ready = True``).
    """

    STREAM = 7

    def __init__(
        self,
        free=None,
        fail_with=None,
        timing=(10.0, 10.0),
        peak_bytes=0,
        pool_bytes=0,
        ready=True,
        busy_needs_hold=False,
    ):
        self.free = free
        self.fail_with = fail_with
        self.timing = timing
        self.peak_bytes = peak_bytes
        self.pool_bytes = pool_bytes
        self.ready = ready
        self.busy_needs_hold = busy_needs_hold
        self.captures = []
        self.encoders = []
        self.devices_asked = []
        self.measured = []
        self.holds = []
        self.pools = []

    def eligible_device(self, inputs):
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]  # not None, no other input
        if not tensors:
            return None
        devices = {x.device for x in tensors}
        return devices.pop() if len(devices) == 1 else None

    def replay_stream(self, device):
        return self.STREAM

    def free_bytes(self, device):
        self.devices_asked.append(device)
        if callable(self.free):
            return self.free()
        return 1 << 62 if self.free is None else self.free

    def scripted(self, out):
        """``(host_ms, gpu_ms, busy_ms)`` of an eager call with output ``out``."""
        host_ms, gpu_ms, *busy = self.timing(out) if callable(self.timing) else self.timing
        return host_ms, gpu_ms, busy[0] if busy else max(0.0, gpu_ms - host_ms)

    def measure_eager(self, device, call, hold_ms=0.0):
        out = call()
        self.measured.append(tuple(out.shape))
        host_ms, gpu_ms, busy_ms = self.scripted(out)
        peak = self.peak_bytes(out) if callable(self.peak_bytes) else self.peak_bytes
        if hold_ms > 0:
            self.holds.append(hold_ms)
            times = (None, max(busy_ms, gpu_ms - hold_ms), hold_ms)
        else:
            times = (gpu_ms, None if self.busy_needs_hold else busy_ms, 0.0)
        return out, CpuMeasurement(self, host_ms, *times, peak)

    def capture(self, encoder, vllm_config, device, pool):
        shapes = [None if t is None else tuple(t[0]) for t in encoder.templates]
        self.captures.append((tuple(encoder.output_shape), shapes))
        self.encoders.append(encoder)
        if self.fail_with is not None:
            raise self.fail_with
        if pool is None:
            pool = object()
            self.pools.append(pool)
        grown = self.pool_bytes(encoder) if callable(self.pool_bytes) else self.pool_bytes
        captured = importlib.import_module(MODULE).CapturedGraph
        return captured(StaticBufferGraph(encoder, device), pool, grown, encoder.static_bytes)


@pytest.fixture
def cpu_backend():
    """The :class:`CpuGraphBackend` class (construct one per adapter)."""
    return CpuGraphBackend


@pytest.fixture
def log_records():
    """``log_records(logger) -> LogRecords`` attached to ``logger`` for the test (``helpers.logs``)."""
    with contextlib.ExitStack() as stack:
        yield lambda target: stack.enter_context(logs.captured(target))
