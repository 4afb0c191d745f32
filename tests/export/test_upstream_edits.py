# SPDX-License-Identifier: Apache-2.0
"""``UPSTREAM-EDITS.md``: the edits to vllm-omni files the release wheel lacks, in plain words for the
person opening the PR (the files, where, the exact lines), the same edits the checkout mode makes,
and nothing about this project. CPU only, no network."""

from __future__ import annotations

import re

import pytest

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import transform, upstream_edits

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

E2E = "tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py"
PAGE = "docs/design/minicpmo_encoder_cuda_graph.md"
FILES = [E2E, "tests/e2e/online_serving/serve_helpers.py", "vllm_omni/model_executor/models/x.py"]

#: Stand-ins for the three vllm-omni files, shaped as the edits expect (the real ones differ in detail).
STAND_INS = {
    conv.BUILDKITE_READY: (
        "steps:\n"
        '  - group: ":card_index_dividers: E2E Test"\n'
        "    steps:\n"
        '      - label: "Omni · MiniCPM-o 4.5 Online Test"\n'
        "        key: minicpmo-online\n"
        "        agents:\n"
        "          queue: gpu_h100\n"
        "        commands:\n"
        "          - pytest -sv tests/e2e/online_serving/test_minicpmo_4_5.py\n"
    ),
    conv.NAV_FILE: "nav:\n  - Design:\n    - MiniCPM-o MRv2: design/minicpm_o45_mrv2_performance.md\n",
    conv.DESIGN_INDEX_FILE: "# Design\n\n- [MiniCPM-o MRv2](minicpm_o45_mrv2_performance.md)\n",
}


def _checkout(tmp_path):
    for rel, text in STAND_INS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def _added(before: str, after: str) -> list[str]:
    old = before.splitlines()
    return [line for line in after.splitlines() if line not in old]


def _indented_lines(text: str) -> list[str]:
    """The lines the file gives to copy: its indented (code) lines, without their indentation."""
    return [line.strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]


def test_no_edit_no_file():
    assert upstream_edits.render(["vllm_omni/x.py", "tests/model_executor/test_x.py"], None, "0.30.0") is None


def test_the_file_names_each_file_and_gives_the_exact_lines_the_checkout_edits_add(tmp_path):
    text = upstream_edits.render(FILES, PAGE, "0.30.0")
    checkout = _checkout(tmp_path)
    made = upstream_edits.apply_to_checkout(checkout, FILES, PAGE)
    assert set(made) == set(STAND_INS)
    for rel in STAND_INS:
        assert f"`{rel}`" in text and upstream_edits.commit_title(rel) in text
    given = _indented_lines(text)
    for rel in (conv.NAV_FILE, conv.DESIGN_INDEX_FILE):
        [line] = _added(STAND_INS[rel], made[rel])
        assert line.strip() in given, rel
    # the Buildkite copy: the label, the key and the one pytest line the file names
    step = _added(STAND_INS[conv.BUILDKITE_READY], made[conv.BUILDKITE_READY])
    assert any(upstream_edits.step_label() in line for line in step) and upstream_edits.step_label() in text
    assert f"key: {upstream_edits.STEP_KEY}" in [line.strip() for line in step]
    [pytest_line] = [line for line in step if "pytest" in line]
    command = f"{conv.E2E_HUB_ENV}=1 pytest -sv {E2E}"  # the checkpoint may be downloaded
    assert pytest_line.strip().removeprefix("- ") == command and command in given
    assert conv.BUILDKITE_SIBLING_STEP in text and conv.BUILDKITE_E2E_GROUP in text
    assert "vllm-omni 0.30.0" in text


def test_the_file_says_nothing_of_this_project_or_its_tooling():
    for files, page in ((FILES, PAGE), (FILES, None), (["vllm_omni/x.py"], PAGE)):
        text = upstream_edits.render(files, page, "0.30.0")
        found = transform.project_mentions({"UPSTREAM-EDITS.md": text})
        found += transform.project_mentions({"UPSTREAM-EDITS.md": text}, words=transform.NOT_UPSTREAM)
        found += transform.project_mentions({"UPSTREAM-EDITS.md": text}, words=transform.POSITIONAL)
        assert found == []
        assert not re.search(r"--checkout|\bexport\b|minicpmo-cg|patch tool", text, re.IGNORECASE), text


def test_only_the_edits_the_pr_needs_are_described():
    serving_only = upstream_edits.render(FILES, None, "0.30.0")
    assert conv.BUILDKITE_READY in serving_only and conv.NAV_FILE not in serving_only
    page_only = upstream_edits.render(["vllm_omni/x.py"], PAGE, "0.30.0")
    assert conv.BUILDKITE_READY not in page_only
    assert conv.NAV_FILE in page_only and conv.DESIGN_INDEX_FILE in page_only
    assert "## 1. " in page_only and "## 2. " in page_only and "## 3. " not in page_only


def test_the_step_sets_the_variable_the_e2e_test_reads_as_vllm_omni_names_it():
    from helpers import serve_smoke

    from minicpmo_cg.export import transform

    assert transform.rename_project_names(serve_smoke.ENV_HUB) == conv.E2E_HUB_ENV
    assert transform.rename_project_names(serve_smoke.ENV_MODEL) == conv.E2E_MODEL_ENV
