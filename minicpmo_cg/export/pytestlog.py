"""What one pytest run of a PR's tests did, read from its output and from a small collection plugin.

Shared by the export's checks (:mod:`.verify`, on a CPU machine) and by ``stack-run`` on an offline
GPU host (:mod:`minicpmo_cg.offline_gpu.stackrun`), so that both describe a run the same way: its
summary line, why tests skipped, which warnings pytest counted (category, where raised, counted),
and which tests the run collected with their marks and which of them ``-m`` deselected. The PR
texts account for every collected test from this (:mod:`.prtext`). Standard library only: the GPU
host runs it with nothing of the export's dependencies installed.

Also where the tests of a PR's tree are split into its own and the earlier PRs' ones
(:func:`earlier_test_files`), the same on both machines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

__all__ = [
    "COLLECT_PLUGIN",
    "Collection",
    "earlier_test_files",
    "read_collection",
    "skip_reasons",
    "summary",
    "warnings",
    "write_collect_plugin",
]

#: The module name of the collection plugin (``pytest -p COLLECT_PLUGIN``); its file is written
#: into a folder on ``PYTHONPATH`` by :func:`write_collect_plugin`.
COLLECT_PLUGIN = "collected_marks_plugin"
#: The environment variable naming the JSON file the plugin writes.
COLLECT_OUT = "COLLECTED_MARKS_OUT"

# tryfirst: pytest's own -m deselection is a later implementation of the same hook, so the first
# sees every collected test; pytest_deselected then names those -m (or -k) took away.
_PLUGIN_SOURCE = (
    '''\
"""Writes the tests pytest collected, with their marks, and those it deselected (JSON)."""
import json
import os

import pytest

_found = {"collected": {}, "deselected": []}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    _found["collected"] = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}


def pytest_deselected(items):
    _found["deselected"] += [item.nodeid for item in items]


def pytest_collection_finish(session):
    with open(os.environ["%s"], "w", encoding="utf-8") as f:
        json.dump(_found, f)
'''
    % COLLECT_OUT
)


@dataclass
class Collection:
    """The tests one run collected (node id -> its mark names) and those ``-m`` deselected."""

    tests: dict[str, list[str]] = field(default_factory=dict)
    deselected: list[str] = field(default_factory=list)

    @property
    def selected(self) -> list[str]:
        gone = set(self.deselected)
        return [node for node in self.tests if node not in gone]


def write_collect_plugin(folder: Path) -> str:
    """Write the collection plugin into ``folder`` (which the run puts on ``PYTHONPATH``); return
    the name for ``pytest -p``. The run sets :data:`COLLECT_OUT` to where the plugin writes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{COLLECT_PLUGIN}.py").write_text(_PLUGIN_SOURCE, encoding="utf-8")
    return COLLECT_PLUGIN


def read_collection(path: Path) -> Collection | None:
    """What the plugin wrote at ``path``; None when it wrote nothing (pytest stopped before the
    collection finished, e.g. an import error)."""
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    return Collection(dict(doc.get("collected") or {}), list(doc.get("deselected") or []))


def summary(output: str) -> str | None:
    """pytest's last summary line without its duration (``12 passed, 3 skipped, 40 deselected``)."""
    pattern = r"\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran"
    lines = [line.strip("= ").strip() for line in output.splitlines() if re.search(pattern, line)]
    return re.sub(r"\s+in [\d.]+s.*$", "", lines[-1]) if lines else None


def skip_reasons(output: str) -> dict[str, int]:
    """Skip reason -> how many tests skipped for it, from the ``-rs`` lines of the output."""
    found: dict[str, int] = {}
    for count, reason in re.findall(r"^SKIPPED \[(\d+)\] [^\n]*?:\d+: (.*)$", output, re.MULTILINE):
        found[reason.strip()] = found.get(reason.strip(), 0) + int(count)
    return found


def warnings(output: str, tree: Path | str) -> dict[str, int]:
    """The warnings of pytest's warnings summary: ``"FutureWarning (transformers/x.py:202): The ...
    is deprecated."`` -> how many times it was raised; the counts add up to the summary's
    ``N warnings``.

    pytest lists each warning under the tests that raised it (one line each) or under its location
    with a count (``path:365: 14 warnings``), then the warning indented. Paths are cut to the
    installed package (after ``site-packages/``) or to ``tree``; the message to its first sentence.
    """
    m = re.search(r"^=+ warnings summary =+$(.*?)^-- Docs: ", output, re.MULTILINE | re.DOTALL)
    found: dict[str, int] = {}
    for group in re.split(r"\n\s*\n", m.group(1).strip("\n")) if m else []:
        lines = group.splitlines()
        heads = [line for line in lines if line and not line[0].isspace()]
        warned = next((w for line in lines if (w := re.match(r"^\s+(\S+?):(\d+): (\w+): (.*)$", line))), None)
        if warned is None:
            continue
        path, lineno, category, message = warned.groups()
        path = re.sub(r"^.*/site-packages/", "", path).removeprefix(f"{tree}/")
        path = PurePosixPath(path).name if path.startswith("/") else path
        sentence = re.match(r"^(.*?[.!?])(?:\s|$)", message.strip())
        key = f"{category} ({path}:{lineno}): {sentence.group(1) if sentence else message.strip()}"
        counts = [re.search(r": (\d+) warnings?$", head) for head in heads]
        found[key] = found.get(key, 0) + sum(int(c.group(1)) if c else 1 for c in counts)
    return found


def earlier_test_files(prs: list[dict], index: int, key: str = "tests") -> list[str]:
    """The test files (``test_*.py``) of the PRs before ``prs[index]`` that this PR leaves as they
    are: what "the earlier PRs' tests on this tree" runs. A test file the PR changes (a test an
    earlier PR added, grown by this one) is this PR's own.

    ``prs``: the vllm-omni PRs in stack order, each with ``key`` naming its test files (the
    export manifest's ``tests``, or ``run`` of ``STACK.json``)."""

    def tests(pr: dict) -> list[str]:
        return [t for t in pr.get(key) or [] if PurePosixPath(t).name.startswith("test_")]

    own = set(tests(prs[index]))
    earlier = {t for pr in prs[:index] for t in tests(pr)}
    return sorted(earlier - own)
