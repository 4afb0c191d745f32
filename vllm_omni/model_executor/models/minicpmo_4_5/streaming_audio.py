# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's streaming (duplex) Whisper chunks: one paged, batched forward, one graph per bucket.

Every chunk, a session alone included, runs through :func:`encode_rows`: a
:class:`StreamingAudioChunk` in, ``(embeddings, cache)`` out (:meth:`StreamingAudioEncoder.encode`).
A session's :class:`SessionAudioCache` is a page range of one :class:`KVPagePool`, released
explicitly (:func:`release_cache`). Rows attend over their own pages only, so every past length
shares one graph per bucket (:data:`BUCKETS`); per-row data is one int32 tensor
(:class:`RowLayout`), copied once per call. Each row is bitwise equal to its session encoded alone
(GEMMs whose kernel depends on the row count run row by row, :func:`probe_row_plan`). What the
forward does not cover runs the original eager code (:func:`encode_eager`). Padding rows touch
scratch pages only, so a NaN there or in a free page never reaches a real row. Design:
``docs/design/minicpmo_encoder_cuda_graph/streaming_audio.md``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from vllm.logger import init_logger

from . import fused_layers
from .encoder_cuda_graph import EncoderCudaGraphOptions, lora_may_reach, make_encoder_cuda_graph
from .encoder_graphs import AUDIO_CAPTURED_MODULES

logger = init_logger(__name__)

__all__ = [
    "BUCKETS",
    "CONTEXT_FRAMES",
    "PAGE_SIZE",
    "KVPagePool",
    "RowLayout",
    "RowLinear",
    "RowPlan",
    "SessionAudioCache",
    "StreamingAudioChunk",
    "StreamingAudioEncoder",
    "encode_eager",
    "encode_rows",
    "encode_streaming_chunk",
    "init_streaming_audio",
    "probe_row_plan",
    "release_cache",
]

#: Positions per K/V page (a multiple of 16, as vLLM's FlashAttention wants for paged K/V).
PAGE_SIZE = 16
#: Rows per batched call: a step's chunks are padded up to the next bucket (larger steps split).
BUCKETS = (1, 2, 4, 8, 16, 32)
#: Mel frames of context the duplex stage frames a chunk with (prefix after the first chunk, suffix).
CONTEXT_FRAMES = 2


def bucket_for(rows: int, largest: int) -> int:
    """The smallest bucket that holds ``rows`` rows, at most ``largest``."""
    return next(b for b in BUCKETS if b >= min(rows, largest))


# -- Sessions' caches: pages of one pool


class SessionAudioCache:
    """A duplex session's Whisper self-attention cache: its page range of a :class:`KVPagePool`.

    Attributes:
        pool: the pool holding the pages.
        first_page: the first of the session's ``pool.pages_per_session`` consecutive pages.
        length: cached positions (``get_seq_length``, as vllm-omni's model file reads it).
    """

    def __init__(self, pool: KVPagePool, first_page: int) -> None:
        self.pool, self.first_page, self.length = pool, first_page, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def released(self) -> bool:
        return self.first_page < 0


class KVPagePool:
    """Whisper K/V pages for ``sessions`` duplex sessions and the padding rows of a batched call.

    ``kv`` is ``(layers, 2, pages, PAGE_SIZE, heads, head_dim)`` (index 0 of dim 1: keys, 1:
    values), each layer's keys and values in the paged layout of vLLM's FlashAttention. Session
    ``i`` owns pages ``[i * pages_per_session, (i + 1) * pages_per_session)``, enough for the whole
    position table; after them come ``scratch_pages`` for padding rows. A normal tensor even under
    inference mode (calls under ``no_grad`` write it in place).

    Args:
        sessions: sessions the pool holds at once (``duplex_max_sessions``), at least 1.
        rows: the largest bucket (scratch for that many padding rows of ``chunk`` positions).
        layers, heads, head_dim, max_positions, chunk: Whisper's dimensions and positions per chunk.
        dtype, device: of ``kv``.

    Raises:
        ValueError: ``sessions`` or ``rows`` below 1.
    """

    def __init__(
        self,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        max_positions: int,
        sessions: int,
        rows: int,
        chunk: int,
        dtype: torch.dtype,
        device: Any,
    ) -> None:
        if sessions < 1 or rows < 1:
            raise ValueError(f"a K/V page pool needs sessions >= 1 and rows >= 1, got {sessions} and {rows}")
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.sessions, self.max_positions = sessions, max_positions
        self.pages_per_session = math.ceil(max_positions / PAGE_SIZE)
        self.scratch_start = sessions * self.pages_per_session
        self.scratch_pages = math.ceil(rows * chunk / PAGE_SIZE)
        shape = (layers, 2, self.scratch_start + self.scratch_pages, PAGE_SIZE, heads, head_dim)
        with torch.inference_mode(False):
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(sessions - 1, -1, -1))  # popped from the end: lowest first
        #: the ops batched calls run row by row (:func:`probe_row_plan`; None: every op batched)
        self.row_plan: RowPlan | None = None

    @staticmethod
    def nbytes_for(
        *, layers: int, d_model: int, itemsize: int, max_positions: int, sessions: int, rows: int, chunk: int
    ) -> int:
        """Bytes of a pool of these dimensions (what its constructor allocates)."""
        pages = sessions * math.ceil(max_positions / PAGE_SIZE) + math.ceil(rows * chunk / PAGE_SIZE)
        return layers * 2 * pages * PAGE_SIZE * d_model * itemsize

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def free_sessions(self) -> int:
        return len(self._free)

    def acquire(self) -> SessionAudioCache | None:
        """A new, empty session cache with zeroed pages, or None when every session's pages are taken."""
        if not self._free:
            return None
        first = self._free.pop() * self.pages_per_session
        self.kv[:, :, first : first + self.pages_per_session].zero_()
        return SessionAudioCache(self, first)

    def release(self, cache: SessionAudioCache) -> None:
        """Give ``cache``'s pages back (idempotent)."""
        if cache.released:
            return
        self._free.append(cache.first_page // self.pages_per_session)
        cache.first_page, cache.length = -1, 0

    def positions(self, cache: SessionAudioCache) -> torch.Tensor:
        """``(layers, 2, heads, length, head_dim)``: ``cache``'s positions (a view)."""
        pages = self.kv[:, :, cache.first_page : cache.first_page + self.pages_per_session]
        return pages.flatten(2, 3)[:, :, : cache.length].permute(0, 1, 3, 2, 4)


def release_cache(cache: Any) -> None:
    """Return a session's pages to their pool: on a cache reset and when the session closes.

    Anything else (None, the eager path's ``EncoderDecoderCache``) has nothing to return."""
    if isinstance(cache, SessionAudioCache):
        cache.pool.release(cache)


@dataclass
class StreamingAudioChunk:
    """One duplex chunk to encode.

    Attributes:
        mel: ``(1, n_mels, frames)`` log-mel frames with their context frames (any float dtype;
            on the host or the model's device).
        prefix_frames: 0 for a session's first chunk, else :data:`CONTEXT_FRAMES`.
        cache: the session's cache before the chunk (None before its first chunk), or the eager
            path's ``EncoderDecoderCache``.
    """

    mel: torch.Tensor
    prefix_frames: int
    cache: Any = None


# -- The batched forward (the captured region)


@dataclass(frozen=True)
class RowLayout:
    """Where a call's per-row data sit in its int32 ``meta`` tensor.

    ``meta`` is ``[start (rows), used (rows), positions (rows x n), table (rows x pages), slots
    (rows x n)]``: the conv output position each row's chunk starts at, its valid K/V positions
    after the call, its position-table rows, its page table and the flat slots its new K/V go
    to, each stored as slot + 1. A slot of 0 is the position's own scratch slot (padding rows),
    so all-zero inputs write only scratch, never a session's pages.
    """

    rows: int
    chunk: int
    pages: int

    @property
    def size(self) -> int:
        return self.rows * (2 + 2 * self.chunk + self.pages)

    def split(self, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        r, n, p = self.rows, self.chunk, self.pages
        start, used, positions, table, slots = meta.split((r, r, r * n, r * p, r * n))
        return start, used, positions.view(r, n), table.view(r, p), slots

    def build(
        self, first_pages: np.ndarray, past: np.ndarray, first_chunk: np.ndarray, scratch_start: int
    ) -> np.ndarray:
        """``meta`` for real rows (the leading ``len(past)``) and padding rows, with array operations.

        Args:
            first_pages, past, first_chunk: per real row, the session's first page, its cached
                positions before the chunk and whether the chunk is its first (no prefix frames).
            scratch_start: the pool's first scratch page.
        """
        r, n, p, real = self.rows, self.chunk, self.pages, len(past)
        span = np.arange(n, dtype=np.int64)
        start = np.ones(r, dtype=np.int64)
        start[:real] = np.where(first_chunk, 0, 1)
        start[real:] = 0
        used = np.full(r, n, dtype=np.int64)
        used[:real] = past + n
        positions = np.broadcast_to(span, (r, n)).copy()
        positions[:real] += past[:, None]
        table = np.empty((r, p), dtype=np.int64)
        table[:real] = first_pages[:, None] + np.arange(p)
        pad_rows = np.arange(real, r)
        table[real:] = (scratch_start + (pad_rows * n) // PAGE_SIZE)[:, None]
        slots = np.zeros((r, n), dtype=np.int64)
        slots[:real] = first_pages[:, None] * PAGE_SIZE + past[:, None] + span + 1
        parts = (start, used, positions.ravel(), table.ravel(), slots.ravel())
        return np.concatenate(parts).astype(np.int32)


@dataclass(frozen=True)
class RowPlan:
    """Which ops of :func:`encode_rows` run row by row so that each row keeps its solo bits.

    Attributes:
        gemms: ``(in_features, out_features, bias, rows)`` of the GEMMs that run row by row.
        convs: buckets whose convolutions run row by row.
    """

    gemms: frozenset[tuple[int, int, bool, int]] = frozenset()
    convs: frozenset[int] = frozenset()

    def describe(self) -> str:
        gemms = sorted({(k, n) for k, n, _, _ in self.gemms})
        parts = [
            "GEMMs " + ", ".join(f"{k}x{n}" for k, n in gemms) + " row by row"
            if gemms
            else "every GEMM batched"
        ]
        parts.append(
            f"convolutions row by row at buckets {sorted(self.convs)}"
            if self.convs
            else "convolutions batched"
        )
        return "; ".join(parts)


class RowLinear:
    """``linear(x, weight, bias)`` over ``rows`` rows of ``chunk`` positions (``x`` ``(rows * chunk,
    in_features)``, contiguous): one GEMM, or one per row where ``plan`` says a batch rounds
    differently (each row's GEMM the one ``F.linear`` runs for the row alone)."""

    def __init__(self, plan: RowPlan | None, rows: int, chunk: int) -> None:
        self.plan, self.rows, self.chunk = plan, rows, chunk

    def per_row(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        key = (weight.shape[1], weight.shape[0], bias is not None, self.rows)
        return self.plan is not None and self.rows > 1 and key in self.plan.gemms

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.per_row(weight, bias):
            return nn.functional.linear(x, weight, bias)
        out = x.new_empty((x.shape[0], weight.shape[0]))
        for first in range(0, x.shape[0], self.chunk):
            rows = slice(first, first + self.chunk)
            if bias is None:
                torch.mm(x[rows], weight.t(), out=out[rows])
            else:
                torch.addmm(bias, x[rows], weight.t(), out=out[rows])
        return out


def _convolve(apm: nn.Module, mel: torch.Tensor) -> torch.Tensor:
    """Whisper's convolutions and GELUs: ``(rows, n_mels, frames)`` -> ``(rows, d_model, frames // 2)``."""
    hidden = nn.functional.gelu(apm.conv1(mel.to(dtype=apm.conv1.weight.dtype)))
    return nn.functional.gelu(apm.conv2(hidden))


def _gemms(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of every GEMM :func:`encode_rows` runs (fused layers: q/k/v packed, the
    output projection and ``fc2`` without their biases; unfused: each projection with its bias)."""
    found: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    fused = bool(getattr(model.apm, "_fused_layers", False))
    for layer in model.apm.layers:
        attn = layer.self_attn
        if fused:
            qkv = fused_layers.pack_qkv(attn)
            found += [(qkv.weight, qkv.bias), (attn.out_proj.weight, None), (layer.fc2.weight, None)]
        else:
            found += [
                (m.weight, m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, layer.fc2)
            ]
        found.append((layer.fc1.weight, layer.fc1.bias))
    for name in ("linear1", "linear2"):
        linear = getattr(model.audio_projection_layer, name, None)
        if linear is not None:
            found.append((linear.weight, linear.bias))
    return found


@torch.inference_mode()
def probe_row_plan(
    model: nn.Module, buckets: Sequence[int], chunk: int, frames: int, device: torch.device
) -> RowPlan:
    """Find, on ``device``, the ops :func:`encode_rows` must run row by row (:class:`RowPlan`).

    Each GEMM shape of the forward and the convolutions of ``frames`` mel frames run once on random
    inputs of every bucket of rows and once per row; a bucket whose rows differ in any bit from
    their own calls runs that op row by row. cuBLAS and cuDNN pick kernels by shape, dtype and
    device, not by value, so one probe per device serves every call. Host reads: outside any capture.
    """
    apm, dtype = model.apm, model.apm.conv1.weight.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    seen, gemms, convs = set(), set(), set()
    for weight, bias in _gemms(model):
        key = (weight.shape[1], weight.shape[0], bias is not None)
        if key in seen:
            continue
        seen.add(key)
        for rows in (b for b in buckets if b > 1):
            x = torch.randn((rows * chunk, key[0]), generator=gen, device=device, dtype=dtype)
            alone = [nn.functional.linear(x[r * chunk : (r + 1) * chunk], weight, bias) for r in range(rows)]
            if not torch.equal(nn.functional.linear(x, weight, bias), torch.cat(alone)):
                gemms.add((*key, rows))
    for rows in (b for b in buckets if b > 1):
        mel = torch.randn((rows, apm.config.num_mel_bins, frames), generator=gen, device=device)
        if not torch.equal(
            _convolve(apm, mel), torch.cat([_convolve(apm, mel[r : r + 1]) for r in range(rows)])
        ):
            convs.add(rows)
    return RowPlan(frozenset(gemms), frozenset(convs))


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    used: torch.Tensor,
    flash: bool,
) -> torch.Tensor:
    """Attention of each row's queries ``(rows, n, heads, head_dim)`` (already scaled) over its pages.

    ``keys``/``values``: a layer's pages ``(pages, PAGE_SIZE, heads, head_dim)``; ``table``:
    ``(rows, pages per row)``; ``used``: ``(rows,)`` valid positions. ``flash``: vLLM's
    FlashAttention (varlen, block table, one split, so a row's kernel never depends on the others);
    else SDPA over the gathered pages with the positions past ``used`` masked by ``-inf`` (masked
    positions must be finite). Graph-safe, no host reads. Returns ``(rows, n, heads, head_dim)``.
    """
    rows, n, heads, head_dim = query.shape
    if flash:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q=query.reshape(rows * n, heads, head_dim),
            k=keys,
            v=values,
            max_seqlen_q=n,
            cu_seqlens_q=torch.arange(0, (rows + 1) * n, n, dtype=torch.int32, device=query.device),
            max_seqlen_k=table.shape[1] * PAGE_SIZE,
            seqused_k=used,
            softmax_scale=1.0,
            causal=False,
            block_table=table,
            num_splits=1,
        )
        return out.view(rows, n, heads, head_dim)
    k = keys[table.long()].flatten(1, 2).transpose(1, 2)
    v = values[table.long()].flatten(1, 2).transpose(1, 2)
    out = nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), k, v, attn_mask=_mask(used, table.shape[1], n, query.dtype), scale=1.0
    )
    return out.transpose(1, 2)


def _mask(used: torch.Tensor, pages: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """``(rows, 1, chunk, pages * PAGE_SIZE)`` additive mask: 0 below a row's ``used``, ``-inf`` past it."""
    positions = torch.arange(pages * PAGE_SIZE, device=used.device)
    masked = (positions[None, :] >= used[:, None])[:, None, None, :].expand(used.shape[0], 1, chunk, -1)
    return torch.zeros(masked.shape, dtype=dtype, device=used.device).masked_fill(masked, float("-inf"))


class _PagedRows:
    """The cache :func:`.fused_layers.whisper_encode_layers` runs the rows with: each layer's new
    keys and values go to the rows' slots; attention reads every row's gathered pages."""

    def __init__(self, pool: KVPagePool, slots: torch.Tensor, table: torch.Tensor) -> None:
        self.pool, self.slots, self.table = pool, slots, table.long()

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.pool.kv[layer_idx]
        heads, head_dim = self.pool.heads, self.pool.head_dim
        for side, new in enumerate((key, value)):
            pages[side].view(-1, heads, head_dim).index_copy_(
                0, self.slots, new.transpose(1, 2).reshape(-1, heads, head_dim)
            )
        return tuple(pages[side][self.table].flatten(1, 2).transpose(1, 2) for side in (0, 1))


def _unfused_layers(
    apm: nn.Module,
    hidden: torch.Tensor,
    pool: KVPagePool,
    slots: torch.Tensor,
    table: torch.Tensor,
    used: torch.Tensor,
    rows: int,
    chunk: int,
    linear: RowLinear,
    flash: bool,
) -> torch.Tensor:
    """Whisper's layers module by module over ``(rows * chunk, d_model)``, every GEMM through ``linear``."""
    heads, head_dim, d_model = pool.heads, pool.head_dim, hidden.shape[-1]
    for index, layer in enumerate(apm.layers):
        attn = layer.self_attn
        normed = layer.self_attn_layer_norm(hidden)
        query = linear(normed, attn.q_proj.weight, attn.q_proj.bias) * attn.scaling
        for side, proj in enumerate((attn.k_proj, attn.v_proj)):
            new = linear(normed, proj.weight, proj.bias).view(-1, heads, head_dim)
            pool.kv[index, side].view(-1, heads, head_dim).index_copy_(0, slots, new)
        out = paged_attention(
            query.view(rows, chunk, heads, head_dim), pool.kv[index, 0], pool.kv[index, 1], table, used, flash
        )
        hidden = hidden + linear(out.reshape(rows * chunk, d_model), attn.out_proj.weight, attn.out_proj.bias)
        normed = layer.final_layer_norm(hidden)
        hidden = hidden + linear(
            layer.activation_fn(linear(normed, layer.fc1.weight, layer.fc1.bias)),
            layer.fc2.weight,
            layer.fc2.bias,
        )
    return apm.layer_norm(hidden)


def encode_rows(model: nn.Module, mel: torch.Tensor, meta: torch.Tensor, encoder: Any = None) -> torch.Tensor:
    """The captured region: Whisper over each row's chunk with its own pages, then projection and pooling.

    Args:
        model: the thinker (``apm``, ``audio_projection_layer``, ``audio_avg_pooler``, and
            ``_streaming_audio``, the :class:`StreamingAudioEncoder` whose pool, chunk and
            attention the call uses).
        mel: ``(rows, n_mels, 2 * chunk + 2 * CONTEXT_FRAMES)`` float32 log-mel frames (a first
            chunk's missing frames are zeros at the end; they leave its first ``chunk`` conv
            positions unchanged).
        meta: ``(RowLayout.size,)`` int32 per-row data of :class:`RowLayout`.
        encoder: the :class:`StreamingAudioEncoder` (default ``model._streaming_audio``).

    Returns:
        ``(rows, chunk // audio_pool_step, embed_dim)``; the rows' new K/V are in their pages.
    """
    encoder = model._streaming_audio if encoder is None else encoder
    apm, pool, chunk = model.apm, encoder.pool, encoder.chunk
    rows = mel.shape[0]
    start, used, positions, table, codes = RowLayout(rows, chunk, pool.pages_per_session).split(meta)
    codes = codes.long()
    scratch = pool.scratch_start * PAGE_SIZE + torch.arange(codes.numel(), device=codes.device)
    slots = torch.where(codes > 0, codes - 1, scratch)
    plan = pool.row_plan
    if plan is not None and rows in plan.convs:
        hidden = torch.cat([_convolve(apm, mel[r : r + 1]) for r in range(rows)])
    else:
        hidden = _convolve(apm, mel)
    hidden = hidden.permute(0, 2, 1)  # (rows, chunk + 2, d_model)
    d_model = hidden.shape[-1]
    picks = (start[:, None] + torch.arange(chunk, device=mel.device)).long()
    hidden = hidden.gather(1, picks[:, :, None].expand(rows, chunk, d_model))
    # the position table first, as vllm-omni's streaming encoder adds it (the sum is contiguous)
    hidden = (apm.embed_positions.weight[positions.long()] + hidden).reshape(rows * chunk, d_model)
    linear = RowLinear(plan, rows, chunk)
    if encoder.fused:
        pages = _PagedRows(pool, slots, table)
        mask = _mask(used, table.shape[1], chunk, hidden.dtype)
        hidden, _ = fused_layers.whisper_encode_layers(
            apm, hidden.view(rows, chunk, d_model), mask, pages, linear=linear
        )
        hidden = hidden.reshape(rows * chunk, d_model)
    else:
        hidden = _unfused_layers(
            apm, hidden, pool, slots, table, used, rows, chunk, linear, encoder.attention == "flash"
        )
    projector = model.audio_projection_layer
    parts = [getattr(projector, name, None) for name in ("linear1", "relu", "linear2")]
    if any(p is None for p in parts):
        hidden = projector(hidden)
    else:
        hidden = linear(
            parts[1](linear(hidden, parts[0].weight, parts[0].bias)), parts[2].weight, parts[2].bias
        )
    return model.audio_avg_pooler(hidden.view(rows, chunk, -1).transpose(1, 2)).transpose(1, 2)


# -- The original eager code (what the batched forward does not cover)


def encode_eager(
    model: nn.Module, wavforms: torch.Tensor, cache: Any, positions: int, context: tuple
) -> tuple[torch.Tensor, Any]:
    """vllm-omni's streaming chunk: Whisper with an ``EncoderDecoderCache``, projection, pooling.

    Args:
        wavforms: ``(1, n_mels, frames)``; cache: None or an ``EncoderDecoderCache`` (a
            :class:`SessionAudioCache` is copied into one and its pages released);
        positions: the chunk's positions after the context frames;
        context: ``(use_extra_context, prefix_extra_frames, suffix_extra_frames, cnn_min_length)``.

    Returns:
        ``((1, positions // audio_pool_step, embed_dim), the updated cache)``.
    """
    if isinstance(cache, SessionAudioCache):
        self_attention = DynamicCache()
        kv = cache.pool.positions(cache).unsqueeze(2)
        for layer in range(kv.shape[0]):
            self_attention.update(kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), layer)
        release_cache(cache)
        cache = EncoderDecoderCache(self_attention, DynamicCache())
    past = 0 if cache is None else cache.get_seq_length()
    mask = torch.zeros(
        (wavforms.shape[0], 1, positions, past + positions),
        dtype=model.apm.conv1.weight.dtype,
        device=wavforms.device,
    )
    use_extra_context, prefix, suffix, cnn_min_length = context
    out = model.apm(
        wavforms,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        attention_mask=mask,
        use_extra_context=use_extra_context,
        prefix_extra_frames=prefix,
        suffix_extra_frames=suffix,
        cnn_min_length=cnn_min_length,
    )
    embeds = model.audio_projection_layer(out.hidden_states[model.audio_encoder_layer])
    embeds = model.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2)
    return embeds, out.past_key_values


# -- The encoder: chunks in, (embeddings, cache) out


class StreamingAudioEncoder:
    """Encodes duplex chunks: covered ones in batched calls of at most the largest bucket, one graph
    replay each (or the eager forward without graphs), the rest through :func:`encode_eager`.

    Args:
        model: the thinker.
        graph: the bucket graphs' adapter over :func:`encode_rows` (None: eager forward).
        sessions: sessions the page pool holds (``duplex_max_sessions``).
        chunk: positions per chunk (50 at 1 s).
    """

    def __init__(self, model: nn.Module, graph: Any, sessions: int, chunk: int) -> None:
        self.model, self.graph, self.sessions, self.chunk = model, graph, max(1, sessions), chunk
        self.largest = bucket_for(self.sessions, BUCKETS[-1])
        self.buckets = tuple(b for b in BUCKETS if b <= self.largest)
        self.frames = 2 * chunk + 2 * CONTEXT_FRAMES
        self._pool: KVPagePool | None = None
        self.attention, self.attention_reason = "reference", "not chosen yet"
        self._warned_full = False
        #: rows through the batched forward, calls of it, chunks through the eager code
        self.rows = self.calls = self.eager_chunks = 0

    @property
    def fused(self) -> bool:
        """Whether the rows run the fused Whisper layers (with SDPA over the gathered pages)."""
        return bool(getattr(self.model.apm, "_fused_layers", False))

    @property
    def pool(self) -> KVPagePool:
        """The page pool, allocated (and the device's row plan probed) on first use."""
        if self._pool is None:
            apm = self.model.apm
            device, dtype = apm.conv1.weight.device, apm.conv1.weight.dtype
            heads = apm.config.encoder_attention_heads
            self._pool = KVPagePool(
                layers=len(apm.layers),
                heads=heads,
                head_dim=apm.config.d_model // heads,
                max_positions=apm.embed_positions.weight.shape[0],
                sessions=self.sessions,
                rows=self.largest,
                chunk=self.chunk,
                dtype=dtype,
                device=device,
            )
            self.attention, self.attention_reason = paged_attention_choice(device, dtype)
            if self.fused:
                self.attention, self.attention_reason = (
                    "reference",
                    "the fused layers attend with SDPA over the gathered pages",
                )
            if device.type == "cuda":
                self._pool.row_plan = probe_row_plan(
                    self.model, self.buckets, self.chunk, self.frames, device
                )
            plan = self._pool.row_plan.describe() if self._pool.row_plan else "no probe off CUDA"
            logger.info(
                "MiniCPM-o 4.5 streaming audio K/V pages: %d sessions, %.1f MiB on %s; attention %s (%s); exact rows: %s",
                self.sessions,
                self._pool.nbytes / (1 << 20),
                device,
                self.attention,
                self.attention_reason,
                plan,
            )
        return self._pool

    def pool_bytes(self) -> int:
        """Bytes :attr:`pool` allocates (whether or not it exists yet)."""
        apm = self.model.apm
        return KVPagePool.nbytes_for(
            layers=len(apm.layers),
            d_model=apm.config.d_model,
            itemsize=apm.conv1.weight.element_size(),
            max_positions=apm.embed_positions.weight.shape[0],
            sessions=self.sessions,
            rows=self.largest,
            chunk=self.chunk,
        )

    def covers(self, chunk: StreamingAudioChunk) -> bool:
        """Whether the batched forward encodes ``chunk`` (else the original eager code does)."""
        model, mel = self.model, chunk.mel
        return (
            not model.training
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(model.apm.conv1.weight.device.type)
            and model.apm.conv1.weight.dtype != torch.float16
            and chunk.prefix_frames in (0, CONTEXT_FRAMES)
            and tuple(mel.shape)
            == (1, model.apm.config.num_mel_bins, self.frames - CONTEXT_FRAMES + chunk.prefix_frames)
            and (chunk.cache is None or isinstance(chunk.cache, SessionAudioCache))
        )

    def encode(self, chunks: Sequence[StreamingAudioChunk]) -> list[tuple[torch.Tensor, Any]]:
        """Encode ``chunks`` (at most one per session): ``(embeddings (1, chunk // pool_step, dim), cache)`` each.

        A cache whose next chunk would reach the position table's end resets first (its pages are
        reused from position 0), as vllm-omni's ``get_audio_embedding_streaming`` resets it.
        """
        results: list[tuple[torch.Tensor, Any] | None] = [None] * len(chunks)
        rows: list[tuple[int, StreamingAudioChunk, SessionAudioCache]] = []
        limit = self.model.apm.embed_positions.weight.shape[0]
        for index, chunk in enumerate(chunks):
            if chunk.cache is not None and chunk.cache.get_seq_length() + self.chunk >= limit:
                if isinstance(chunk.cache, SessionAudioCache):
                    chunk.cache.length = 0  # its pages, from position 0
                else:
                    chunk.cache = None
            cache = chunk.cache
            if self.covers(chunk):
                cache = self.pool.acquire() if cache is None else cache
                if cache is not None:
                    rows.append((index, chunk, cache))
                    continue
                self._warn_full()
            context = (True, chunk.prefix_frames, CONTEXT_FRAMES, None)
            mel = chunk.mel.to(self.model.apm.conv1.weight.device)
            results[index] = encode_eager(self.model, mel, chunk.cache, self.chunk, context)
            self.eager_chunks += 1
        for first in range(0, len(rows), self.largest):
            part = rows[first : first + self.largest]
            out = self._call([c for _, c, _ in part], [cache for _, _, cache in part])
            for r, (index, _, cache) in enumerate(part):
                cache.length += self.chunk
                results[index] = (out[r : r + 1], cache)
        return results

    def inputs(
        self, mels: Sequence[torch.Tensor], caches: Sequence[SessionAudioCache], bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mel, meta)`` of a call of ``bucket`` rows, the real rows first. Host mels travel with
        ``meta`` in one host-to-device copy."""
        pool, device = self.pool, self.model.apm.conv1.weight.device
        layout = RowLayout(bucket, self.chunk, pool.pages_per_session)
        meta = layout.build(
            np.fromiter((c.first_page for c in caches), np.int64, len(caches)),
            np.fromiter((c.length for c in caches), np.int64, len(caches)),
            np.fromiter((m.shape[-1] < self.frames for m in mels), bool, len(mels)),
            pool.scratch_start,
        )
        n_mels = self.model.apm.config.num_mel_bins
        on_host = all(m.device.type == "cpu" for m in mels)
        host_mel = torch.zeros(
            (bucket, n_mels, self.frames), dtype=torch.float32, device="cpu" if on_host else device
        )
        for r, m in enumerate(mels):
            host_mel[r, :, : m.shape[-1]] = m[0]
        if not on_host:
            return host_mel, _to_device(torch.from_numpy(meta), device)
        packed = torch.cat([torch.from_numpy(meta), host_mel.view(-1).view(torch.int32)])
        packed = _to_device(packed, device)
        return packed[meta.size :].view(torch.float32).view(bucket, n_mels, self.frames), packed[: meta.size]

    def padding_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mel, meta)`` of a call of ``bucket`` padding rows (scratch pages only): start-up capture's inputs."""
        return self.inputs([], [], bucket)

    def _call(
        self, chunks: Sequence[StreamingAudioChunk], caches: Sequence[SessionAudioCache]
    ) -> torch.Tensor:
        mel, meta = self.inputs([c.mel for c in chunks], caches, bucket_for(len(chunks), self.largest))
        self.rows += len(chunks)
        self.calls += 1
        if self.graph is not None:
            return self.graph(mel, meta)
        return encode_rows(self.model, mel, meta, self)

    def _warn_full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "MiniCPM-o 4.5 streaming audio: more live duplex sessions than duplex_max_sessions=%d; a session "
                "without pages runs the eager streaming encoder. Raise duplex_max_sessions.",
                self.sessions,
            )

    def stats(self) -> dict[str, Any]:
        pool = self._pool
        return {
            "rows": self.rows,
            "calls": self.calls,
            "eager_chunks": self.eager_chunks,
            "pool_bytes": 0 if pool is None else pool.nbytes,
            "free_sessions": self.sessions if pool is None else pool.free_sessions,
            "attention": self.attention,
        }


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, copied from pinned memory (the host does not wait)."""
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


FA2_VARLEN_OP = ("_vllm_fa2_C", "varlen_fwd")


def paged_attention_choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """``("flash" | "reference", reason)``: vLLM's paged FlashAttention 2 only where it runs (CUDA,
    compute capability 8.0+, bf16/fp16, its compiled op registered); host-side checks only."""
    if device.type != "cuda":
        return "reference", f"a {device.type} device"
    if dtype not in (torch.bfloat16, torch.float16):
        return "reference", f"Whisper in {str(dtype).removeprefix('torch.')}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return "reference", f"compute capability {major}.{minor}"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface
    except ImportError as exc:
        return "reference", f"vllm.vllm_flash_attn does not import ({exc})"
    if not getattr(flash_attn_interface, "FA2_AVAILABLE", False):
        return "reference", "vLLM FlashAttention 2 unavailable"
    if not hasattr(getattr(torch.ops, FA2_VARLEN_OP[0]), FA2_VARLEN_OP[1]):
        return "reference", "vLLM FlashAttention ops not built"
    return "flash", f"vLLM FlashAttention 2, compute capability {major}.{minor}"


# -- The model file's hooks


def encode_streaming_chunk(
    model: nn.Module, wavforms: torch.Tensor, positions: int, total_seq_len: int, context: tuple
) -> torch.Tensor:
    """``get_audio_embedding_streaming``'s encoder call for one chunk of the session whose cache is
    ``model.audio_past_key_values`` (which it updates, as the eager code did).

    Args:
        wavforms: ``(1, n_mels, frames)`` with the context frames; positions: after they are cut;
        total_seq_len: past plus chunk positions;
        context: ``(use_extra_context, prefix_extra_frames, suffix_extra_frames, cnn_min_length)``.

    Returns:
        ``(1, positions // audio_pool_step, embed_dim)`` embeddings.
    """
    encoder: StreamingAudioEncoder | None = getattr(model, "_streaming_audio", None)
    cache = model.audio_past_key_values
    use_extra_context, prefix, suffix, cnn_min_length = context
    framed = (
        encoder is not None
        and use_extra_context is True
        and suffix == CONTEXT_FRAMES
        and cnn_min_length is None
        and positions == encoder.chunk
        and total_seq_len <= model.apm.embed_positions.weight.shape[0]
    )
    if framed:
        ((embeds, model.audio_past_key_values),) = encoder.encode(
            [StreamingAudioChunk(wavforms, prefix, cache)]
        )
    else:
        embeds, model.audio_past_key_values = encode_eager(model, wavforms, cache, positions, context)
    return embeds


def init_streaming_audio(model: nn.Module, vllm_config: Any, options: EncoderCudaGraphOptions) -> None:
    """Build ``model._streaming_audio`` (:class:`StreamingAudioEncoder`) and its bucket graphs; log one line.

    The encoder exists whenever the model has Whisper; its page pool, for ``duplex_max_sessions``
    sessions, is allocated on first use (or by start-up capture). The bucket graphs' adapter
    exists where the stateless audio one may (``encoder_cuda_graph``, no ``--enforce-eager``, no
    LoRA on the audio modules) and ``encoder_cuda_graph_streaming_audio`` is on; it captures by
    the ``"count"`` rule, one graph per bucket.
    """
    model._streaming_audio = None
    if getattr(model, "apm", None) is None:
        logger.info("MiniCPM-o 4.5 streaming audio: off (no encoder)")
        return
    sessions = int(getattr(getattr(vllm_config, "model_config", None), "duplex_max_sessions", 1) or 1)
    chunk = max(1, round(50 * getattr(model.config, "audio_chunk_length", 1.0)))
    buckets = sum(1 for b in BUCKETS if b <= bucket_for(max(1, sessions), BUCKETS[-1]))
    buckets = buckets if options.max_graphs else 0  # encoder_cuda_graph_max_graphs=0: no capture
    graph, state = None, "off (encoder_cuda_graph_streaming_audio=false)"
    if options.streaming_audio:
        graph, state = make_encoder_cuda_graph(
            types.MethodType(encode_rows, model),
            vllm_config,
            replace(options, max_graphs=buckets, admission="count"),
            name="streaming audio",
            captured_modules=AUDIO_CAPTURED_MODULES,
            lora_reason=lora_may_reach(vllm_config, model, AUDIO_CAPTURED_MODULES),
        )
    encoder = model._streaming_audio = StreamingAudioEncoder(model, graph, sessions, chunk)
    logger.info(
        "MiniCPM-o 4.5 streaming audio: paged batched forward, up to %d rows per call (buckets %s), K/V pages for "
        "%d sessions; CUDA graphs %s",
        encoder.largest,
        ", ".join(map(str, encoder.buckets)),
        encoder.sessions,
        state if graph is None or state != "on" else f"on, one per bucket ({buckets})",
    )
