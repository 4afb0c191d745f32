# SPDX-License-Identifier: Apache-2.0
"""The Test Plan of each exported PR text against what its tests and the stack say.

One export of this checkout without its verification (a few seconds); the marks of the tests are
pytest's own, from a collection of the checkout's test files, so that a Test Plan command listing a
level none of the PR's tests has (pytest exit 5, "no tests ran") fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
from exportkit import AUTHOR, REPO

from minicpmo_cg.export import conventions as conv

pytestmark = [pytest.mark.core_model]

# Written next to the collection: each collected test's node id and the names of its marks
# (module, class, function and parametrization marks, as pytest's -m sees them).
_MARK_DUMP = """
import json, os

def pytest_collection_modifyitems(session, config, items):
    with open(os.environ["MARK_DUMP_OUT"], "w") as f:
        json.dump({item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}, f)
"""


@pytest.fixture(scope="module")
def plain_export(tmp_path_factory, current_lane_only):
    """``(out dir, manifest)`` of an export of this checkout (texts as written, no test runs)."""
    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity

    out = tmp_path_factory.mktemp("plans") / "pr"
    build.export(build.ExportOptions(repo=REPO, out=out, author=Identity(AUTHOR)))
    return out, json.loads((out / "export.json").read_text())


def _test_plan_commands(text: str) -> list[list[str]]:
    plan = text.split(conv.PR_TEMPLATE_HEADINGS[1], 1)[1].split(conv.PR_TEMPLATE_HEADINGS[2], 1)[0]
    found = re.findall(r"^```bash\n(.*?)^```$", plan, re.MULTILINE | re.DOTALL)
    lines = [line.split("  #", 1)[0] for block in found for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("pytest ")]


def _collected_marks(files: list[str], tmp_path) -> dict[str, list[str]]:
    plugin = tmp_path / "mark_dump_plugin.py"
    plugin.write_text(textwrap.dedent(_MARK_DUMP))
    dump = tmp_path / "marks.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "MARK_DUMP_OUT": str(dump),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
         "mark_dump_plugin", *files],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(dump.read_text())


@pytest.mark.cpu
def test_each_test_plan_command_selects_tests_of_its_pr(plain_export, tmp_path):
    """Every ``pytest ... -m EXPR`` line of a Test Plan names the PR's test files and selects at least
    one of their tests by pytest's own marker evaluation; a level the PR has no tests of is not listed."""
    from _pytest.mark.expression import Expression

    out, manifest = plain_export
    plans = {
        pr["folder"]: _test_plan_commands((out / pr["folder"] / "PR.md").read_text())
        for pr in manifest["prs"]
    }
    files = sorted({a for cmds in plans.values() for cmd in cmds for a in cmd[1:] if a.endswith(".py")})
    assert files, "no Test Plan names a test file"
    marks = _collected_marks(files, tmp_path)
    for folder, commands in plans.items():
        assert commands, f"{folder}: the Test Plan lists no pytest command"
        for cmd in commands:
            named = [a for a in cmd[1:] if a.endswith(".py")]
            assert all((REPO / f).is_file() for f in named), (folder, named)
            expr = cmd[cmd.index("-m") + 1] if "-m" in cmd else None
            tests = {node: names for node, names in marks.items() if node.split("::", 1)[0] in named}
            assert tests, f"{folder}: {' '.join(cmd)} collects no test"
            if expr is None:
                continue
            compiled = Expression.compile(expr)
            selected = [node for node, names in tests.items() if compiled.evaluate(lambda n, **_: n in names)]
            assert selected, f"{folder}: -m {expr!r} selects none of {named} (pytest would exit 5)"


@pytest.mark.cpu
def test_the_vllm_version_names_the_vllm_changes_a_pr_needs_itself_or_through_earlier_prs(plain_export):
    """A PR on top of one that needs an unmerged vLLM change runs on vLLM with that change too: its
    Test Plan's vLLM line says so, as the PR needing it does; a PR needing none names the release."""
    out, manifest = plain_export
    names = {v["folder"]: v["key"].replace("-", " ") for v in manifest["vllm_prs"]}
    needed: list[str] = []
    for pr in manifest["prs"]:
        needed += [f for f in pr["vllm"] if f not in needed]
        text = (out / pr["folder"] / "PR.md").read_text()
        line = next(line for line in text.splitlines() if line.startswith(conv.PR_FIELD_VLLM))
        if not needed:
            assert line == f"{conv.PR_FIELD_VLLM} {manifest['vllm']}", pr["folder"]
            continue
        shown = ", ".join(names[f] for f in needed)
        change = "change" if len(needed) == 1 else "changes"
        assert line == f"{conv.PR_FIELD_VLLM} {manifest['vllm']} with the vLLM {change} ({shown})", pr[
            "folder"
        ]
