# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's streaming (duplex) Whisper chunks, replayed from exact-shape CUDA graphs.

Full-duplex sessions encode every 1 s audio chunk through ``get_audio_embedding_streaming``, which
runs the Whisper encoder with a per-session KV cache (``audio_past_key_values``, reset at the rows of
the position table, prefix/suffix context frames). With ``encoder_cuda_graph_streaming_audio``
(default on) the chunk's encoder call goes through a third adapter,
``model._streaming_audio_encoder_graph``, whose forward (:func:`encode_audio_streaming_graphed`) is
the eager chunk's code (:func:`encode_audio_streaming`) with a cache view
(:class:`StreamingAudioKVArenaPast`) over one shared two-sided K/V buffer per device and stream
(:class:`StreamingAudioKVArena`):

- graphs are keyed by the exact input shapes plus the past length, the side holding the past, the
  context frames and the arena (static arguments of the adapter);
- each layer reads the past from one side in the eager cache's layout and ``torch.cat`` writes past
  + new K/V into the other side, so nothing is padded, attention sees the tensors eager's
  ``DynamicCache`` makes (same values, same layout), a forward never writes what it reads (the
  manager's warm-up and the capturing replay agree), and no graph holds a copy of the cache;
- a session's cache (:class:`StreamingAudioKVCache`, its chunks' K/V blocks) is copied into the
  arena only when the arena holds another session's, and each chunk's new K/V are copied out after
  the call, so sessions never read each other's K/V;
- the chunk's all-zero attention mask is left out of the graph where the eager call's kernel can be
  pinned (:class:`ZeroMaskPlan`).

Training, autograd, autocast, FP16 Whisper, chunks past the position table and sessions whose cache
the eager path made keep the eager path (:func:`streaming_audio_graph_applies`).

The model-file hooks: ``get_audio_embedding_streaming`` calls :func:`encode_streaming_chunk`;
``_init_encoder_cuda_graphs`` calls :func:`init_streaming_audio_graph`; the thinker's
``_encode_audio_streaming_graphed`` (the adapter's bound forward) calls
:func:`encode_audio_streaming_graphed`. Every Whisper call of a chunk, eager or graphed, runs
through :func:`encode_audio_streaming`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from vllm.logger import init_logger

from . import fused_layers
from .encoder_cuda_graph import EncoderCudaGraphOptions, lora_may_reach, make_encoder_cuda_graph
from .encoder_graphs import AUDIO_CAPTURED_MODULES

# isort: split
from . import duplex_batch  # the batched duplex steps; it imports this module back


logger = init_logger(__name__)


class StreamingAudioKVCache:
    """Whisper self-attention cache of one streaming audio session on the graphed path.

    With ``encoder_cuda_graph_streaming_audio`` on, ``get_audio_embedding_streaming`` keeps this
    object in ``audio_past_key_values`` instead of an ``EncoderDecoderCache``; like that one it
    belongs to the session (the duplex stage swaps it in and out per session), and the model
    file's ``_get_audio_cache_length`` reads its length.

    Attributes:
        blocks: the K/V of each encoded chunk in order, ``(layers, 2, 1, heads, n_i,
            head_dim)`` in the encoder's dtype (index 0 of dim 1: keys, 1: values).
        length: cached positions, ``sum(n_i)``.
        token: identity of this cache's contents for :class:`StreamingAudioKVArena`.
    """

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []
        self.length = 0
        self.token = object()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def to_eager(self) -> EncoderDecoderCache:
        """The same positions as the ``EncoderDecoderCache`` the eager path keeps (a copy)."""
        self_attention = DynamicCache()
        if self.blocks:
            kv = torch.cat(self.blocks, dim=4)
            for layer in range(kv.shape[0]):
                self_attention.update(kv[layer, 0], kv[layer, 1], layer)
        return EncoderDecoderCache(self_attention, DynamicCache())


class StreamingAudioKVArena:
    """The K/V buffers that the streaming audio graphs of one (device, stream) read and write.

    ``kv`` is ``(2, layers, 2, heads * max_positions * head_dim)``: two sides, each with every
    layer's keys (index 0 of dim 2) and values (1). A cache of ``L`` positions sits on one side
    in the layout of the eager path's ``DynamicCache``: each layer's keys and values are
    contiguous ``(1, heads, L, head_dim)`` tensors at the start of their rows (``layer``). A
    session's cache of ``b`` blocks sits on side ``b % 2`` (``side``); the forward of its next
    chunk reads the past there and writes ``torch.cat([past, new])`` (the tensors
    ``DynamicCache.update`` makes) to the other side, where attention reads them and the chunk
    after finds its past. The addresses are fixed per past length and side, so every graph
    reads the past from here instead of from a static copy of the cache, and the past reaches
    attention through one contiguous concatenation per tensor, as on the eager path. A forward
    never writes what it reads, so running it twice (the graph manager's warm-up, then the
    capturing replay) leaves the same result.

    Sessions share the arena and never see each other's K/V: ``load`` copies a session's cache
    in unless the arena holds exactly it already (the same session continuing), and ``save``
    copies the chunk's new positions out into the session's cache.
    """

    def __init__(
        self, *, layers: int, heads: int, head_dim: int, max_positions: int, dtype: torch.dtype, device: Any
    ) -> None:
        self.heads, self.head_dim = heads, head_dim
        # A normal tensor even under inference mode: calls under no_grad write it in place too.
        with torch.inference_mode(False):
            self.kv = torch.zeros(
                (2, layers, 2, heads * max_positions * head_dim), dtype=dtype, device=device
            )
        # (token, length) of the session cache whose positions [0, length) the arena holds
        self.holds: tuple[object, int] | None = None

    def __repr__(self) -> str:
        positions = self.kv.shape[3] // (self.heads * self.head_dim)
        return f"{type(self).__name__}({self.kv.device}, 2 x {positions} positions)"

    @staticmethod
    def side(cache: StreamingAudioKVCache) -> int:
        """The side holding ``cache``'s past once loaded: its block count modulo 2."""
        return len(cache.blocks) % 2

    def positions(self, side: int, length: int) -> torch.Tensor:
        """``(layers, 2, heads, length, head_dim)``: side ``side`` holding a cache of ``length``."""
        return self.kv[side, :, :, : self.heads * length * self.head_dim].unflatten(
            -1, (self.heads, length, self.head_dim)
        )

    def layer(self, side: int, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` on side ``side`` for ``length`` positions, each a
        contiguous ``(1, heads, length, head_dim)`` view."""
        rows = self.kv[side, layer, :, : self.heads * length * self.head_dim]
        shape = (1, self.heads, length, self.head_dim)
        return rows[0].view(shape), rows[1].view(shape)

    def load(self, cache: StreamingAudioKVCache) -> None:
        """Make side ``side(cache)`` hold ``cache``'s ``cache.length`` positions (one copy per block)."""
        if self.holds == (cache.token, cache.length):
            return
        past = self.positions(self.side(cache), cache.length)
        start = 0
        for block in cache.blocks:
            end = start + block.shape[4]
            past[:, :, :, start:end].copy_(block[:, :, 0])
            start = end
        self.holds = (cache.token, cache.length)

    def save(self, cache: StreamingAudioKVCache, positions: int) -> None:
        """Append the ``positions`` the chunk wrote after ``cache.length`` to ``cache`` as its next
        block (one strided copy); the cache's side flips with its block count."""
        start, end = cache.length, cache.length + positions
        written = self.positions(1 - self.side(cache), end)[:, :, :, start:end]
        cache.blocks.append(written.unsqueeze(2).clone(memory_format=torch.contiguous_format))
        cache.length = end
        self.holds = (cache.token, end)


class StreamingAudioKVArenaPast(DynamicCache):
    """``past_key_values`` of ``MiniCPMWhisperEncoder`` inside a streaming audio graph.

    ``length`` past positions live on side ``side`` of ``arena`` (a :class:`StreamingAudioKVArena`).
    Of the cache interface the encoder uses, ``get_seq_length`` returns ``length``, and
    ``update`` returns what ``DynamicCache.update`` returns, past and new states concatenated
    along positions into contiguous ``(1, heads, length + n, head_dim)`` tensors (the same
    values in the same layout as eager), written by ``torch.cat`` straight into the other side.
    """

    def __init__(self, arena: StreamingAudioKVArena, side: int, length: int) -> None:
        super().__init__()
        self.arena, self.side, self.length = arena, side, length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        past_keys, past_values = self.arena.layer(self.side, layer_idx, self.length)
        end = self.length + key_states.shape[-2]
        keys, values = self.arena.layer(1 - self.side, layer_idx, end)
        torch.cat([past_keys, key_states], dim=-2, out=keys)
        torch.cat([past_values, value_states], dim=-2, out=values)
        return keys, values


@dataclass(frozen=True)
class ZeroMaskPlan:
    """How a streaming audio graph treats the all-zero attention mask of its chunk.

    ``get_audio_embedding_streaming`` always passes ``torch.zeros`` as Whisper's additive mask:
    adding 0.0 changes no attention score, so a kernel computes the same output with or without
    it. Without the mask, though, SDPA would pick its kernel afresh (flash attention, which
    refuses masks, comes first), so a graph drops the mask only where it can run the kernel the
    eager call runs: the ``"eager"`` attention implementation (a plain matmul + add + softmax),
    or ``"sdpa"`` with ``sdpa_backend`` pinned to SDPA's choice for the eager call's inputs.
    Dropped, it saves building and copying the mask, SDPA's per-layer padding of it (the
    memory-efficient kernel wants 8-aligned rows), and the kernel's load of a mask tile per key
    block.

    Attributes:
        drop_mask: run the encoder without the mask.
        sdpa_backend: the SDPA backend to pin while it runs (None: no pin).
    """

    drop_mask: bool
    sdpa_backend: SDPBackend | None = None


#: SDPA backends whose kernels add the mask to the scores and nothing else (with the same kernel
#: pinned, the all-zero mask can go). cuDNN builds another execution plan with a bias, so its choice
#: keeps the mask.
ZERO_MASK_FREE_SDPA = frozenset({SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION})


def zero_mask_plan(attn_implementation: str, sdpa_choice: Callable[[], SDPBackend]) -> ZeroMaskPlan:
    """The :class:`ZeroMaskPlan` for Whisper's attention implementation; ``sdpa_choice()`` returns
    SDPA's backend for the eager call's inputs (asked only for ``"sdpa"``)."""
    if attn_implementation == "eager":
        return ZeroMaskPlan(drop_mask=True)
    if attn_implementation == "sdpa":
        choice = sdpa_choice()
        if choice in ZERO_MASK_FREE_SDPA:
            return ZeroMaskPlan(drop_mask=True, sdpa_backend=choice)
    return ZeroMaskPlan(drop_mask=False)


def eager_sdpa_choice(apm: nn.Module, device: torch.device, positions: int, total: int) -> SDPBackend:
    """SDPA's backend for the attention of an eager streaming chunk: ``positions`` queries over
    ``total`` keys of ``apm``'s heads in its dtype, contiguous, with the ``(1, 1, positions,
    total)`` mask, scale 1 (Whisper scales the queries itself), no dropout. Host-side only:
    the tensors are allocated, never written."""
    heads = apm.config.encoder_attention_heads
    head_dim, dtype = apm.config.d_model // heads, apm.conv1.weight.dtype
    query = torch.empty((1, heads, positions, head_dim), dtype=dtype, device=device)
    key = torch.empty((1, heads, total, head_dim), dtype=dtype, device=device)
    mask = torch.empty((1, 1, positions, total), dtype=dtype, device=device)
    return SDPBackend(torch._fused_sdp_choice(query, key, key, mask, 0.0, False, scale=1.0))


# ---------------------------------------------------------------------------
# The chunk's encoder call
# ---------------------------------------------------------------------------


def encode_audio_streaming(
    model: nn.Module,
    wavforms: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    use_extra_context: bool,
    prefix_extra_frames: int,
    suffix_extra_frames: int,
    cnn_min_length: int | None,
) -> tuple[torch.Tensor, Any]:
    """Whisper with a KV cache -> projection -> average pooling, for one streaming chunk.

    The one function through which every streaming chunk runs Whisper, eager or graphed.

    Args:
        model: the MiniCPM-o 4.5 thinker (``apm``, ``audio_projection_layer``,
            ``audio_avg_pooler``, ``audio_encoder_layer``).
        wavforms: log-mel features ``(1, n_mels, T_mel)`` with the context frames.
        attention_mask: zeros ``(1, 1, n, past + n)`` in the encoder's dtype, ``n`` the chunk's
            positions after the context frames are cut; None inside a streaming audio graph
            whose :class:`ZeroMaskPlan` drops it.
        past_key_values: the session's cache (None, an ``EncoderDecoderCache``, or a
            :class:`StreamingAudioKVArenaPast` inside a graph); updated in place.
        use_extra_context, prefix_extra_frames, suffix_extra_frames, cnn_min_length: as
            ``get_audio_embedding_streaming`` takes them.

    Returns:
        ``(1, n // audio_pool_step, embed_dim)`` embeddings and the updated cache.
    """
    audio_outputs = model.apm(
        wavforms,
        past_key_values=past_key_values,
        use_cache=True,
        output_hidden_states=True,
        attention_mask=attention_mask,
        use_extra_context=use_extra_context,
        prefix_extra_frames=prefix_extra_frames,
        suffix_extra_frames=suffix_extra_frames,
        cnn_min_length=cnn_min_length,
    )
    audio_states = audio_outputs.hidden_states[model.audio_encoder_layer]
    audio_embeds = model.audio_projection_layer(audio_states)
    audio_embeds = audio_embeds.transpose(1, 2)
    audio_embeds = model.audio_avg_pooler(audio_embeds)
    return audio_embeds.transpose(1, 2), audio_outputs.past_key_values


def encode_audio_streaming_graphed(
    model: nn.Module,
    wavforms: torch.Tensor,
    arena: StreamingAudioKVArena,
    side: int,
    past_length: int,
    positions: int,
    mask_plan: ZeroMaskPlan,
    use_extra_context: bool,
    prefix_extra_frames: int,
    suffix_extra_frames: int,
    cnn_min_length: int | None,
) -> torch.Tensor:
    """The region the streaming audio CUDA graph captures (the thinker's
    ``_encode_audio_streaming_graphed``): :func:`encode_audio_streaming` of a chunk of
    ``positions`` positions over the ``past_length`` past positions on side ``side`` of
    ``arena``, writing past and chunk K/V to the other side.

    The zero mask ``get_audio_embedding_streaming`` builds for the eager call is built here
    (``(1, 1, positions, past_length + positions)``), or left out as ``mask_plan`` says.
    Every argument but ``wavforms`` is a static argument of the adapter (part of the graph
    key), so each graph has fixed shapes and fixed arena addresses. A replay re-runs only
    the GPU work recorded at capture (the arena writes included): keep this and the modules
    it calls free of Python side effects, as for the stateless audio region.
    """
    past = StreamingAudioKVArenaPast(arena, side, past_length)
    context = (use_extra_context, prefix_extra_frames, suffix_extra_frames, cnn_min_length)
    if not mask_plan.drop_mask:
        shape = (1, 1, positions, past_length + positions)
        mask = torch.zeros(shape, dtype=model.apm.conv1.weight.dtype, device=wavforms.device)
        return encode_audio_streaming(model, wavforms, mask, past, *context)[0]
    if mask_plan.sdpa_backend is None:
        return encode_audio_streaming(model, wavforms, None, past, *context)[0]
    with sdpa_kernel(mask_plan.sdpa_backend):
        return encode_audio_streaming(model, wavforms, None, past, *context)[0]


def encode_streaming_chunk(
    model: nn.Module, wavforms: torch.Tensor, positions: int, total_seq_len: int, context: tuple
) -> torch.Tensor:
    """The encoder call of ``get_audio_embedding_streaming`` for one chunk; updates
    ``model.audio_past_key_values``.

    Args:
        model: the MiniCPM-o 4.5 thinker.
        wavforms: log-mel features ``(1, n_mels, T_mel)`` with the context frames.
        positions: the chunk's positions after the context frames are cut.
        total_seq_len: past plus chunk positions.
        context: ``(use_extra_context, prefix_extra_frames, suffix_extra_frames, cnn_min_length)``.

    Returns:
        ``(1, positions // audio_pool_step, embed_dim)`` embeddings. Through the streaming audio
        adapter where :func:`streaming_audio_graph_applies`, else eagerly with the zero mask (a
        graphed session's cache converted to the eager path's ``EncoderDecoderCache`` first).
    """
    # inside a batched duplex step the chunk is encoded with the step's others (duplex_batch.route)
    batched = duplex_batch.route(model, wavforms, positions, total_seq_len, context)
    if batched is not None:
        return batched
    if streaming_audio_graph_applies(model, wavforms, total_seq_len):
        return encode_audio_streaming_with_graph(model, wavforms, positions, context)
    audio_attention_mask = torch.zeros(
        (wavforms.shape[0], 1, positions, total_seq_len),
        dtype=model.apm.conv1.weight.dtype,
        device=wavforms.device,
    )
    if isinstance(model.audio_past_key_values, StreamingAudioKVCache):
        model.audio_past_key_values = model.audio_past_key_values.to_eager()
    audio_embeds, model.audio_past_key_values = encode_audio_streaming(
        model, wavforms, audio_attention_mask, model.audio_past_key_values, *context
    )
    return audio_embeds


# ---------------------------------------------------------------------------
# Wiring and session bookkeeping
# ---------------------------------------------------------------------------


def init_streaming_audio_graph(model: nn.Module, vllm_config: Any, options: EncoderCudaGraphOptions) -> None:
    """Build the streaming audio adapter (``encoder_cuda_graph_streaming_audio``) and log its state.

    Sets ``model._streaming_audio_encoder_graph`` (None when off) and empties
    ``model._streaming_audio_arenas`` and ``model._streaming_audio_mask_plans``.

    A session's chunks start at past lengths ``0, n, 2n, ...`` below the position table's
    ``max_source_positions`` rows (then its cache resets), each length its own graph, so
    the cap is ``encoder_cuda_graph_max_graphs`` chunk forms of
    ``ceil(max_source_positions / n)`` past lengths, ``n = 50 * audio_chunk_length``.
    Admission is ``"count"`` whatever ``encoder_cuda_graph_admission`` says: those keys are
    a fixed schedule that every live session walks once per cache cycle (about 30 s), so a
    key seen twice is certain to recur, while the ``"cost"`` rule, which estimates a key's
    recurrence from the calls seen so far, would take several cycles (minutes) to admit
    them. Off, besides the option, wherever the stateless audio adapter is off
    (``encoder_cuda_graph`` false, ``--enforce-eager``, LoRA).
    """
    model._streaming_audio_arenas = {}
    model._streaming_audio_mask_plans = {}
    model._streaming_audio_encoder_graph = None
    apm = getattr(model, "apm", None)
    if apm is None:
        state = "off (no encoder)"
    elif not options.streaming_audio:
        state = "off (encoder_cuda_graph_streaming_audio=false)"
    else:
        positions = max(1, round(50 * getattr(model.config, "audio_chunk_length", 1.0)))
        lengths = math.ceil(apm.embed_positions.weight.shape[0] / positions)
        cap = options.max_graphs * lengths
        model._streaming_audio_encoder_graph, state = make_encoder_cuda_graph(
            model._encode_audio_streaming_graphed,
            vllm_config,
            replace(options, max_graphs=cap, admission="count"),
            name="streaming audio",
            static_args=True,
            captured_modules=AUDIO_CAPTURED_MODULES,
            lora_reason=lora_may_reach(vllm_config, model, AUDIO_CAPTURED_MODULES),
        )
        if state == "on":
            state = (
                f"on, up to {cap} graphs ({options.max_graphs} chunk forms x {lengths} past lengths), "
                'admission "count" (each past length recurs once per cache cycle)'
            )
    logger.info("MiniCPM-o 4.5 streaming audio encoder CUDA graphs: %s", state)
    duplex_batch.init_duplex_batch(model, vllm_config, options)


def streaming_audio_graph_applies(model: nn.Module, wavforms: torch.Tensor, total_seq_len: int) -> bool:
    """Whether this streaming chunk goes through the streaming audio adapter.

    Not in training, with autograd or autocast on, for FP16 Whisper (its inf/nan clamp
    reads values on the host), past the position table, or for a session whose cache
    the eager path made (it stays eager until its cache resets).
    """
    return (
        model._streaming_audio_encoder_graph is not None
        and not model.training
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled(wavforms.device.type)
        and model.apm.conv1.weight.dtype != torch.float16
        and total_seq_len <= model.apm.embed_positions.weight.shape[0]
        and (
            model.audio_past_key_values is None
            or isinstance(model.audio_past_key_values, StreamingAudioKVCache)
        )
    )


def encode_audio_streaming_with_graph(
    model: nn.Module, wavforms: torch.Tensor, positions: int, context: tuple
) -> torch.Tensor:
    """Encode one chunk of ``positions`` positions through the streaming audio adapter;
    updates ``model.audio_past_key_values``.

    The session bookkeeping (copy into the arena, copy of the new K/V out) runs here,
    outside the captured region.
    """
    cache = model.audio_past_key_values
    if cache is None:
        cache = StreamingAudioKVCache()
    arena = streaming_audio_arena(model, wavforms.device)
    arena.load(cache)
    past_length = cache.length
    plan = streaming_audio_mask_plan(model, wavforms.device, positions, past_length + positions)
    audio_embeds = model._streaming_audio_encoder_graph(
        wavforms, arena, arena.side(cache), past_length, positions, plan, *context
    )
    arena.save(cache, positions)
    model.audio_past_key_values = cache
    return audio_embeds


def streaming_audio_mask_plan(
    model: nn.Module, device: torch.device, positions: int, total: int
) -> ZeroMaskPlan:
    """The :class:`ZeroMaskPlan` of a chunk of ``positions`` over ``total`` positions on ``device``
    (SDPA's choice is asked once per shape and kept in ``model._streaming_audio_mask_plans``).
    """
    key = (device, positions, total)
    plan = model._streaming_audio_mask_plans.get(key)
    if plan is None:
        plan = _decide_mask_plan(model, device, positions, total)
        model._streaming_audio_mask_plans[key] = plan
    return plan


def _decide_mask_plan(model: nn.Module, device: torch.device, positions: int, total: int) -> ZeroMaskPlan:
    """:func:`streaming_audio_mask_plan`'s decision for a shape it has not planned yet."""
    # With the fused Whisper layers the mask goes and nothing is pinned: their streaming attention
    # pins its own backends, which give the same bits with the all-zero mask and without it
    # (fused_layers.whisper_streaming_drops_zero_mask).
    if fused_layers.whisper_streaming_drops_zero_mask(model.apm):
        return ZeroMaskPlan(drop_mask=True)
    return zero_mask_plan(
        model.apm.config._attn_implementation,
        lambda: eager_sdpa_choice(model.apm, device, positions, total),
    )


def streaming_audio_arena(model: nn.Module, device: torch.device) -> StreamingAudioKVArena:
    """The arena of ``device`` and its current stream (created on first use, kept in
    ``model._streaming_audio_arenas``)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    arena = model._streaming_audio_arenas.get((device, stream))
    if arena is None:
        heads = model.apm.config.encoder_attention_heads
        arena = StreamingAudioKVArena(
            layers=len(model.apm.layers),
            heads=heads,
            head_dim=model.apm.config.d_model // heads,
            max_positions=model.apm.embed_positions.weight.shape[0],
            dtype=model.apm.conv1.weight.dtype,
            device=device,
        )
        model._streaming_audio_arenas[(device, stream)] = arena
    return arena
