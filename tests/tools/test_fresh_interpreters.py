# SPDX-License-Identifier: Apache-2.0
"""A scenario run in a fresh interpreter imports the shared test helpers as the session does.

The CUDA tests of a failed capture run it in a fresh process (``helpers.scenarios``), and that
process imports the test module, which imports ``helpers``. pytest puts ``tests/`` on the
session's ``sys.path`` only; the root ``tests/conftest.py`` puts it on ``PYTHONPATH`` too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.scenarios import output_tail, run_python_scenario

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

TAG = "FRESH-INTERPRETER:"


def test_a_fresh_interpreter_imports_the_test_helpers(tmp_path: Path) -> None:
    code = f"import json, helpers.logs, helpers.scenarios\nprint({TAG!r} + json.dumps(helpers.logs.__name__))"
    proc, results = run_python_scenario(code, TAG, repo=tmp_path, timeout_s=120)
    assert proc.returncode == 0 and results == ["helpers.logs"], output_tail(proc)
