# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's image call without host reads, captured by the vision CUDA graph as a whole.

Everything that depends on the values of ``tgt_sizes`` is computed on the device, so the call from
pixels to resampler output (:func:`encode_images`) is one graph region keyed by input shapes alone.
Position ids come from grow-only device tables (:class:`GrowingDeviceTable`) built before the graph
runs. With the same attention, eager outputs are bitwise those of vllm-omni's own image call; FA2
with padding stays eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from . import fused_layers
from . import siglip_attention
from .encoder_graphs import VisionGraphRegion

#: Modules the image-call region (:func:`encode_images`) calls, relative to the thinker: the
#: adapter looks for hooks on them (and their children) before it captures.
VISION_CAPTURED_MODULES = (
    "vpm.embeddings.patch_embedding",
    "vpm.embeddings.position_embedding",
    "vpm.encoder",
    "vpm.post_layernorm",
    "resampler",
)

#: The whole image call, pixels to resampler output (the thinker's ``_encode_images``).
IMAGE_CALL = VisionGraphRegion(
    forward="_encode_images",
    captured_modules=VISION_CAPTURED_MODULES,
    lora_prefixes=("vpm", "resampler"),
    needs=("resampler",),
)


class GrowingDeviceTable:
    """Lookup tables built on the host, one per (device, dtype), grown to what a call needs.

    ``get(size, device, dtype, build)`` returns ``build(rows)`` on ``device``, ``rows`` being ``size``
    rounded up to a multiple of ``granule``. A replaced table stays referenced (graphs read it).

    Raises:
        RuntimeError: a build while the current stream is capturing (build before a capture).
    """

    def __init__(self, granule: int = 256) -> None:
        self.granule = granule
        self._tables: dict[tuple[torch.device, torch.dtype | None], tuple[int, torch.Tensor]] = {}
        self._replaced: list[torch.Tensor] = []

    def get(
        self,
        size: int,
        device: torch.device,
        dtype: torch.dtype | None,
        build: Callable[[int], torch.Tensor],
    ) -> torch.Tensor:
        entry = self._tables.get((device, dtype))
        if entry is not None and entry[0] >= size:
            return entry[1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a lookup table for {size} rows must be built before a CUDA graph capture, not during it"
            )
        rows = max(1, -(-size // self.granule)) * self.granule
        with torch.inference_mode(False):
            table = build(rows).to(device=device, dtype=dtype)
        if entry is not None:
            self._replaced.append(entry[1])
        self._tables[(device, dtype)] = (rows, table)
        return table




def position_bucket_rows(embeddings: nn.Module, max_side: int) -> torch.Tensor:
    """The position bucket of every row (or column) of every grid side ``1..max_side``.

    Args:
        embeddings: a ``SiglipVisionEmbeddings`` (its ``num_patches_per_side``).

    Returns:
        A flat int16 CPU tensor of ``max_side * (max_side + 1) // 2`` entries; entry
        ``side * (side - 1) // 2 + k`` is the bucket of row ``k`` of a side of ``side``
        patches, with ``_create_grid_position_ids``'s float32 ``arange`` and ``bucketize``
        (a division on the device lands in another bucket for some sides).
    """
    step = 1 / embeddings.num_patches_per_side
    boundaries = torch.arange(step, 1.0, step)
    fractions = torch.cat([torch.arange(0, 1 - 1e-6, 1 / side) for side in range(1, max_side + 1)])
    if fractions.numel() != max_side * (max_side + 1) // 2:
        raise RuntimeError(
            f"SigLIP position buckets: {fractions.numel()} fractions for the sides 1..{max_side}"
        )
    return torch.bucketize(fractions, boundaries, right=True).to(torch.int16)


def position_bucket_table(embeddings: nn.Module, max_side: int, device: torch.device) -> torch.Tensor:
    """The :func:`position_bucket_rows` table of ``embeddings`` on ``device``, covering every grid
    side ``<= max_side`` (kept in ``embeddings._bucket_tables``).
    """
    return embeddings._bucket_tables.get(
        max_side, device, None, lambda rows: position_bucket_rows(embeddings, rows)
    )


def position_ids_from_tgt_sizes(
    embeddings: nn.Module, tgt_sizes: torch.Tensor, num_patches: int
) -> torch.Tensor:
    """Position ids of slices whose patches are packed row-major, computed on the device.

    Args:
        embeddings: a ``SiglipVisionEmbeddings``.
        tgt_sizes: ``(B, 2)`` integer ``(h, w)`` patch grid of each slice, on the device the
            ids are wanted on.
        num_patches: ``N``, patches per slice after padding (``>= h * w`` of every slice).

    Returns:
        ``(B, N)`` int64: patch ``p < h * w`` (row ``p // w``, column ``p % w``) gets
        ``bucket(row of h) * num_patches_per_side + bucket(column of w)``, a padding patch 0, as
        ``_create_position_ids`` returns; no host read, so a CUDA graph can capture it.
    """
    table = position_bucket_table(embeddings, num_patches, tgt_sizes.device)
    sizes = tgt_sizes.to(torch.int64)
    height, width = sizes[:, :1], sizes[:, 1:]
    patch = torch.arange(num_patches, device=tgt_sizes.device)
    valid = patch < height * width
    width = width.clamp(min=1)
    row = torch.div(patch, width, rounding_mode="floor")
    last = table.numel() - 1
    row_bucket = table[(height * (height - 1) // 2 + row).clamp(0, last)]
    col_bucket = table[(width * (width - 1) // 2 + patch - row * width).clamp(0, last)]
    position_ids = row_bucket.to(torch.int64) * embeddings.num_patches_per_side + col_bucket
    return position_ids.masked_fill(~valid, 0)




def pos_embed_rows(resampler: nn.Module, num_rows: int) -> torch.Tensor:
    """``(num_rows + 1, embed_dim // 2)`` float32 sincos rows on the host, the last one zero."""
    from .minicpmo_4_5_omni_llm import get_1d_sincos_pos_embed_from_grid_new

    positions = np.arange(num_rows, dtype=np.float32)[None, :]
    rows = torch.from_numpy(get_1d_sincos_pos_embed_from_grid_new(resampler.embed_dim // 2, positions)[0])
    return torch.cat((rows.float(), rows.new_zeros(1, rows.shape[1], dtype=torch.float32)))


def pos_embed_table(
    resampler: nn.Module, max_side: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The :func:`pos_embed_rows` table in ``dtype`` on ``device``, covering sides ``<= max_side``
    (kept in ``resampler._pos_embed_tables``).
    """
    return resampler._pos_embed_tables.get(
        max_side, device, dtype, lambda rows: pos_embed_rows(resampler, rows)
    )


def resampler_positions(
    resampler: nn.Module, x: torch.Tensor, tgt_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The resampler's key positions and key padding mask for ``x`` (``Resampler.forward``).

    Args:
        resampler: the ``Resampler``.
        x: ``(B, N, kv_dim)`` features of ``B`` slices, slice ``i``'s first ``h_i * w_i``
            patches (row-major) real, the rest padding.
        tgt_sizes: ``(B, 2)`` integer ``(h_i, w_i)``, ``h_i * w_i <= N``.

    Returns:
        ``pos_embed (N, B, embed_dim)`` in ``x``'s dtype (the 2-D sincos position of each real
        patch, zeros for padding) and ``key_padding_mask (B, N)`` bool, True for padding.
    """
    num_patches, device, dtype = x.shape[1], x.device, x.dtype
    sizes = tgt_sizes.to(device=device, dtype=torch.int64)
    height, width = sizes[:, :1], sizes[:, 1:]
    patch = torch.arange(num_patches, device=device)
    key_padding_mask = patch >= height * width  # B * L, True = padding
    width = width.clamp(min=1)
    row = torch.div(patch, width, rounding_mode="floor")
    table = pos_embed_table(resampler, num_patches, device, dtype)
    zero_row = table.shape[0] - 1
    index = torch.stack((patch - row * width, row), dim=-1).clamp(0, zero_row - 1)
    index = index.masked_fill(key_padding_mask.unsqueeze(-1), zero_row)
    pos_embed = table[index].flatten(2).permute(1, 0, 2)  # B * L * 2 * D/2 => L * B * D
    return pos_embed, key_padding_mask




def pad_vision_slices(pixel_values: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Stack image slices ``(3, patch, L_i)`` into one ``(B, 3, patch, max L_i)`` batch, zero-padded."""
    if isinstance(pixel_values, torch.Tensor):
        return pixel_values.contiguous(), False
    lengths = [item.shape[-1] for item in pixel_values]
    longest = max(lengths)
    if min(lengths) == longest:
        if len(pixel_values) == 1:
            return pixel_values[0].unsqueeze(0).contiguous(), False
        return torch.stack(list(pixel_values)), False
    first = pixel_values[0]
    shape = (len(pixel_values), *first.shape[:-1], longest)
    batch = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for i, item in enumerate(pixel_values):
        batch[i, ..., : item.shape[-1]] = item
    return batch, True


def to_device_without_sync(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes through pinned memory, so the host never waits."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)


def encode_packed_slices(
    vpm: nn.Module, pixel_values: torch.Tensor, tgt_sizes: torch.Tensor, patch_valid: torch.Tensor | None
) -> torch.Tensor:
    """Patch and position embeddings, encoder and post layernorm of packed slices.

    Args:
        vpm: the ``SiglipVisionTransformer``.
        pixel_values: ``(B, 3, patch, patch * N)`` in the model dtype, slice ``i`` in its first
            ``patch * h_i * w_i`` columns (the processor's layout, padded).
        tgt_sizes: ``(B, 2)`` integer ``(h_i, w_i)``, on the pixels' device.
        patch_valid: None when every slice has ``N`` patches, else ``(B, N)`` bool, True for
            the first ``h_i * w_i`` patches of slice ``i``.

    Returns:
        ``(B, N, hidden)``: ``SiglipVisionTransformer.forward``'s ``last_hidden_state`` for the
        patch mask ``patch_valid``, without host reads.
    """
    # The conv output read as (B, N, hidden) is a transposed view; the sum is written contiguous so
    # that no layer copies its input or runs a strided residual add.
    embeddings = patch_embeddings(vpm, pixel_values)
    position_ids = position_ids_from_tgt_sizes(vpm.embeddings, tgt_sizes, embeddings.shape[1])
    position_embeds = vpm.embeddings.position_embedding(position_ids)
    hidden_states = torch.empty(
        embeddings.shape,
        dtype=torch.promote_types(embeddings.dtype, position_embeds.dtype),
        device=embeddings.device,
    )
    torch.add(embeddings, position_embeds, out=hidden_states)
    attention_mask = None
    if patch_valid is not None:
        attention_mask = siglip_attention.encoder_attention_mask(
            patch_valid, hidden_states.dtype, vpm._use_flash_attention_2
        )
    return vpm._encode_last_hidden_state(hidden_states, attention_mask)


def patch_embeddings(vpm: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """SigLIP's patch embedding of packed slices, ``(B, 3, P, P * N)`` -> ``(B, N, hidden)`` in the
    convolution's dtype, not necessarily contiguous (the convolution's output read as
    ``(B, N, hidden)`` is a transposed view).
    """
    # with the fused layers on, the convolution runs as the GEMM it is, contiguous already
    # (fused_layers.siglip_patch_embeddings, which falls back to the convolution itself)
    if getattr(vpm, "_fused_layers", False):
        return fused_layers.siglip_patch_embeddings(vpm, pixel_values)
    return vpm.embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)


def get_vision_hidden_states(model: nn.Module, data: dict) -> torch.Tensor:
    """Resampled features of ``B`` image slices, ``(B, query_num, hidden_size)`` (the thinker's
    ``get_vision_hidden_states``), through ``model.vpm._encoder_graph`` when one is set.

    Args:
        data: ``pixel_values``, the slices as the image processor unfolds them, ``(3, patch, patch *
            h_i * w_i)`` each (a list, or one tensor of equal slices); ``tgt_sizes``, ``(B, 2)``
            integer ``(h_i, w_i)`` on any device.
    """
    pixel_values, padded = pad_vision_slices(data["pixel_values"])
    device = pixel_values.device
    tgt_sizes = to_device_without_sync(data["tgt_sizes"], device)
    patch_size = model.vpm.embeddings.patch_size
    num_patches = (pixel_values.shape[-2] // patch_size) * (pixel_values.shape[-1] // patch_size)
    patch_valid = None
    if padded:
        patch_valid = torch.arange(num_patches, device=device) < tgt_sizes.prod(-1, keepdim=True)
    # The lookup tables are built (or grown) here, never inside a capture.
    position_bucket_table(model.vpm.embeddings, num_patches, device)
    pos_embed_table(model.resampler, num_patches, device, pixel_values.dtype)

    graph = model.vpm._encoder_graph
    # in training (dropout, as the audio paths) the call stays eager, whatever autograd's mode
    if graph is None or model.training or (model.vpm._use_flash_attention_2 and padded):
        return model._encode_images(pixel_values, tgt_sizes, patch_valid)
    return graph(pixel_values, tgt_sizes, patch_valid)


def encode_images(
    model: nn.Module, pixel_values: torch.Tensor, tgt_sizes: torch.Tensor, patch_valid: torch.Tensor | None
) -> torch.Tensor:
    """Pixels to resampled features: the region the vision CUDA graph captures (the thinker's
    ``_encode_images``; its modules are :data:`VISION_CAPTURED_MODULES`).

    Args:
        model: the MiniCPM-o 4.5 thinker (``vpm``, ``resampler``, ``config.vision_batch_size``).
        pixel_values: ``(B, 3, patch, patch * N)`` slices padded to the longest, model dtype.
        tgt_sizes: ``(B, 2)`` integer ``(h_i, w_i)`` on the pixels' device.
        patch_valid: None when no slice is padded, else ``(B, N)`` bool, True for the first
            ``h_i * w_i`` patches of slice ``i``.

    Returns:
        ``(B, query_num, hidden_size)`` in the model dtype.
    """
    batch_size = pixel_values.shape[0]
    chunk = max(1, int(model.config.vision_batch_size))
    vision_embeddings = [
        encode_packed_slices(
            model.vpm,
            pixel_values[start : start + chunk],
            tgt_sizes[start : start + chunk],
            None if patch_valid is None else patch_valid[start : start + chunk],
        )
        for start in range(0, batch_size, chunk)
    ]
    if len(vision_embeddings) > 1:
        return model.resampler(torch.cat(vision_embeddings, dim=0), tgt_sizes)
    return model.resampler(vision_embeddings[0], tgt_sizes)
