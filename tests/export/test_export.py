# SPDX-License-Identifier: Apache-2.0
"""``minicpmo-cg-patch export``: the series applies to the vllm-omni release, passes its lint, and
its tests pass from the resulting tree; the PR text carries the template and the checkout's pages.

Nothing here pins what the adapter, the patches or the pages say: expectations are read from the
checkout when the test runs.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from exportkit import AUTHOR, REPO

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import prtext
from minicpmo_cg.export.changeset import read_change_set

pytestmark = [pytest.mark.core_model]


def _patch_texts(out: Path, folder: str) -> list[str]:
    return [p.read_text() for p in sorted((out / folder).glob("*.patch"))]


@pytest.mark.cpu
def test_series_applies_to_the_release_signed_off_and_lint_clean(exported):
    out, manifest, report = exported
    assert report.problems == [], "\n".join(report.problems)
    assert manifest["lint"]["problems"] == []
    for text in _patch_texts(out, "vllm-omni") + _patch_texts(out, "vllm"):
        assert f"Signed-off-by: {AUTHOR}" in text
        assert re.search(r"^Subject: \[PATCH[^\]]*\] \[[A-Z][\w/]*\]", text, re.MULTILINE)


@pytest.mark.cpu
def test_exported_cpu_tests_pass_from_the_vllm_omni_tree(exported):
    _, manifest, report = exported
    assert report.tests_summary and " passed" in report.tests_summary, report.tests_output[-3000:]
    assert not re.search(r"\d+ (failed|error)", report.tests_summary), report.tests_output[-3000:]
    for rel in manifest["files"]:
        if rel.startswith("tests/") and rel.endswith(".py"):
            text = _exported_file(exported, rel)
            tree = ast.parse(text)
            imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m and m.split(".")[0] in ("minicpmo_cg", "helpers")], rel
            assert "from minicpmo_cg" not in text, rel


def _exported_file(exported, rel: str) -> str:
    """The file ``rel`` as the series leaves it, read from the patch that last touches it."""
    out, _, _ = exported
    for text in reversed(_patch_texts(out, "vllm-omni")):
        m = re.search(
            rf"^--- /dev/null\n\+\+\+ b/{re.escape(rel)}\n@@[^\n]*\n((?:[+\\][^\n]*\n?)*)", text, re.MULTILINE
        )
        if m:
            return "\n".join(line[1:] for line in m.group(1).splitlines() if line.startswith("+"))
    raise AssertionError(f"{rel} is not created by the series")


@pytest.mark.cpu
def test_layout_follows_vllm_omni(exported):
    _, manifest, _ = exported
    cs = read_change_set(REPO, "current")
    files = set(manifest["files"])
    assert set(cs.owned) <= files
    assert {rel for patch in cs.omni_patches for rel in patch.file_paths} <= files
    assert set(cs.design_pages) <= files and all(f.startswith("docs/design/") for f in cs.design_pages)
    unit = {f for f in files if f.startswith("tests/model_executor/models/minicpmo_4_5/")}
    assert {f for f in cs.tests if f.startswith("tests/model_executor/")} <= unit
    for rel in files:
        if rel.endswith(".py"):
            head = _exported_file(exported, rel).splitlines()[:2] if rel not in _modified(cs) else None
            assert head is None or tuple(head) == conv.SPDX_LINES, rel
    titles = [c["title"] for c in manifest["commits"]]
    assert len(titles) == 3 + len(cs.omni_patches)
    for patch in cs.omni_patches:
        assert any(patch.subject.split(": ", 1)[-1] in t for t in titles), patch.name


def _modified(cs) -> set[str]:
    return {rel for patch in cs.omni_patches for rel in patch.file_paths}


@pytest.mark.cpu
def test_vllm_changes_are_a_separate_series_named_in_the_pr(exported):
    out, manifest, _ = exported
    cs = read_change_set(REPO, "current")
    assert len(list((out / "vllm").glob("*.patch"))) == len(cs.vllm_patches)
    assert all(f.startswith(("vllm_omni/", "tests/", "docs/")) for f in manifest["files"])
    pr = (out / "PR.md").read_text()
    for patch in cs.vllm_patches:
        assert patch.subject in pr
        assert any(patch.subject in t for t in manifest["vllm_commits"])


@pytest.mark.cpu
def test_pr_text_has_the_template_sections_and_the_results_tables(exported):
    out, manifest, report = exported
    pr = (out / "PR.md").read_text()
    assert pr.splitlines()[0] == conv.PR_TEMPLATE_FIRST_LINE
    positions = [pr.index(h + "\n") for h in conv.PR_TEMPLATE_HEADINGS]
    assert positions == sorted(positions)
    assert f"{conv.PR_FIELD_VLLM} {manifest['vllm']}" in pr
    assert f"{conv.PR_FIELD_OMNI} v{manifest['vllm_omni']}" in pr
    assert report.tests_summary in pr
    results = (REPO / "docs/results/README.md").read_text()
    from minicpmo_cg.lanes import all_lanes

    lanes = tuple(lane.name for lane in all_lanes(REPO / "lanes"))
    for table in prtext.tables(results):
        assert prtext.plain_links(prtext.lane_view(table, manifest["lane"], lanes)) in pr
    assert (out / "PR-title.txt").read_text().startswith(conv.TITLE_PREFIX_MODEL)
    assert conv.MODEL_TITLE in (out / "PR-title.txt").read_text()


def _copy_checkout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in (
        "lanes",
        "patches",
        "vllm_omni",
        "minicpmo_cg",
        "tests/model_executor",
        "tests/e2e",
        "tests/helpers",
        "docs",
    ):
        shutil.copytree(REPO / rel, dest / rel, ignore=ignore)
    return dest


@pytest.mark.cpu
def test_export_reads_the_checkout_when_it_runs(tmp_path, current_lane_only, monkeypatch):
    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity

    monkeypatch.chdir(tmp_path)  # a relative --out: the series lands there, not in the scratch repository
    repo = _copy_checkout(tmp_path / "repo")
    adapter = next(iter(read_change_set(repo, "current").owned.values()))
    adapter.write_text(adapter.read_text() + "\n\ndef _export_probe() -> int:\n    return 1\n")
    results = repo / "docs/results/README.md"
    results.write_text(
        results.read_text() + "\n## Export probe\n\n| probe | value |\n|---|---|\n| rerun | 42 |\n"
    )
    out = Path("pr")
    build.export(build.ExportOptions(repo=repo, out=out, author=Identity(AUTHOR)))
    assert (
        "+def _export_probe() -> int:"
        in (out / "vllm-omni").joinpath(min(p.name for p in (out / "vllm-omni").iterdir())).read_text()
    )
    pr = (out / "PR.md").read_text()
    assert "### Export probe" in pr and "| rerun | 42 |" in pr


@pytest.mark.cpu
def test_nothing_exported_names_this_project(exported):
    """Every patch (diffs and commit messages) and PR text, read back from the files written; the
    PR may name the project once, in its note on where the measurements come from."""
    from minicpmo_cg.export import transform

    out, _, _ = exported
    texts = {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.glob("*/*.patch"))}
    texts |= {p.name: p.read_text() for p in [*out.glob("vllm-PR-*.md"), out / "PR-title.txt"]}
    assert len(texts) > 3 and transform.project_mentions(texts) == []
    pr = (out / "PR.md").read_text()
    assert transform.project_mentions({"PR.md": pr}, conv.PR_SOURCE_NOTE_PREFIX) == []
    assert [line for line in pr.splitlines() if line.startswith(conv.PR_SOURCE_NOTE_PREFIX)]


@pytest.mark.cpu
def test_export_fails_when_a_file_or_commit_message_names_this_project(tmp_path, current_lane_only):
    from minicpmo_cg.export import build, transform
    from minicpmo_cg.export.gitseries import Identity

    repo = _copy_checkout(tmp_path / "repo")
    rel, adapter = next(iter(read_change_set(repo, "current").owned.items()))
    adapter.write_text(adapter.read_text() + "\n# needs patches/vllm/0007 (minicpmo-cg-patch apply)\n")
    patch = repo / "patches/vllm-omni" / _series_names(repo / "patches/vllm-omni")[0]
    patch.write_text(patch.read_text().replace("\nWhy: ", "\nWhy: On both lanes, ", 1))
    with pytest.raises(transform.ExportError, match=r"names this project in 2 place") as info:
        build.export(build.ExportOptions(repo=repo, out=tmp_path / "pr", author=Identity(AUTHOR)))
    message = str(info.value)
    assert f"{rel}:" in message and "# needs patches/vllm/0007" in message
    assert "vllm-omni commit 2:3: On both lanes" in message


@pytest.mark.cpu
def test_export_refuses_a_foreign_out_dir_and_a_missing_identity(tmp_path, current_lane_only):
    from minicpmo_cg.patchtool import run

    (tmp_path / "keep.txt").write_text("not an export")
    assert run(["export", "--out", str(tmp_path), "--author", AUTHOR]) == 2
    assert (tmp_path / "keep.txt").read_text() == "not an export"
    assert run(["export", "--out", str(tmp_path / "new"), "--author", "nobody"]) == 2


@pytest.mark.cpu
def test_cli_export_to_a_vllm_omni_checkout(tmp_path, current_lane_only, exported):
    """``--checkout``: a branch with the series plus the Buildkite and nav edits, each as a commit.

    The checkout is the release tree with stand-ins for the three upstream files the wheel lacks,
    shaped as vllm-omni's are described (a group ``E2E Test`` holding the MiniCPM-o online step;
    a nav and an index naming the MiniCPM-o performance page); the real files differ in detail.
    """
    from minicpmo_cg.export import fetch
    from minicpmo_cg.export.gitseries import git
    from minicpmo_cg.patchtool import run

    _, manifest, _ = exported
    checkout = fetch.extract_package(
        fetch.wheel("vllm-omni", manifest["vllm_omni"]), "vllm_omni", tmp_path / "omni"
    )
    _stand_ins(checkout)
    git(checkout, "init", "-q", "-b", "main")
    git(checkout, "add", "-A")
    git(
        checkout,
        "commit",
        "-q",
        "-m",
        "v0.30.0",
        env={
            "GIT_AUTHOR_NAME": "r",
            "GIT_AUTHOR_EMAIL": "r@x",
            "GIT_COMMITTER_NAME": "r",
            "GIT_COMMITTER_EMAIL": "r@x",
        },
    )
    out = tmp_path / "pr"
    assert (
        run(["export", "--out", str(out), "--author", AUTHOR, "--checkout", str(checkout), "--branch", "cg"])
        == 0
    )
    log = git(checkout, "log", "--format=%s", "main..cg").splitlines()
    assert len(log) == len(manifest["commits"]) + 3
    assert len(list((out / "vllm-omni").glob("*.patch"))) == len(log)
    import yaml

    steps = yaml.safe_load((checkout / conv.BUILDKITE_READY).read_text())["steps"][0]["steps"]
    ours = [s for s in steps if "eager vs graphed" in s["label"]]
    assert len(ours) == 1 and ours[0]["agents"] == steps[0]["agents"]
    assert any("test_minicpmo_4_5_encoder_cuda_graph.py" in c for c in ours[0]["commands"])
    assert "minicpmo_encoder_cuda_graph.md" in (checkout / conv.NAV_FILE).read_text()
    assert "minicpmo_encoder_cuda_graph.md" in (checkout / conv.DESIGN_INDEX_FILE).read_text()
    assert subprocess.run(["git", "diff", "--quiet"], check=False, cwd=checkout).returncode == 0


def _stand_ins(checkout: Path) -> None:
    (checkout / ".buildkite/cuda").mkdir(parents=True)
    (checkout / conv.BUILDKITE_READY).write_text(
        "steps:\n"
        '  - group: ":card_index_dividers: E2E Test"\n'
        "    steps:\n"
        '      - label: "Omni · MiniCPM-o 4.5 Online Test"\n'
        "        timeout_in_minutes: 30\n"
        "        agents:\n"
        "          queue: gpu_h100\n"
        "        commands:\n"
        "          - pytest -sv tests/e2e/online_serving/test_minicpmo_4_5.py\n"
        '      - label: "Omni · Other Test"\n'
        "        commands:\n"
        "          - pytest -sv tests/e2e/other.py\n"
    )
    (checkout / "docs/design").mkdir(parents=True)
    (checkout / conv.NAV_FILE).write_text(
        "nav:\n  - Design:\n    - MiniCPM-o MRv2: design/minicpm_o45_mrv2_performance.md\n"
    )
    (checkout / conv.DESIGN_INDEX_FILE).write_text(
        "# Design\n\n- [MiniCPM-o MRv2](minicpm_o45_mrv2_performance.md)\n"
    )


@pytest.mark.cpu
def test_exported_patches_are_those_the_patch_tool_applies_on_the_lane(current_lane_only):
    from minicpmo_cg.patchtool import build_plan, discover_installation

    plan = build_plan(discover_installation(None), REPO / "patches", REPO)
    active = {r.patch.name for r in plan.reports if r.state in ("applied", "pending")}
    cs = read_change_set(REPO, "current")
    assert {p.name for p in cs.omni_patches + cs.vllm_patches} == active


@pytest.mark.cpu
def test_a_lane_whose_vllm_omni_patches_are_upstream_has_nothing_to_export(tmp_path):
    from minicpmo_cg.export import build, transform
    from minicpmo_cg.export.gitseries import Identity

    repo = _copy_checkout(tmp_path / "repo")
    for patch in (repo / "patches/vllm-omni").glob("*.patch"):
        text = patch.read_text()
        patch.write_text(text.replace("\nTargets:", "\nUpstream-Since: vllm-omni==0.30.0\nTargets:", 1))
    with pytest.raises(transform.ExportError, match="nothing to export for lane current"):
        build.export(build.ExportOptions(repo=repo, out=tmp_path / "pr", author=Identity(AUTHOR)))
    assert not (tmp_path / "pr").exists()


def _series_names(folder: Path) -> list[str]:
    lines = (folder / "series").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


@pytest.mark.cpu
def test_every_owned_file_test_and_active_patch_of_the_checkout_is_exported(exported):
    """Listed from the checkout independently of the export's own discovery: a new adapter module,
    test file or vllm-omni patch that the export leaves out fails here."""
    _, manifest, _ = exported
    files = set(manifest["files"])
    tracked = subprocess.run(
        ["git", "ls-files", "vllm_omni", "tests/model_executor/models/minicpmo_4_5", "tests/e2e"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    expected = {f for f in tracked if f.endswith(".py") and not f.startswith("tests/e2e/")}
    expected |= {
        f for f in tracked if f.startswith("tests/e2e/") and Path(f).name.startswith("test_minicpmo")
    }
    assert expected and expected - files == set()
    lane_omni = manifest["vllm_omni"]
    active = []
    for name in _series_names(REPO / "patches/vllm-omni"):
        header = (REPO / "patches/vllm-omni" / name).read_text().split("\n---\n", 1)[0]
        if f"vllm-omni=={lane_omni}" in header and "Upstream-Since:" not in header:
            active.append(name)
    assert len(active) == len(manifest["commits"]) - 3
    for name in active:
        subject = re.search(
            r"^Subject: (?:minicpmo_4_5: )?(.+)$",
            (REPO / "patches/vllm-omni" / name).read_text(),
            re.MULTILINE,
        )
        assert any(subject.group(1) in c["title"] for c in manifest["commits"]), name
    tooling = [
        src
        for src in manifest["vendored"].values()
        if src.startswith(("minicpmo_cg/patchtool", "minicpmo_cg/export"))
    ]
    assert tooling == []
