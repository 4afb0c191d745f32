# SPDX-License-Identifier: Apache-2.0
"""What holds for every test of the repository.

- Shared helpers live in ``tests/helpers/`` and are imported as ``helpers.<module>``: pytest puts
  this directory (the root conftest's, which is no package) on ``sys.path``.
- Every test carries exactly one hardware mark, ``cpu`` or ``cuda`` (``multi_gpu`` tests are
  ``cuda`` too). The CI levels select tests by these marks (``-m "core_model and cpu"``,
  ``-m "core_model and cuda"``), so a test without one would run in no level, and one with both
  in two. Collection fails and names every such test.
- A fresh interpreter a test starts (``helpers.scenarios``) imports ``helpers`` as the session
  does: this directory goes first on ``PYTHONPATH`` for the session's child processes.
- A test run leaves no temporary files behind. torch's inductor cache, which vLLM's import creates
  as ``<tmp>/torchinductor_<user>``, goes to a directory of the session that is removed at its end
  (unless ``TORCHINDUCTOR_CACHE_DIR`` is set). Under ``tools/test.sh``, which gives pytest a
  temporary directory of its own (``TMPDIR`` = ``MINICPMO_CG_RUN_TMPDIR``), the session fails when
  anything but pytest's own ``pytest-of-<user>`` is left there, and names it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

HARDWARE_MARKS = ("cpu", "cuda")
#: set by tools/test.sh to the TMPDIR it gives pytest (a directory nothing else uses)
ENV_RUN_TMPDIR = "MINICPMO_CG_RUN_TMPDIR"
_INDUCTOR_DIR = pytest.StashKey[str]()
_RUN_TMPDIR = pytest.StashKey[str]()


_TESTS_DIR = str(Path(__file__).resolve().parent)
_PYTHONPATH = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    # pytest puts this directory on sys.path, not on PYTHONPATH: without it a scenario that a test
    # runs in a fresh interpreter fails on its first ``import helpers``
    paths = os.environ.get("PYTHONPATH", "")
    if _TESTS_DIR not in paths.split(os.pathsep):
        config.stash[_PYTHONPATH] = paths or None
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS_DIR, paths]))
    # the outermost session checks; a pytest that a test starts (and xdist workers) must not
    run_tmp = os.environ.pop(ENV_RUN_TMPDIR, None)
    if run_tmp:
        config.stash[_RUN_TMPDIR] = run_tmp
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # xdist workers inherit the controller's
        path = tempfile.mkdtemp(prefix="minicpmo-cg-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        config.stash[_INDUCTOR_DIR] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if _PYTHONPATH in config.stash:
        previous = config.stash[_PYTHONPATH]
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
    path = config.stash.get(_INDUCTOR_DIR, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def leftovers(run_tmp: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """What a run left in its own temporary directory, besides pytest's basetemp and ``keep``."""
    return sorted(
        p.name for p in run_tmp.iterdir() if not p.name.startswith("pytest-of-") and p.name not in keep
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run_tmp = session.config.stash.get(_RUN_TMPDIR, None)
    if hasattr(session.config, "workerinput") or not run_tmp:
        return  # an xdist worker (the controller checks), or a run without a TMPDIR of its own
    if Path(run_tmp).resolve() != Path(tempfile.gettempdir()).resolve() or not Path(run_tmp).is_dir():
        return
    inductor = session.config.stash.get(_INDUCTOR_DIR, None)
    left = leftovers(Path(run_tmp), (Path(inductor).name,) if inductor else ())
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests left temporary files in {run_tmp} (TMPDIR): {', '.join(left)}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def hardware_marks(item: pytest.Item) -> list[str]:
    """The hardware marks of a collected test (module, class and function marks together)."""
    return [name for name in HARDWARE_MARKS if item.get_closest_marker(name) is not None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = [
        f"{item.nodeid} ({', '.join(marks) or 'none'})"
        for item in items
        if len(marks := hardware_marks(item)) != 1
    ]
    if bad:
        raise pytest.UsageError(
            f"every test needs exactly one of the marks {', '.join(HARDWARE_MARKS)}; "
            "these have another count:\n  " + "\n  ".join(bad)
        )
