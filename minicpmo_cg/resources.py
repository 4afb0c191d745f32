"""Where the patch set's payload lives: the source tree (editable install) or ``_payload`` (wheel)."""

from __future__ import annotations

from pathlib import Path

ADAPTER_RELPATH = Path("vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph.py")


def payload_root() -> Path:
    """Directory holding ``patches/`` and the adapter's ``vllm_omni/...`` path.

    Raises:
        FileNotFoundError: neither a wheel payload nor a source checkout is found.
    """
    here = Path(__file__).resolve().parent
    for root in (here / "_payload", here.parent):
        if (root / "patches").is_dir() and (root / ADAPTER_RELPATH).is_file():
            return root
    raise FileNotFoundError(f"minicpmo_cg: no patch payload next to {here} (broken install?)")


def patches_dir() -> Path:
    return payload_root() / "patches"


def adapter_source() -> Path:
    return payload_root() / ADAPTER_RELPATH
