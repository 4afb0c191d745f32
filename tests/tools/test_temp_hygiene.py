# SPDX-License-Identifier: Apache-2.0
"""A test run leaves no temporary folders: the root conftest's check, driven by a nested pytest.

``tools/test.sh`` gives pytest a ``TMPDIR`` of its own and names it in ``MINICPMO_CG_RUN_TMPDIR``;
the root ``tests/conftest.py`` then fails the session when anything but pytest's basetemp is left
there (the three folders earlier runs left in ``/tmp``: a ``mkdtemp`` of a fixture, another of a
session fixture, and torch's inductor cache, which it now keeps in a directory of the session).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LEAKY = """
import tempfile

import pytest


@pytest.mark.cpu
def test_leaks():
    tempfile.mkdtemp(prefix="leaked-by-a-test-")
"""

CLEAN = """
import pytest


@pytest.mark.cpu
def test_uses_tmp_path(tmp_path):
    (tmp_path / "x").write_text("pytest's basetemp is pytest's business")
"""


def _session(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, Path]:
    project, run_tmp = tmp_path / "project", tmp_path / "run-tmp"
    project.mkdir()
    run_tmp.mkdir()
    shutil.copy(ROOT_CONFTEST, project / "conftest.py")
    (project / "test_case.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TMPDIR=str(run_tmp), MINICPMO_CG_RUN_TMPDIR=str(run_tmp))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(project)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    return proc, run_tmp


def test_a_session_that_leaves_a_temporary_folder_fails_naming_it(tmp_path):
    proc, run_tmp = _session(tmp_path, LEAKY)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout and "left temporary files" in proc.stdout
    (leaked,) = [p for p in run_tmp.iterdir() if not p.name.startswith("pytest-of-")]
    assert leaked.name.startswith("leaked-by-a-test-") and leaked.name in proc.stdout


def test_a_clean_session_passes_and_its_inductor_cache_is_gone(tmp_path):
    proc, run_tmp = _session(tmp_path, CLEAN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in run_tmp.iterdir() if not p.name.startswith("pytest-of-")] == []
