"""Fixtures for the adapter tests: the adapter module as vllm-omni imports it."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"
REPO_ADAPTER = Path(__file__).resolve().parents[4] / "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph.py"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def ecg():
    """The adapter module under its in-tree name.

    After ``minicpmo-cg-patch apply`` this is the copy installed beside vllm-omni's model
    file, which must equal the repository's source (a stale install fails loudly instead
    of testing old code). Before apply, the repository's file is loaded under that name.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is not None and spec.origin:
        installed = Path(spec.origin)
        if _sha(installed) != _sha(REPO_ADAPTER):
            pytest.fail(f"installed adapter {installed} differs from {REPO_ADAPTER}: run `minicpmo-cg-patch apply`")
        return importlib.import_module(MODULE)
    importlib.import_module("vllm_omni.model_executor.models.minicpmo_4_5")
    spec = importlib.util.spec_from_file_location(MODULE, REPO_ADAPTER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def vllm_config():
    from minicpmo_cg.vllm_config import standalone_vllm_config

    return standalone_vllm_config()
