# SPDX-License-Identifier: Apache-2.0
"""The stack-order checks of each PR's tree (``minicpmo_cg.export.forward``), on small made-up trees: a
tree names nothing a later PR adds, and each module a PR adds has a user in its tree. Fast: no export.
The export tests run the same checks on this checkout's stack (``verify``'s ``stack order:`` problems).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from minicpmo_cg.export import forward

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

PKG = "vllm_omni/models/m"

RELEASE = {
    f"{PKG}/__init__.py": "",
    f"{PKG}/llm.py": (
        '"""The model; it mentions graph_cap in its docstring only."""\n\n'
        "import torch\n\n\nclass Model:\n    capture_stream = None\n\n    def forward(self, x):\n"
        "        return x  # blocks of tokens\n"
    ),
    f"{PKG}/ops/__init__.py": "",
    "vllm_omni/other/conftest.py": "",
}


def _trees(tmp_path: Path, prs: list[dict[str, str]]):
    """The release and one tree per PR (each PR's files: path -> text, on the trees before it);
    returns ``(ReleaseIndex, [Snapshot])`` as ``verify`` reads them."""
    root = tmp_path / "tree"
    for rel, text in RELEASE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    touched_all = {rel for pr in prs for rel in pr}
    release = forward.ReleaseIndex.read(root, touched_all)
    snapshots, touched = [], set()
    for n, pr in enumerate(prs, 1):
        for rel, text in pr.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        touched |= set(pr)
        snapshots.append(forward.Snapshot.read(root, f"0{n}-pr", touched))
    shutil.rmtree(root)
    return release, snapshots


def test_a_tree_naming_a_file_or_a_name_of_a_later_pr_is_reported_line_by_line(tmp_path):
    first = {
        f"{PKG}/llm.py": RELEASE[f"{PKG}/llm.py"] + "\nfrom . import graphs  # see fused_layers.py\n",
        f"{PKG}/graphs.py": (
            '"""Graphs; the immediate capture is :mod:`.immediate`."""\n\n'
            "def init_graphs(model):\n    model._audio_graph = None\n"
        ),
        "tests/m/test_graphs.py": (
            '"""Tests; the streaming ones are in ``test_streaming.py``."""\n\n'
            "def test_slots(model):\n    model._streaming_graph = None  # set by start_streaming\n"
            "    local_helper = 1\n"
        ),
        "docs/design/page.md": "# Page\n\nThe kernel: `ops/fused_norm.py`; the duplex steps (`DuplexRows`).\n",
    }
    later = {
        f"{PKG}/immediate.py": "from .graphs import init_graphs\n\ndef capture_now(adapter):\n    return adapter\n",
        f"{PKG}/fused_layers.py": "def local_helper():\n    pass\n",
        f"{PKG}/ops/fused_norm.py": "",
        f"{PKG}/streaming.py": (
            "class DuplexRows:\n    pass\n\n\ndef start_streaming(model, graph_cap):\n"
            "    model._streaming_graph = object()\n    model.capture_stream = None\n    blocks = 1\n"
        ),
        f"{PKG}/graphs.py": first[f"{PKG}/graphs.py"]
        + "\nfrom . import fused_layers, immediate, streaming\n",
        "tests/m/test_streaming.py": "",
    }
    release, snapshots = _trees(tmp_path, [first, later])
    found = forward.forward_references(release, snapshots)
    assert found["02-pr"] == []
    names = {problem.split(": names ")[0]: problem.split(": names ")[1] for problem in found["01-pr"]}
    assert names == {
        f"{PKG}/llm.py:12": f"{PKG}/fused_layers.py (02-pr), which a later PR adds: "
        "from . import graphs  # see fused_layers.py",
        f"{PKG}/graphs.py:1": f"{PKG}/immediate.py (02-pr), which a later PR adds: "
        '"""Graphs; the immediate capture is :mod:`.immediate`."""',
        "tests/m/test_graphs.py:1": "tests/m/test_streaming.py (02-pr), which a later PR adds: "
        '"""Tests; the streaming ones are in ``test_streaming.py``."""',
        "tests/m/test_graphs.py:4": "_streaming_graph (02-pr), start_streaming (02-pr), which a later PR adds: "
        "model._streaming_graph = None  # set by start_streaming",
        "docs/design/page.md:3": f"DuplexRows (02-pr), {PKG}/ops/fused_norm.py (02-pr), which a later PR adds: "
        "The kernel: `ops/fused_norm.py`; the duplex steps (`DuplexRows`).",
    }


def test_names_the_tree_has_words_and_release_lines_are_not_forward_references(tmp_path):
    """``graph_cap`` is named by later code and only by a docstring of the release: still a later name,
    but the release's own lines are never read; ``capture_stream`` the release's code has; ``blocks``
    is a word; ``local_helper`` the tests define themselves; a later ``conftest.py`` or ``ops/__init__``
    has the name of a file the tree has."""
    first = {
        f"{PKG}/graphs.py": "def init_graphs(model):\n    model.capture_stream = None  # blocks, capture_stream\n",
        "tests/m/test_graphs.py": "def test_x():\n    local_helper = 2  # conftest.py, ops/__init__.py\n",
        f"{PKG}/llm.py": RELEASE[f"{PKG}/llm.py"] + "\nfrom . import graphs\n",
    }
    later = {
        f"{PKG}/streaming.py": (
            "def start(model, graph_cap):\n    blocks = graph_cap\n    model.capture_stream = blocks\n"
            "    local_helper = 3\n"
        ),
        f"{PKG}/graphs.py": first[f"{PKG}/graphs.py"] + "from . import streaming\n",
        f"{PKG}/ops/kernels/__init__.py": "",
        "tests/n/conftest.py": "",
    }
    release, snapshots = _trees(tmp_path, [first, later])
    assert forward.forward_references(release, snapshots) == {"01-pr": [], "02-pr": []}
    first[f"{PKG}/graphs.py"] += "# the cap: graph_cap\n"
    release, snapshots = _trees(tmp_path, [first, later])
    assert forward.forward_references(release, snapshots)["01-pr"] == [
        f"{PKG}/graphs.py:3: names graph_cap (02-pr), which a later PR adds: # the cap: graph_cap"
    ]


def test_a_module_no_other_file_of_its_tree_uses_is_reported_with_the_pr_adding_it(tmp_path):
    graphs = f"{PKG}/graphs/__init__.py"
    first = {
        graphs: '"""Graphs."""\n\nfrom .adapter import Adapter\nfrom .immediate import capture_now\n',
        f"{PKG}/graphs/adapter.py": "class Adapter:\n    pass\n",
        f"{PKG}/graphs/immediate.py": "def capture_now(adapter):\n    return adapter\n",
        f"{PKG}/wiring.py": "from .graphs import Adapter\n",
        f"{PKG}/lengths.py": "def lengths():\n    return 1\n",
        f"{PKG}/kernel.py": "",
        f"{PKG}/llm.py": RELEASE[f"{PKG}/llm.py"] + "from . import wiring\n",
        "tests/m/helper.py": 'KERNEL = "vllm_omni.models.m.kernel"\n',
    }
    later = {
        f"{PKG}/startup.py": "from .graphs import capture_now\n",
        "tests/m/test_lengths.py": 'lengths = pytest.importorskip("vllm_omni.models.m.lengths")\n',
        f"{PKG}/wiring.py": first[f"{PKG}/wiring.py"] + "from . import startup\n",
    }
    release, snapshots = _trees(tmp_path, [first, later])
    unused = forward.unused_modules(release, snapshots)
    assert [p.split(":")[0] for p in unused["01-pr"]] == [f"{PKG}/graphs/immediate.py", f"{PKG}/lengths.py"]
    assert unused["01-pr"][0].endswith("it belongs to the first PR whose code uses it")
    assert unused["02-pr"] == []  # startup.py: imported by wiring.py; the earlier modules are not re-checked
    first["tests/m/test_graphs.py"] = "def test_now(graphs):\n    assert graphs.capture_now(1) == 1\n"
    first["tests/m/test_lengths.py"] = "from vllm_omni.models.m.lengths import lengths\n"
    release, snapshots = _trees(tmp_path, [first, later])
    assert forward.problems(release, snapshots) == {"01-pr": [], "02-pr": []}


def test_what_a_pr_adds_and_only_a_later_prs_tests_name_is_reported(tmp_path):
    """The wiring a PR adds, named first by a later PR's tests (in code; a comment or a docstring
    does not count), or a test defining a function of the same name, is reported for the PR adding
    it; what no test names, or the PR's own tests name, is not."""
    first = {
        f"{PKG}/llm.py": RELEASE[f"{PKG}/llm.py"]
        + "\n    def _init_graphs(self):\n        pass\n\n    def _untested_helper(self):\n        pass\n",
        f"{PKG}/plan.py": "class MaskPlan:\n    pass\n\n\ndef make_plan():\n    return MaskPlan()\n",
        "tests/m/test_plan.py": (
            '"""Tests of MaskPlan, through make_plan."""\n\nfrom vllm_omni.models.m.plan import make_plan\n\n'
            "def test_plan():\n    assert make_plan()  # _init_graphs comes later\n\n"
            "def _init_graphs():\n    pass\n"
        ),
    }
    later = {
        f"{PKG}/other.py": "from .plan import make_plan\n",
        "tests/m/test_wiring.py": (
            "from vllm_omni.models.m.plan import MaskPlan\n\n"
            "def test_wiring(model):\n    model._init_graphs()\n    assert isinstance(model.plan, MaskPlan)\n"
        ),
    }
    release, snapshots = _trees(tmp_path, [first, later])
    assert forward.late_tests(release, snapshots) == {
        "01-pr": [
            "MaskPlan: added here, and first named by the tests of 02-pr: the tests of what a PR adds go with it",
            "_init_graphs: added here, and first named by the tests of 02-pr: the tests of what a PR adds go "
            "with it",
        ],
        "02-pr": [],
    }
    first["tests/m/test_plan.py"] = first["tests/m/test_plan.py"].replace(
        "def _init_graphs():\n    pass\n", "def test_init(model):\n    model._init_graphs()\n"
    )
    release, snapshots = _trees(tmp_path, [first, later])
    assert forward.late_tests(release, snapshots)["01-pr"] == [
        "MaskPlan: added here, and first named by the tests of 02-pr: the tests of what a PR adds go with it"
    ]
