# SPDX-License-Identifier: Apache-2.0
"""``minicpmo-cg-patch export``: a stack of pull requests, each applying on the vllm-omni release with
the ones before it, passing vllm-omni's lint, its tests passing from its own tree, and its text
carrying the template, its own results and what was not run.

Nothing here pins what the adapter, the patches, the pages or the stack table say: expectations are
read from the checkout and the table when the test runs.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from exportkit import AUTHOR, REPO, created_file, no_git_identity, patch_texts, series_names, tracked

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export.changeset import RESULTS_PAGE
from minicpmo_cg.export import docsplit, prtext, pytestlog, stack, testmarks, transform
from minicpmo_cg.export.changeset import read_change_set

pytestmark = [pytest.mark.core_model]

RESULTS = RESULTS_PAGE


def _folders(manifest: dict) -> list[str]:
    return [pr["folder"] for pr in manifest["prs"]]


def _selected(summary: str) -> int:
    """How many tests a pytest summary line says ran (every outcome but ``deselected``)."""
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary)
    return sum(int(n) for n, _ in counts)


@pytest.mark.cpu
def test_each_pr_applies_on_the_previous_is_signed_off_lint_clean_and_its_tests_pass(exported):
    out, manifest, report = exported
    assert report.prs_ok, "\n".join(report.all_problems())
    assert [c.folder for c in report.checks] == _folders(manifest) + [
        pr["folder"] for pr in manifest["vllm_prs"]
    ]
    for pr in manifest["prs"] + manifest["vllm_prs"]:
        assert pr["lint"]["problems"] == []
        texts = patch_texts(out / pr["folder"])
        assert len(texts) == len(pr["commits"]) > 0
        for text in texts:
            assert f"Signed-off-by: {AUTHOR}" in text
            assert re.search(r"^Subject: \[PATCH[^\]]*\] \[[A-Z][\w/]*\]", text, re.MULTILINE)
    for index, (check, pr) in enumerate(zip(report.checks, manifest["prs"])):
        tests = [t for t in pr["tests"] if Path(t).name.startswith("test_")]
        own = [run for run in check.runs if run.scope == prtext.OWN]
        earlier = [run for run in check.runs if run.scope == prtext.EARLIER]
        # on each tree the earlier PRs' tests run too, apart from its own: one run each per --marks
        files = pytestlog.earlier_test_files(manifest["prs"], index)
        assert bool(files) == (index > 0) and [run.files for run in earlier] == ([files] if files else [])
        assert [run.files for run in own] == ([tests] if tests else [])
        for run in own + earlier:
            assert run.ok and " passed" in run.summary, check.outputs
            assert not re.search(r"\d+ (failed|error)", run.summary)
            assert run.collection and len(run.collection.selected) == _selected(run.summary), run.summary
    for check in report.checks:
        for run in check.runs:  # every warning pytest counted is named in the PR text
            warned = re.search(r"(\d+) warnings?\b", run.summary)
            assert sum(run.warnings.values()) == (int(warned.group(1)) if warned else 0), check.outputs


@pytest.mark.cpu
def test_a_placeholder_author_is_flagged_in_stack_md_the_manifest_and_by_verify(exported):
    """The test author's address is under example.com (RFC 2606): a DCO check would take its sign-offs."""
    from minicpmo_cg.export import identity

    out, manifest, report = exported
    problem = identity.placeholder_problem(AUTHOR)
    assert problem and AUTHOR in problem and identity.REEXPORT in problem
    commits = sum(len(pr["series"]) for pr in manifest["prs"] + manifest["vllm_prs"])
    assert report.identity == [f"{commits} of the {commits} commits: {problem}"]
    assert not report.ok and report.all_problems()[0] == report.identity[0]
    assert problem in manifest["warnings"]
    title, note, *_ = (out / "STACK.md").read_text().split("\n\n")
    assert title.startswith("# ") and note.startswith("> **Placeholder identity.**")
    assert AUTHOR in note and identity.REEXPORT in note


@pytest.mark.cpu
def test_exported_tests_import_nothing_of_this_project(exported):
    out, manifest, _ = exported
    for pr in manifest["prs"]:
        for rel in pr["tests"]:
            text = created_file(out / pr["folder"], rel)
            if text is None:  # an earlier PR created it
                continue
            tree = ast.parse(text)
            imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m and m.split(".")[0] in ("minicpmo_cg", "helpers")], rel
            assert "from minicpmo_cg" not in text, rel


@pytest.mark.cpu
def test_layout_follows_vllm_omni(exported):
    out, manifest, _ = exported
    cs = read_change_set(REPO, "current")
    st = stack.resolve(cs)
    modified = {rel for patch in cs.omni_patches for rel in patch.file_paths}
    for resolved, pr in zip(st.omni, manifest["prs"]):
        assert pr["folder"] == resolved.folder and pr["title"] == resolved.title
        files = set(pr["files"])
        assert set(resolved.owned) <= files
        assert {rel for patch in resolved.patches for rel in patch.file_paths} <= files
        assert all(f.startswith(("vllm_omni/", "tests/", "docs/design/")) for f in files)
        assert {f for f in resolved.tests if f.startswith("tests/model_executor/")} <= set(pr["tests"]) | {
            f for earlier in manifest["prs"] for f in earlier["tests"]
        }
        titles = [c["title"] for c in pr["commits"]]
        assert all(any(p.subject.split(": ", 1)[-1] in t for t in titles) for p in resolved.patches)
        for commit in pr["commits"]:  # a commit changing vllm-omni outside the model's folder is [Core]
            outside = [
                f for f in commit["files"] if f.startswith("vllm_omni/") and not f.startswith(conv.MODEL_DIR)
            ]
            assert commit["title"].startswith(conv.TITLE_PREFIX_CORE) == bool(outside), commit
        assert any(t.startswith(conv.TITLE_PREFIX_MODEL) and "add " in t for t in titles) == bool(
            resolved.owned
        )
        # a commit that adds modules and also changes ones an earlier PR added names those in its title
        # (by file name or by path in the model's folder: each changed file, once)
        before = {f for p in manifest["prs"][: manifest["prs"].index(pr)] for f in p["files"]}
        for commit in pr["commits"]:
            changed = [f for f in commit["files"] if f in before and f.startswith("vllm_omni/")]
            if ": add " not in commit["title"] or not changed:
                continue
            extended = re.search(r" and (?:extend|trim|change) (.+) for (?:it|them)$", commit["title"])
            assert extended, commit
            named = extended.group(1).split(", ")
            assert len(named) == len(changed), commit
            assert all(sum(f.endswith(f"/{n}") for n in named) == 1 for f in changed), commit
        for rel in files:
            if rel.endswith(".py") and rel not in modified:
                head = (created_file(out / pr["folder"], rel) or "").splitlines()[:2]
                assert not head or tuple(head) == conv.SPDX_LINES, rel
    unit = {f for pr in manifest["prs"] for f in pr["tests"] if f.startswith("tests/model_executor/")}
    assert unit and all(f.startswith("tests/model_executor/models/minicpmo_4_5/") for f in unit)


@pytest.mark.cpu
def test_the_vllm_change_is_its_own_pr_with_tests_in_vllms_layout(exported):
    out, manifest, _ = exported
    cs = read_change_set(REPO, "current")
    st = stack.resolve(cs)
    assert [pr["folder"] for pr in manifest["vllm_prs"]] == [pr.folder for pr in st.vllm]
    assert {p.name for pr in st.vllm for p in pr.patches} == {p.name for p in cs.vllm_patches}
    for resolved, pr in zip(st.vllm, manifest["vllm_prs"]):
        assert pr["tests"] and all(t.startswith("tests/") for t in pr["tests"])
        for source, (target, _) in resolved.tests.items():
            text = created_file(out / pr["folder"], target)
            assert text is not None and tuple(text.splitlines()[:2]) == conv.VLLM_SPDX_LINES, target
            assert "import minicpmo_cg" not in text and "from minicpmo_cg" not in text
        body = (out / pr["folder"] / "PR.md").read_text()
        assert all(patch.why in body for patch in resolved.patches)
        assert " passed" in body  # its tests ran against the installed vLLM with the change
        # what did not run, vLLM main first: this export had no vLLM checkout to check the series against
        not_run = body.split("## Not run\n", 1)[1]
        assert not_run.startswith(
            f"\n- vLLM `main`: the tests ran against vLLM {manifest['vllm']} with this change"
        )
        assert "whether the series applies to `main` was not checked" in not_run
        needing = [p for p in manifest["prs"] if pr["folder"] in p["vllm"]]
        assert needing, "no vllm-omni PR depends on the vLLM PR"
        for omni in needing:
            text = (out / omni["folder"] / "PR.md").read_text()
            assert pr["title"] in text and _cites_the_tracker(text)


def _accounts_for_every_collected_test(text: str, runs: list, where: str) -> None:
    """Per scope, the Test Result's "In all" line names every test the runs collected, its parts add
    up, and each test no run selects is named under Not run."""
    result, not_run = text.split("## Test Result", 1)[1].split("### Not run", 1)
    totals = re.findall(r"^- In all, the (\d+) collected tests: (.*)\.$", result, re.MULTILINE)
    scopes = [scope for scope in (prtext.OWN, prtext.EARLIER) if any(r.scope == scope for r in runs)]
    assert len(totals) == len(scopes), where
    for scope, (total, parts) in zip(scopes, totals):
        scoped = [run for run in runs if run.scope == scope]
        marks = {node: m for run in scoped for node, m in run.collection.tests.items()}
        assert int(total) == len(marks), where
        assert sum(int(n) for n in re.findall(r"(\d+) ", parts)) == len(marks), (where, parts)
        ran = {node for run in scoped for node in run.collection.selected}
        assert f"{len(ran)} selected by the runs" in parts, where
        for node in set(marks) - ran:  # a unit level not run would select it, or Not run names it
            unit = any(testmarks.expression_selects(lv, frozenset(marks[node])) for lv in prtext.UNIT_MARKS)
            assert unit or f"`{node}`" in not_run, (where, node)


def _cites_the_tracker(text: str) -> bool:
    """The tracker by its full reference and title, and no bare ``#7452`` beside it."""
    bare = re.sub(re.escape(conv.TRACKER_ISSUE), "", text)
    return conv.TRACKER_ISSUE in text and conv.TRACKER_TITLE in text and "#7452" not in bare


def _tables_have_captions(text: str, where: str) -> None:
    blocks = re.split(r"\n\s*\n", text)
    for i, block in enumerate(blocks):
        for table in prtext.tables(block):
            before = block[: block.index(table)].strip() or (blocks[i - 1].strip() if i else "")
            assert before and not before.startswith("#"), f"{where}: a table without a caption:\n{table}"


@pytest.mark.cpu
def test_each_pr_text_reads_once_a_maintainer(exported):
    """Template sections, its own stack position and dependencies, captions on every table, the test
    runs from its own tree with their skip reasons, the GPU environment against the pins, Not run."""
    out, manifest, report = exported
    resolved = stack.resolve(read_change_set(REPO, "current")).omni
    earlier: list[str] = []
    two_gpu = False  # a two-GPU test of this PR or of one before it: its tree's one-GPU runs skip it
    for pr, check, source in zip(manifest["prs"], report.checks, resolved):
        text = (out / pr["folder"] / "PR.md").read_text()
        where = pr["folder"]
        assert text.splitlines()[0] == conv.PR_TEMPLATE_FIRST_LINE
        positions = [text.index(h + "\n") for h in conv.PR_TEMPLATE_HEADINGS]
        assert positions == sorted(positions)
        assert f"{conv.PR_FIELD_VLLM} {manifest['vllm']}" in text
        assert f"{conv.PR_FIELD_OMNI} v{manifest['vllm_omni']}" in text
        assert (out / pr["folder"] / "PR-title.txt").read_text().strip() == pr["title"]
        assert pr["title"].startswith("[") and conv.MODEL_TITLE in pr["title"]
        assert all(title in text for title in earlier), where
        # not opened yet (no --pr-number): each earlier PR by its place in the stack and its branch
        for k, before in enumerate(manifest["prs"][: len(earlier)], 1):
            place = f"PR {k} of the {len(manifest['prs'])} of the stack, branch `{before['branch']}`"
            assert f"{k}. {before['title']} (not opened yet: {place})" in text, where
        if not earlier and not pr["vllm"]:
            assert "it can merge on the current vLLM pin" in text
        earlier.append(pr["title"])
        for run in check.runs:
            assert run.summary in text and run.environment in text
            assert f"- `{run.command}`: `{run.summary}`" in text, where  # the files each run ran
            for reason in run.skipped:
                assert reason in text
            for warning in run.warnings:
                assert warning in text, where
        _accounts_for_every_collected_test(text, check.runs, where)
        # a vLLM change an earlier PR needs holds this one back too, and its text says so
        needed = {v for p in manifest["prs"][: manifest["prs"].index(pr) + 1] for v in p["vllm"]}
        for vllm_pr in manifest["vllm_prs"]:
            if vllm_pr["folder"] in needed:
                assert vllm_pr["title"] in text and _cites_the_tracker(text), where
        _tables_have_captions(text, where)
        assert all(remark in text for remark in source.remarks), where
        assert transform.project_mentions({where: text}, words=transform.POSITIONAL) == []
        # the commits UPSTREAM-EDITS.md asks for by hand are named in the text too
        edits = out / pr["folder"] / "UPSTREAM-EDITS.md"
        titles = re.findall(r"Commit title: `([^`]+)`", edits.read_text()) if edits.exists() else []
        assert ("To add by hand on the branch" in text) == bool(titles), where
        assert all(title in text for title in titles), where
        not_run = text.split("### Not run", 1)[1]
        assert "checkpoint" in not_run and "Buildkite" in not_run
        assert (conv.PR_NO_MEASUREMENTS in not_run) == (not source.results), where
        two_gpu = two_gpu or any(
            "pytest.mark.multi_gpu" in path.read_text() for path in source.tests.values()
        )
        assert ("two GPUs" in not_run) == two_gpu, where


@pytest.mark.cpu
def test_the_gpu_environment_is_stated_with_its_differences_from_the_pins(exported):
    import importlib.metadata

    out, manifest, _ = exported
    setup = prtext.section((REPO / RESULTS).read_text(), "Setup")
    assert setup, "the results page has no Setup section"
    first = prtext.first_paragraph(setup)
    requirements = {
        d: [r for r in importlib.metadata.requires(d) or [] if "extra ==" not in r]
        for d in ("vllm", "vllm-omni")
    }
    diffs = prtext.pin_differences(
        first, requirements, {"vllm": manifest["vllm"], "vllm-omni": manifest["vllm_omni"]}
    )
    for pr in manifest["prs"]:
        text = (out / pr["folder"] / "PR.md").read_text()
        assert prtext.plain_links(first) in text
        assert all(item in text for item in diffs), pr["folder"]


def _tagged_rows(results: str) -> dict[str, list[str]]:
    """Table rows of the results page by the one key they are tagged with (tag cut off): a row
    ending in ``<!-- pr: KEY -->``, or a row inside a ``<!-- pr: KEY -->`` ... ``<!-- /pr -->`` block."""
    rows: dict[str, list[str]] = {}
    block = None
    for line in results.splitlines():
        opened = re.match(r"^\s*<!--\s*pr:\s*([\w-]+)\s*-->\s*$", line)
        if opened or re.match(r"^\s*<!--\s*/pr\s*-->\s*$", line):
            block = opened.group(1) if opened else None
            continue
        m = re.match(r"^(\|.*\|)[ \t]*<!--[ \t]*pr:[ \t]*([\w-]+)[ \t]*-->[ \t]*$", line)
        if m:
            rows.setdefault(m.group(2), []).append(m.group(1))
        elif block and line.startswith("| ") and not line.startswith("|---") and results.count(line) == 1:
            rows.setdefault(block, []).append(line.rstrip())  # not a header every section has
    return rows


@pytest.mark.cpu
def test_each_pr_shows_only_its_own_results(exported):
    out, manifest, _ = exported
    results = (REPO / RESULTS).read_text()
    rows = _tagged_rows(results)
    assert rows, "the results page tags no row with a PR"
    texts = {pr["key"]: (out / pr["folder"] / "PR.md").read_text() for pr in manifest["prs"]}
    shown = {key: [row for row in rows.get(key, []) if row in texts[key]] for key in texts}
    assert any(shown.values())
    for key, own in rows.items():
        for other, text in texts.items():
            if other != key:
                assert not [row for row in own if row in text], f"{other} shows results of {key}"


@pytest.mark.cpu
def test_nothing_exported_names_this_project_or_what_only_it_has(exported):
    """Every patch (diffs and commit messages) and PR text, read back from the files written: none
    names the project, not even where it says how its figures were measured."""
    out, manifest, _ = exported
    texts = {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.glob("*/*.patch"))}
    texts |= {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.glob("*/PR-title.txt"))}
    assert len(texts) > 2 * len(manifest["prs"])
    assert transform.project_mentions(texts) == []
    assert transform.project_mentions(texts, words=transform.NOT_UPSTREAM) == []
    for pr in manifest["prs"]:
        text = (out / pr["folder"] / "PR.md").read_text()
        assert transform.project_mentions({"PR.md": text}) == []
        assert transform.project_mentions({"PR.md": text}, words=transform.NOT_UPSTREAM) == []


def _test_result(text: str) -> str:
    return text.split("## Test Result", 1)[1].split("### Not run", 1)[0]


@pytest.mark.cpu
def test_each_pr_says_how_and_on_which_tree_its_figures_were_measured(exported):
    """The method comes from the results page's section, as far as it is the PR's (its untagged parts
    and those tagged for the PR: nothing outside the PR is needed to read it); the tree is the one the
    stack table records for the PR's figures."""
    out, manifest, _ = exported
    page = transform.drop_project_only((REPO / RESULTS).read_text(), RESULTS)
    method = prtext.section(page, conv.RESULTS_METHOD_HEADING)
    assert method and "CUDA events" in method and "median" in method and "random" in method
    by_key = {pr.key: pr for pr in stack.STACK}
    keys = [pr["key"] for pr in manifest["prs"]]
    for number, pr in enumerate(manifest["prs"], 1):
        result = _test_result((out / pr["folder"] / "PR.md").read_text())
        spec = by_key[pr["key"]]
        if not spec.results:
            assert "### How the figures were measured" not in result
            continue
        own = prtext.section(
            docsplit.own_parts(page, RESULTS, pr["key"], set(keys)), conv.RESULTS_METHOD_HEADING
        )
        if not own:  # every part of the method is tagged for other PRs: the PR's own sections say how
            assert "### How the figures were measured" not in result
            continue
        assert "### How the figures were measured" in result and prtext.plain_links(own) in result
        upto = {"stack": len(keys), "own": number}.get(spec.measured_on) or keys.index(spec.measured_on) + 1
        inp = prtext.PrInputs(pr["key"], number, "", [], [], manifest["vllm"], manifest["vllm_omni"],
                              total=len(keys), measured_upto=upto)  # fmt: skip
        # the measured tree ran against vLLM with the vLLM PRs its PRs need (the manifest's, in order)
        needed = dict.fromkeys(folder for p in manifest["prs"][:upto] for folder in p["vllm"])
        titles = {v["folder"]: v["title"] for v in manifest["vllm_prs"]}
        inp.measured_vllm = [(titles[folder], folder) for folder in needed]
        assert prtext.measured_tree(inp) in result
        # a PR's own tree comes first: the last PR's own tree is the whole stack, said as its own
        assert ("whole stack" in result) == (upto == len(keys) != number), pr["folder"]
        assert ("this PR's own tree" in result) == (upto == number), pr["folder"]


@pytest.mark.cpu
def test_every_pr_shows_measurements_of_its_own_with_captions_and_targets(exported):
    out, manifest, _ = exported
    for pr in manifest["prs"]:
        result = _test_result((out / pr["folder"] / "PR.md").read_text())
        tables = prtext.tables(result)
        assert tables, f"{pr['folder']} shows no measurement"
        assert "target" in result.lower(), pr["folder"]
        _tables_have_captions(result, pr["folder"])


@pytest.mark.cpu
def test_stack_overview_lists_each_pr_with_its_size(exported):
    out, manifest, _ = exported
    overview = (out / "STACK.md").read_text()
    for pr in manifest["prs"] + manifest["vllm_prs"]:
        row = next(line for line in overview.splitlines() if f"`{pr['folder']}` | {pr['title']} |" in line)
        assert (
            pr["title"] in row and f"+{pr['size']['insertions']}" in row and str(pr["size"]["bytes"]) in row
        )
        assert pr["size"]["bytes"] == sum((out / s).stat().st_size for s in pr["series"])
    # a PR needs the vLLM PRs of the PRs it applies on: the table says so, and through which
    needed: list[str] = []
    for pr in manifest["prs"]:
        row = next(line for line in overview.splitlines() if f"`{pr['folder']}` |" in line)
        cell = row.split(" | ")[-2]
        for v in needed:
            assert f"`{v}`" in cell and (v in pr["vllm"] or "through the PRs before it" in cell), row
        if not needed and not pr["vllm"]:
            assert cell == "—"
        needed += [v for v in pr["vllm"] if v not in needed]
    assert needed  # the stack needs a vLLM change: the check above ran on a PR that inherits it


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
        "tests/vllm_patches/upstream",
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
    cs = read_change_set(repo, "current")
    first = stack.resolve(cs).omni[0]
    adapter = next(iter(first.owned.values()))
    adapter.write_text(adapter.read_text() + "\n\ndef _export_probe() -> int:\n    return 1\n")
    results = repo / RESULTS
    text = results.read_text()
    at = text.index("\n|---", text.index(f"# {first.results[0]}"))  # a table of the first PR's results
    at = text.index("\n", at + 1)
    results.write_text(text[:at] + f"\n| probe row | 42 | <!-- pr: {first.key} -->" + text[at:])
    out = Path("pr")
    build.export(build.ExportOptions(repo=repo, out=out, author=Identity(AUTHOR)))
    assert "+def _export_probe() -> int:" in patch_texts(out / first.folder)[0]
    assert "| probe row | 42 |" in (out / first.folder / "PR.md").read_text()
    assert all(
        "probe row" not in (out / pr.folder / "PR.md").read_text() for pr in stack.resolve(cs).omni[1:]
    )


@pytest.mark.cpu
def test_export_fails_when_a_file_or_commit_message_names_this_project(tmp_path, current_lane_only):
    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity

    repo = _copy_checkout(tmp_path / "repo")
    first = stack.resolve(read_change_set(repo, "current")).omni[0]
    adapter = next(iter(first.owned.values()))
    adapter.write_text(adapter.read_text() + "\n# needs patches/vllm/0007 (minicpmo-cg-patch apply)\n")
    patch = first.patches[0].path
    patch.write_text(patch.read_text().replace("\nWhy: ", "\nWhy: On both lanes, ", 1))
    with pytest.raises(transform.ExportError) as info:
        build.export(build.ExportOptions(repo=repo, out=tmp_path / "pr", author=Identity(AUTHOR)))
    message = str(info.value)
    owned = next(iter(first.owned))
    found = message.split("\n  ")[1:]
    # the owned file (as it ends up, and in its PR's series), the commit message, the PR text
    assert [f for f in found if f.startswith(f"{owned}:") and "# needs patches/vllm/0007" in f]
    assert [f for f in found if f.startswith(f"{first.folder}/0001-") and "# needs patches/vllm/0007" in f]
    commit = 1 + bool(first.owned)  # after the owned modules
    assert [f for f in found if f.startswith(f"{first.folder} commit {commit}:3: On both lanes")]
    assert [f for f in found if f.startswith(f"{first.folder}/PR.md:") and "On both lanes" in f]
    assert f"in {len(found)} place(s)" in message


@pytest.mark.cpu
def test_export_refuses_a_foreign_out_dir_an_out_file_and_a_missing_identity(tmp_path, monkeypatch, capsys):
    from minicpmo_cg.export.gitseries import Identity
    from minicpmo_cg.patchtool import run

    (tmp_path / "keep.txt").write_text("not an export")
    assert run(["export", "--out", str(tmp_path), "--author", AUTHOR]) == 2
    assert "holds no earlier export" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "not an export"
    assert run(["export", "--out", str(tmp_path / "keep.txt"), "--author", AUTHOR]) == 2
    assert "keep.txt" in (err := capsys.readouterr().err) and "not a directory" in err
    from minicpmo_cg.export import build

    with pytest.raises(FileExistsError, match="is a file, not a directory"):  # the same below the CLI
        build.export(build.ExportOptions(repo=REPO, out=tmp_path / "keep.txt", author=Identity(AUTHOR)))
    assert (tmp_path / "keep.txt").read_text() == "not an export"
    assert run(["export", "--out", str(tmp_path / "new"), "--author", "nobody"]) == 2
    no_git_identity(tmp_path / "home", monkeypatch)
    assert run(["export", "--out", str(tmp_path / "new")]) == 2
    assert "git config --global user.name" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.cpu
def test_the_identity_is_gits_global_one_unless_author_overrides_it(tmp_path, monkeypatch):
    import argparse

    from minicpmo_cg.export import cli

    no_git_identity(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="--author"):
        cli.git_identity(tmp_path)
    (tmp_path / ".gitconfig").write_text("[user]\n\tname = Global Name\n\temail = global@example.org\n")
    assert str(cli.git_identity(tmp_path)) == "Global Name <global@example.org>"
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Env Name")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "env@example.org")
    assert str(cli.git_identity(tmp_path)) == "Env Name <env@example.org>"
    args = argparse.Namespace(author=AUTHOR)
    assert str(cli._identity(args, tmp_path)) == AUTHOR


@pytest.mark.cpu
def test_cli_export_to_a_vllm_omni_checkout(tmp_path, current_lane_only, exported):
    """``--checkout``: one branch per PR, each on the one before, with the PR's Buildkite and nav
    edits as commits of its own branch.

    The checkout is the release tree with stand-ins for the three upstream files the wheel lacks,
    shaped as vllm-omni's are described (a group ``E2E Test`` holding the MiniCPM-o online step;
    a nav and an index naming the MiniCPM-o performance page); the real files differ in detail.
    """
    import yaml

    from minicpmo_cg.export import fetch
    from minicpmo_cg.export.gitseries import git
    from minicpmo_cg.patchtool import run

    _, manifest, _ = exported
    checkout = fetch.extract_package(
        fetch.wheel("vllm-omni", manifest["vllm_omni"]), "vllm_omni", tmp_path / "omni"
    )
    _stand_ins(checkout)
    env = {
        "GIT_AUTHOR_NAME": "r",
        "GIT_AUTHOR_EMAIL": "r@x",
        "GIT_COMMITTER_NAME": "r",
        "GIT_COMMITTER_EMAIL": "r@x",
    }
    git(checkout, "init", "-q", "-b", "main")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-q", "-m", "v0.30.0", env=env)
    out = tmp_path / "pr"
    argv = ["export", "--out", str(out), "--author", AUTHOR, "--checkout", str(checkout), "--branch", "cg"]
    assert run(argv) == 0
    previous = "main"
    e2e = [pr for pr in manifest["prs"] if any(t.startswith("tests/e2e/") for t in pr["tests"])]
    paged = [pr for pr in manifest["prs"] if pr["page"]]
    for pr in manifest["prs"]:
        branch = f"cg-{pr['folder']}"
        log = git(checkout, "log", "--format=%s", f"{previous}..{branch}").splitlines()
        edits = (pr in e2e) + 2 * (pr in paged)
        assert len(log) == len(pr["commits"]) + edits, branch
        assert len(list((out / pr["folder"]).glob("*.patch"))) == len(log)
        previous = branch
    last = f"cg-{manifest['prs'][-1]['folder']}"
    git(checkout, "checkout", "-q", last)
    steps = yaml.safe_load((checkout / conv.BUILDKITE_READY).read_text())["steps"][0]["steps"]
    ours = [s for s in steps if "eager vs graphed" in s["label"]]
    assert len(ours) == len(e2e) == 1 and ours[0]["agents"] == steps[0]["agents"]
    assert any(Path(t).name in c for c in ours[0]["commands"] for t in e2e[0]["tests"] if "/e2e/" in t)
    page = Path(paged[0]["page"]).name
    assert (
        page in (checkout / conv.NAV_FILE).read_text()
        and page in (checkout / conv.DESIGN_INDEX_FILE).read_text()
    )
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
    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity

    repo = _copy_checkout(tmp_path / "repo")
    for patch in (repo / "patches/vllm-omni").glob("*.patch"):
        text = patch.read_text()
        patch.write_text(text.replace("\nTargets:", "\nUpstream-Since: vllm-omni==0.30.0\nTargets:", 1))
    with pytest.raises(transform.ExportError, match="nothing to export for lane current"):
        build.export(build.ExportOptions(repo=repo, out=tmp_path / "pr", author=Identity(AUTHOR)))
    assert not (tmp_path / "pr").exists()


@pytest.mark.cpu
def test_every_owned_file_test_and_active_patch_of_the_checkout_is_exported(exported):
    """Listed from the checkout independently of the export's own discovery: a new adapter module,
    test file or vllm-omni patch that the export leaves out fails here."""
    _, manifest, _ = exported
    files = {f for pr in manifest["prs"] for f in pr["files"]}
    listed = tracked("vllm_omni", "tests/model_executor/models/minicpmo_4_5", "tests/e2e")
    expected = {f for f in listed if f.endswith(".py") and not f.startswith("tests/e2e/")}
    expected |= {f for f in listed if f.startswith("tests/e2e/") and Path(f).name.startswith("test_minicpmo")}
    assert expected and expected - files == set()
    lane_omni = manifest["vllm_omni"]
    active = []
    for name in series_names(REPO / "patches/vllm-omni"):
        header = (REPO / "patches/vllm-omni" / name).read_text().split("\n---\n", 1)[0]
        if f"vllm-omni=={lane_omni}" in header and "Upstream-Since:" not in header:
            active.append(name)
    titles = [c["title"] for pr in manifest["prs"] for c in pr["commits"]]
    for name in active:
        subject = re.search(
            r"^Subject: (?:minicpmo_4_5: )?(.+)$",
            (REPO / "patches/vllm-omni" / name).read_text(),
            re.MULTILINE,
        )
        assert sum(subject.group(1) in t for t in titles) == 1, name
    vendored = {src for pr in manifest["prs"] for src in pr["vendored"].values()}
    assert not [src for src in vendored if src.startswith(("minicpmo_cg/patchtool", "minicpmo_cg/export"))]
    assert json.dumps(manifest)  # the manifest is plain JSON
