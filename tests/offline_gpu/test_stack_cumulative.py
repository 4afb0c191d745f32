# SPDX-License-Identifier: Apache-2.0
"""``stack-run`` on a hand-made stack of three PRs with a stand-in host Python: on each tree the PR's
own tests and the earlier PRs' tests run as separate pytest processes, ``--jobs`` runs several at
once, the summary (version 2) records each run's scope, files, collection and warnings, and the
export reads both that summary and one of version 1 into the PRs' Test Result."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from minicpmo_cg.export import gpuresults, prtext
from minicpmo_cg.export.gitseries import authored_series_fingerprint, series_fingerprint, tree_fingerprint
from minicpmo_cg.offline_gpu import cli, stackrun

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

# Answers `python -m pytest ...` as pytest would for one test per file named: a junit xml, the
# collection plugin's JSON, a warnings summary. It also counts how many of its kind run at once:
# each marks itself running in RUNNING and arrived in ARRIVED (for good), then, until WANT have
# arrived, waits (WANT 1: not at all; at most 30 s, so that a run one at a time cannot hang); how
# many were running then goes to SEEN. `-c` (the host facts) prints a software line.
FAKE_PYTEST = """#!{python}
import json, os, sys, time
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["-c"]:
    print("Python 3.12, torch 2.11, no GPU")
    sys.exit(0)
running = Path({running!r})
running.mkdir(exist_ok=True)
me = running / str(os.getpid())
me.write_text("")
arrived = Path({seen!r} + ".arrived")
arrived.mkdir(exist_ok=True)
(arrived / str(os.getpid())).write_text("")
want = int(Path({want!r}).read_text())
for _ in range(3000):
    if len(list(arrived.iterdir())) >= want:
        break
    time.sleep(0.01)
with open({seen!r}, "a") as f:
    f.write(f"{{len(list(running.iterdir()))}}\\n")
files = [a for a in args if a.endswith(".py")]
junit = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
cases = "".join(f'<testcase classname="t" name="{{Path(f).stem}}"/>' for f in files)
Path(junit).write_text(f'<testsuites><testsuite name="pytest">{{cases}}</testsuite></testsuites>')
collected = {{f"{{f}}::test_it": ["core_model", "cuda"] for f in files}}
Path(os.environ["COLLECTED_MARKS_OUT"]).write_text(json.dumps({{"collected": collected, "deselected": []}}))
print("=" * 20 + " warnings summary " + "=" * 20)
print(files[0] + "::test_it")
print("  /venv/lib/python3.12/site-packages/torch/cuda/graphs.py:126: UserWarning: The CUDA Graph is empty. More.")
print("")
print("-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html")
print(f"{{len(files)}} passed, 1 warning in 0.01s")
me.unlink()
"""


def _series(folder: Path, name: str) -> list[Path]:
    path = folder / f"{name}.patch"
    path.write_text(f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] {name}\n\nbody\n")
    return [path]


@pytest.fixture
def hand_stack(tmp_path: Path) -> tuple[Path, dict[str, list[Path]]]:
    """A bundle dir with ``stack-current/`` for three vllm-omni PRs, one test file each, no
    overlay; the series files each entry's fingerprint is of."""
    folder = tmp_path / "bundles" / "stack-current"
    folder.mkdir(parents=True)
    blobs, entries, series = {}, [], {}
    tests: dict[str, str] = {}
    for n, key in enumerate(("first", "second", "third"), 1):
        rel = f"tests/m/test_{key}.py"
        data = f"def test_it():\n    pass  # {key}\n".encode()
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        tests[rel] = digest
        pr_folder = f"0{n}-{key}"
        series[pr_folder] = _series(tmp_path, pr_folder)
        entries.append({"folder": pr_folder, "title": f"[Model] {key}", "kind": "vllm-omni", "depends": [],
                        "vllm_prs": [], "tree_fingerprint": tree_fingerprint([series_fingerprint(series[pr_folder])]),
                        "overlay": {}, "tests": dict(tests), "run": [rel], "marks": "core_model and cuda"})  # fmt: skip
    with tarfile.open(folder / stackrun.BLOBS, "w:xz") as tf:
        for digest, data in blobs.items():
            info = tarfile.TarInfo(f"blobs/{digest}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    doc = {"lane": "current", "vllm": "0.30.0", "vllm_omni": "0.30.0", "base_files": {}, "markers": ["core_model", "cuda"],
           "bundle": {"archive_sha256": "x"}, "prs": entries}  # fmt: skip
    (folder / stackrun.STACK_FILE).write_text(json.dumps(doc))
    return tmp_path / "bundles", series


def _run(tmp_path: Path, bundles: Path, *extra: str, want: int = 1) -> tuple[int, dict, list[int]]:
    """``stack-run`` with the stand-in; each of its pytest processes waits to see ``want`` running."""
    fake = tmp_path / "fakepython"
    seen = tmp_path / f"seen-{len(list(tmp_path.glob('seen-*')))}"
    (tmp_path / "want").write_text(str(want))
    fake.write_text(FAKE_PYTEST.format(python=sys.executable, running=str(tmp_path / "running"), seen=str(seen),
                                       want=str(tmp_path / "want")))  # fmt: skip
    fake.chmod(0o755)
    out = tmp_path / f"out-{seen.name}"
    argv = ["stack-run", "current", "--installed-site", str(tmp_path / "site"), "--python", str(fake),
            "--bundle-dir", str(bundles), "--out", str(out), *extra]  # fmt: skip
    (tmp_path / "site").mkdir(exist_ok=True)
    code = cli.main(argv)
    counts = [int(line) for line in seen.read_text().split()] if seen.is_file() else []
    return code, json.loads((out / "stack-current.json").read_text()), counts


def test_each_tree_runs_its_own_and_the_earlier_prs_tests_apart(tmp_path: Path, hand_stack) -> None:
    bundles, _ = hand_stack
    code, doc, seen = _run(tmp_path, bundles)
    assert code == 0 and doc["version"] == stackrun.SUMMARY_VERSION == 2 and doc["jobs"] == 1
    runs = {e["folder"]: [(r["scope"], r["files"]) for r in e["runs"]] for e in doc["prs"]}
    assert runs == {
        "01-first": [("own", ["tests/m/test_first.py"])],
        "02-second": [("own", ["tests/m/test_second.py"]), ("earlier", ["tests/m/test_first.py"])],
        "03-third": [("own", ["tests/m/test_third.py"]),
                     ("earlier", ["tests/m/test_first.py", "tests/m/test_second.py"])],
    }  # fmt: skip
    earlier = doc["prs"][2]["runs"][1]
    assert earlier["summary"] == "2 passed, 1 warning" and earlier["counts"]["passed"] == 2
    assert earlier["collected"] == {"tests/m/test_first.py::test_it": ["core_model", "cuda"],
                                    "tests/m/test_second.py::test_it": ["core_model", "cuda"]}  # fmt: skip
    assert earlier["warnings"] == {"UserWarning (torch/cuda/graphs.py:126): The CUDA Graph is empty.": 1}
    assert earlier["log"] == "tests-03-third-earlier.log" and earlier["junit"] == "junit-03-third-earlier.xml"
    assert earlier["time_limit_s"] == stackrun.DEFAULT_EARLIER_TIMEOUT_S
    assert max(seen) == 1  # --jobs 1: one pytest process at a time
    # --own-only: the earlier PRs' tests stay out
    code, doc, _ = _run(tmp_path, bundles, "--own-only")
    assert code == 0 and [[r["scope"] for r in e["runs"]] for e in doc["prs"]] == [["own"]] * 3


def test_jobs_runs_several_pytest_processes_at_once(tmp_path: Path, hand_stack) -> None:
    bundles, _ = hand_stack
    code, doc, seen = _run(tmp_path, bundles, "--jobs", "3", want=2)
    assert code == 0 and doc["jobs"] == 3 and len(seen) == 5
    assert max(seen) >= 2  # processes waited for one another: one at a time, none would have seen two
    # the entries stay in stack order, each with its runs in scope order
    assert [e["folder"] for e in doc["prs"]] == ["01-first", "02-second", "03-third"]
    assert [[r["scope"] for r in e["runs"]] for e in doc["prs"]] == [
        ["own"],
        ["own", "earlier"],
        ["own", "earlier"],
    ]


def test_bad_jobs_and_timeouts_are_refused_naming_the_option(tmp_path: Path, hand_stack, capsys) -> None:
    bundles, _ = hand_stack
    for bad, flag in ((["--jobs", "0"], "--jobs 0"), (["--earlier-timeout", "0"], "--earlier-timeout")):
        with pytest.raises(SystemExit) as info:
            cli.main(["stack-run", "current", "--bundle-dir", str(bundles), "--dry-run", *bad])
        assert info.value.code == 2 and flag in capsys.readouterr().err


class _Pr:
    def __init__(self, folder: str, series: list[Path]) -> None:
        self.folder, self.series = folder, series


def test_the_export_reads_each_run_under_its_scope_with_its_files_and_warnings(
    tmp_path: Path, hand_stack
) -> None:
    bundles, series = hand_stack
    _, doc, _ = _run(tmp_path, bundles, "--jobs", "2")
    summary = next(tmp_path.glob("out-*/stack-current.json"))
    prs = [_Pr(folder, files) for folder, files in series.items()]
    runs, notes = gpuresults.gpu_runs([summary], prs)
    third = runs["03-third"]
    assert [(r.scope, r.files) for r in third] == [
        (prtext.OWN, ["tests/m/test_third.py"]),
        (prtext.EARLIER, ["tests/m/test_first.py", "tests/m/test_second.py"]),
    ]
    assert third[1].command == 'pytest -m "core_model and cuda" tests/m/test_first.py tests/m/test_second.py'
    assert third[1].warnings == {"UserWarning (torch/cuda/graphs.py:126): The CUDA Graph is empty.": 1}
    assert len(third[1].collection.selected) == 2 and "on a machine without a GPU" in third[1].environment
    assert "03-third: the earlier PRs' tests, run of" in "\n".join(notes)
    # a summary of a version this export does not know is refused, naming it
    doc["version"] = 3
    (tmp_path / "v3.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="of version 3; this export reads versions 1, 2"):
        gpuresults.gpu_runs([tmp_path / "v3.json"], prs)


def test_a_version_1_summary_is_read_as_each_prs_own_run_with_the_warnings_of_its_log(tmp_path: Path) -> None:
    series = _series(tmp_path, "02-graphs")
    log = "....\n" + "=" * 10 + " warnings summary " + "=" * 10 + "\ntests/m/test_a.py::test_x\n"
    log += "  /opt/venv/lib/python3.12/site-packages/torch/cuda/__init__.py:1270: UserWarning: Sync debug mode.\n\n"
    log += "-- Docs: https://docs.pytest.org\n2 passed, 1 warning in 3.0s\n"
    (tmp_path / "tests-02-graphs.log").write_text(log)
    entry = {"folder": "02-graphs", "title": "t", "status": "ok", "marks": "core_model and cuda",
             "summary": "2 passed, 1 warning", "counts": {"passed": 2}, "skip_reasons": {}, "kind": "vllm-omni",
             "vllm_prs": ["vllm-x"], "series_fingerprint": authored_series_fingerprint(series), "log": "tests-02-graphs.log",
             "command": ["python3", "-m", "pytest", "-m", "core_model and cuda", "--junitxml=/o/j.xml",
                         "tests/m/test_a.py", "tests/m/test_b.py"]}  # fmt: skip
    doc = {
        "lane": "current",
        "date": "2026-12-02",
        "device": "GPU X",
        "environment": "Python 3.12",
        "prs": [entry],
    }
    (tmp_path / "stack-current.json").write_text(json.dumps(doc))
    runs, _ = gpuresults.gpu_runs([tmp_path / "stack-current.json"], [_Pr("02-graphs", series)])
    [run] = runs["02-graphs"]
    assert run.scope == prtext.OWN and run.files == ["tests/m/test_a.py", "tests/m/test_b.py"]
    assert run.warnings == {"UserWarning (torch/cuda/__init__.py:1270): Sync debug mode.": 1}
    assert run.collection is None and "on an offline GPU host (GPU X)" in run.environment
    # without its log beside it, the text says the warnings are not itemised
    (tmp_path / "tests-02-graphs.log").unlink()
    [run] = gpuresults.gpu_runs([tmp_path / "stack-current.json"], [_Pr("02-graphs", series)])[0]["02-graphs"]
    assert run.warnings_unknown and "not itemised" in prtext.run_lines([run])[0]
