# SPDX-License-Identifier: Apache-2.0
"""Per-PR overlays of a real export (``stack``) and the per-PR test runs (``stack-run``) on the CPU.

The overlays are built from an export of this checkout against a stand-in bundle archive (the
installed lane's patched ``vllm_omni``), then laid over the installed site-packages as the GPU host
lays them over the unpacked bundle; each result is compared with the PR's tree made independently
(``git apply`` of the PR's series and the earlier ones on the release wheel's ``vllm_omni/``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from minicpmo_cg.export import pytestlog
from minicpmo_cg.offline_gpu import payload, stackrun

REPO = Path(__file__).resolve().parents[2]
AUTHOR = "Stack Test <stack-test@example.com>"
SITE = Path(sysconfig.get_paths()["purelib"])
pytestmark = pytest.mark.cpu


def _lane() -> str | None:
    from minicpmo_cg.patchtool import ToolError, discover_installation

    try:
        return discover_installation(None).lane
    except ToolError:
        return None


def _files(root: Path, under: str) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted((root / under).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``(export dir, export.json, bundle dir, STACK.json, blobs dir)`` for this checkout's export."""
    if _lane() != "current":
        pytest.skip("the export is of the current lane; its vLLM series needs that lane's installation")
    from minicpmo_cg.export import build
    from minicpmo_cg.export.gitseries import Identity
    from minicpmo_cg.offline_gpu import stackbuild

    work = tmp_path_factory.mktemp("stack")
    out = work / "export"
    build.export(build.ExportOptions(repo=REPO, out=out, author=Identity(AUTHOR)))
    # stand-in bundle: the installed (patched) vllm_omni package is what the bundle's site holds
    site = work / "site"
    shutil.copytree(SITE / "vllm_omni", site / "vllm_omni", ignore=shutil.ignore_patterns("__pycache__"))
    lane_dir = work / "bundles" / "current"
    lane_dir.mkdir(parents=True)
    payload.pack(site, lane_dir / payload.ARCHIVE, preset=0)
    archive_sha = payload.file_sha256(lane_dir / payload.ARCHIVE)
    payload.write_manifest(lane_dir, {"lane": "current", "patched": True, "archive_sha256": archive_sha})
    built = stackbuild.build_stack(out, REPO, work / "bundles")
    doc = stackrun.read_stack(built.out)
    blobs = work / "unpacked"
    with tarfile.open(built.out / stackrun.BLOBS) as tf:
        tf.extractall(blobs, filter="data")
    return out, json.loads((out / "export.json").read_text()), work / "bundles", doc, blobs / "blobs", built


def _pr_trees(out: Path, manifest: dict, work: Path) -> dict[str, Path]:
    """Each PR's tree: the wheel's vllm_omni/ with that PR's series and the earlier ones, by git apply."""
    from minicpmo_cg.export import fetch

    wheel = fetch.wheel("vllm-omni", manifest["vllm_omni"])
    tree = fetch.extract_package(wheel, "vllm_omni", work / "tree")
    trees = {}
    for pr in manifest["prs"]:
        for patch in pr["series"]:
            subprocess.run(["git", "apply", str(out / patch)], cwd=tree, check=True)
        trees[pr["folder"]] = shutil.copytree(tree, work / pr["folder"])
    return trees


def test_overlaid_package_is_each_prs_tree(stack, tmp_path: Path) -> None:
    out, manifest, _, doc, blobs, built = stack
    trees = _pr_trees(out, manifest, tmp_path / "trees")
    site_before = _files(SITE, "vllm_omni/model_executor/models/minicpmo_4_5")
    assert [pr["folder"] for pr in doc["prs"]] == [
        pr["folder"] for pr in manifest["prs"] + manifest["vllm_prs"]
    ]
    for pr in doc["prs"]:
        if pr["kind"] != "vllm-omni":
            continue
        dest = tmp_path / "pkgs" / pr["folder"]
        packages = stackrun.overlay_packages(SITE, pr, blobs, dest)
        want = _files(trees[pr["folder"]], "vllm_omni")
        got = _files(dest, "vllm_omni")
        assert sorted(got) == sorted(want), pr["folder"]
        assert [rel for rel in want if got[rel] != want[rel]] == [], pr["folder"]
        assert stackrun.check_package(doc, pr, SITE, dest) == ([], 0)
        # the PR tree's tests, and the tests it runs among them
        assert {rel: hashlib.sha256(blobs.joinpath(d).read_bytes()).hexdigest() for rel, d in pr["tests"].items()} \
            == {rel: hashlib.sha256(data).hexdigest() for rel, data in _files(trees[pr["folder"]], "tests").items()}  # fmt: skip
        assert pr["run"] and set(pr["run"]) <= set(pr["tests"])
        # vLLM: pristine for a PR that needs no vLLM PR, the bundle's otherwise
        if pr["vllm_prs"]:
            assert packages == ["vllm_omni"]
        else:
            assert packages == ["vllm", "vllm_omni"]
            from minicpmo_cg.export.changeset import read_change_set
            from minicpmo_cg.export.vllm_base import pristine_files

            rels = [r for r in pr["overlay"] if r.startswith("vllm/")]
            assert rels, "a PR without a vLLM dependency gets vLLM's pristine files"
            pristine = pristine_files(read_change_set(REPO, "current"), rels, None)
            assert {r: (dest / r).read_bytes() for r in rels} == pristine
            assert all((dest / r).read_bytes() != (SITE / r).read_bytes() for r in rels)
    first = doc["prs"][0]
    assert first["folder"].startswith("01-") and first["vllm_prs"] == []
    # the site itself is untouched by the overlays (hard links are replaced, never written through)
    assert _files(SITE, "vllm_omni/model_executor/models/minicpmo_4_5") == site_before
    # small: it is shipped to the host beside the bundle
    assert built.bytes_total < 2 * payload.MIB


def test_check_package_names_a_file_that_is_not_the_prs(stack, tmp_path: Path) -> None:
    _, _, _, doc, blobs, _ = stack
    pr = doc["prs"][1]
    dest = tmp_path / "pkgs"
    stackrun.overlay_packages(SITE, pr, blobs, dest)
    changed = next(rel for rel, d in pr["overlay"].items() if d and rel.startswith("vllm_omni/"))
    (dest / changed).write_bytes((dest / changed).read_bytes() + b"\n# changed\n")
    # a file PR 02 adds: absent from PR 01's tree
    absent = next(rel for rel, d in doc["prs"][0]["overlay"].items() if d is None and pr["overlay"][rel])
    problems, _ = stackrun.check_package(doc, pr, SITE, dest)
    assert problems == [f"{changed}: differs from the PR's tree"]
    problems, _ = stackrun.check_package(doc, doc["prs"][0], SITE, dest)
    assert f"{absent}: not in the PR's tree" in problems


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="6">
<testcase classname="t" name="ok"/>
<testcase classname="t" name="ok2"/>
<testcase classname="t" name="bad"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="t" name="setup"><error message="fixture broke">x</error></testcase>
<testcase classname="t" name="gpu"><skipped type="pytest.skip" message="needs a CUDA device">f.py:3</skipped></testcase>
<testcase classname="t" name="gpu2"><skipped type="pytest.skip" message="needs a CUDA device">f.py:9</skipped></testcase>
<testcase classname="t" name="known"><skipped type="pytest.xfail" message="known bug"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    counts, reasons = stackrun.junit_counts(path)
    assert counts == {"passed": 2, "failed": 1, "errors": 1, "skipped": 2, "xfailed": 1}
    assert reasons == {"needs a CUDA device": 2}
    assert stackrun.junit_counts(tmp_path / "none.xml")[0]["passed"] == 0


def test_stack_run_on_the_cpu_end_to_end(stack, tmp_path: Path, capsys) -> None:
    """One PR's runs through the command line: overlay, check, pytest on its own tests and on the
    earlier PRs' tests of its tree, junit, summary; the export then reads the summary into that
    PR's runs (and refuses them for another series)."""
    from minicpmo_cg.export.gitseries import series_fingerprint
    from minicpmo_cg.export.gpuresults import gpu_runs, pr_tree_fingerprints
    from minicpmo_cg.offline_gpu.cli import main

    out, manifest, bundles, doc, _, _ = stack
    folder = next(pr["folder"] for pr in manifest["prs"] if pr["key"] == "streaming-audio")
    results = tmp_path / "results"
    argv = ["stack-run", "current", folder.split("-", 1)[0], "--installed-site", str(SITE),
            "--python", sys.executable, "--bundle-dir", str(bundles), "--out", str(results)]  # fmt: skip
    code = main(argv)
    printed = capsys.readouterr().out
    summary = json.loads((results / "stack-current.json").read_text())
    assert [e["folder"] for e in summary["prs"]] == [folder] and summary["version"] == 2
    entry = summary["prs"][0]
    assert code == 0 and entry["status"] == "ok", printed
    own, earlier = entry["runs"]
    index = [pr["folder"] for pr in manifest["prs"]].index(folder)
    assert (own["scope"], earlier["scope"]) == ("own", "earlier")
    assert earlier["files"] == pytestlog.earlier_test_files(manifest["prs"], index) != []
    for run in (own, earlier):
        counts, reasons = stackrun.junit_counts(results / run["junit"])
        assert run["counts"] == counts and run["skip_reasons"] == reasons
        # every test pytest collected is in the record: the selected ones ran, the others were deselected
        assert sum(counts.values()) == len(run["collected"]) - len(run["deselected"]) > 0
    counts, reasons = own["counts"], own["skip_reasons"]
    assert f"{counts['skipped']} skipped" in own["summary"] == entry["summary"]
    assert entry["marks"] == "core_model and cuda" and entry["packages_overlaid"] == ["vllm_omni"]
    assert (results / f"tests-{folder}.log").is_file() and (results / f"tests-{folder}-earlier.log").is_file()
    assert "SUMMARY per-PR runs" in printed
    assert "Python" in summary["environment"] and summary["date"]

    class Pr:
        def __init__(self, pr: dict) -> None:
            self.folder, self.series = pr["folder"], [out / s for s in pr["series"]]
            self.depends, self.vllm = pr.get("depends", []), pr.get("vllm", [])

    prs = [Pr(pr) for pr in [*manifest["prs"], *manifest["vllm_prs"]]]
    assert entry["series_fingerprint"] == series_fingerprint(prs[3].series)
    # the tree the run recorded is the one the export computes: the vLLM PRs, the earlier PRs, this one
    assert entry["tree_fingerprint"] == pr_tree_fingerprints(prs)[folder]
    runs, notes = gpu_runs([results / "stack-current.json"], prs)
    assert list(runs) == [folder]
    run, earlier_run = runs[folder]
    assert (run.marks, run.summary, run.skipped, run.ok) == (entry["marks"], entry["summary"], reasons, True)
    assert (run.scope, earlier_run.scope) == ("own", "earlier") and earlier_run.files == earlier["files"]
    where = "on an offline GPU host" if summary["device"] else "on a machine without a GPU"
    assert where in run.environment and summary["date"] in run.environment
    assert (
        f"{manifest['prs'][0]['folder']}: in no summary given; its Test Result says its GPU tests were not run"
        in notes
    )
    # an earlier PR's code changed: this PR's series is the same, its tree is not
    changed = [Pr(pr) for pr in [*manifest["prs"], *manifest["vllm_prs"]]]
    changed[1].series = changed[1].series[:-1]
    assert series_fingerprint(changed[3].series) == entry["series_fingerprint"]
    runs, notes = gpu_runs([results / "stack-current.json"], changed)
    assert (
        folder not in runs
        and f"{folder}: stack-current.json ran another version of its tree (this PR, an earlier one or a vLLM PR it needs); not used"
        in notes
    )
    # another version of the tree: not used
    summary["prs"][0]["tree_fingerprint"] = "0" * 64
    (results / "other.json").write_text(json.dumps(summary))
    runs, notes = gpu_runs([results / "stack-current.json", results / "other.json"], prs)
    assert (
        runs == {}
        and f"{folder}: other.json ran another version of its tree (this PR, an earlier one or a vLLM PR it needs); not used"
        in notes
    )


def test_release_overlay_is_the_wheel(stack, tmp_path: Path) -> None:
    """``STACK.json``'s release entry turns the bundle's packages back into the release wheel's."""
    from minicpmo_cg.export import fetch

    out, manifest, _, doc, blobs, _ = stack
    release = doc["release"]
    assert release["folder"] == "00-release"
    dest = tmp_path / "pkgs"
    assert stackrun.overlay_packages(SITE, release, blobs, dest) == ["vllm", "vllm_omni"]
    wheel = fetch.wheel("vllm-omni", manifest["vllm_omni"])
    want = _files(fetch.extract_package(wheel, "vllm_omni", tmp_path / "wheel"), "vllm_omni")
    assert _files(dest, "vllm_omni") == want
    assert stackrun.check_package(doc, release, SITE, dest) == ([], 0)


def test_stack_run_figures_on_the_cpu(stack, tmp_path: Path, capsys) -> None:
    """``--figures --no-tests --figures-cpu`` for the first PR: the release's tree and the PR's are
    measured (the logic check), compared, and made into the PR's results section."""
    from minicpmo_cg.bench import tree_report
    from minicpmo_cg.offline_gpu.cli import main

    _, manifest, bundles, _, _, _ = stack
    folder = manifest["prs"][0]["folder"]
    results = tmp_path / "results"
    argv = ["stack-run", "current", folder.split("-", 1)[0], "--installed-site", str(SITE), "--python",
            sys.executable, "--bundle-dir", str(bundles), "--out", str(results), "--figures", "--no-tests",
            "--figures-cpu"]  # fmt: skip
    code = main(argv)
    printed = capsys.readouterr().out
    summary = json.loads((results / "stack-current.json").read_text())
    assert code == 0 and summary["prs"] == [], printed
    assert [(e["folder"], e["status"]) for e in summary["figures"]] == [("00-release", "ok"), (folder, "ok")]
    release = json.loads((results / "figures" / "00-release.json").read_text())
    first = json.loads((results / "figures" / f"{folder}.json").read_text())
    assert release["features"] == dict.fromkeys(("sdpa", "graphs", "startup_capture", "fused_layers"), False)
    assert first["features"]["sdpa"] and not first["features"]["graphs"]
    assert release["build"]["vision_attn"] == "eager" and first["build"]["vision_attn"] == "sdpa"
    # every tree took one block per round, eager rounds first (graphed blocks: nothing on these trees)
    rounds = stackrun.FIGURES_ROUNDS
    for entry in summary["figures"]:
        assert [c for c, _ in entry["blocks"]] == ["eager"] * rounds + ["graphed"] * rounds, entry
    assert (
        len(first["eager"]["audio, 1 s"]["blocks"])
        == rounds
        == len(first["eager"]["duplex session"]["blocks"])
    )
    compare = json.loads((results / "figures" / "compare.json").read_text())
    # contiguous hidden states change no bit of the audio; SDPA changes the image call's rounding
    assert compare[folder]["vs_previous"]["eager/audio, 1 s"] == 0.0
    assert compare[folder]["vs_previous"]["eager/duplex session"] == 0.0
    assert 0.0 < compare[folder]["vs_previous"]["eager/image, 1 slice"] < 1e-3
    assert not list((results / "figures").glob("*.pt"))
    text = tree_report.sections(results)
    key = manifest["prs"][0]["key"]
    assert f"<!-- pr: {key} -->" in text and text.count("| image, 1 slice |") == 1
