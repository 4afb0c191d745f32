"""Fixtures of the patch tool tests (helpers live in ``patchkit.py``)."""

from __future__ import annotations

from pathlib import Path

import patchkit
import pytest

from minicpmo_cg import patchtool


@pytest.fixture(scope="session")
def versions() -> dict[str, str]:
    return patchtool.discover_installation().versions


@pytest.fixture
def tmp_site(tmp_path) -> Path:
    """A pristine site-packages copy of the lane's target files (see :func:`patchkit.make_site`)."""
    return patchkit.make_site(tmp_path)
