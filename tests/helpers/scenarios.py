# SPDX-License-Identifier: Apache-2.0
"""Running a test scenario in a fresh Python interpreter and reading the result it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_python_scenario(
    code: str, tag: str, *, repo: Path, timeout_s: int = 300
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``python -c code`` in a fresh interpreter, with ``repo`` first on ``PYTHONPATH``.

    Returns the process and every JSON object the scenario printed on a stdout line starting with
    ``tag`` (a fresh process keeps a scenario's CUDA state, e.g. a failed capture, out of the test
    session).
    """
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    results = [json.loads(line[len(tag) :]) for line in proc.stdout.splitlines() if line.startswith(tag)]
    return proc, results


def output_tail(proc: subprocess.CompletedProcess) -> str:
    """The last 4000 characters of a process's stdout and of its stderr, for an assertion message."""
    return proc.stdout[-4000:] + proc.stderr[-4000:]
