# SPDX-License-Identifier: Apache-2.0
"""Kernels of MiniCPM-o 4.5's fused encoder layers (``fused_layers``)."""

from .fused_add_layer_norm import add_layer_norm, add_layer_norm_reference, triton_unavailable_reason

__all__ = ["add_layer_norm", "add_layer_norm_reference", "triton_unavailable_reason"]
