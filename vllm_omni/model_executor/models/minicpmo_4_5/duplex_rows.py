# SPDX-License-Identifier: Apache-2.0
"""The batched duplex forward: Whisper over the chunks of several sessions, each with its paged K/V.

The batched path of :mod:`.duplex_batch` keeps every batched session's Whisper self-attention
cache in pages of one pool per device (:class:`KVPagePool`, the paged layout of vLLM's
FlashAttention), referenced by the session's :class:`PagedStreamingCache`. :func:`encode_rows`
(the region the batched graph captures) runs one chunk per row: the convolutions and position
table rows per row, each layer's new keys and values written into the row's own pages and
attention over the row's own pages only (vLLM's FlashAttention with a block table where
:func:`paged_attention_choice` finds it usable, else :func:`reference_paged_attention`), then the
projection and pooling. Every per-row number is data (one int32 tensor laid out by
:class:`RowLayout`), so one graph per batch bucket serves every past length.

What a real row reads: its own positions, and zeros. A page is zeroed when a session takes it
(:meth:`KVPagePool.reserve`, applied by :meth:`KVPagePool.zero_reserved` before the next write),
so the positions of its last page past its length are zeros, never another session's K/V; the
rest of its page table points at the pool's zero page, which nothing writes. Padding rows write
and read the scratch pages only. A NaN in scratch, or in a page another session left, therefore
never reaches a real row. If it did, the row's masked positions would turn the row into NaN
(``-inf`` plus a NaN score, or a zero weight times a NaN value, is NaN).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import fused_layers

if TYPE_CHECKING:
    # streaming_audio imports duplex_batch, which imports this module: importing it here at
    # import time would leave this module half-initialized when it is the first one imported
    from . import streaming_audio as sa

__all__ = [
    "ATTENTION",
    "FA2_VARLEN_OP",
    "PAGE_SIZE",
    "KVPagePool",
    "PagedStreamingCache",
    "RowLayout",
    "RowLinear",
    "RowPlan",
    "encode_rows",
    "on_device",
    "paged_attention_choice",
    "probe_row_plan",
    "reference_paged_attention",
]

#: Positions per K/V page (a multiple of 16, as vLLM's FlashAttention wants for paged K/V).
PAGE_SIZE = 16

# ---------------------------------------------------------------------------
# Paged K/V
# ---------------------------------------------------------------------------


class KVPagePool:
    """Whisper K/V pages shared by the batched duplex sessions of one device.

    ``kv`` is ``(layers, 2, pages, PAGE_SIZE, heads, head_dim)`` (index 0 of dim 1: keys, 1:
    values), each layer's keys and values in the paged layout of vLLM's FlashAttention. Pages
    ``[0, scratch_start)`` hold sessions' caches; the next ``scratch_pages`` are scratch (the
    padding rows of a batched call write and read there only); the last, ``zero_page``, is all
    zeros and never written (a real row's page table past its pages). A normal tensor even under
    inference mode (calls under ``no_grad`` write it in place).

    Args:
        sessions: sessions whose caches the pool holds at once (:meth:`page_count`).
        rows: the largest bucket (scratch pages for that many padding rows of ``chunk`` positions).
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
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.max_positions = max_positions
        #: the ops batched calls run row by row (:func:`probe_row_plan`; None: every op batched)
        self.row_plan: RowPlan | None = None
        self.pages_per_session = math.ceil(max_positions / PAGE_SIZE)
        self.scratch_pages = math.ceil(rows * chunk / PAGE_SIZE)
        self.num_pages = self.page_count(
            sessions=sessions, rows=rows, chunk=chunk, max_positions=max_positions
        )
        with torch.inference_mode(False):
            self.kv = torch.zeros(
                (layers, 2, self.num_pages, PAGE_SIZE, heads, head_dim), dtype=dtype, device=device
            )
        self.scratch_start = self.num_pages - self.scratch_pages - 1
        self.zero_page = self.num_pages - 1
        self._free = list(range(self.scratch_start - 1, -1, -1))  # popped from the end: lowest first
        self._reserved: list[int] = []  # pages taken since the last zero_reserved()

    @staticmethod
    def page_count(*, sessions: int, rows: int, chunk: int, max_positions: int) -> int:
        """Pages of a pool for ``sessions`` sessions, the scratch of ``rows`` padding rows and the zero page.

        A session holds at most a full cache (``max_positions``), except in the step its cache
        resets: the caller still holds the cycle's last cache (``max_positions - chunk``
        positions) until the call returns, while the new cycle's first chunk takes its pages.
        """
        full = math.ceil(max_positions / PAGE_SIZE)
        resetting = math.ceil((max_positions - chunk) / PAGE_SIZE) + math.ceil(chunk / PAGE_SIZE)
        return sessions * max(full, resetting) + math.ceil(rows * chunk / PAGE_SIZE) + 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kv.device}, {self.scratch_start} pages of {PAGE_SIZE})"

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def reserve(self, cache: PagedStreamingCache, length: int) -> bool:
        """Give ``cache`` pages for ``length`` positions; False (nothing taken) when the pool is full.

        The pages taken are zeroed by the next :meth:`zero_reserved` (call it before writing them)."""
        need = math.ceil(length / PAGE_SIZE) - len(cache.pages)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        taken = [self._free.pop() for _ in range(need)]
        cache.pages.extend(taken)
        self._reserved.extend(taken)
        return True

    def zero_reserved(self) -> None:
        """Zero the pages :meth:`reserve` gave out since the last call (one ``index_fill_`` on the
        current stream; the page numbers reach the device from pinned memory, the host waits for
        nothing). A page so holds nothing a previous session left when its new session reads its
        positions past its length (masked, but a NaN there would still reach the row)."""
        if self._reserved:
            self.kv.index_fill_(2, on_device(self._reserved, self.kv.device), 0)
            self._reserved.clear()

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()

    def slots(self, cache: PagedStreamingCache, start: int, count: int) -> list[int]:
        """Flat slot numbers (``page * PAGE_SIZE + offset``) of positions ``[start, start + count)``."""
        return [cache.pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(start, start + count)]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer``, each ``(pages, PAGE_SIZE, heads, head_dim)``."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def positions(self, cache: PagedStreamingCache) -> torch.Tensor:
        """``(layers, 2, heads, length, head_dim)``: ``cache``'s positions gathered from its pages (a copy)."""
        pages = on_device(cache.pages, self.kv.device)
        rows = self.kv[:, :, pages].flatten(2, 3)[:, :, : cache.length]
        return rows.permute(0, 1, 3, 2, 4)

    def store(self, cache: PagedStreamingCache, kv: torch.Tensor) -> None:
        """Write ``kv`` ``(layers, 2, heads, n, head_dim)`` as ``cache``'s positions ``[0, n)`` (pages reserved)."""
        n = kv.shape[3]
        index = on_device(self.slots(cache, 0, n), self.kv.device)
        flat = self.kv.flatten(2, 3)
        flat.index_copy_(2, index, kv.permute(0, 1, 3, 2, 4).to(flat.dtype))


def on_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied from pinned memory (the host does not wait)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class PagedStreamingCache:
    """A batched duplex session's Whisper self-attention cache: its pages of a :class:`KVPagePool`.

    Like the other session caches it lives in ``audio_past_key_values`` between calls (the duplex
    stage swaps it per session) and reports its length (``get_seq_length``). Its pages return to
    the pool when the object is dropped (a cache reset, a finished session).
    """

    def __init__(self, pool: KVPagePool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0
        self._finalizer = weakref.finalize(self, pool.release, self.pages)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @classmethod
    def from_blocks(cls, pool: KVPagePool, cache: sa.StreamingAudioKVCache) -> PagedStreamingCache | None:
        """A per-session cache moved into pages (one copy), or None when the pool is full."""
        paged = cls(pool)
        if cache.length and not pool.reserve(paged, cache.length):
            return None
        pool.zero_reserved()
        if cache.blocks:
            pool.store(paged, torch.cat(cache.blocks, dim=4)[:, :, 0])
        paged.length = cache.length
        return paged

    def to_blocks(self) -> sa.StreamingAudioKVCache:
        """The same positions as a per-session :class:`~.streaming_audio.StreamingAudioKVCache`
        (one block, a copy); this cache's pages go back to the pool."""
        from .streaming_audio import StreamingAudioKVCache

        blocks = StreamingAudioKVCache()
        if self.length:
            blocks.blocks.append(self.pool.positions(self).unsqueeze(2).contiguous())
            blocks.length = self.length
        self.pool.release(self.pages)
        self.length = 0
        return blocks


# ---------------------------------------------------------------------------
# The batched forward (the captured region)
# ---------------------------------------------------------------------------


def reference_paged_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, used: torch.Tensor
) -> torch.Tensor:
    """Attention of each row's queries over its own pages, for devices without paged FlashAttention.

    Args:
        query: ``(rows, n, heads, head_dim)``, already scaled (Whisper scales its queries).
        keys, values: a layer's pages ``(pages, PAGE_SIZE, heads, head_dim)``.
        table: ``(rows, pages per row)`` page numbers; ``used``: ``(rows,)`` valid positions.

    Returns:
        ``(rows, n, heads, head_dim)``: each row's gathered pages, the positions past ``used``
        masked with ``-inf``, through SDPA with scale 1. Graph-safe and free of host reads: a
        gather of the pages by the table (no boolean indexing), the mask built on the device.
        Masked positions must hold finite values (a NaN there gives NaN); :func:`encode_rows`
        keeps them zeros or the row's own.
    """
    rows, per_row = table.shape
    k = keys[table.long()].flatten(1, 2).transpose(1, 2)  # (rows, heads, per_row * PAGE_SIZE, head_dim)
    v = values[table.long()].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(per_row * PAGE_SIZE, device=used.device)
    mask = torch.zeros((rows, 1, 1, positions.numel()), dtype=query.dtype, device=query.device)
    mask.masked_fill_((positions[None, :] >= used[:, None])[:, None, None, :], float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), k, v, attn_mask=mask, scale=1.0
    )
    return out.transpose(1, 2)


def _flash_paged_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, used: torch.Tensor
) -> torch.Tensor:
    """:func:`reference_paged_attention` through vLLM's FlashAttention (varlen, paged K/V)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    rows, n, heads, head_dim = query.shape
    cu_seqlens_q = torch.arange(0, (rows + 1) * n, n, dtype=torch.int32, device=query.device)
    out = flash_attn_varlen_func(
        q=query.reshape(rows * n, heads, head_dim),
        k=keys,
        v=values,
        max_seqlen_q=n,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=table.shape[1] * PAGE_SIZE,
        seqused_k=used,
        softmax_scale=1.0,
        causal=False,
        block_table=table,
    )
    return out.view(rows, n, heads, head_dim)


ATTENTION = {"reference": reference_paged_attention, "flash": _flash_paged_attention}

#: The compiled op ``flash_attn_varlen_func`` calls (FA2, its default version): ``torch.ops`` namespace and name.
FA2_VARLEN_OP = ("_vllm_fa2_C", "varlen_fwd")


def paged_attention_choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """The attention of the batched duplex forward on ``device`` for Whisper in ``dtype``, and why.

    ``"flash"`` (vLLM's paged varlen FlashAttention 2) only where it can run: a CUDA device of
    compute capability 8.0 or newer, bf16/fp16, ``vllm.vllm_flash_attn`` importing with FA2
    available, and its compiled op (:data:`FA2_VARLEN_OP`) registered in ``torch.ops``, since a
    vLLM install whose extensions were left out may import the Python package without the op.
    Else ``"reference"`` (:func:`reference_paged_attention`). Host-side checks only.

    Returns:
        ``(name, reason)``: a key of :data:`ATTENTION` and a phrase for the log line.
    """
    if device.type != "cuda":
        return "reference", f"a {device.type} device (vLLM's FlashAttention runs on CUDA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return (
            "reference",
            f"Whisper in {str(dtype).removeprefix('torch.')} (vLLM's FlashAttention takes bf16/fp16)",
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return "reference", f"compute capability {major}.{minor} (vLLM's FlashAttention 2 needs 8.0 or newer)"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface
    except ImportError as exc:
        return "reference", f"vllm.vllm_flash_attn does not import ({exc})"
    if not getattr(flash_attn_interface, "FA2_AVAILABLE", False):
        why = getattr(flash_attn_interface, "FA2_UNAVAILABLE_REASON", None) or "FA2_AVAILABLE is false"
        return "reference", f"vLLM FlashAttention 2 unavailable ({why})"
    namespace, op = FA2_VARLEN_OP
    if not hasattr(getattr(torch.ops, namespace), op):
        return (
            "reference",
            f"vLLM FlashAttention ops not built (torch.ops.{namespace}.{op} is not registered)",
        )
    return "flash", f"vLLM FlashAttention 2 ops registered, compute capability {major}.{minor}"


@dataclass(frozen=True)
class RowLayout:
    """Where a batched call's per-row data sit in its int32 ``meta`` tensor (one copy per call).

    ``meta`` is ``[start (rows), used (rows), positions (rows x n), table (rows x pages), slots
    (rows x n)]``: the conv output position each row's chunk starts at (after the context frames),
    its valid K/V positions after the call, its position-table rows, its page table and the slots
    its new K/V go to, each stored as slot + 1. A slot of 0 is the position's own scratch slot
    (padding rows), so the all-zero inputs vLLM's graph manager runs the forward on before a
    capture write only scratch, never a session's pages.
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


def _project(projector: nn.Module, hidden: torch.Tensor, linear: RowLinear) -> torch.Tensor:
    """The audio projector (``linear1``, ReLU, ``linear2``) through ``linear``; any other projector
    through its own call."""
    parts = [getattr(projector, name, None) for name in ("linear1", "relu", "linear2")]
    if any(p is None for p in parts):
        return projector(hidden)
    linear1, relu, linear2 = parts
    return linear(relu(linear(hidden, linear1.weight, linear1.bias)), linear2.weight, linear2.bias)


def _unfused_layers(
    apm: nn.Module,
    hidden: torch.Tensor,
    pool: KVPagePool,
    slots: torch.Tensor,
    table: torch.Tensor,
    used: torch.Tensor,
    rows: int,
    chunk: int,
    attention: str,
) -> torch.Tensor:
    """Whisper's layers over ``(rows * chunk, d_model)`` rows, module by module (the unfused
    encoders', and every encoder's with vLLM's paged FlashAttention), final LayerNorm excluded."""
    attend = ATTENTION[attention]
    heads, head_dim = pool.heads, pool.head_dim
    d_model = hidden.shape[-1]
    for index, layer in enumerate(apm.layers):
        attn = layer.self_attn
        residual = hidden
        normed = layer.self_attn_layer_norm(hidden)
        query = attn.q_proj(normed) * attn.scaling
        keys, values = pool.layer(index)
        keys.view(-1, heads, head_dim).index_copy_(0, slots, attn.k_proj(normed).view(-1, heads, head_dim))
        values.view(-1, heads, head_dim).index_copy_(0, slots, attn.v_proj(normed).view(-1, heads, head_dim))
        out = attend(query.view(rows, chunk, heads, head_dim), keys, values, table, used)
        hidden = residual + attn.out_proj(out.reshape(rows * chunk, d_model))
        residual = hidden
        hidden = layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden)))
        hidden = residual + layer.fc2(hidden)
    return hidden


# ---------------------------------------------------------------------------
# Exact rows: the ops a batch would round differently run row by row
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RowPlan:
    """Which ops of :func:`encode_rows` run row by row so that each row gets the bits of its
    session's own encode, found by :func:`probe_row_plan` on the device.

    The batched rows' attention (cuDNN over the gathered pages, the positions past a row masked
    with ``-inf``) gives each row the bits of its own unmasked call, and most of Whisper's GEMMs
    give a row the same bits whatever the number of rows; a few do not (cuBLAS picks another
    kernel for more rows, e.g. for the ``fc2`` GEMM of a single 50-position chunk on an H200),
    and cuDNN's convolution algorithm may change with the batch.

    Attributes:
        gemms: ``(in_features, out_features, bias, rows)`` of the GEMMs that run row by row.
        convs: buckets (rows) whose convolutions run row by row.
        first_chunks: whether a session's first chunk (two context frames fewer, zeros in the
            batch) convolves as its own shorter call does; if not, first chunks are encoded alone.
    """

    gemms: frozenset[tuple[int, int, bool, int]] = frozenset()
    convs: frozenset[int] = frozenset()
    first_chunks: bool = True

    def describe(self) -> str:
        gemms = sorted({(k, n) for k, n, _, _ in self.gemms})
        return "; ".join(
            (
                "GEMMs " + ", ".join(f"{k}x{n}" for k, n in gemms) + " row by row"
                if gemms
                else "every GEMM batched",
                f"convolutions row by row at buckets {sorted(self.convs)}"
                if self.convs
                else "convolutions batched",
                "first chunks batched" if self.first_chunks else "first chunks encoded alone",
            )
        )


class RowLinear:
    """``linear(x, weight, bias)`` over ``rows`` rows of ``chunk`` positions, ``x`` ``(rows *
    chunk, in_features)`` contiguous: one GEMM, or one per row where ``plan`` says a batch rounds
    differently (each row's GEMM, the one ``F.linear`` runs for the row alone, written into its
    slice of the output)."""

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


def _gemm_shapes(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of every GEMM :func:`encode_rows` runs with the fused layers: the packed
    q/k/v, the output projection and ``fc2`` without their biases (the fused add takes them),
    ``fc1`` and the projector's two."""
    found: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for layer in model.apm.layers:
        qkv = fused_layers.pack_qkv(layer.self_attn)
        found += [
            (qkv.weight, qkv.bias),
            (layer.self_attn.out_proj.weight, None),
            (layer.fc1.weight, layer.fc1.bias),
            (layer.fc2.weight, None),
        ]
    projector = model.audio_projection_layer
    for name in ("linear1", "linear2"):
        linear = getattr(projector, name, None)
        if linear is not None:
            found.append((linear.weight, linear.bias))
    return found


@torch.inference_mode()
def probe_row_plan(
    model: nn.Module, buckets: Sequence[int], chunk: int, frames: int, device: torch.device
) -> RowPlan:
    """Find, on ``device``, the ops :func:`encode_rows` runs row by row (:class:`RowPlan`).

    Each GEMM shape of the batched forward (:func:`_gemm_shapes`) and the convolutions of
    ``frames`` mel frames run once on random inputs of every bucket of rows and once per row; a
    bucket whose rows differ in any bit from their own calls runs that op row by row. A first
    chunk (``frames - 2`` frames) is compared with its zero-padded row. cuBLAS and cuDNN pick
    their kernels by shape, dtype and device, not by value, so one probe per device serves every
    call. Its host reads are the only ones of the batched path: the encoder probes when it first
    makes a device's page pool, outside any capture.
    """
    apm = model.apm
    dtype = apm.conv1.weight.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    seen, gemms = set(), set()
    for weight, bias in _gemm_shapes(model):
        key = (weight.shape[1], weight.shape[0], bias is not None)
        if key in seen:
            continue
        seen.add(key)
        for rows in (b for b in buckets if b > 1):
            x = torch.randn((rows * chunk, key[0]), generator=gen, device=device, dtype=dtype)
            alone = [nn.functional.linear(x[r * chunk : (r + 1) * chunk], weight, bias) for r in range(rows)]
            if not torch.equal(nn.functional.linear(x, weight, bias), torch.cat(alone)):
                gemms.add((*key, rows))
    convs = set()
    n_mels = apm.config.num_mel_bins
    for rows in (b for b in buckets if b > 1):
        mel = torch.randn((rows, n_mels, frames), generator=gen, device=device)
        alone = torch.cat([_convolve(apm, mel[r : r + 1]) for r in range(rows)])
        if not torch.equal(_convolve(apm, mel), alone):
            convs.add(rows)
    first = torch.randn((1, n_mels, frames - 2), generator=gen, device=device)
    padded = nn.functional.pad(first, (0, 2))
    first_chunks = torch.equal(_convolve(apm, first)[..., :chunk], _convolve(apm, padded)[..., :chunk])
    return RowPlan(frozenset(gemms), frozenset(convs), first_chunks)


class PagedRowsAttentionCache:
    """The cache :func:`.fused_layers.whisper_encode_layers` runs the batched rows with: each
    layer's new keys and values go into the rows' page slots, and attention reads every row's
    pages gathered, ``(rows, heads, pages per row * PAGE_SIZE, head_dim)``, positions past the
    row's ``used`` masked by :meth:`mask` (finite there: zeros or the row's own, see the module
    docstring)."""

    def __init__(self, pool: KVPagePool, slots: torch.Tensor, table: torch.Tensor) -> None:
        self.pool, self.slots, self.table = pool, slots, table.long()

    def mask(self, used: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive ``(rows, 1, chunk, keys)`` mask: 0 for a row's first ``used`` positions,
        ``-inf`` past them (built on the device, no host reads)."""
        rows, per_row = self.table.shape
        positions = torch.arange(per_row * PAGE_SIZE, device=used.device)
        masked = (positions[None, :] >= used[:, None])[:, None, None, :].expand(rows, 1, chunk, -1)
        zeros = torch.zeros(masked.shape, dtype=dtype, device=used.device)
        return zeros.masked_fill(masked, float("-inf"))

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(rows, heads, chunk, head_dim)`` keys and values into their slots; return the rows'
        gathered pages (as ``DynamicCache.update`` returns past and new together)."""
        keys, values = self.pool.layer(layer_idx)
        heads, head_dim = self.pool.heads, self.pool.head_dim
        for pages, new in ((keys, key), (values, value)):
            pages.view(-1, heads, head_dim).index_copy_(
                0, self.slots, new.transpose(1, 2).reshape(-1, heads, head_dim)
            )
        return tuple(p[self.table].flatten(1, 2).transpose(1, 2) for p in (keys, values))


def encode_rows(
    model: nn.Module,
    mel: torch.Tensor,
    meta: torch.Tensor,
    pool: KVPagePool,
    chunk: int,
    attention: str,
) -> torch.Tensor:
    """The region the batched duplex graph captures: Whisper over each row's chunk with its own
    paged cache, then the projection and pooling, as ``streaming_audio.encode_audio_streaming``
    runs them for one chunk.

    Args:
        model: the thinker (``apm``, ``audio_projection_layer``, ``audio_avg_pooler``).
        mel: ``(rows, n_mels, 2 * chunk + 4)`` log-mel frames (a first chunk's 2 missing frames
            are zeros at the end, which leave its first ``chunk`` conv positions unchanged).
        meta: the int32 per-row data of :class:`RowLayout`.
        pool, chunk, attention: static arguments (graph key): the page pool, the positions per
            chunk and the attention (``"flash"`` or ``"reference"``).

    Returns:
        ``(rows, chunk // audio_pool_step, embed_dim)`` embeddings; the rows' new K/V are in
        their pages.
    """
    apm = model.apm
    rows = mel.shape[0]
    layout = RowLayout(rows, chunk, pool.pages_per_session)
    start, used, positions, table, codes = layout.split(meta)
    # a row attends to at least one position: the all-zero inputs vLLM's graph manager runs before
    # a capture (every row used 0) would otherwise give some kernels an all-masked row, NaN, and
    # write it to scratch (real rows never read scratch; the padding rows would)
    used = used.clamp_min(1)
    codes = codes.long()
    scratch = pool.scratch_start * PAGE_SIZE + torch.arange(codes.numel(), device=codes.device)
    slots = torch.where(codes > 0, codes - 1, scratch)
    plan = getattr(pool, "row_plan", None)
    if plan is not None and rows in plan.convs:
        hidden = torch.cat([_convolve(apm, mel[r : r + 1]) for r in range(rows)])
    else:
        hidden = _convolve(apm, mel)
    hidden = hidden.permute(0, 2, 1)  # (rows, chunk + 2, d_model)
    picks = (start[:, None] + torch.arange(chunk, device=mel.device)).long()
    d_model = hidden.shape[-1]
    hidden = hidden.gather(1, picks[:, :, None].expand(rows, chunk, d_model))
    # the position table first, as the streaming path adds it (the sum is contiguous)
    hidden = (apm.embed_positions.weight[positions.long()] + hidden).reshape(rows * chunk, d_model)
    if attention == "reference" and fused_layers.whisper_fused_applies(apm, hidden, None, False):
        # the per-session path's own layers: the packed q/k/v GEMM, the scale inside SDPA, the fused
        # residual add + LayerNorm, so a row rounds where its session's own encode rounds
        pages = PagedRowsAttentionCache(pool, slots, table)
        linear = RowLinear(plan, rows, chunk)
        hidden, _ = fused_layers.whisper_encode_layers(
            apm,
            hidden.view(rows, chunk, d_model),
            pages.mask(used, chunk, hidden.dtype),
            pages,
            linear=linear,
        )
        hidden = _project(model.audio_projection_layer, hidden.reshape(rows * chunk, d_model), linear)
    else:
        hidden = apm.layer_norm(
            _unfused_layers(apm, hidden, pool, slots, table, used, rows, chunk, attention)
        )
        hidden = model.audio_projection_layer(hidden)
    embeds = hidden.view(rows, chunk, -1).transpose(1, 2)
    return model.audio_avg_pooler(embeds).transpose(1, 2)


# ---------------------------------------------------------------------------
# The encoder: rows in, embeddings and caches out
