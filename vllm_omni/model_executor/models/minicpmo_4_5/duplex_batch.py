# SPDX-License-Identifier: Apache-2.0
"""Cross-session batching of MiniCPM-o 4.5's duplex audio chunks: one encoder call per engine step.

vllm-omni's model runner calls the stage model's ``preprocess`` once per scheduled request; for a
duplex append that runs the duplex stage, which encodes the session's 1 s audio chunk through
``get_audio_embedding_streaming`` on its own (one graph replay per session), bitwise equal to its
eager encode: the default. With ``encoder_cuda_graph_duplex_batch:
true`` (opt-in) the runner hands every duplex append of a step to :func:`preprocess_append_batch`
instead, and their chunks are encoded in one batched call, replayed from one CUDA graph per batch
bucket:

- **Coroutines.** Each request's own ``preprocess`` runs unchanged, in a worker thread of
  :class:`_TaskPool`, one at a time; when it reaches the chunk's encoder call
  (``streaming_audio.encode_streaming_chunk`` asks :func:`route`) it parks. Once every request
  has parked or finished, the runner's thread encodes all parked chunks together
  (:meth:`DuplexBatchEncoder.encode`) and resumes each request with its rows, so everything
  around the encoder (session state, mel processing, frames, token bookkeeping) is the stage's
  own code, in request order. The thread-local state a request runs under (autograd and
  inference mode, CUDA device and stream, context variables) is the runner thread's.
- **Paged K/V.** A batched session's Whisper cache lives in pages of one pool per device
  (:class:`~.duplex_rows.KVPagePool`, ``(layers, K/V, pages, 16, heads, head_dim)``), referenced by a
  :class:`PagedStreamingCache` (its pages and length). A batched call writes each row's new K/V
  into its own pages and attends over its own pages only: rows never attend across the batch,
  and no cache is copied in or out per step. Pages come back to the pool when the session's
  cache is dropped (a reset, a finished session).
- **One graph per bucket.** The batched forward (:func:`~.duplex_rows.encode_rows`) takes the rows' mel
  (padded to the bucket with rows that write and read only scratch pages) and one int32 tensor
  of per-row data: the position table rows, the page table, the cached lengths and the slots the
  new K/V go to. Its shapes depend on the bucket alone (1, 2, 4, 8, 16, 32 rows), so every past
  length of the 1500-position cache cycle, a session's first chunk and a reset session replay
  the same graph.
- **Attention.** vLLM's FlashAttention over the pages (``flash_attn_varlen_func`` with a block
  table) where it can run: CUDA, compute capability 8.0+, bf16/fp16, and vLLM's compiled FA2 op
  registered (a vLLM install without its compiled extensions imports the Python package but has
  no op). Elsewhere a gather of the pages and masked SDPA
  (:func:`~.duplex_rows.reference_paged_attention`). The choice is made once per device and
  dtype (:func:`~.duplex_rows.paged_attention_choice`), logged at INFO with its reason (in the
  start-up line for the model's device) and kept in :meth:`DuplexBatchEncoder.stats`.

Per-row parity: bitwise with the SDPA reference attention and the fused layers. The rows run the
per-session path's fused Whisper layers; cuDNN attention over a row's gathered pages, the
positions past it masked with ``-inf``, gives the row its unmasked call's bits; and the GEMMs and
convolutions that round a batch differently on the device (found by
:func:`~.duplex_rows.probe_row_plan` when a page pool is made, e.g. Whisper's ``fc2`` GEMM) run
row by row. With vLLM's FlashAttention (another attention kernel than the session's own) or
unfused layers the rows are not bitwise. Opt-in all the same: a single session's chunk and the
first session after start-up are faster on the per-session path (the default,
``encoder_cuda_graph_duplex_batch: false``), and the page pool and batch graphs take memory at
start-up; the measured figures are in the design page's "Batched steps" section. A chunk the
batched forward does not cover (other framing or length, autograd, FP16 Whisper, a cache the
eager path made, a full pool) is encoded on its own, as without batching.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import queue
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger

from . import streaming_audio as sa
from .duplex_rows import (
    PAGE_SIZE,
    KVPagePool,
    PagedStreamingCache,
    RowPlan,
    encode_rows,
    on_device,
    paged_attention_choice,
    probe_row_plan,
)
from .encoder_cuda_graph import EncoderCudaGraphOptions, lora_may_reach, make_encoder_cuda_graph
from .encoder_graphs import AUDIO_CAPTURED_MODULES

logger = init_logger(__name__)

__all__ = [
    "BATCH_BUCKETS",
    "ChunkRequest",
    "DuplexBatchEncoder",
    "can_batch_append",
    "init_duplex_batch",
    "preprocess_append_batch",
    "route",
    "run_batched",
]

#: Rows per batched call: a step's chunks are padded up to the next bucket (larger steps split).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
#: Mel frames of context the duplex stage frames a chunk with (prefix after the first chunk, suffix).
CONTEXT_FRAMES = 2


def bucket_for(rows: int, largest: int) -> int:
    """The smallest bucket that holds ``rows`` rows (at most ``largest``)."""
    return next(b for b in BATCH_BUCKETS if b >= min(rows, largest))


# ---------------------------------------------------------------------------


@dataclass
class ChunkRequest:
    """One parked chunk call: what ``streaming_audio.encode_streaming_chunk`` was asked, and the
    session's cache at that moment (``model.audio_past_key_values``)."""

    model: nn.Module
    wavforms: torch.Tensor
    positions: int
    total_seq_len: int
    context: tuple
    cache: Any
    #: set by the encoder: the chunk's embeddings and the session's cache after it, or what it raised
    embeds: torch.Tensor | None = None
    new_cache: Any = None
    error: BaseException | None = None


class DuplexBatchEncoder:
    """Encodes a step's parked chunks: batched rows through one graph per bucket, the rest alone.

    Args:
        model: the thinker.
        graph: the batched forward's CUDA graph adapter (None: run it eagerly).
        sessions: sessions the page pool holds (``duplex_max_sessions``).
        chunk: positions per chunk (50 at 1 s).
    """

    def __init__(self, model: nn.Module, graph: Any, sessions: int, chunk: int) -> None:
        self.model = model
        self.graph = graph
        self.sessions = sessions
        self.chunk = chunk
        self.largest = bucket_for(sessions, BATCH_BUCKETS[-1])
        self._pools: dict[tuple[torch.device, int | None], KVPagePool] = {}
        #: (device, dtype) -> (attention, reason), chosen and logged once each
        self._attention: dict[tuple[torch.device, torch.dtype], tuple[str, str]] = {}
        #: rows encoded batched / requests encoded alone, since construction
        self.batched_rows = 0
        self.single_rows = 0
        self.batched_calls = 0

    # -- eligibility ---------------------------------------------------------------
    def _frames(self, prefix: int) -> int:
        return 2 * self.chunk + CONTEXT_FRAMES + (CONTEXT_FRAMES if prefix else 0)

    def batchable(self, request: ChunkRequest) -> bool:
        """Whether the batched forward computes this chunk as its own call would."""
        model, wav = request.model, request.wavforms
        use_context, prefix, suffix, cnn_min = request.context
        return (
            model is self.model
            and not model.training
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(wav.device.type)
            and model.apm.conv1.weight.dtype != torch.float16
            and use_context is True
            and (prefix == CONTEXT_FRAMES or (prefix == 0 and self._first_chunks(wav.device)))
            and suffix == CONTEXT_FRAMES
            and cnn_min is None
            and request.positions == self.chunk
            and wav.dim() == 3
            and wav.shape[0] == 1
            and wav.shape[1] == model.apm.config.num_mel_bins
            and wav.shape[2] == self._frames(prefix)
            and request.total_seq_len <= model.apm.embed_positions.weight.shape[0]
            and (
                request.cache is None
                or isinstance(request.cache, (sa.StreamingAudioKVCache, PagedStreamingCache))
            )
        )

    def _first_chunks(self, device: torch.device) -> bool:
        """Whether a session's first chunk is batched (its row gets its own call's bits)."""
        plan = self.pool(device).row_plan
        return plan is None or plan.first_chunks

    def pool(self, device: torch.device) -> KVPagePool:
        """The page pool of ``device`` and its current stream (allocated on first use)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        pool = self._pools.get((device, stream))
        if pool is None:
            apm = self.model.apm
            heads = apm.config.encoder_attention_heads
            pool = KVPagePool(
                layers=len(apm.layers),
                heads=heads,
                head_dim=apm.config.d_model // heads,
                max_positions=apm.embed_positions.weight.shape[0],
                sessions=self.sessions,
                rows=self.largest,
                chunk=self.chunk,
                dtype=apm.conv1.weight.dtype,
                device=device,
            )
            pool.row_plan = self._row_plan(device)
            self._pools[(device, stream)] = pool
        return pool

    def _row_plan(self, device: torch.device) -> RowPlan | None:
        """The device's :class:`~.duplex_rows.RowPlan`, probed once (and logged at INFO) where the
        batched rows run the fused layers over gathered pages; None elsewhere (every op batched)."""
        if self.attention(device) != "reference" or not getattr(self.model.apm, "_fused_layers", False):
            return None
        plan = probe_row_plan(self.model, self.buckets(), self.chunk, self._frames(CONTEXT_FRAMES), device)
        logger.info("MiniCPM-o 4.5 duplex audio batching on %s, exact rows: %s", device, plan.describe())
        return plan

    def pool_bytes(self) -> int:
        """Bytes of one page pool of this encoder (what :meth:`pool` allocates per device and stream)."""
        apm = self.model.apm
        positions = apm.embed_positions.weight.shape[0]
        pages = KVPagePool.page_count(
            sessions=self.sessions, rows=self.largest, chunk=self.chunk, max_positions=positions
        )
        per_position = len(apm.layers) * 2 * apm.config.d_model * apm.conv1.weight.element_size()
        return pages * PAGE_SIZE * per_position

    def attention_choice(self, device: torch.device, *, log: bool = True) -> tuple[str, str]:
        """``(attention, reason)`` of batched calls on ``device``: ``"flash"`` or ``"reference"``
        (:func:`~.duplex_rows.paged_attention_choice` for Whisper's dtype), chosen once per device
        and dtype; the first time, one INFO line says which and why (``log=False``: the caller
        logs it)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.accelerator.current_device_index())
        dtype = self.model.apm.conv1.weight.dtype
        choice = self._attention.get((device, dtype))
        if choice is None:
            choice = self._attention[(device, dtype)] = paged_attention_choice(device, dtype)
            if log:
                logger.info(
                    "MiniCPM-o 4.5 duplex audio batching on %s: %s", device, describe_attention(*choice)
                )
        return choice

    def attention(self, device: torch.device) -> str:
        """The attention of batched calls on ``device`` (a key of ``duplex_rows.ATTENTION``)."""
        return self.attention_choice(device)[0]

    # -- a step ----------------------------------------------------------------------
    def encode(self, requests: Sequence[ChunkRequest]) -> None:
        """Encode every request (sets ``embeds`` and ``new_cache``): the batchable ones in batched
        calls of at most the largest bucket, in order, the others on their own."""
        rows: list[tuple[ChunkRequest, PagedStreamingCache]] = []
        for request in requests:
            paged = self._paged(request) if self.batchable(request) else None
            if paged is None:
                self._encode_alone(request)
            else:
                rows.append((request, paged))
        for first in range(0, len(rows), self.largest):
            self._encode_batch(rows[first : first + self.largest])

    def _paged(self, request: ChunkRequest) -> PagedStreamingCache | None:
        """The request's cache as pages reserved for this chunk, or None (the pool is full)."""
        pool = self.pool(request.wavforms.device)
        cache = request.cache
        if isinstance(cache, PagedStreamingCache) and cache.pool is pool:
            paged = cache
        elif isinstance(cache, sa.StreamingAudioKVCache):
            paged = PagedStreamingCache.from_blocks(pool, cache)
        elif cache is None:
            paged = PagedStreamingCache(pool)
        else:
            return None
        if paged is None or not pool.reserve(paged, paged.length + request.positions):
            return None
        return paged

    def _encode_alone(self, request: ChunkRequest) -> None:
        """The per-session path, as without batching (a paged cache goes back to blocks)."""
        model = request.model
        saved = model.audio_past_key_values
        model.audio_past_key_values = request.cache
        try:
            request.embeds = sa.encode_streaming_chunk(
                model, request.wavforms, request.positions, request.total_seq_len, request.context
            )
            request.new_cache = model.audio_past_key_values
        finally:
            model.audio_past_key_values = saved
        self.single_rows += 1

    def inputs(
        self,
        rows: Sequence[tuple[torch.Tensor, int, PagedStreamingCache | None]],
        device: torch.device,
        bucket: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KVPagePool]:
        """The batched forward's tensor inputs for ``rows`` of ``(mel, prefix, cache)``, padded to
        ``bucket`` (default: the smallest that holds them; a row without a cache is a padding row:
        scratch pages only). A real row's page table is its pages, then the pool's zero page."""
        pool = self.pool(device)
        bucket = bucket_for(max(1, len(rows)), self.largest) if bucket is None else bucket
        n, per_row = self.chunk, pool.pages_per_session
        frames = self._frames(CONTEXT_FRAMES)
        mel = torch.zeros(
            (bucket, self.model.apm.config.num_mel_bins, frames), dtype=torch.float32, device=device
        )
        start, used, positions, table, slots = [], [], [], [], []
        for r in range(bucket):
            wav, prefix, cache = rows[r] if r < len(rows) else (None, CONTEXT_FRAMES, None)
            if cache is None:  # padding: its positions' own scratch slots (code 0), a scratch page to read
                start.append(0)
                used.append(n)
                positions.extend(range(n))
                table.extend([pool.scratch_start + (r * n) // PAGE_SIZE] * per_row)
                slots.extend([0] * n)
                continue
            mel[r, :, : wav.shape[-1]].copy_(wav[0])
            past = cache.length
            start.append(1 if prefix else 0)
            used.append(past + n)
            positions.extend(range(past, past + n))
            table.extend(cache.pages + [pool.zero_page] * (per_row - len(cache.pages)))  # never scratch
            slots.extend(slot + 1 for slot in pool.slots(cache, past, n))
        return mel, on_device(start + used + positions + table + slots, device, torch.int32), pool

    def _encode_batch(self, rows: Sequence[tuple[ChunkRequest, PagedStreamingCache]]) -> None:
        device = rows[0][0].wavforms.device
        mel, meta, pool = self.inputs([(req.wavforms, req.context[1], cache) for req, cache in rows], device)
        pool.zero_reserved()  # the pages the rows took this step, before the forward writes them
        args = (mel, meta, pool, self.chunk, self.attention(device))
        out = self.graph(*args) if self.graph is not None else encode_rows(self.model, *args)
        for r, (request, cache) in enumerate(rows):
            cache.length += request.positions
            request.embeds, request.new_cache = out[r : r + 1], cache
        self.batched_rows += len(rows)
        self.batched_calls += 1

    def buckets(self) -> list[int]:
        """The batch buckets this encoder's calls use (up to the one holding every session)."""
        return [b for b in BATCH_BUCKETS if b <= self.largest]

    def stats(self) -> dict[str, Any]:
        pools = list(self._pools.values())
        return {
            "batched_calls": self.batched_calls,
            "batched_rows": self.batched_rows,
            "single_rows": self.single_rows,
            "pool_bytes": sum(p.nbytes for p in pools),
            "free_pages": sum(p.free_pages for p in pools),
            "attention": {str(device): name for (device, _), (name, _) in self._attention.items()},
        }


# ---------------------------------------------------------------------------
# Coroutines: each request's preprocess runs as written, parked at its encoder call
# ---------------------------------------------------------------------------

_local = threading.local()


class _ThreadState:
    """What a request's code runs under in the runner's thread: autograd and inference mode, the
    CUDA device and stream, context variables (applied in a worker thread)."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.device = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device = (torch.accelerator.current_device_index(), torch.accelerator.current_stream())
        self.context = contextvars.copy_context()

    @contextlib.contextmanager
    def applied(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.device is not None:  # the device, then its stream (a torch.Stream sets itself current)
                stack.enter_context(torch.accelerator.device_index(self.device[0]))
                stack.enter_context(self.device[1])
            yield


class _Task:
    """One request's call, run in a worker thread that hands control back when it parks or ends."""

    def __init__(self, call: Callable[[], Any], state: _ThreadState) -> None:
        self.call, self.state = call, state
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.request: ChunkRequest | None = None

    def body(self) -> None:  # worker thread
        self._go.acquire()
        _local.task = self
        try:
            with self.state.applied():
                self.result = self.state.context.copy().run(self.call)  # one context per task
        except BaseException as exc:  # noqa: BLE001 - handed to the runner's thread, re-raised there
            self.error = exc
        finally:
            _local.task = None
            self.done = True
            self._back.release()

    def advance(self) -> None:  # runner's thread: run until the task parks or ends
        self._go.release()
        self._back.acquire()

    def park(self, request: ChunkRequest) -> ChunkRequest:  # worker thread
        self.request = request
        self._back.release()
        self._go.acquire()
        self.request = None
        return request


class _TaskPool:
    """Worker threads (daemons) that run :class:`_Task` bodies; grows to the largest step seen."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def _work(self) -> None:
        while True:
            task = self._jobs.get()
            task.body()
            del task  # keep nothing of a finished request alive
            with self._lock:
                self._idle += 1

    def submit(self, task: _Task) -> None:
        with self._lock:
            if self._idle == 0:
                thread = threading.Thread(target=self._work, name="duplex-append", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1
        self._jobs.put(task)


_POOL = _TaskPool()


def route(model: nn.Module, wavforms: torch.Tensor, positions: int, total_seq_len: int, context: tuple):
    """``streaming_audio.encode_streaming_chunk``'s first question: the chunk's embeddings when a
    batched step encodes it (the call parks until then), else None (encode it alone; a paged
    cache goes back to the per-session layout first).

    Raises:
        RuntimeError: the batched step failed (its error chained as the cause); the model's
            ``audio_past_key_values`` is this session's cache again.
    """
    task = getattr(_local, "task", None)
    if task is not None:
        request = task.park(
            ChunkRequest(model, wavforms, positions, total_seq_len, context, model.audio_past_key_values)
        )
        if request.error is not None:
            # this session's cache back in the shared attribute (another parked call set it since),
            # and an error no caller takes for its own call's signature: vllm-omni's duplex stage
            # retries a chunk call that raised TypeError with other framing, on whatever cache the
            # attribute then holds
            model.audio_past_key_values = request.cache
            if not isinstance(request.error, Exception):
                raise request.error  # KeyboardInterrupt, SystemExit: as they are
            raise RuntimeError(
                f"batched duplex audio step failed: {type(request.error).__name__}: {request.error}"
            ) from request.error
        model.audio_past_key_values = request.new_cache
        return request.embeds
    cache = model.audio_past_key_values
    if isinstance(cache, PagedStreamingCache):
        model.audio_past_key_values = cache.to_blocks()
    return None


def _parked(tasks: Sequence[_Task]) -> list[_Task]:
    """The calls of ``tasks`` parked at a chunk, waiting for its encode."""
    return [t for t in tasks if not t.done and t.request is not None]


def _end_parked(tasks: Sequence[_Task], exc: BaseException) -> None:
    """Resume each call of ``tasks`` parked at a chunk with ``exc`` as that chunk's error
    (:func:`route` raises from it), until every one has ended."""
    while parked := _parked(tasks):
        for task in parked:
            task.request.error = exc
            task.advance()


def run_batched(model: nn.Module, calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` (each one request's code) with their streaming chunks encoded together.

    Each call runs in a worker thread, one at a time and in order, until it parks at a chunk's
    encoder call or ends; then the parked chunks are encoded by ``model._duplex_batch`` and their
    calls resumed, in order, until every call has ended. The model's ``audio_past_key_values`` is
    the same after as before. Without a batch encoder the calls run one after the other here.

    Raises:
        the first exception a call raised (after every call has ended); a call parked at a chunk
        whose batched step failed raises ``RuntimeError`` from that failure (:func:`route`).
    """
    encoder = getattr(model, "_duplex_batch", None)
    if encoder is None or torch.is_autocast_enabled():
        return [call() for call in calls]
    state = _ThreadState()
    tasks = [_Task(call, state) for call in calls]
    saved = model.audio_past_key_values
    try:
        running: list[_Task] = []
        for task in tasks:
            try:
                _POOL.submit(task)  # may fail to start a thread
            except BaseException as exc:
                _end_parked(running, exc)  # no call of this step stays parked in a worker for good
                raise
            running.append(task)
            task.advance()
        while parked := _parked(running):
            requests = [t.request for t in parked]
            try:
                encoder.encode(requests)
            except BaseException as exc:  # noqa: BLE001 - re-raised by every parked call
                for request in requests:
                    request.error = exc
            for task in parked:
                task.advance()
    finally:
        model.audio_past_key_values = saved
    for task in tasks:
        if task.error is not None:
            raise task.error
    return [task.result for task in tasks]


# ---------------------------------------------------------------------------
# The stage model's hooks and the wiring
# ---------------------------------------------------------------------------


def can_batch_append(stage: nn.Module, req_infos: dict[str, Any]) -> bool:
    """Whether the runner may hand this request to :func:`preprocess_append_batch`: a duplex
    append (data plane, before the request's prompt end) on the thinker stage, with batching on."""
    if getattr(stage, "model_stage", None) != "llm" or getattr(stage.thinker, "_duplex_batch", None) is None:
        return False
    duplex = req_infos.get("duplex")
    if not isinstance(duplex, dict) or duplex.get("data_plane") is not True:
        return False
    prompt_len, offset = req_infos.get("duplex_prompt_len"), req_infos.get("duplex_token_offset", 0)
    return not (isinstance(prompt_len, int) and isinstance(offset, int) and offset >= prompt_len)


def preprocess_append_batch(
    stage: nn.Module,
    input_ids: Sequence[torch.Tensor],
    input_embeds: Sequence[torch.Tensor | None],
    req_infos: Sequence[dict[str, Any]],
) -> list[tuple[Any, Any, Any]]:
    """The stage model's ``preprocess`` for several duplex appends: one result per request, in order,
    each what ``preprocess`` returns for it alone; their audio chunks are encoded together."""
    calls = [
        functools.partial(stage.preprocess, input_ids=ids, input_embeds=embeds, **infos)
        for ids, embeds, infos in zip(input_ids, input_embeds, req_infos, strict=True)
    ]
    return run_batched(stage.thinker, calls)


def init_duplex_batch(model: nn.Module, vllm_config: Any, options: EncoderCudaGraphOptions) -> None:
    """Build ``model._duplex_batch`` (``encoder_cuda_graph_duplex_batch``) and log its state.

    Off by default (the option is opt-in; the line then names it). On when the option is on, the
    deployment serves duplex sessions (``session_mode: duplex``)
    with ``duplex_max_sessions`` >= 2 and the model has Whisper; the batched forward gets its own
    CUDA graph adapter (one graph per bucket, ``"count"`` admission) wherever the streaming audio
    adapter exists, else it runs eagerly.
    """
    model._duplex_batch = None
    model_config = getattr(vllm_config, "model_config", None)
    sessions = int(getattr(model_config, "duplex_max_sessions", 1) or 1)
    if getattr(model, "apm", None) is None:
        state = "off (no encoder)"
    elif not options.duplex_batch:
        state = (
            "off (encoder_cuda_graph_duplex_batch=false, the default: each session's chunk on its own, "
            "bitwise equal to eager; true batches a step's chunks, for many concurrent sessions)"
        )
    elif getattr(model_config, "session_mode", "turn") != "duplex":
        state = "off (not a duplex deployment)"
    elif sessions < 2:
        state = f"off (duplex_max_sessions={sessions})"
    else:
        chunk = max(1, round(50 * getattr(model.config, "audio_chunk_length", 1.0)))
        graph = None
        if getattr(model, "_streaming_audio_encoder_graph", None) is not None:
            graph, _ = make_encoder_cuda_graph(
                types.MethodType(encode_rows, model),
                vllm_config,
                _batch_options(options),
                name="duplex audio batch",
                static_args=True,
                captured_modules=AUDIO_CAPTURED_MODULES,
                lora_reason=lora_may_reach(vllm_config, model, AUDIO_CAPTURED_MODULES),
            )
        encoder = model._duplex_batch = DuplexBatchEncoder(model, graph, sessions, chunk)
        largest = encoder.largest
        device = model.apm.conv1.weight.device
        state = (
            f"on, a step's chunks in one call of up to {largest} rows (buckets "
            f"{', '.join(str(b) for b in BATCH_BUCKETS if b <= largest)}), K/V pages for {sessions} sessions, "
            f"{'graphed' if graph is not None else 'eager'}"
        )
        if device.type != "meta":  # the model's device: its attention goes in this line
            state += f"; on {device}: {describe_attention(*encoder.attention_choice(device, log=False))}"
    logger.info("MiniCPM-o 4.5 duplex audio batching: %s", state)


def describe_attention(name: str, reason: str) -> str:
    """The log phrase of an attention choice: ``attention <which> (<reason>)``."""
    which = {
        "flash": "vLLM FlashAttention over the pages",
        "reference": "SDPA over the gathered pages (reference_paged_attention)",
    }[name]
    return f"attention {which}: {reason}"


def _batch_options(options: EncoderCudaGraphOptions) -> EncoderCudaGraphOptions:
    from dataclasses import replace

    return replace(options, max_graphs=len(BATCH_BUCKETS), admission="count")
