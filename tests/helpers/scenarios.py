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


#: The script of :func:`run_adapter_scenario`: the adapter package imported again under its own name
#: (the test's copy of the installed files), ``setup`` run, the scenario called and its result printed.
_ADAPTER_SCENARIO = """
import importlib, importlib.util, json, os, sys
sys.path.insert(0, {test_dir!r})
importlib.import_module("vllm_omni.model_executor.models.minicpmo_4_5")
package_dir = os.path.dirname({path!r})
spec = importlib.util.spec_from_file_location({name!r}, {path!r}, submodule_search_locations=[package_dir])
ecg = importlib.util.module_from_spec(spec)
sys.modules[{name!r}] = ecg
spec.loader.exec_module(ecg)
{setup}
scenario = importlib.import_module({scenario!r})
from minicpmo_cg.vllm_config import standalone_vllm_config
result = getattr(scenario, {function!r})(ecg, standalone_vllm_config())
print({tag!r} + json.dumps(result), flush=True)
{after}
"""


def run_adapter_scenario(
    adapter, test_file: str, function: str, tag: str, *, setup: str = "", hard_exit: bool = False
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Call ``function(adapter, standalone_vllm_config())`` of the test module ``test_file`` in a
    fresh interpreter, through :func:`run_python_scenario`.

    Args:
        adapter: the imported adapter package (the tests' ``ecg`` fixture): the fresh interpreter
            imports the same files under the same name.
        test_file: the calling test module's ``__file__``; its folder goes first on ``sys.path`` and
            the repository is four folders above it (``tests/model_executor/models/minicpmo_4_5/``).
        function: the scenario function of that module; it returns a JSON-serialisable result.
        tag: the prefix of the printed result line.
        setup: Python lines run after the adapter is imported (``ecg`` names it).
        hard_exit: end with ``os._exit(0)``, skipping interpreter teardown.
    """
    test_path = Path(test_file).resolve()
    code = _ADAPTER_SCENARIO.format(
        test_dir=str(test_path.parent),
        name=adapter.__name__,
        path=str(Path(adapter.__file__).resolve()),
        setup=setup,
        scenario=test_path.stem,
        function=function,
        tag=tag,
        after="os._exit(0)" if hard_exit else "",
    )
    return run_python_scenario(code, tag, repo=test_path.parents[4])
