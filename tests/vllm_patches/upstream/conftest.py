# SPDX-License-Identifier: Apache-2.0
"""Tests of this repository's vLLM changes kept in vLLM's own layout and style.

``upstream/<path>`` is the file's path in vllm-project/vllm (``upstream/tests/v1/cudagraph/x.py`` is
vLLM's ``tests/v1/cudagraph/x.py``); ``minicpmo-cg-export`` puts them, as they are, into the
vLLM pull request. vLLM's tests carry no level or hardware marks, so this conftest gives each test
here the marks this repository's CI levels select by: ``core_model``, and ``cuda`` when the test
skips without CUDA (a ``skipif`` whose reason names CUDA, vLLM's idiom), ``cpu`` otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _needs_cuda(item: pytest.Item) -> bool:
    return any(
        "cuda" in str(mark.kwargs.get("reason", "")).lower()
        for mark in item.iter_markers("skipif")
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.core_model)
            item.add_marker(pytest.mark.cuda if _needs_cuda(item) else pytest.mark.cpu)
