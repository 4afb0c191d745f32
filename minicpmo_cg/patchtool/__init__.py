"""``minicpmo-cg-patch``: install the MiniCPM-o 4.5 encoder CUDA graph patch set into vllm-omni / vLLM."""

from __future__ import annotations

from minicpmo_cg.patchtool.cli import main, run
from minicpmo_cg.patchtool.errors import EXIT_CONFLICT, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, ToolError
from minicpmo_cg.patchtool.install import Installation, discover_installation
from minicpmo_cg.patchtool.plan import build_plan
from minicpmo_cg.patchtool.views import ADAPTER_STATES, OWNED_STATES, PATCH_STATES, Plan

__all__ = [
    "ADAPTER_STATES",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "OWNED_STATES",
    "PATCH_STATES",
    "Installation",
    "Plan",
    "ToolError",
    "build_plan",
    "discover_installation",
    "main",
    "run",
]
