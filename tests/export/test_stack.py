# SPDX-License-Identifier: Apache-2.0
"""The stack table (``minicpmo_cg.export.stack``) against the checkout, and the pieces that split the
change set into PRs: the page parts of each PR, the import check of each PR's tree, the PR text's
environment and test lines. Fast: nothing here exports.

The invariants are checked on whatever the table and the checkout say, so a renumbered series, a new
owned module or test file, or a moved PR keeps these tests meaningful without editing them.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path, PurePosixPath

import pytest
from exportkit import REPO, series_names, tracked

from minicpmo_cg.export import docsplit, prtext, stack, transform
from minicpmo_cg.export.changeset import RESULTS_PAGE, read_change_set
from minicpmo_cg.export.verify import unresolved_imports

pytestmark = [pytest.mark.core_model]

DESIGN_DIR = "docs/design"
RESULTS = RESULTS_PAGE


@pytest.fixture(scope="module")
def cs():
    return read_change_set(REPO, "current")


@pytest.fixture(scope="module")
def st(cs):
    return stack.resolve(cs)


def _active_omni_patches(lane_version: str) -> list[str]:
    """The lane's vllm-omni patches read from the series and the headers, without the export's code."""
    active = []
    for name in series_names(REPO / "patches/vllm-omni"):
        header = (REPO / "patches/vllm-omni" / name).read_text().split("\n---\n", 1)[0]
        if f"vllm-omni=={lane_version}" in header and "Upstream-Since:" not in header:
            active.append(f"vllm-omni/{name}")
    return active


def _disjoint_union(parts: list[set[str]]) -> set[str]:
    union: set[str] = set()
    for part in parts:
        assert not union & part, f"in two PRs: {sorted(union & part)}"
        union |= part
    return union


@pytest.mark.cpu
def test_every_active_patch_is_in_exactly_one_pr_in_series_order(cs, st):
    active = _active_omni_patches(cs.lane.vllm_omni)
    assert active
    assert _disjoint_union([{p.name for p in pr.patches} for pr in st.omni]) == set(active)
    stacked = [p.name for pr in st.omni for p in pr.patches]
    assert stacked == [name for name in active if name in stacked], (
        "the PRs take the patches out of series order"
    )
    vllm = {p.name for p in cs.vllm_patches}
    assert _disjoint_union([{p.name for p in pr.patches} for pr in st.vllm]) == vllm


@pytest.mark.cpu
def test_every_owned_file_and_test_file_is_in_exactly_one_pr(st):
    owned = set(tracked("vllm_omni"))
    assert _disjoint_union([set(pr.owned) for pr in st.omni]) == owned
    listed = tracked("tests/model_executor/models/minicpmo_4_5", "tests/e2e")
    tests = {f for f in listed if f.endswith(".py") and not f.startswith("tests/e2e/")}
    tests |= {
        f for f in listed if f.startswith("tests/e2e/") and PurePosixPath(f).name.startswith("test_minicpmo")
    }
    assert tests and tests <= _disjoint_union([set(pr.tests) for pr in st.omni])
    vllm_tests = {f for f in tracked(stack.VLLM_TESTS_ROOT) if PurePosixPath(f).name.startswith("test_")}
    assert vllm_tests <= _disjoint_union([set(pr.tests) for pr in st.vllm])
    for pr in st.vllm:
        for source, (target, _) in pr.tests.items():
            assert target == source.removeprefix(stack.VLLM_TESTS_ROOT) and target.startswith("tests/")


@pytest.mark.cpu
def test_every_design_page_is_added_by_one_pr_and_every_tag_names_a_pr(cs, st):
    pages = {p for pr in st.omni for p in pr.pages}
    assert pages == set(cs.design_pages) and sum(len(pr.pages) for pr in st.omni) == len(pages)
    keys = set(st.keys)
    for rel in [*cs.design_pages, RESULTS]:
        text = transform.drop_project_only((REPO / rel).read_text(), rel)
        tags = set(re.findall(r"<!--\s*pr(?:-before)?:\s*([\w-]+)", text))
        assert tags <= keys, f"{rel}: tags {sorted(tags - keys)} name no PR of the stack"
    for pr in st.omni:
        for heading in pr.results:
            assert any(
                h.startswith(heading) for _, h, _ in prtext.markdown_sections((REPO / RESULTS).read_text())
            )


@pytest.mark.cpu
def test_each_page_version_holds_the_parts_of_its_pr_and_the_earlier_ones_only(cs, st):
    """A part tagged for PR K shows from K on; a pr-before part of K shows before K only; every
    version keeps its own anchors (page_version raises on a link to a part it dropped)."""
    keys = st.keys
    tags = 0
    for page, path in cs.design_pages.items():
        text = transform.drop_project_only(path.read_text(), page)
        tagged = [
            (m.group(1), m.group(2))
            for m in re.finditer(r"^(\S.*?)[ \t]+<!--[ \t]*pr:[ \t]*([\w-]+)[ \t]*-->[ \t]*$", text, re.M)
        ]
        hidden = re.findall(r"^<!--\s*pr-before:\s*([\w-]+)\n(.*?)\n-->$", text, re.M | re.S)
        tags += len(tagged) + len(hidden)
        for i, key in enumerate(keys):
            version = docsplit.page_version(text, page, keys[: i + 1], set(keys), st.page_sections.get(page))
            assert "<!-- pr" not in version and "-->" not in version.replace("<!-- markdownlint", "")
            for line, owner in tagged:
                assert (line in version) == (keys.index(owner) <= i), (key, line)
            for owner, body in hidden:
                assert (body.strip() in version) == (keys.index(owner) > i), (key, body[:60])
            for heading, owner in st.page_sections.get(page, {}).items():
                present = any(h == heading for _, h, _ in prtext.markdown_sections(version))
                assert present == (keys.index(owner) <= i), (key, heading)
    assert tags, "no design page tags a part with a PR"


# -- the table's errors -----------------------------------------------------------------------------


def _replace(table, index, **fields):
    out = list(table)
    out[index] = dataclasses.replace(out[index], **fields)
    return tuple(out)


@pytest.mark.cpu
def test_a_patch_in_two_prs_or_in_none_is_refused(cs):
    table = stack.STACK
    doubled = _replace(table, 1, patches=table[1].patches + table[0].patches)
    with pytest.raises(
        stack.StackError, match=rf"is in {table[0].key}, {table[1].key}: it must be in exactly one"
    ):
        stack.resolve(cs, doubled)
    with pytest.raises(stack.StackError, match=r"vllm-omni patch .* is in no PR") as info:
        stack.resolve(cs, table[:-1])
    assert "test file" in str(info.value) or not table[-1].tests


@pytest.mark.cpu
def test_the_tree_of_each_prs_figures_resolves_and_a_tree_without_the_pr_is_refused(cs):
    st = stack.resolve(cs)
    for pr in st.omni:
        on = pr.spec.measured_on
        expected = {"stack": len(st.omni), "own": pr.number}.get(on) or st.keys.index(on) + 1
        assert pr.measured_upto == expected >= pr.number, pr.key
    last = len(stack.STACK) - 1
    with pytest.raises(stack.StackError, match="a tree without this PR"):
        stack.resolve(cs, _replace(stack.STACK, last, measured_on=stack.STACK[0].key))
    with pytest.raises(stack.StackError, match="measured_on 'nowhere' is none of"):
        stack.resolve(cs, _replace(stack.STACK, 0, measured_on="nowhere"))
    assert stack.resolve(cs, _replace(stack.STACK, 0, measured_on="own")).omni[0].measured_upto == 1


@pytest.mark.cpu
def test_prs_out_of_series_order_are_refused(cs):
    table = stack.STACK
    swapped = (table[1], table[0], *table[2:])
    with pytest.raises(stack.StackError, match="would not apply PR by PR"):
        stack.resolve(cs, swapped)


def _diff_paths(patch) -> set[str]:
    """The files a patch changes, read off its ``+++ b/`` lines (not the patch tool's parser)."""
    return set(re.findall(r"^\+\+\+ b/(\S+)", patch.diff, re.MULTILINE))


@pytest.mark.cpu
def test_a_patch_commit_is_core_where_it_changes_vllm_omni_outside_the_model_and_its_pr_says_so(cs, st):
    """A vllm-omni patch's commit is [Model] when every file it changes is in the model's folder,
    [Core] when one is elsewhere in vllm-omni (the model runner); each PR holding a [Core] commit
    carries [Core] among its title prefixes, and a table whose PR lacks it is refused, naming its patches."""
    model_dir = "vllm_omni/model_executor/models/minicpmo_4_5/"
    core = set()
    for pr in st.omni:
        for patch in pr.patches:
            outside = {f for f in _diff_paths(patch) if not f.startswith(model_dir)}
            title = stack.patch_commit_title(patch)
            assert title.startswith("[Core] " if outside else "[Model] MiniCPM-o 4.5: "), patch.name
            assert patch.subject.removeprefix("minicpmo_4_5: ") in title
            if outside:
                core.add(patch.name)
                assert "[Core]" in pr.spec.prefixes and "[Core]" in pr.title, pr.key
    assert core, "no vllm-omni patch changes vllm-omni outside the model's folder"
    # each PR holding a [Core] commit (the start-up capture's and the batched duplex steps' runner hooks)
    holders = [i for i, pr in enumerate(st.omni) if any(p.name in core for p in pr.patches)]
    for holder in holders:
        lacking = tuple(p for p in stack.STACK[holder].prefixes if p != "[Core]")
        with pytest.raises(
            stack.StackError, match=r"so its commit is \[Core\], which the PR's title prefixes"
        ) as info:
            stack.resolve(cs, _replace(stack.STACK, holder, prefixes=lacking))
        own = [p.name for p in st.omni[holder].patches if p.name in core]
        assert own and all(PurePosixPath(name).name in str(info.value) for name in own)


@pytest.mark.cpu
def test_table_entries_that_match_nothing_are_refused_each_one_named(cs):
    table = _replace(stack.STACK, 0, tests=stack.STACK[0].tests + ("tests/nowhere/test_x.py",),
                     docs=stack.STACK[0].docs + (f"{DESIGN_DIR}/minicpmo_encoder_cuda_graph.md#No such heading",),
                     vllm=("no-such-vllm-pr",), patches=stack.STACK[0].patches + ("9999-no-such.patch",))  # fmt: skip
    with pytest.raises(stack.StackError) as info:
        stack.resolve(cs, table)
    message = str(info.value)
    assert "'tests/nowhere/test_x.py' matches no file" in message
    assert "has no heading 'No such heading'" in message
    assert "'no-such-vllm-pr', which the vLLM table does not have" in message
    assert "patch '9999-no-such.patch' matches 0 patches" in message


@pytest.mark.cpu
def test_a_vllm_change_the_lane_ships_needs_no_pr(cs):
    shipped = dataclasses.replace(cs, vllm_patches=())
    resolved = stack.resolve(shipped)
    assert resolved.vllm == [] and all(pr.vllm == [] for pr in resolved.omni)


@pytest.mark.cpu
def test_patches_are_named_by_topic_or_file_name():
    assert (
        stack.patch_topic("vllm-omni/0005-minicpmo45-siglip-sdpa-attention.patch")
        == "minicpmo45-siglip-sdpa-attention"
    )
    assert stack.patch_topic("0001-a-b.patch") == "a-b"


# -- page parts -------------------------------------------------------------------------------------

PAGE = """# Title

Intro.

| a | b |
|---|---|
| 1 | base |
| 2 | later | <!-- pr: two -->
<!-- pr-before: two
| 2 | before two |
-->

<!-- pr: three -->
Three's paragraph, see [Sec](#sec).
<!-- /pr -->

## Sec

Section of three.

## Other

Link to [Sec](#sec). <!-- pr: three -->
"""


@pytest.mark.cpu
def test_page_version_takes_tags_blocks_hidden_parts_and_sections():
    keys = {"one", "two", "three"}
    sections = {"Sec": "three"}
    one = docsplit.page_version(PAGE, "p.md", ["one"], keys, sections)
    assert "| 2 | before two |" in one and "later" not in one and "Three's" not in one and "## Sec" not in one
    assert "<!--" not in one and "-->" not in one
    two = docsplit.page_version(PAGE, "p.md", ["one", "two"], keys, sections)
    assert "| 2 | later |\n" in two and "before two" not in two and "## Sec" not in two
    three = docsplit.page_version(PAGE, "p.md", ["one", "two", "three"], keys, sections)
    assert "Three's paragraph" in three and "Section of three." in three and "Link to [Sec](#sec)." in three
    assert "\n\n\n" not in three


@pytest.mark.cpu
def test_page_version_refuses_unknown_keys_unbalanced_markers_and_dangling_anchors():
    with pytest.raises(transform.ExportError, match="tagged for four, no PR of the stack"):
        docsplit.page_version("x <!-- pr: four -->\n", "p.md", ["one"], {"one"})
    with pytest.raises(transform.ExportError, match="p.md:1: the in block of 'one' is never closed"):
        docsplit.page_version("<!-- pr: one -->\nx\n", "p.md", ["one"], {"one"})
    with pytest.raises(transform.ExportError, match="p.md:1: <!-- /pr --> without"):
        docsplit.page_version("<!-- /pr -->\n", "p.md", ["one"], {"one"})
    with pytest.raises(transform.ExportError, match=r"as of PR one: links to #sec"):
        docsplit.page_version(PAGE.replace("Link to [Sec](#sec). <!-- pr: three -->", "Link to [Sec](#sec)."),
                              "p.md", ["one"], {"one", "two", "three"}, {"Sec": "three"})  # fmt: skip


@pytest.mark.cpu
def test_own_parts_keep_untagged_text_and_the_prs_own_only():
    text = "Caption.\n\n| r | v |\n|---|---|\n| a | 1 | <!-- pr: one -->\n| b | 2 | <!-- pr: two -->\n"
    assert (
        docsplit.own_parts(text, "r.md", "one", {"one", "two"})
        == "Caption.\n\n| r | v |\n|---|---|\n| a | 1 |\n"
    )


@pytest.mark.cpu
def test_anchors_are_the_headings_slugs():
    assert docsplit.slug("Options (`--hf-overrides`)") == "options---hf-overrides"
    assert docsplit.slug("Streaming (duplex) audio") == "streaming-duplex-audio"
    assert docsplit.dangling_anchors("# A b\n\n[x](#a-b) [y](#c)\n") == ["c"]


# -- imports of a PR's tree -------------------------------------------------------------------------


@pytest.mark.cpu
def test_imports_of_modules_or_names_a_later_pr_adds_are_found(tmp_path):
    model = tmp_path / "vllm_omni/models/m"
    model.mkdir(parents=True)
    (model / "__init__.py").write_text("")
    (model / "llm.py").write_text("from .adapter import Graph\n\nclass Model:\n    pass\n")
    tests = tmp_path / "tests/m"
    tests.mkdir(parents=True)
    (tests / "test_a.py").write_text(
        "from vllm_omni.models.m.llm import Model, Later\n"
        "import vllm_omni.models.m.vision\n"
        "from helper_of_later_pr import x\n"
        "from vllm_omni.models.m import llm\n"
        'later = pytest.importorskip("vllm_omni.models.m.later")\n'
    )
    problems = unresolved_imports(tmp_path, ["vllm_omni/models/m/llm.py", "tests/m/test_a.py"],
                                  {"tests/m/helper_of_later_pr.py"})  # fmt: skip
    assert problems == [
        "vllm_omni/models/m/llm.py:1: imports vllm_omni.models.m.adapter, which this tree does not have",
        "tests/m/test_a.py:1: imports Later from vllm_omni.models.m.llm, which does not define it",
        "tests/m/test_a.py:2: imports vllm_omni.models.m.vision, which this tree does not have",
        "tests/m/test_a.py:3: imports helper_of_later_pr, which this tree does not have",
        "tests/m/test_a.py:5: imports vllm_omni.models.m.later, which this tree does not have",
    ]
    (model / "adapter.py").write_text("Graph = object\n")
    (model / "vision.py").write_text("")
    (model / "later.py").write_text("")
    (tests / "helper_of_later_pr.py").write_text("x = 1\n")
    (model / "llm.py").write_text("from .adapter import Graph\n\nclass Model:\n    pass\n\nLater = 1\n")
    assert unresolved_imports(tmp_path, ["vllm_omni/models/m/llm.py", "tests/m/test_a.py"],
                              {"tests/m/helper_of_later_pr.py"}) == []  # fmt: skip


#: A vendored helper module's name in an exported test folder (``transform.vendor_tests``).
_VENDORED_PREFIX = "minicpmo45_"
#: An import of a vendored module on a line of a string (a script a test runs in a fresh interpreter).
_SCRIPT_IMPORT = re.compile(
    rf"^\s*(?:from ({_VENDORED_PREFIX}\w+) import ([\w ,]+?)|import ({_VENDORED_PREFIX}\w+) as (\w+))\s*$",
    re.M,
)


@dataclasses.dataclass
class _Scope:
    """What some statements of a module do with the folder's vendored modules: the modules they
    import, the local names they bind to a module (``None``) or to one of its names, the names they
    read and the ``alias.attr`` they read."""

    imports: set[str] = dataclasses.field(default_factory=set)
    bindings: dict[str, tuple[str, str | None]] = dataclasses.field(default_factory=dict)
    reads: set[str] = dataclasses.field(default_factory=set)
    attrs: set[tuple[str, str]] = dataclasses.field(default_factory=set)


def _scope(nodes: list[ast.AST]) -> _Scope:
    out = _Scope()

    def bind(module: str, name: str | None, alias: str) -> None:
        out.imports.add(module)
        out.bindings[alias] = (module, name)

    walked = [n for top in nodes for n in ast.walk(top)]
    # a name read only as ``alias.attr`` reads that attribute, not all of the module
    qualifiers = {
        id(n.value) for n in walked if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    for node in walked:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_VENDORED_PREFIX):
            for a in node.names:
                bind(node.module, a.name, a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(_VENDORED_PREFIX):
                    bind(a.name, None, a.asname or a.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in _SCRIPT_IMPORT.finditer(node.value):
                if m.group(1):
                    for item in m.group(2).split(","):
                        bind(m.group(1), item.split()[0], item.split()[-1])
                else:
                    bind(m.group(3), None, m.group(4))
        elif isinstance(node, ast.Name) and id(node) not in qualifiers:
            out.reads.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out.attrs.add((node.value.id, node.attr))
    return out


def _helper_modules_run(files: dict[str, str]) -> set[str]:
    """The vendored helper modules (``minicpmo45_*``) that the tests of one exported test folder
    (``files``: file name -> text) import when they run (:func:`_units_run`)."""
    return {module for module, _ in _units_run(files) if module.startswith(_VENDORED_PREFIX)}


def _units_run(files: dict[str, str]) -> set[tuple[str, str | None]]:
    """``(module, unit)`` of what the tests of one exported test folder (``files``: file name -> text)
    run, read from the syntax: ``unit`` a top-level function, class or assigned name of ``module``,
    None for the module's top-level statements (it is imported).

    Every statement of a test module or ``conftest.py`` runs. Of a helper module, its top-level
    statements run when it is imported (so a module-level import imports that module too); a top-level
    function, class or assignment runs only when code that runs names it (``from m import f``, ``m.f``,
    ``f`` inside ``m``), and then the imports inside it run too. An import on a line of a string (the
    script of a fresh interpreter) counts as an import of the code holding the string.
    """
    units: dict[str, dict[str, list[ast.AST]]] = {}
    init: dict[str, _Scope] = {}
    for name, text in files.items():
        module = PurePosixPath(name).stem
        units[module], rest = {}, []
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                units[module].setdefault(node.name, []).append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for n in (n for target in targets for n in ast.walk(target)):
                    if isinstance(n, ast.Name):
                        units[module].setdefault(n.id, []).append(node)
            else:
                rest.append(node)
        init[module] = _scope(rest)
    todo: list[tuple[str, str | None]] = []
    for module in units:
        if module.startswith("test_") or module == "conftest":
            todo += [(module, None), *((module, unit) for unit in units[module])]

    def follow(module: str, scope: _Scope, bindings: dict[str, tuple[str, str | None]]) -> None:
        todo.extend((m, None) for m in scope.imports)
        for name in scope.reads:
            if name in units[module]:
                todo.append((module, name))
            elif name in bindings:  # a name imported from a module, or the module itself (all of it)
                target, attr = bindings[name]
                todo.extend([(target, attr)] if attr else [(target, unit) for unit in units.get(target, {})])
        for alias, attr in scope.attrs:
            if alias in bindings and bindings[alias][1] is None:
                todo.append((bindings[alias][0], attr))

    seen: set[tuple[str, str | None]] = set()
    while todo:
        module, unit = todo.pop()
        if (module, unit) in seen or module not in units:
            continue
        seen.add((module, unit))
        if unit is None:
            follow(module, init[module], init[module].bindings)
        elif unit in units[module]:
            todo.append((module, None))
            scope = _scope(units[module][unit])
            follow(module, scope, {**init[module].bindings, **scope.bindings})
        elif (target := init[module].bindings.get(unit)) and target[1]:  # a name the module re-exports
            todo.append(target)
    return seen


@pytest.mark.cpu
def test_the_helper_modules_a_test_runs_are_found_and_only_those():
    broad = (
        "import torch\n"
        "from minicpmo45_narrow import Session\n"
        "__all__ = ['Session', 'speech']\n"
        "def speech():\n"
        "    import minicpmo45_inputs as inputs\n"
        "    return inputs.load()\n"
        "SCRIPT = 'import sys\\nfrom minicpmo45_config import standalone_config\\n'\n"
        "def run_script():\n"
        "    return SCRIPT\n"
    )
    files = {
        "minicpmo45_narrow.py": "class Session:\n    pass\n",
        "minicpmo45_broad.py": broad,
        "minicpmo45_inputs.py": "import minicpmo45_builder as builder\n\ndef load():\n    return 1\n",
        "minicpmo45_builder.py": "",
        "minicpmo45_config.py": "",
        "minicpmo45_unused.py": "",
        "test_a.py": "from minicpmo45_broad import Session\n\ndef test_x():\n    assert Session\n",
    }
    # the session, re-exported by a module whose other functions load real inputs: those never run
    assert _helper_modules_run(files) == {"minicpmo45_broad", "minicpmo45_narrow"}
    files["test_a.py"] += "\ndef test_y():\n    import minicpmo45_broad as broad\n    broad.speech()\n"
    run = {"minicpmo45_broad", "minicpmo45_narrow", "minicpmo45_inputs", "minicpmo45_builder"}
    assert _helper_modules_run(files) == run
    files["conftest.py"] = (
        "from minicpmo45_broad import run_script\n\ndef script():\n    return run_script()\n"
    )
    assert _helper_modules_run(files) == run | {"minicpmo45_config"}


@pytest.mark.cpu
def test_each_pr_vendors_only_the_helper_modules_its_tests_run(st):
    """No PR carries a helper module that its tree's tests never run. The export vendors a module,
    with every module any of its lines imports, into the first PR whose tests import it; so a test
    imports the narrowest module holding what it runs (a duplex session's calls, not the module that
    also loads real speech for later PRs' tests)."""
    keys = set(st.keys)
    tests: dict[str, Path] = {}
    for pr in st.omni:
        upto = st.upto(pr.key)
        tests |= pr.tests
        out = transform.vendor_tests(
            REPO, tests, version=lambda text, rel, upto=upto: docsplit.source_version(text, rel, upto, keys)
        )
        for folder in {PurePosixPath(rel).parent for rel in out.vendored}:
            files = {
                PurePosixPath(r).name: t for r, t in out.files.items() if PurePosixPath(r).parent == folder
            }
            vendored = {
                PurePosixPath(r).stem: src
                for r, src in out.vendored.items()
                if PurePosixPath(r).parent == folder
            }
            unused = sorted(set(vendored) - _helper_modules_run(files))
            assert not unused, (
                f"{pr.key}: {folder}/ vendors {[vendored[m] for m in unused]}, which none of its tests runs"
            )


def _helper_definitions(text: str) -> list[str]:
    """The top-level functions and classes of a vendored helper module."""
    nodes = ast.parse(text).body
    return [n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _vendored_runs(st) -> dict[str, dict[str, tuple[dict[str, str], set[tuple[str, str | None]]]]]:
    """Per PR key, per vendored helper (its exported path): its text as the PR carries it and what
    the tests of its folder in that PR's tree run (:func:`_units_run`)."""
    keys = set(st.keys)
    tests: dict[str, Path] = {}
    out = {}
    for pr in st.omni:
        upto = st.upto(pr.key)
        tests |= pr.tests
        vendored = transform.vendor_tests(
            REPO, tests, version=lambda text, rel, upto=upto: docsplit.source_version(text, rel, upto, keys)
        )
        runs = {}
        for folder in {PurePosixPath(rel).parent for rel in vendored.vendored}:
            files = {
                PurePosixPath(r).name: t
                for r, t in vendored.files.items()
                if PurePosixPath(r).parent == folder
            }
            run = _units_run(files)
            for rel in vendored.vendored:
                if PurePosixPath(rel).parent == folder:
                    runs[rel] = (vendored.files[rel], run)
        out[pr.key] = runs
    return out


@pytest.mark.cpu
def test_a_helper_function_arrives_with_the_first_pr_whose_tests_run_it(st):
    """A function or class of a vendored helper module that only a later PR's tests run is that
    PR's (tagged for it in the helper), not carried by the earlier PRs that vendor the module for
    other parts: e.g. ``vllm_config.duplex_vllm_config``, which the duplex-batch PR's tests use. What
    no PR's tests run (the demo's inputs) goes with the module as it is."""
    runs = _vendored_runs(st)
    problems = []
    for n, pr in enumerate(st.omni):
        for rel, (text, run) in runs[pr.key].items():
            module = PurePosixPath(rel).stem
            for name in _helper_definitions(text):
                if (module, name) in run:
                    continue
                later = next(
                    (
                        p.key
                        for p in st.omni[n + 1 :]
                        if (module, name) in runs[p.key].get(rel, ("", set()))[1]
                    ),
                    None,
                )
                if later:
                    problems.append(f"{pr.key}: {rel} carries {name}, which only the tests of PR {later} run")
    assert not problems, "\n".join(problems)


@pytest.mark.cpu
def test_the_units_a_test_runs_are_found_and_only_those():
    files = {
        "minicpmo45_config.py": "def standalone():\n    return 1\n\ndef duplex(base):\n    return base\n",
        "test_a.py": "from minicpmo45_config import standalone\n\ndef test_x():\n    assert standalone()\n",
    }
    run = _units_run(files)
    assert ("minicpmo45_config", "standalone") in run and ("minicpmo45_config", "duplex") not in run
    files["test_b.py"] = "import minicpmo45_config as config\n\ndef test_y():\n    config.duplex(1)\n"
    assert ("minicpmo45_config", "duplex") in _units_run(files)


# -- PR text pieces ---------------------------------------------------------------------------------


@pytest.mark.cpu
def test_pin_differences_name_each_version_outside_a_requirement():
    setup = "one NVIDIA H200 (driver 1.2, torch 2.11.0+cu130, transformers 5.17.0, Python 3.12.3)"
    requirements = {"vllm": ["torch==2.13.0", "transformers>=5.10.4"], "vllm-omni": ["transformers<5.15,>=5.13.0",
                                                                                  "python>=3.10"]}  # fmt: skip
    assert prtext.pin_differences(setup, requirements, {"vllm": "0.30.0", "vllm-omni": "0.30.0"}) == [
        "torch 2.11.0+cu130 (vLLM 0.30.0 requires torch==2.13.0)",
        "transformers 5.17.0 (vllm-omni 0.30.0 requires transformers<5.15,>=5.13.0)",
    ]
    assert prtext.pin_differences("torch 2.13.0", requirements, {}) == []


@pytest.mark.cpu
def test_run_lines_explain_skips_and_deselection():
    run = prtext.PytestRun(
        "core_model and cpu", "3 passed, 2 skipped, 4 deselected", {"needs two GPUs": 2}, "Python 3.11"
    )
    [line] = prtext.run_lines([run])
    assert '`pytest -m "core_model and cpu"`: `3 passed, 2 skipped, 4 deselected`, Python 3.11' in line
    assert "Skipped: 2 × needs two GPUs" in line
    assert 'Deselected: the collected tests that `-m "core_model and cpu"` does not select' in line


_PYTEST_OUTPUT = """\
....                                                                     [100%]
=============================== warnings summary ===============================
tests/m/test_a.py::test_one[dtype0]
tests/m/test_a.py::test_one[dtype1]
  /venv/lib/python3.11/site-packages/transformers/masks.py:202: FutureWarning: The mask API is deprecated and will be removed in v5.10. Use masking_utils.
    warnings.warn(MESSAGE, FutureWarning)

../../venv/lib/python3.11/site-packages/torch/jit/_script.py:365: 14 warnings
  /venv/lib/python3.11/site-packages/torch/jit/_script.py:365: DeprecationWarning: `torch.jit.script_method` is deprecated. Please switch to `torch.compile`.
    warnings.warn(

tests/m/test_b.py::test_two
  {tree}/tests/m/test_b.py:12: UserWarning: a test's own warning
    warnings.warn("a test's own warning")

-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
4 passed, 17 warnings in 1.50s
"""


@pytest.mark.cpu
def test_the_warnings_of_a_run_are_read_with_their_counts_and_named_in_its_line(tmp_path):
    from minicpmo_cg.export import pytestlog

    output = _PYTEST_OUTPUT.replace("{tree}", str(tmp_path))
    found = pytestlog.warnings(output, tmp_path)
    assert found == {
        "FutureWarning (transformers/masks.py:202): The mask API is deprecated and will be removed in v5.10.": 2,
        "DeprecationWarning (torch/jit/_script.py:365): `torch.jit.script_method` is deprecated.": 14,
        "UserWarning (tests/m/test_b.py:12): a test's own warning": 1,
    }
    assert pytestlog.summary(output) == "4 passed, 17 warnings"
    assert sum(found.values()) == 17
    assert pytestlog.warnings("4 passed in 1.50s\n", tmp_path) == {}
    run = prtext.PytestRun(
        "core_model and cpu", "4 passed, 17 warnings", environment="Python 3.11", warnings=found
    )
    [line] = prtext.run_lines([run])
    assert "Warnings: 14 × DeprecationWarning (torch/jit/_script.py:365)" in line
    assert all(f"{n} × {warning}" in line for warning, n in found.items())
    assert str(tmp_path) not in line and "site-packages" not in line


@pytest.mark.cpu
def test_every_table_gets_the_paragraph_before_it_as_caption():
    body = "Intro:\n\n| a |\n|---|\n| 1 |\n\nText\n| b |\n|---|\n| 2 |\n"
    assert prtext.tables_with_captions(body) == [
        ("Intro:", "| a |\n|---|\n| 1 |"),
        ("Text", "| b |\n|---|\n| 2 |"),
    ]


@pytest.mark.cpu
def test_positional_references_are_found_but_not_comparisons():
    text = "as the table above shows\nsee below\nthe ratio below 3×\nabove 1 GiB\n"
    found = transform.project_mentions({"PR.md": text}, words=transform.POSITIONAL)
    assert [f.split(":")[1] for f in found] == ["1", "2"]


@pytest.mark.cpu
def test_what_vllm_omni_lacks_is_found():
    text = "the demo's table\nthe benchmark runs\nsee the results page\ndemonstrate\n"
    found = transform.project_mentions({"x": text}, words=transform.NOT_UPSTREAM)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3"]


@pytest.mark.cpu
def test_the_folder_of_a_pr_is_its_number_and_key(st):
    assert [pr.folder for pr in st.omni] == [f"{i:02d}-{pr.key}" for i, pr in enumerate(st.omni, 1)]
    assert all(pr.title.startswith("[") and pr.spec.title in pr.title for pr in st.omni + st.vllm)
    assert all(re.fullmatch(r"(?:\[[A-Z][\w/]*\])+", "".join(pr.spec.prefixes)) for pr in st.omni + st.vllm)
    assert Path(REPO / stack.VLLM_TESTS_ROOT).is_dir()


@pytest.mark.cpu
def test_the_remarks_read_the_registry_the_adapter_validates_with():
    """The stack's remarks state defaults from the registry read off the checkout's source; that
    reading gives what the adapter's own registry holds, for every key it can read."""
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph.options import HF_OVERRIDE_KEYS

    read = stack.hf_override_keys((REPO / stack.OPTIONS_MODULE).read_text())
    assert {"encoder_fused_layers", "encoder_cuda_graph_duplex_batch"} <= set(read)
    for name, key in read.items():
        assert key.default == HF_OVERRIDE_KEYS[name].default, name
        assert key.doc == HF_OVERRIDE_KEYS[name].doc, name


def _calls_added(pr, name: str) -> bool:
    return any(re.search(rf"^\+(?!\+).*\b{name}\(", patch.diff, re.MULTILINE) for patch in pr.patches)


@pytest.mark.cpu
def test_the_fused_layers_arrive_with_their_hook_and_its_remark_says_how_close_they_are(st):
    """fused_layers.py and its kernel arrive with the PR adding the constructor's configure_fused_layers
    call (the only setter of ``_fused_layers``), before the PR whose batched duplex rows run the fused
    Whisper layers; that PR's remark states the registry's default and that the fused layers are within
    the CUDA tests' bound, not bitwise."""
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph.options import HF_OVERRIDE_KEYS

    default = HF_OVERRIDE_KEYS["encoder_fused_layers"].default
    carriers = [
        pr
        for pr in st.omni
        if any(rel.endswith(("/fused_layers.py", "/ops/fused_add_layer_norm.py")) for rel in pr.owned)
    ]
    hook = [pr for pr in st.omni if _calls_added(pr, "configure_fused_layers")]
    assert len(hook) == 1 and [pr.key for pr in carriers] == [hook[0].key]
    rows = next(pr for pr in st.omni if any(rel.endswith("/duplex_rows.py") for rel in pr.owned))
    assert st.keys.index(hook[0].key) < st.keys.index(rows.key)
    assert not any(
        "fused_layers.py" in remark for pr in st.omni for remark in pr.remarks if pr is not hook[0]
    )
    stated = " ".join(hook[0].remarks)
    assert f"defaults to `{json.dumps(default)}`" in stated
    assert ("on by default" in stated) == (default != "none")
    bound = re.search(
        r"^BOUND = (\S+)",
        (REPO / "tests/model_executor/models/minicpmo_4_5/test_fused_layers_cuda.py").read_text(),
        re.MULTILINE,
    )
    assert bound and f"within {bound.group(1)} of the original layers" in stated
    assert "not bitwise" in stated


@pytest.mark.cpu
def test_the_duplex_batch_remark_states_the_registrys_default(st):
    """The PR adding batched duplex steps states whether they are on by default as the registry does,
    and how close a batched row is to its session's own encode in that PR's tree: bitwise only where
    it runs the fused Whisper layers (on by default from an earlier PR) with the SDPA reference
    attention; otherwise not bitwise, within the option's four-bf16-step bound."""
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph.options import HF_OVERRIDE_KEYS

    key = HF_OVERRIDE_KEYS["encoder_cuda_graph_duplex_batch"]
    fused = HF_OVERRIDE_KEYS["encoder_fused_layers"].default
    # the PR whose patches add the model's batched append (its own encode of a step's chunks)
    owners = [
        pr for pr in st.omni if any("def preprocess_append_batch" in patch.diff for patch in pr.patches)
    ]
    assert len(owners) == 1
    owner = owners[0]
    text = " ".join(owner.remarks)
    assert f"default `{json.dumps(key.default)}`" in text, owner.key
    assert text.startswith("Batched duplex steps are " + ("on by default" if key.default else "opt-in"))
    assert f"`encoder_fused_layers` defaults to `{json.dumps(fused)}`" in text and key.doc in text
    assert (
        "not bitwise: the option's description bounds them within four bf16 steps of each session's own"
        in text
    )
    if fused in ("all", "audio"):
        hook = next(pr for pr in st.omni if _calls_added(pr, "configure_fused_layers"))
        assert st.keys.index(hook.key) < st.keys.index(owner.key)  # the rows' fused layers are in its tree
        assert "bitwise equal to its session's own encode where it runs the fused Whisper layers" in text
        assert "SDPA reference attention" in text
        assert "which no test checks (the CUDA tests build the default fused layers" in text
        # the FlashAttention rows' bound is what the tests assert, not what a run measured
        assert "no run has measured" in text


@pytest.mark.cpu
def test_a_part_tagged_for_several_prs_goes_with_each_of_them_only():
    text = "Setup.\nGraphs bitwise. <!-- pr: two, three -->\nDuplex example. <!-- pr: three -->\n"
    known = {"one", "two", "three"}
    assert docsplit.own_parts(text, "r.md", "one", known) == "Setup.\n"
    assert docsplit.own_parts(text, "r.md", "two", known) == "Setup.\nGraphs bitwise.\n"
    assert docsplit.own_parts(text, "r.md", "three", known) == "Setup.\nGraphs bitwise.\nDuplex example.\n"
    # a design page shows it from the first of its PRs on
    assert "Graphs bitwise." not in docsplit.page_version(text, "p.md", ["one"], known)
    assert "Graphs bitwise." in docsplit.page_version(text, "p.md", ["one", "two"], known)
    with pytest.raises(transform.ExportError, match="four"):
        docsplit.own_parts("x <!-- pr: two, four -->\n", "r.md", "two", known)


@pytest.mark.cpu
def test_each_tagged_line_of_the_results_page_goes_with_the_prs_it_names_only(st):
    """Sentences and rows of the results page tagged for one PR or several (the Setup's graph and
    duplex sentences among them) show in those PRs' results and in no other's."""
    text = transform.drop_project_only((REPO / RESULTS).read_text(), RESULTS)
    tagged = [
        (m.group(1), {k.strip() for k in m.group(2).split(",")})
        for m in re.finditer(r"^(\S.*?)[ \t]+<!--[ \t]*pr:[ \t]*([\w, -]+?)[ \t]*-->[ \t]*$", text, re.M)
    ]
    # and the lines of each block (the stack's page tags whole sections): their heading and rows
    block: set[str] | None = None
    for line in text.splitlines():
        opened = re.match(r"^\s*<!--\s*pr:\s*([\w, -]+?)\s*-->\s*$", line)
        if opened or re.match(r"^\s*<!--\s*/pr\s*-->\s*$", line):
            block = {k.strip() for k in opened.group(1).split(",")} if opened else None
        elif (
            block
            and line.startswith(("### ", "| "))
            and not line.startswith("|---")
            and text.count(line) == 1
        ):
            tagged.append((line, block))  # a line every section has (a table's header) says nothing
    assert tagged, "the results page tags no line with a PR"
    for key in st.keys:
        own = docsplit.own_parts(text, RESULTS, key, set(st.keys)).splitlines()
        for line, keys in tagged:
            assert (line in own) == (key in keys), (key, line)


# -- the parts of a file that later PRs add ---------------------------------------------------------


def _tree_files(st, key: str) -> dict[str, str]:
    """The owned files of the tree of PR ``key`` (the PRs up to it), each as that PR carries it."""
    upto = st.upto(key)
    return {
        rel: docsplit.source_version(path.read_text(), rel, upto, set(st.keys))
        for pr in st.omni
        if pr.key in upto
        for rel, path in pr.owned.items()
    }


#: Registry keys that no options field carries, and the call that puts each one to use: the key
#: arrives with the PR whose vllm-omni patch makes that call.
MODEL_FILE_READERS = {"encoder_fused_layers": "configure_fused_layers("}


@pytest.mark.cpu
def test_each_hf_overrides_key_arrives_with_the_pr_whose_code_reads_it(cs, st):
    """A key is in a PR's registry (``options.py`` as that PR carries it) from the first PR whose code
    reads it on, never earlier: its options field read as ``options.<field>`` by an owned module, or
    (a key without a field) the call of :data:`MODEL_FILE_READERS` added by one of the PR's patches."""
    source = cs.owned[stack.OPTIONS_MODULE].read_text()
    fields = dict(re.findall(r"^\s+(\w+): \w+ = _hf_field\(\"(\w+)\"\)", source, re.M))
    field_of = {key: name for name, key in fields.items()}
    keys = stack.hf_override_keys(source)
    assert set(field_of) | set(MODEL_FILE_READERS) >= set(keys) - {"vision_attn_implementation"}
    arrived, read = {}, {}
    for pr in st.omni:
        files = _tree_files(st, pr.key)
        registry = stack.hf_override_keys(files.get(stack.OPTIONS_MODULE, ""))
        others = "\n".join(text for rel, text in files.items() if rel != stack.OPTIONS_MODULE)
        added = "\n".join(
            line for patch in pr.patches for line in patch.diff.splitlines() if line.startswith("+")
        )
        for key in keys:
            arrived.setdefault(key, pr.key) if key in registry else None
            used = (key in field_of and f"options.{field_of[key]}" in others) or (
                key in MODEL_FILE_READERS and MODEL_FILE_READERS[key] in added
            )
            if used:
                read.setdefault(key, pr.key)
    later = {k: v for k, v in read.items() if v != st.keys[1]}
    assert len(later) >= 4, later  # streaming audio, start-up capture, batched steps, fused layers
    for key in keys:
        if key in read:
            assert arrived[key] == read[key], f"{key} arrives with {arrived[key]}, read from {read[key]} on"


@pytest.mark.cpu
def test_a_prs_tree_imports_no_module_a_later_pr_adds(cs, st):
    """Each owned module of a PR's tree, as the PR carries it, imports only modules of that tree or
    of the release (``streaming_audio.py`` calls the batched duplex steps only from the PR that adds
    them)."""
    import importlib.util

    package = Path(importlib.util.find_spec("vllm_omni.model_executor.models.minicpmo_4_5").origin).parent
    owned = {PurePosixPath(rel).stem for rel in cs.owned}
    release = {p.stem for p in package.glob("*.py")} - owned
    for pr in st.omni:
        files = _tree_files(st, pr.key)
        names = (
            release
            | {PurePosixPath(rel).stem for rel in files}
            | {PurePosixPath(rel).parent.name for rel in files}
        )
        for rel, text in files.items():
            if not rel.endswith(".py"):
                continue
            relative = re.findall(r"^\s*from \.(\w*) import ([\w, ]+)", text, re.M)
            for module, imported in relative:
                wanted = [module] if module else [n.strip().split(" as ")[0] for n in imported.split(",")]
                missing = [m for m in wanted if m not in names]
                assert not missing, f"{pr.key}: {rel} imports {missing}, which its tree does not have"


@pytest.mark.cpu
def test_source_versions_keep_each_tagged_part_from_its_pr_on():
    text = "a = 1\n# pr: b\nb = 2\n# /pr\nc = 3  # pr: c\n    # pr: b, c\n    d = 4\n    # /pr\n"
    known = {"a", "b", "c"}
    assert docsplit.source_version(text, "m.py", ["a"], known) == "a = 1\n"
    assert docsplit.source_version(text, "m.py", ["a", "b"], known) == "a = 1\nb = 2\n    d = 4\n"
    assert docsplit.source_version(text, "m.py", ["a", "b", "c"], known) == "a = 1\nb = 2\nc = 3\n    d = 4\n"
    assert docsplit.source_version(text, "page.txt", ["a"], known) == text  # not Python: unchanged
    with pytest.raises(transform.ExportError, match="m.py: tagged for x, no PR of the stack"):
        docsplit.source_version("# pr: x\ny = 1\n# /pr\n", "m.py", ["a"], known)
    with pytest.raises(transform.ExportError, match=r"m.py:1: # /pr without # pr: KEY before it"):
        docsplit.source_version("# /pr\n", "m.py", ["a"], known)
    with pytest.raises(transform.ExportError, match="never closed"):
        docsplit.source_version("# pr: b\nx = 1\n", "m.py", ["a"], known)


@pytest.mark.cpu
def test_source_versions_before_a_pr_carry_its_pr_before_lines_uncommented():
    """A rule a later PR changes: the earlier versions carry the commented-out lines (code, blank
    lines and comments alike, at their indentation), the later ones and the file itself the lines
    tagged for that PR; a docstring's line tagged for a PR goes with it like any other line."""
    text = (
        "def f(x):\n"
        '    """Doc.\n'
        "    - later item  # pr: c\n"
        '    """\n'
        "    # pr-before: c\n"
        "    # # clamp first\n"
        "    # y = min(x, 1)\n"
        "    #\n"
        "    # return y\n"
        "    # /pr-before\n"
        "    return x  # pr: c\n"
    )
    known = {"a", "b", "c"}
    before = 'def f(x):\n    """Doc.\n    """\n    # clamp first\n    y = min(x, 1)\n\n    return y\n'
    assert docsplit.source_version(text, "m.py", ["a", "b"], known) == before
    after = 'def f(x):\n    """Doc.\n    - later item\n    """\n    return x\n'
    assert docsplit.source_version(text, "m.py", ["a", "b", "c"], known) == after
    for version in (before, after):
        compile(version, "m.py", "exec")
    uncommented = "if x:\n    # pr-before: b\n    y = 1\n    # /pr-before\n"
    with pytest.raises(transform.ExportError, match=r"m.py:3: a line of a pr-before block must be commented"):
        docsplit.source_version(uncommented, "m.py", ["a"], known)
    with pytest.raises(transform.ExportError, match=r"m.py:1: # /pr-before without # pr-before: KEY"):
        docsplit.source_version("# /pr-before\n", "m.py", ["a"], known)
    with pytest.raises(transform.ExportError, match="m.py: tagged for x, no PR of the stack"):
        docsplit.source_version("# pr-before: x\n# y = 1\n# /pr-before\n", "m.py", ["a"], known)
    with pytest.raises(transform.ExportError, match="the before block of 'b' is never closed"):
        docsplit.source_version("# pr-before: b\n# y = 1", "m.py", ["a"], known)
