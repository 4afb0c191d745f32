# SPDX-License-Identifier: Apache-2.0
"""The export's mechanical rewrites, its lint checks and its anchored upstream edits, on small inputs."""

from __future__ import annotations

import re

import pytest

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import lint, prtext, transform, upstream_edits

pytestmark = [pytest.mark.core_model]


@pytest.mark.cpu
def test_imports_of_the_project_point_at_vendored_modules():
    text = (
        "from minicpmo_cg.duplex import DuplexChunk\n"
        "    from minicpmo_cg import duplex, standalone as sa\n"
        "from helpers import serve_smoke as smoke\n"
        "import minicpmo_cg.vllm_config as vc\n"
    )
    out, used = transform.rewrite_imports(text, "t.py")
    assert out.splitlines() == [
        "from minicpmo45_duplex import DuplexChunk",
        "    import minicpmo45_duplex as duplex",
        "    import minicpmo45_standalone as sa",
        "import minicpmo45_helpers_serve_smoke as smoke",
        "import minicpmo45_vllm_config as vc",
    ]
    assert used == {("minicpmo_cg", "duplex"), ("minicpmo_cg", "standalone"), ("helpers", "serve_smoke"),
                    ("minicpmo_cg", "vllm_config")}  # fmt: skip


@pytest.mark.cpu
@pytest.mark.parametrize("line", ["import minicpmo_cg.duplex", "from minicpmo_cg import (duplex,"])
def test_import_forms_without_a_vendored_equivalent_are_refused(line):
    with pytest.raises(transform.ExportError, match="t.py:1"):
        transform.rewrite_imports(line + "\n", "t.py")


@pytest.mark.cpu
@pytest.mark.parametrize(
    "line",
    [
        "    from minicpmo_cg.patchtool import build_plan",
        "from minicpmo_cg import patchtool",
        "from minicpmo_cg.export.build import export",
    ],
)
def test_the_projects_tooling_is_never_vendored(tmp_path, line):
    test = tmp_path / "tests" / "test_x.py"
    test.parent.mkdir()
    test.write_text(f"import pytest\n\npytestmark = [pytest.mark.core_model]\n\n\ndef f():\n{line}\n")
    with pytest.raises(
        transform.ExportError, match=r"tests/test_x.py: imports minicpmo_cg\.(patchtool|export)"
    ):
        transform.vendor_tests(tmp_path, {"tests/test_x.py": test})
    test.write_text(test.read_text().replace(line, f"    # project-only\n{line}\n    # /project-only"))
    out = transform.vendor_tests(tmp_path, {"tests/test_x.py": test})
    assert out.vendored == {} and line.strip() not in out.files["tests/test_x.py"]


@pytest.mark.cpu
def test_markers_unknown_to_vllm_omni_are_dropped_or_refused():
    text = (
        "pytestmark = [\n    pytest.mark.core_model,\n    pytest.mark.cuda,\n    pytest.mark.multi_gpu,\n]\n"
    )
    out, _ = transform.export_test_source(text, "tests/x/test_a.py")
    assert "multi_gpu" not in out and "pytest.mark.cuda" in out
    assert out.splitlines()[:2] == list(conv.SPDX_LINES)
    with pytest.raises(transform.ExportError, match="legacy_lane"):
        transform.export_test_source(
            "pytestmark = [pytest.mark.core_model, pytest.mark.legacy_lane]\n", "t.py"
        )


@pytest.mark.cpu
def test_level_mark_is_added_to_e2e_modules_only():
    e2e, _ = transform.export_test_source(
        "import pytest\n\n\ndef test_a():\n    pass\n", "tests/e2e/x/test_a.py"
    )
    assert f"pytestmark = [pytest.mark.{conv.E2E_DEFAULT_LEVEL}]" in e2e
    with pytest.raises(transform.ExportError, match="no level mark"):
        transform.export_test_source("import pytest\n", "tests/model_executor/test_a.py")


@pytest.mark.cpu
def test_links_to_files_outside_the_export_become_text():
    text = "See [the results](../results/README.md), [limits](#known-limits), [vLLM](https://x.org) and [me](a.md)."
    out = transform.strip_dead_links(text, "docs/design/p.md", {"docs/design/a.md"})
    assert out == "See the results, [limits](#known-limits), [vLLM](https://x.org) and [me](a.md)."


@pytest.mark.cpu
def test_tables_need_a_separator_row():
    body = "| a | b |\n|---|---|\n| 1 | 2 |\n\n|x − y| = 0 on each).\n"
    assert prtext.tables(body) == ["| a | b |\n|---|---|\n| 1 | 2 |"]


@pytest.mark.cpu
def test_lint_flags_vllm_omni_rules(tmp_path):
    from minicpmo_cg.export import fetch

    ruff = fetch.ruff_binary(conv.RUFF_VERSION)
    config = lint.ruff_config(tmp_path / "ruff.toml")
    (tmp_path / "vllm_omni").mkdir()
    (tmp_path / "vllm_omni/a.py").write_text(
        "\n".join(
            [
                *conv.SPDX_LINES,
                "import re",
                "",
                "import torch",
                "",
                "x = torch.cuda.mem_get_info(0)",
                "real = torch.cuda.mem_get_info",
                "re.compile('a')",
                "",
            ]
        )
    )
    (tmp_path / "vllm_omni/b.py").write_text("import torch\n\ntorch.cuda.synchronize()\n")
    report = lint.check_tree(ruff, config, tmp_path, ["vllm_omni/a.py", "vllm_omni/b.py"])
    joined = "\n".join(report.problems)
    assert "a.py:7: check-torch-cuda-call" in joined
    assert "a.py:8: check-torch-cuda-call" in joined  # a reference, not a call, is flagged too
    assert "a.py:3: check-forbidden-imports: re" in joined
    assert "b.py:1: check-spdx-header" in joined
    assert "b.py:3:1: TID251" in joined


@pytest.mark.cpu
def test_buildkite_step_is_cloned_from_its_sibling_or_refused():
    text = (
        "steps:\n"
        '  - group: "E2E Test"\n'
        "    steps:\n"
        '      - label: "Omni · MiniCPM-o 4.5 Online Test"\n'
        "        key: minicpmo-online\n"
        "        commands:\n"
        "          - export X=1\n"
        "          - pytest -sv tests/e2e/online_serving/test_minicpmo_4_5.py\n"
        "  - label: next\n"
    )
    out = upstream_edits.clone_step(text, "pytest -sv tests/e2e/t.py")
    lines = out.splitlines()
    at = lines.index(f'      - label: "{upstream_edits.step_label()}"')
    assert lines[at + 1 : at + 5] == [
        "        key: minicpmo-4-5-encoder-cuda-graph",
        "        commands:",
        "          - export X=1",
        "          - pytest -sv tests/e2e/t.py",
    ]
    assert lines[-1] == "  - label: next"
    with pytest.raises(upstream_edits.EditError, match="E2E Test"):
        upstream_edits.clone_step("steps: []\n", "pytest x")


@pytest.mark.cpu
def test_nav_line_is_cloned_next_to_the_sibling_page():
    nav = "  - MRv2: design/minicpm_o45_mrv2_performance.md\n"
    out = upstream_edits.clone_nav_line(nav, "design/p.md", "P", "nav")
    assert out.splitlines()[1] == "  - P: design/p.md"
    index = "- [MRv2](minicpm_o45_mrv2_performance.md)\n"
    assert upstream_edits.clone_nav_line(index, "p.md", "P", "i").splitlines()[1] == "- [P](p.md)"
    with pytest.raises(upstream_edits.EditError, match="minicpm_o45_mrv2_performance"):
        upstream_edits.clone_nav_line("nav: []\n", "p.md", "P", "nav")


@pytest.mark.cpu
@pytest.mark.parametrize("module", ["verify", "build", "changeset", "cli"])
def test_each_export_module_imports_first_in_a_fresh_interpreter(module):
    """The export and the patch tool import each other's modules: no import order may be circular."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", f"import minicpmo_cg.export.{module}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.cpu
def test_project_only_blocks_are_dropped_with_their_markers():
    py = "a = 1\n    # project-only\nimport minicpmo_cg\n    # /project-only\nb = 2\n"
    assert transform.drop_project_only(py, "t.py") == "a = 1\nb = 2\n"
    md = "Intro.\n\n<!-- project-only -->\nRun `minicpmo-cg-patch apply`.\n<!-- /project-only -->\nEnd.\n"
    assert transform.drop_project_only(md, "d.md") == "Intro.\n\nEnd.\n"
    assert transform.drop_project_only(py, "t.yml") == py  # no markers for that suffix


@pytest.mark.cpu
@pytest.mark.parametrize(
    "text, where",
    [
        ("# project-only\nx\n", "t.py:1: '# project-only' is never closed"),
        ("x\n# /project-only\n", "t.py:2: '# /project-only' without"),
        (
            "# project-only\n# project-only\n# /project-only\n",
            "t.py:2: '# project-only' inside the block opened at line 1",
        ),
    ],
)
def test_unbalanced_project_only_markers_are_refused(text, where):
    with pytest.raises(transform.ExportError, match=re.escape(where)):
        transform.drop_project_only(text, "t.py")


@pytest.mark.cpu
def test_names_with_the_project_prefix_are_renamed_whole():
    text = 'ENV = "MINICPMO_CG_E2E_MODEL"\nNAME = "minicpmo-cg-e2e"\nX_MINICPMO_CG_E2E_Y = 1\n'
    out = transform.rename_project_names(text)
    assert 'ENV = "MINICPMO45_E2E_MODEL"' in out and 'NAME = "minicpmo45-e2e"' in out
    assert "X_MINICPMO_CG_E2E_Y" in out  # part of another name: left alone


@pytest.mark.cpu
def test_references_to_vendored_modules_name_the_copies():
    vendored = {
        "tests/x/minicpmo45_inputs.py": "minicpmo_cg/inputs.py",
        "tests/x/minicpmo45_helpers_serve_smoke.py": "tests/helpers/serve_smoke.py",
    }
    text = (
        ":class:`minicpmo_cg.inputs.VisionInput` (``minicpmo_cg/inputs.py``), "
        "``tests/helpers/serve_smoke.py``, :mod:`minicpmo_cg.bench`, "
        ":class:`helpers.serve_smoke.Server`, ``helpers.logs``, ``pkg.helpers.serve_smoke``"
    )
    assert transform.point_references_at_vendored(text, vendored) == (
        ":class:`minicpmo45_inputs.VisionInput` (``tests/x/minicpmo45_inputs.py``), "
        "``tests/x/minicpmo45_helpers_serve_smoke.py``, :mod:`minicpmo_cg.bench`, "
        ":class:`minicpmo45_helpers_serve_smoke.Server`, ``helpers.logs``, ``pkg.helpers.serve_smoke``"
    )


@pytest.mark.cpu
@pytest.mark.parametrize(
    "line",
    [
        "run `minicpmo-cg-patch apply` first",
        "from minicpmo_cg.inputs import x",
        "MINICPMO_CG_E2E_MODEL",
        "is the patch set applied?",
        "on both lanes",
        "the lane venv",
        "patches/vllm/0007-encoder-cudagraph-capture-error-mode.patch",
        "vllm-omni patch 0004",
        "patches 0001 and 0006",
        "rebuilt by the patch tool",
        "tools/test.sh current -m cuda",
    ],
)
def test_the_word_list_finds_each_kind_of_mention(line):
    assert transform.project_mentions({"f.py": f"ok\n{line}\n"}) == [f"f.py:2: {line}"]


@pytest.mark.cpu
def test_the_word_list_leaves_upstream_words_alone():
    text = "the patch mask\nminicpmo45_inputs\nthe legacy default stream\nplane, lanes_x\npatch 14\n"
    assert transform.project_mentions({"f.py": text}) == []


@pytest.mark.cpu
def test_an_allowed_prefix_lets_one_line_name_the_project_once():
    note = "> **Note:** measured with minicpmo_cg"
    assert transform.project_mentions({"PR.md": f"a\n{note}\n"}, "> **Note:**") == []
    twice = transform.project_mentions({"PR.md": f"{note}\n{note}\n"}, "> **Note:**")
    assert [m.split(":")[1] for m in twice] == ["2"]
    assert transform.project_mentions({"PR.md": note}) != []  # only with the prefix allowed


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("number", "upto", "says"),
    [
        (1, 1, "this PR's own tree: the v0.30.0 release with this PR applied"),
        (
            3,
            3,
            "this PR's own tree: the v0.30.0 release with the earlier PRs of the stack and this PR applied",
        ),
        (2, 6, "the whole stack of 6 PRs applied to the v0.30.0 release"),
        (2, 4, "PRs 1 to 4 of the stack applied to the v0.30.0 release (this one and the 2 after it)"),
        (3, 4, "PRs 1 to 4 of the stack applied to the v0.30.0 release (this one and the one after it)"),
    ],
)
def test_the_tree_of_a_prs_figures_is_said_as_recorded(number, upto, says):
    inp = prtext.PrInputs("k", number, "", [], [], "0.30.0", "0.30.0", total=6, measured_upto=upto)
    text = prtext.measured_tree(inp)
    assert f"measured on {says}, against the pinned vLLM 0.30.0 as released;" in text
    assert transform.project_mentions({"PR.md": text}) == []
    # a tree whose PRs need a vLLM change ran against vLLM with it: the sentence says so
    inp.measured_vllm = [("[Core] a change", "vllm-capture-error-mode")]
    text = prtext.measured_tree(inp)
    assert (
        f"measured on {says}, against vLLM 0.30.0 with the vLLM change (capture error mode) applied;" in text
    )
    assert "pinned" not in text
    with pytest.raises(ValueError, match="lacks the PR itself"):
        prtext.measured_tree(
            prtext.PrInputs("k", 5, "", [], [], "0.30.0", "0.30.0", total=6, measured_upto=4)
        )


@pytest.mark.cpu
def test_results_tables_show_the_exported_lane_alone():
    lanes = ("current", "legacy")
    tests = (
        "| lane | passed |\n|---|---|\n"
        "| current (vLLM 0.30.0 + vllm-omni 0.30.0) | 33 |\n| legacy (vLLM 0.28.0 + vllm-omni 0.28.0, patched) | 31 |"
    )
    assert prtext.lane_view(tests, "current", lanes).splitlines() == [
        "| versions | passed |",
        "|---|---|",
        "| vLLM 0.30.0 + vllm-omni 0.30.0 | 33 |",
    ]
    bench = (
        "| shape | eager ms (median, current / legacy) | graphed ms | speedup current / legacy | max \\|g−e\\| |\n"
        "|---|---|---|---|---|\n"
        "| a 28×36 | 16.52 / 10.02 | 6.85 / 6.68 | **2.41× / 1.50×** | 0 |"
    )
    assert prtext.lane_view(bench, "legacy", lanes).splitlines() == [
        "| shape | eager ms (median) | graphed ms | speedup | max \\|g−e\\| |",
        "|---|---|---|---|---|",
        "| a 28×36 | 10.02 | 6.68 | **1.50×** | 0 |",
    ]
    plain = "| input | ms |\n|---|---|\n| a / b | 1 |"
    assert prtext.lane_view(plain, "current", lanes) == plain


@pytest.mark.cpu
def test_results_headings_lose_project_and_lane_parentheses():
    assert (
        prtext.heading_for_upstream("Demo (`minicpmo-cg-demo`, current lane, full size)")
        == "Demo (full size)"
    )
    assert prtext.heading_for_upstream("Benchmark (`minicpmo-cg-bench`)") == "Benchmark"
    assert prtext.heading_for_upstream("Tests (2 GPUs)") == "Tests (2 GPUs)"


@pytest.mark.cpu
@pytest.mark.parametrize(
    "changes, verb",
    [
        ([("a\nb\n", "a\nb\nc\n")], "extend"),
        ([("a\nb\nc\n", "a\nc\n")], "trim"),
        ([("a\nb\n", "a\nB\n")], "change"),
        ([("a\n", "a\nb\n"), ("x\ny\n", "x\n")], "change"),  # one file grows, another shrinks
    ],
    ids=["only-added", "only-removed", "replaced", "mixed-files"],
)
def test_a_commit_title_says_how_it_changes_an_earlier_prs_files(changes, verb):
    from minicpmo_cg.export.build import _growth_verb

    assert _growth_verb(changes) == verb
