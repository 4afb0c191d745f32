# SPDX-License-Identifier: Apache-2.0
"""The unpatched vllm-omni model file, imported beside the patched one for bitwise comparisons.

The patch tool rebuilds the file's pre-apply content from the installed (patched) site; the module
is written under a pytest temporary directory (transformers' docstring decorators read the source
with ``inspect``, so it needs a real file) and imported under a private name, so both versions of
the model can be built in one process.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

MODEL_REL = "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_llm.py"
_PACKAGE = "vllm_omni.model_executor.models.minicpmo_4_5"


def pristine_model_module(directory: Path, tag: str, absent: str) -> Iterator[ModuleType]:
    """Yield the unpatched model module (a generator for a pytest fixture), then unregister it.

    Args:
        directory: where the rebuilt source is written (a ``tmp_path_factory`` directory).
        tag: a name part that keeps each test module's copy apart in ``sys.modules``.
        absent: an attribute only the patched file has; asserted missing, so the comparison is
            never made against a patched copy.

    Skips the test where the patch tool is not importable (a source tree that carries the change
    itself has no unpatched file) or cannot rebuild the file.
    """
    patchtool = pytest.importorskip(
        "minicpmo_cg.patchtool", reason="no patch tool to rebuild the unpatched model file"
    )
    try:
        source = patchtool.build_plan(patchtool.discover_installation()).revert_contents[MODEL_REL]
    except (patchtool.ToolError, KeyError) as exc:
        pytest.skip(f"cannot rebuild the unpatched model file: {exc}")
    path = directory / f"pristine_{tag}_minicpmo_4_5_omni_llm.py"
    path.write_bytes(source)
    name = f"{_PACKAGE}._pristine_{tag}_minicpmo_4_5_omni_llm"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        assert not hasattr(module, absent), f"the rebuilt model file still has {absent}: not pristine"
        yield module
    finally:
        sys.modules.pop(name, None)
