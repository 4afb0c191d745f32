"""A vLLM general plugin: say in the server log when the patch set is not applied."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENV_CHECKED", "check_patch_set", "encoder_graphs_disabled", "patch_set_warning"]

#: set by the first check of a server; its child processes skip theirs
ENV_CHECKED = "MINICPMO_CG_PATCH_CHECKED"
_OFF = (False, 0, "false", "False", "0", "off", "no")
#: reasons named in the warning (``minicpmo-cg-patch status`` lists them all)
_SHOWN = 3


def _overrides(argv: Sequence[str]) -> dict:
    """The ``--hf-overrides`` of a command line (JSON, or ``--hf-overrides.KEY VALUE`` pieces)."""
    found: dict = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if not name.startswith("--hf-overrides") and not name.startswith("--hf_overrides"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        key = name[len("--hf-overrides") :].lstrip(".")
        if key:
            found[key] = value
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            found.update(parsed)
    return found


def encoder_graphs_disabled(argv: Sequence[str]) -> bool:
    """Whether ``argv`` turns MiniCPM-o 4.5's encoder CUDA graphs off (``encoder_cuda_graph``)."""
    return _overrides(argv).get("encoder_cuda_graph", True) in _OFF


def patch_set_warning(site: Path | None = None) -> str | None:
    """The warning for the installation of ``site`` (default: where ``vllm`` is imported from), or None."""
    try:
        from minicpmo_cg.patchtool.applied import missing_pieces
        from minicpmo_cg.patchtool.install import discover_installation

        install = discover_installation(site)
        problems = missing_pieces(install)
        where = install.site
    except Exception as exc:  # noqa: BLE001 - a server start must not fail on this check
        problems, where = [f"the check failed: {exc}"], site or "this environment"
    if not problems:
        return None
    shown = "; ".join(problems[:_SHOWN]) + (
        f"; {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    )
    return (
        "MiniCPM-o 4.5 encoder CUDA graphs are on by default, but the minicpmo-cg patch set is not "
        f"applied to the vllm-omni in {where} ({shown}): MiniCPM-o 4.5 runs without "
        "them (or fails to load). Run `minicpmo-cg-patch apply` with this Python "
        f"({sys.executable}), check with `minicpmo-cg-patch status`; or turn them off with "
        "--hf-overrides '{\"encoder_cuda_graph\": false}'."
    )


def check_patch_set(argv: Sequence[str] | None = None, site: Path | None = None) -> None:
    """The ``vllm.general_plugins`` entry point: log the warning once per server, never raise."""
    try:
        if os.environ.get(ENV_CHECKED):
            return
        os.environ[ENV_CHECKED] = "1"
        if encoder_graphs_disabled(sys.argv if argv is None else argv):
            return
        message = patch_set_warning(site)
        if message is not None:
            from vllm.logger import init_logger

            init_logger(f"vllm.{__name__}").warning("%s", message)
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM
        return
