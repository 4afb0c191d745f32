# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: N803
"""Residual add fused with the LayerNorm that follows it, in one Triton kernel.

``residual + (update + update_bias)`` is summed in float32 and rounded once to the residual's dtype;
the LayerNorm (float32 statistics) normalises that rounded sum. Without ``update_bias`` the sum is
bitwise torch's ``residual + update``. Without Triton or off CUDA, :func:`add_layer_norm_reference`
runs the same math with torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.logger import init_logger
from vllm.triton_utils import HAS_TRITON, tl, triton

logger = init_logger(__name__)

__all__ = ["add_layer_norm", "add_layer_norm_reference", "contiguous_rows", "triton_unavailable_reason"]

#: Fallback reasons already logged (one INFO line per reason and process).
_LOGGED_FALLBACKS: set[str] = set()


@triton.jit
def _add_layer_norm_kernel(
    out_ptr,
    sum_ptr,
    residual_ptr,
    update_ptr,
    update_bias_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    cols,
    stride_out,
    stride_sum,
    stride_residual,
    stride_update,
    eps,
    HAS_UPDATE: tl.constexpr,
    HAS_UPDATE_BIAS: tl.constexpr,
    STORE_SUM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program normalises BLOCK_ROWS rows; a row fits in one block of BLOCK_COLS columns.
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_COLS)
    row_ok = row < rows
    col_ok = col < cols
    ok = row_ok[:, None] & col_ok[None, :]
    row = row.to(tl.int64)[:, None]
    total = tl.load(residual_ptr + row * stride_residual + col[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_UPDATE:
        update = tl.load(update_ptr + row * stride_update + col[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_UPDATE_BIAS:
            update += tl.load(update_bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        total += update
    # Round the sum to the residual's dtype once: it is the next residual, and the LayerNorm
    # normalises what is stored, as the unfused LayerNorm reads the stored sum.
    total = total.to(residual_ptr.dtype.element_ty)
    if STORE_SUM:
        tl.store(sum_ptr + row * stride_sum + col[None, :], total, mask=ok)
    total = total.to(tl.float32)
    mean = tl.sum(total, axis=1) / cols
    centred = tl.where(ok, total - mean[:, None], 0.0)
    variance = tl.sum(centred * centred, axis=1) / cols
    inv_std = 1.0 / tl.sqrt(variance + eps)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    normed = centred * inv_std[:, None] * weight[None, :] + bias[None, :]
    tl.store(out_ptr + row * stride_out + col[None, :], normed.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_config(cols: int) -> tuple[int, int]:
    if cols <= 1024:
        return 1, 4
    return 1, 2


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (None: it can).

    Returns:
        ``"Triton is not available (...)"`` when ``vllm.triton_utils.HAS_TRITON`` is False, or
        ``"the tensors are on <device>, not a CUDA device"``.
    """
    if not HAS_TRITON:
        return "Triton is not available (vllm.triton_utils.HAS_TRITON is False: not installed or no usable driver)"
    if device.type != "cuda":
        return f"the tensors are on {device}, not a CUDA device"
    return None


def _log_fallback_once(reason: str) -> None:
    if reason not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(reason)
        logger.info(
            "MiniCPM-o 4.5 fused residual add + LayerNorm: %s; running torch's add and layer_norm instead",
            reason,
        )


def contiguous_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` when its rows are contiguous (any row stride: the kernel reads it in place), else
    its contiguous copy (a column-sliced or transposed view, whose last dimension is strided)."""
    return tensor if tensor.dim() == 0 or tensor.stride(-1) == 1 else tensor.contiguous()


def _rows(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"add_layer_norm: {name} must be {shape}, got {tuple(tensor.shape)}")
    return contiguous_rows(tensor)


def add_layer_norm_reference(
    residual: torch.Tensor,
    update: torch.Tensor | None,
    update_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    store_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`add_layer_norm` with torch ops (the fallback, and the tests' reference)."""
    total = residual.float()
    if update is not None:
        addend = update.float()
        if update_bias is not None:
            addend = addend + update_bias.float()
        total = total + addend
    total = total.to(residual.dtype)
    normed = F.layer_norm(total, (residual.shape[-1],), weight, bias, eps)
    return normed, total if store_sum else None


def add_layer_norm(
    residual: torch.Tensor,
    update: torch.Tensor | None,
    update_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    store_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LayerNorm(residual + update + update_bias)`` and the sum, in one kernel on CUDA.

    Args:
        residual: ``(rows, cols)``, float32, bf16 or fp16; contiguous rows (any row stride) are read
            in place, other layouts (a column-sliced or transposed view) copied once.
        update: None, or ``(rows, cols)`` (a GEMM output without its bias), read or copied as ``residual``.
        update_bias: None, or ``(cols,)``: added to ``update`` (needs ``update``).
        weight, bias: the LayerNorm's affine ``(cols,)``.
        eps: the LayerNorm's epsilon.
        store_sum: also return the sum; False skips its write (the encoder's last LayerNorm).

    Returns:
        ``(normed, total)``, contiguous ``(rows, cols)`` in ``residual``'s dtype; ``total`` (the sum
        rounded once from float32) is None when ``store_sum`` is False.

    Raises:
        ValueError: a shape other than the above.
    """
    if residual.dim() != 2:
        raise ValueError(f"add_layer_norm: residual must be (rows, cols), got {tuple(residual.shape)}")
    rows, cols = residual.shape
    residual = _rows("residual", residual, (rows, cols))
    if update is not None:
        update = _rows("update", update, (rows, cols))
    if update_bias is not None:
        if update is None:
            raise ValueError("add_layer_norm: update_bias needs an update")
        update_bias = _rows("update_bias", update_bias, (cols,))
    weight = _rows("weight", weight, (cols,))
    bias = _rows("bias", bias, (cols,))
    reason = triton_unavailable_reason(residual.device)
    if reason is not None:
        _log_fallback_once(reason)
        return add_layer_norm_reference(residual, update, update_bias, weight, bias, eps, store_sum)
    block_rows, num_warps = _launch_config(cols)
    return _launch(residual, update, update_bias, weight, bias, eps, store_sum, block_rows, num_warps)


def _launch(
    residual: torch.Tensor,
    update: torch.Tensor | None,
    update_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    store_sum: bool,
    block_rows: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, cols = residual.shape
    normed = torch.empty((rows, cols), dtype=residual.dtype, device=residual.device)
    total = torch.empty_like(normed) if store_sum else None
    if rows == 0:
        return normed, total
    _add_layer_norm_kernel[(triton.cdiv(rows, block_rows),)](
        normed,
        total if total is not None else normed,
        residual,
        update if update is not None else residual,
        update_bias if update_bias is not None else weight,
        weight,
        bias,
        rows,
        cols,
        normed.stride(0),
        total.stride(0) if total is not None else 0,
        residual.stride(0),
        update.stride(0) if update is not None else 0,
        float(eps),
        HAS_UPDATE=update is not None,
        HAS_UPDATE_BIAS=update_bias is not None,
        STORE_SUM=store_sum,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=triton.next_power_of_2(cols),
        num_warps=num_warps,
    )
    return normed, total
