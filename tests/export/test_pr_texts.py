# SPDX-License-Identifier: Apache-2.0
"""The Test Result and Not run of the PR texts, from hand-made runs (no export, no checkout read):
each run line gives the command it ran, a PR's own tests and the earlier PRs' tests on its tree are
reported apart, and every collected test is accounted for (selected by a run, by a level not run,
or by none, with why, and then named under Not run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minicpmo_cg.export import prtext, pytestlog
from minicpmo_cg.export.pytestlog import Collection

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

OWN_FILES = ["tests/m/test_path.py", "tests/e2e/online_serving/test_serve.py"]
EARLIER_FILES = ["tests/m/test_first.py"]
CPU, CUDA = prtext.UNIT_MARKS


def _own_collection(deselect: str) -> Collection:
    """Three CPU tests, two CUDA tests and two serving tests (``cuda`` and ``advanced_model``, no
    ``core_model``): what ``-m deselect``'s run collected, the others deselected."""
    tests = {f"tests/m/test_path.py::test_cpu_{i}": ["core_model", "cpu"] for i in range(3)}
    tests |= {f"tests/m/test_path.py::test_gpu_{i}": ["core_model", "cuda", "skipif"] for i in range(2)}
    tests |= {f"tests/e2e/online_serving/test_serve.py::test_answers[{a}]": ["advanced_model", "cuda"]
              for a in ("sdpa", "eager")}  # fmt: skip
    keep = {CPU: "cpu", CUDA: "cuda"}[deselect]
    return Collection(tests, [n for n, m in tests.items() if keep not in m or "core_model" not in m])


def _inputs(runs: list[prtext.PytestRun]) -> prtext.PrInputs:
    return prtext.PrInputs(
        "image-call", 2, "[Model] T", [], ["c"], "0.30.0", "0.30.0", test_files=list(OWN_FILES),
        unit_marks=(CPU, CUDA), earlier=[("[Bugfix] First", "01-first")], earlier_test_files=EARLIER_FILES,
        earlier_marks=(CPU,), total=2, runs=runs,
    )  # fmt: skip


def _cpu_run(scope: str = prtext.OWN) -> prtext.PytestRun:
    if scope == prtext.EARLIER:
        tests = {"tests/m/test_first.py::test_a": ["core_model", "cpu"]}
        return prtext.PytestRun(CPU, "1 passed", environment="Python 3.11, no GPU", files=EARLIER_FILES,
                                scope=scope, collection=Collection(tests, []))  # fmt: skip
    return prtext.PytestRun(CPU, "3 passed, 4 deselected", environment="Python 3.11, no GPU", files=OWN_FILES,
                            collection=_own_collection(CPU))  # fmt: skip


def test_each_run_line_gives_the_command_with_the_files_it_ran():
    [line] = prtext.run_lines([_cpu_run()])
    assert line.startswith(f'- `pytest -m "{CPU}" {" ".join(OWN_FILES)}`: `3 passed, 4 deselected`')
    vllm = prtext.PytestRun("", "2 passed", files=["tests/v1/test_x.py"])
    assert prtext.run_lines([vllm])[0].startswith("- `pytest tests/v1/test_x.py`: `2 passed`")


def test_every_collected_test_is_accounted_for_and_the_unselected_ones_are_named_under_not_run():
    text = prtext.omni_pr(_inputs([_cpu_run(), _cpu_run(prtext.EARLIER)]))
    result = text.split("## Test Result", 1)[1].split("### Not run", 1)[0]
    own, earlier = result.split("The earlier PRs' tests on this tree", 1)
    assert "This PR's tests (the test files it adds or changes); they collect 7 tests:" in own
    assert f'-m "{CUDA}"` selects 2 of them: not run.' in own
    assert (
        "No run selects 2 tests of `tests/e2e/online_serving/test_serve.py`: marked `advanced_model`, `cuda`, "
        "not `core_model`, which each unit level requires; the serving end to end tests" in own
    )
    assert (
        "In all, the 7 collected tests: 3 selected by the runs, 2 only by a level not run, 2 by none." in own
    )
    assert (
        "they collect 1 test:" in earlier
        and f'`pytest -m "{CPU}" tests/m/test_first.py`: `1 passed`' in earlier
    )
    assert "In all, the 1 collected tests: 1 selected by the runs." in earlier
    not_run = text.split("### Not run", 1)[1]
    assert f'This PR\'s tests with `-m "{CUDA}"` from its own tree.' in not_run
    named = next(line for line in not_run.splitlines() if "no `-m` expression of Test Result selects" in line)
    assert named.startswith("- This PR's 2 tests that")
    assert all(f"`{node}`" in named for node in _own_collection(CPU).tests if "e2e" in node)
    # the earlier PRs' tests ran at their only level: nothing of theirs is missing
    assert "The earlier PRs' tests with" not in not_run


def test_a_gpu_run_closes_the_account_of_its_level():
    gpu = prtext.PytestRun(CUDA, "2 passed, 5 deselected", environment="on an offline GPU host",
                           files=OWN_FILES, collection=_own_collection(CUDA))  # fmt: skip
    text = prtext.omni_pr(_inputs([_cpu_run(), gpu]))
    assert "In all, the 7 collected tests: 5 selected by the runs, 2 by none." in text
    assert "of them: not run." not in text and f'with `-m "{CUDA}"` from its own tree' not in text


def test_without_a_record_of_the_collection_the_levels_not_run_are_still_named():
    run = prtext.PytestRun(CPU, "3 passed, 4 deselected", files=OWN_FILES)
    text = prtext.omni_pr(_inputs([run]))
    assert "they collect" not in text and "In all" not in text
    assert f'Deselected: the collected tests that `-m "{CPU}"` does not select' in text
    not_run = text.split("### Not run", 1)[1]
    assert f'This PR\'s tests with `-m "{CUDA}"` from its own tree.' in not_run
    assert f'The earlier PRs\' tests with `-m "{CPU}"` on this tree.' in not_run


def test_the_buildkite_line_says_whether_any_test_ran_outside_the_pipelines():
    """Not run always names vllm-omni's Buildkite pipelines; where Test Result holds runs they ran
    outside them, and where it holds none the line must not point at runs that are not there."""

    def buildkite(text: str) -> str:
        return next(line for line in text.split("### Not run", 1)[1].splitlines() if "Buildkite" in line)

    assert buildkite(prtext.omni_pr(_inputs([_cpu_run()]))).endswith(
        "the tests of Test Result ran with pytest outside them."
    )
    assert buildkite(prtext.omni_pr(_inputs([]))).endswith("no test of this PR ran yet.")


def test_the_earlier_test_files_are_those_of_earlier_prs_this_one_leaves_as_they_are():
    prs = [{"tests": ["tests/a/conftest.py", "tests/a/test_one.py", "tests/a/test_two.py"]},
           {"tests": ["tests/a/test_two.py", "tests/a/test_three.py", "tests/a/helper.py"]}]  # fmt: skip
    assert pytestlog.earlier_test_files(prs, 0) == []
    # test_two.py grows in the second PR: its own, not an earlier PR's
    assert pytestlog.earlier_test_files(prs, 1) == ["tests/a/test_one.py"]


def test_the_collection_plugin_records_every_collected_test_with_its_marks_and_the_deselected(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_marks.py").write_text(textwrap.dedent("""\
        import pytest
        pytestmark = pytest.mark.core_model

        @pytest.mark.cpu
        @pytest.mark.parametrize("n", [1, 2])
        def test_cpu(n):
            pass

        @pytest.mark.cuda
        def test_gpu():
            pass
        """))  # fmt: skip
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    core_model: x\n    cpu: x\n    cuda: x\n")
    plugin = pytestlog.write_collect_plugin(tmp_path / "plugins")
    out = tmp_path / "collected.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "plugins"), pytestlog.COLLECT_OUT: str(out)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", plugin, "-p", "no:cacheprovider", "-m", "core_model and cpu",
         "tests/test_marks.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = pytestlog.read_collection(out)
    assert found.tests == {
        "tests/test_marks.py::test_cpu[1]": ["core_model", "cpu", "parametrize"],
        "tests/test_marks.py::test_cpu[2]": ["core_model", "cpu", "parametrize"],
        "tests/test_marks.py::test_gpu": ["core_model", "cuda"],
    }
    assert found.deselected == ["tests/test_marks.py::test_gpu"] and len(found.selected) == 2
    assert pytestlog.summary(proc.stdout) == "2 passed, 1 deselected"
    assert json.loads(out.read_text())["deselected"] == found.deselected
    assert pytestlog.read_collection(tmp_path / "none.json") is None


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x", "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def _vllm_checkout(root: Path, text: str) -> Path:
    """A git checkout on branch ``main`` holding ``vllm/v1/worker/encoder_cudagraph.py`` = ``text``."""
    (root / "vllm/v1/worker").mkdir(parents=True)
    (root / "vllm/v1/worker/encoder_cudagraph.py").write_text(text)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    return root


def _series(tmp_path: Path) -> list[Path]:
    """A one-commit ``git format-patch`` series changing the second line of the file."""
    repo = _vllm_checkout(tmp_path / "author", "a = 1\nb = 2\nc = 3\n")
    (repo / "vllm/v1/worker/encoder_cudagraph.py").write_text("a = 1\nb = 20\nc = 3\n")
    _git(repo, "commit", "-q", "-am", "[Core] change b")
    return [repo / name for name in _git(repo, "format-patch", "-1", "-o", str(repo)).split()]


def _vllm_inputs(runs: list[prtext.PytestRun], check=None) -> prtext.PrInputs:
    return prtext.PrInputs("capture-error-mode", 0, "[Core] T", [], ["c"], "0.30.0", "0.30.0",
                           test_files=["tests/v1/test_x.py"], runs=runs, main_check=check)  # fmt: skip


def test_the_vllm_pr_says_what_did_not_run_vllm_main_first():
    cpu = prtext.PytestRun("", "1 passed, 1 skipped", {"requires a CUDA device": 1}, "Python 3.11, no GPU",
                           files=["tests/v1/test_x.py"])  # fmt: skip
    text = prtext.vllm_pr(_vllm_inputs([cpu]))
    not_run = text.split("## Not run\n", 1)[1]
    items = [line for line in not_run.splitlines() if line.startswith("- ")]
    assert items[0] == (
        "- vLLM `main`: the tests ran against vLLM 0.30.0 with this change applied, not `main`; "
        "whether the series applies to `main` was not checked."
    )
    assert (
        "- The tests that need a GPU: no run of Test Result had one, so they skipped (1 × requires a CUDA device)."
        in items
    )
    assert any("pre-commit" in item and "Buildkite" in item for item in items)
    # a GPU run (without vLLM's compiled kernels) closes the GPU item and names what it lacked
    gpu = prtext.PytestRun("", "2 passed", environment="on an offline GPU host; vLLM 0.30.0's Python code "
                           "without its compiled kernels", files=["tests/v1/test_x.py"], on_gpu=True)  # fmt: skip
    not_run = prtext.vllm_pr(_vllm_inputs([cpu, gpu])).split("## Not run\n", 1)[1]
    assert "no run of Test Result had one" not in not_run and "compiled kernels installed" in not_run
    # no run at all: the tests themselves are named
    assert "This change's tests (`pytest -sv tests/v1/test_x.py`)." in prtext.vllm_pr(_vllm_inputs([]))


def test_the_vllm_pr_names_the_versions_its_runs_used_outside_vllms_requirements():
    runs = [
        prtext.PytestRun(
            "",
            "2 passed",
            environment=f"Python 3.12.3, torch {torch}, transformers 5.17.0, on a host",
            files=["tests/v1/test_x.py"],
            on_gpu=True,
        )
        for torch in ("2.11.0", "2.11.0")
    ]
    inputs = _vllm_inputs(runs)
    inputs.requirements = {"vllm": ["torch==2.13.0", "transformers>=4.56.0", "python>=3.10"]}
    result = prtext.vllm_pr(inputs).split("## Test Result\n", 1)[1].split("## Not run", 1)[0]
    # once, however many runs used it; transformers and Python are inside the requirements
    assert result.count("Versions that differ from vLLM's pins") == 1
    assert (
        "Versions that differ from vLLM's pins: torch 2.11.0 (vLLM 0.30.0 requires torch==2.13.0)." in result
    )
    inputs.requirements = {"vllm": ["torch==2.11.0"]}
    assert "differ from vLLM's pins" not in prtext.vllm_pr(inputs)


def test_the_series_is_checked_against_a_vllm_checkout_and_the_text_names_its_commit(tmp_path):
    from minicpmo_cg.export import vllm_main

    series = _series(tmp_path)
    same = _vllm_checkout(tmp_path / "main", "a = 1\nb = 2\nc = 3\n")
    check = vllm_main.check_series(same, series)
    head = _git(same, "rev-parse", "HEAD").strip()
    assert (check.applies, check.commit, check.branch) == (True, head, "main")
    assert _git(same, "status", "--porcelain") == ""  # nothing written there
    text = prtext.vllm_pr(_vllm_inputs([], check))
    assert f"The series applies to vLLM `main` at commit {head[:12]} (`git apply --check`)." in text
    assert (
        f"(the series applies to vLLM `main` at commit {head[:12]}, but its tests did not run there)" in text
    )
    moved = _vllm_checkout(tmp_path / "moved", "a = 1\nb = 5\nc = 3\n")
    check = vllm_main.check_series(moved, series)
    assert not check.applies and "encoder_cudagraph.py" in check.detail
    text = prtext.vllm_pr(_vllm_inputs([], check))
    assert "The series does not apply to vLLM `main` at commit" in text and "needs a rebase first" in text


def test_a_vllm_checkout_that_is_no_git_checkout_is_refused_naming_the_option(tmp_path, capsys):
    from minicpmo_cg.export import vllm_main
    from minicpmo_cg.patchtool import run

    with pytest.raises(ValueError, match="--vllm-checkout"):
        vllm_main.checkout_commit(tmp_path)
    argv = [
        "export",
        "--out",
        str(tmp_path / "pr"),
        "--author",
        "A B <a@b.org>",
        "--vllm-checkout",
        str(tmp_path),
    ]
    assert run(argv) == 2
    assert f"--vllm-checkout {tmp_path}: not a git checkout" in capsys.readouterr().err
    assert not (tmp_path / "pr").exists()


def _omni_series(author: Path, name: str, text: str) -> list[Path]:
    """One commit on ``author``'s ``main`` writing ``m/{name}`` = ``text``, as a format-patch series."""
    (author / "m").mkdir(exist_ok=True)
    (author / "m" / name).write_text(text)
    _git(author, "add", "-A")
    _git(author, "commit", "-q", "-m", f"[Model] {name}")
    out = author / f"series-{name}"
    return [Path(p) for p in _git(author, "format-patch", "-1", "-o", str(out)).split()]


def test_the_stack_is_applied_pr_by_pr_to_a_vllm_omni_checkout_and_each_text_says_so(tmp_path):
    from minicpmo_cg.export import vllm_main

    author = tmp_path / "author"
    author.mkdir()
    (author / "m").mkdir()
    (author / "m" / "model.py").write_text("a = 1\n")
    _git(author, "init", "-q", "-b", "main")
    _git(author, "add", "-A")
    _git(author, "commit", "-q", "-m", "base")
    first = _omni_series(author, "model.py", "a = 1\nb = 2\n")  # changes a file main has
    second = _omni_series(author, "new.py", "c = 3\n")  # applies only on the first
    main = tmp_path / "main"
    _git(tmp_path, "clone", "-q", str(author), str(main))
    _git(main, "reset", "-q", "--hard", "HEAD~2")
    head = _git(main, "rev-parse", "HEAD").strip()
    checks = vllm_main.check_stack(main, [first, second])
    assert [c.applies for c in checks] == [True, True]
    assert {(c.commit, c.branch, c.project, c.how) for c in checks} == {
        (head, "main", "vllm-omni", "git am --3way")
    }
    assert _git(main, "status", "--porcelain") == "" and _git(main, "rev-parse", "HEAD").strip() == head
    inp = _inputs([])
    inp.main_check = checks[1]
    assert (
        f"- vllm-omni `main`: this PR and the ones before it are built and tested on the v0.30.0 release; "
        f"they apply to vllm-omni `main` at commit {head[:12]} (`git am --3way`), but no test ran there."
    ) in prtext.omni_pr(inp)
    # main moved on where the first PR changes it: the first does not apply, the second is not tried
    (main / "m" / "model.py").write_text("a = 10\n")
    _git(main, "commit", "-q", "-am", "upstream change")
    checks = vllm_main.check_stack(main, [first, second])
    assert [c.applies for c in checks] == [False, False]
    assert "model.py" in checks[0].detail and checks[1].detail.startswith("not tried: PR 1 of the stack")
    inp.main_check = checks[0]
    assert "they do not apply to vllm-omni `main` at commit" in prtext.omni_pr(inp)
    assert "so a rebase comes first." in prtext.omni_pr(inp)


def test_the_vllm_omni_main_item_says_when_it_was_not_checked():
    inp = _inputs([])
    assert (
        "- vllm-omni `main`: this PR and the ones before it are built and tested on the v0.30.0 release; "
        "whether they apply to `main` was not checked."
    ) in prtext.omni_pr(inp)
    inp.number = 1
    assert "- vllm-omni `main`: this PR is built and tested on the v0.30.0 release; whether it applies" in (
        prtext.omni_pr(inp)
    )


def test_a_vllm_omni_checkout_that_is_no_git_checkout_is_refused_naming_the_option(tmp_path):
    from minicpmo_cg.export import vllm_main

    with pytest.raises(
        ValueError, match="--vllm-omni-checkout .*clone https://github.com/vllm-project/vllm-omni"
    ):
        vllm_main.check_stack(tmp_path, [[]])


def test_a_pr_is_named_by_its_number_once_opened_else_by_its_place_and_branch():
    opened = prtext.PrRef("[Bugfix] First", "01-first", prtext.OMNI_REPO, 101, (1, 2), "cg-01-first")
    vllm = prtext.PrRef("[Core] Mode", "vllm-mode", prtext.VLLM_REPO)
    assert opened.text() == "vllm-project/vllm-omni#101: [Bugfix] First"
    assert vllm.text() == "[Core] Mode (not opened yet: the vLLM pull request `vllm-mode` of the stack)"
    waiting = prtext.PrRef("[Model] T", "02-image-call", prtext.OMNI_REPO, None, (2, 2), "cg-02-image-call")
    assert (
        waiting.text() == "[Model] T (not opened yet: PR 2 of the 2 of the stack, branch `cg-02-image-call`)"
    )
    inp = _inputs([])
    inp.vllm_deps = [("[Core] Mode", "vllm-mode")]
    inp.refs = {
        "01-first": opened,
        "vllm-mode": prtext.PrRef("[Core] Mode", "vllm-mode", prtext.VLLM_REPO, 202),
    }
    text = prtext.omni_pr(inp)
    assert "1. vllm-project/vllm-omni#101: [Bugfix] First\n" in text
    assert "- vllm-project/vllm#202: [Core] Mode\n" in text
    assert "**vLLM Version:** 0.30.0 with the vLLM change (mode, vllm-project/vllm#202)" in text
    vllm_text = prtext.vllm_pr(
        prtext.PrInputs(
            "mode",
            0,
            "[Core] Mode",
            [],
            ["c"],
            "0.30.0",
            "0.30.0",
            needed_by=[("[Model] T", "02-image-call")],
            refs={"02-image-call": waiting},
        )  # fmt: skip
    )
    assert f"- {waiting.text()}\n" in vllm_text


def _stack_of(omni: list[str], vllm: list[str]):
    from types import SimpleNamespace

    return SimpleNamespace(
        omni=[SimpleNamespace(key=k, folder=f"{i:02d}-{k}") for i, k in enumerate(omni, 1)],
        vllm=[SimpleNamespace(key=k, folder=f"vllm-{k}") for k in vllm],
    )


def test_pr_numbers_are_resolved_by_key_or_folder_and_bad_ones_refused_naming_the_option():
    from minicpmo_cg.export import build

    st = _stack_of(["first", "second"], ["mode"])
    given = [("first", 101), ("02-second", 102), ("vllm-mode", 101)]  # vLLM's #101 is another repository's
    assert build.pr_numbers(given, st) == {"01-first": 101, "02-second": 102, "vllm-mode": 101}
    with pytest.raises(
        ValueError,
        match=r"--pr-number thrid=3: no PR of the stack has the key 'thrid' \(keys: first, second, mode\)",
    ):
        build.pr_numbers([("thrid", 3)], st)
    with pytest.raises(ValueError, match="--pr-number first=2: 01-first is already given #1"):
        build.pr_numbers([("first", 1), ("first", 2)], st)
    with pytest.raises(ValueError, match="01-first and 02-second are both given vllm-project/vllm-omni#7"):
        build.pr_numbers([("first", 7), ("second", 7)], st)


def test_a_malformed_pr_number_is_refused_by_the_command_line_naming_the_option(tmp_path, capsys):
    from minicpmo_cg.patchtool import run

    for bad in ("first", "first=x", "first=0", "=5"):
        with pytest.raises(SystemExit) as info:
            run(["export", "--out", str(tmp_path / "pr"), "--pr-number", bad])
        assert info.value.code == 2
        assert f"argument --pr-number: {bad!r} is not KEY=N" in capsys.readouterr().err
    assert not (tmp_path / "pr").exists()


def test_the_export_names_each_opened_pr_by_number_and_the_others_by_place_and_branch(
    tmp_path, current_lane_only
):
    from exportkit import AUTHOR, REPO

    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity

    opts = build.ExportOptions(repo=REPO, out=tmp_path / "pr", author=Identity(AUTHOR), branch="cg",
                               pr_numbers=[("01-siglip-attention", 101), ("capture-error-mode", 202)])  # fmt: skip
    result = build.export(opts)
    first, second = result.prs[:2]
    [vllm] = result.vllm_prs
    text = (opts.out / second.folder / "PR.md").read_text()
    assert f"1. vllm-project/vllm-omni#101: {first.title}\n" in text
    assert f"- vllm-project/vllm#202: {vllm.title}\n" in text
    assert "with the vLLM change (capture error mode, vllm-project/vllm#202)" in text
    vllm_text = (opts.out / vllm.folder / "PR.md").read_text()
    assert (
        f"- {second.title} (not opened yet: PR 2 of the {len(result.prs)} of the stack, branch `cg-{second.folder}`)"
        in vllm_text
    )
    overview = (opts.out / "STACK.md").read_text()
    assert (
        f"| `{first.folder}` | {first.title} | vllm-project/vllm-omni#101 | `cg-{first.folder}` |" in overview
    )
    assert f"| `{second.folder}` | {second.title} | not opened yet | `cg-{second.folder}` |" in overview
    assert f"| `{vllm.folder}` | {vllm.title} | vllm-project/vllm#202 |" in overview
    manifest = json.loads((opts.out / "export.json").read_text())
    assert [(p["number"], p["branch"]) for p in manifest["prs"][:2]] == [
        (101, f"cg-{first.folder}"),
        (None, f"cg-{second.folder}"),
    ]
    assert any(
        w.startswith(f"not numbered: {second.folder}") and "--pr-number KEY=N" in w for w in result.warnings
    )


def test_a_warning_that_ends_a_sentence_gets_no_second_stop_and_accounted_runs_no_deselection_sentence():
    run = prtext.PytestRun(CUDA, "2 passed, 5 deselected, 1 warning", files=OWN_FILES,
                           warnings={"UserWarning (torch/cuda/graphs.py:126): The CUDA Graph is empty.": 1})  # fmt: skip
    [line] = prtext.run_lines([run])
    assert "The CUDA Graph is empty. Deselected: the collected tests that" in line and ".." not in line
    [line] = prtext.run_lines([run], accounted=True)
    assert line.endswith("The CUDA Graph is empty.") and "Deselected" not in line
    # in a PR text, the CPU run's collection accounts for the GPU run's deselected tests too
    text = prtext.omni_pr(_inputs([_cpu_run(), run]))
    assert (
        "Deselected:" not in text
        and "In all, the 7 collected tests: 5 selected by the runs, 2 by none." in text
    )


@pytest.mark.cpu
def test_a_sentence_starting_with_a_code_name_keeps_its_case():
    from minicpmo_cg.export.prtext import sentence_start

    assert sentence_start("get_audio_hidden_states and x sliced") == "`get_audio_hidden_states` and x sliced"
    assert sentence_start("vpm.forward() runs") == "`vpm.forward()` runs"
    assert sentence_start("serving could never") == "Serving could never"
    assert sentence_start("") == ""


def test_a_parametrized_id_that_another_host_builds_differently_is_one_test():
    """Two hosts' pytest may build one case's id differently: the CPU run and the GPU run then
    collect the same test under two ids, and it must neither count twice nor read as selected by
    no run."""

    def collection(case: str, deselect: str) -> Collection:
        tests = {
            f"tests/m/test_path.py::test_kinds[{v}]": ["core_model", "cpu", "parametrize"]
            for v in ("a", case)
        }
        tests |= {"tests/m/test_path.py::test_gpu": ["core_model", "cuda"]}
        return Collection(tests, [n for n, m in tests.items() if deselect in m])

    cpu = prtext.PytestRun(CPU, "2 passed, 1 deselected", files=OWN_FILES[:1],
                           collection=collection('b-expected "x"', "cuda"))  # fmt: skip
    gpu = prtext.PytestRun(CUDA, "1 passed, 2 deselected", environment="on an offline GPU host",
                           files=OWN_FILES[:1], collection=collection("b-expected0", "cpu"))  # fmt: skip
    acc = prtext.account([cpu, gpu])
    assert acc is not None and len(acc.tests) == 3 and acc.unselected == []
    assert "tests/m/test_path.py::test_kinds[b-expected0]" not in acc.tests
    inputs = _inputs([cpu, gpu])
    inputs.test_files = OWN_FILES[:1]
    text = prtext.omni_pr(inputs)
    assert "In all, the 3 collected tests: 3 selected by the runs." in text
    assert "No run selects" not in text.split("The earlier PRs' tests", 1)[0]


def test_a_module_summary_shows_sphinx_roles_as_code():
    assert prtext._plain_roles("Immediate capture: :func:`capture_now` and :mod:`.immediate`.") == (
        "Immediate capture: `capture_now` and `immediate`."
    )
