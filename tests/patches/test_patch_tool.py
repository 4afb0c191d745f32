# SPDX-License-Identifier: Apache-2.0
"""``minicpmo-cg-patch`` on the lane packages of the running interpreter and on temp copies of them.

The round trip runs on the real installation (``sys.executable``'s site-packages)
and always ends in the starting state. Conflict, version and format cases run on a
temporary site-packages holding copies of the target files and the two dist-info
directories, passed with ``--site-packages``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# tests/patches is on sys.path: pytest imports this module rootdir-relative, without a package
from patchkit import (
    ADAPTER_PACKAGE_REL,
    ADAPTER_REL,
    GOOD_STATES,
    INIT_REL,
    MODEL_REL,
    OWNED_RELS,
    SITE,
    SITE_SOURCE,
    STATE_DIR,
    WIRING,
    WIRING_LINE_EDITED,
    cli,
    cli_json,
    custom_patches,
    edit_wiring,
    hashes,
    make_patch,
    record_hashes,
    set_version,
    sha,
    target_rels,
    tree,
)

from minicpmo_cg import lanes, patchtool, resources
from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.series import PatchFormatError, load_all_series, load_series, parse_patch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


# ---------------------------------------------------------------------------
# The real installation
# ---------------------------------------------------------------------------


@pytest.fixture
def site_restored(tmp_path):
    """The lane's target files and patch state as they were before the test, put back after it."""
    rels = target_rels()
    start = {rel: (SITE / rel).read_bytes() if (SITE / rel).is_file() else None for rel in rels}
    start_hashes = {rel: None if b is None else hashlib.sha256(b).hexdigest() for rel, b in start.items()}
    state_backup = tmp_path / "state-backup"
    had_state = (SITE / STATE_DIR).exists()
    if had_state:
        shutil.copytree(SITE / STATE_DIR, state_backup)
    _, status = cli_json("status")
    was_applied = (
        all(p["state"] in GOOD_STATES for p in status["patches"])
        and status["adapter"]["state"] == "installed"
    )
    yield rels
    cli("apply" if was_applied else "revert")
    if hashes(SITE, rels) != start_hashes:
        # A partially applied start state: put the exact bytes back.
        for rel, data in start.items():
            if data is None:
                (SITE / rel).unlink(missing_ok=True)
            else:
                fsops.write_file(SITE / rel, data)
        shutil.rmtree(SITE / STATE_DIR, ignore_errors=True)
        if had_state:
            shutil.copytree(state_backup, SITE / STATE_DIR)
    assert {rel: sha(SITE / rel) for rel in rels} == start_hashes


def _revert_to_the_wheel(rels) -> dict:
    """``revert``: every target back to the installed wheel's bytes (RECORD), the adapter gone."""
    wheel = record_hashes(SITE)
    proc = cli("revert")
    assert proc.returncode == 0, proc.stderr
    pristine = hashes(SITE, rels)
    assert pristine[ADAPTER_REL] is None
    for rel, digest in pristine.items():
        if digest is not None:
            assert digest == wheel[rel], f"{rel} differs from the installed wheel after revert"
    return pristine


def _apply_and_check_status(rels, pristine) -> dict:
    """``apply`` from pristine: the wiring patched, the adapter installed, ``status`` agrees."""
    code, report = cli_json("apply")
    assert code == 0, report
    assert (
        report["result"] == "applied" and MODEL_REL in report["changed"] and ADAPTER_REL in report["changed"]
    )
    code, status = cli_json("status")
    assert code == 0
    states = {p["name"]: p["state"] for p in status["patches"]}
    assert states[WIRING] == "applied"
    assert set(states.values()) <= GOOD_STATES, states
    assert status["adapter"]["state"] == "installed" and status["conflicts"] == []
    applied = hashes(SITE, rels)
    assert applied[MODEL_REL] != pristine[MODEL_REL]
    assert applied[ADAPTER_REL] == sha(resources.adapter_source())
    assert {rel: applied[rel] for rel in OWNED_RELS} == {
        rel: sha(path) for rel, path in resources.owned_files().items()
    }
    return applied


def test_round_trip_on_the_installed_lane(site_restored, versions):
    rels = site_restored
    _, status = cli_json("status")
    assert Path(status["site_packages"]) == SITE
    assert status["lane"] == lanes.lane_for_versions(versions["vllm"], versions["vllm-omni"]).name

    pristine = _revert_to_the_wheel(rels)
    applied = _apply_and_check_status(rels, pristine)

    mtimes = {rel: (SITE / rel).stat().st_mtime_ns for rel in rels if (SITE / rel).exists()}
    proc = cli("apply")
    assert proc.returncode == 0 and "nothing to do" in proc.stdout
    assert hashes(SITE, rels) == applied
    assert {rel: (SITE / rel).stat().st_mtime_ns for rel in mtimes} == mtimes  # not even rewritten
    code, check = cli_json("check")
    assert code == 0 and check["ok"]

    code, report = cli_json("revert")
    assert code == 0 and report["result"] == "reverted"
    assert hashes(SITE, rels) == pristine
    assert not (SITE / ADAPTER_PACKAGE_REL).exists()  # the package directory apply created, caches and all
    assert not (SITE / STATE_DIR).exists()
    proc = cli("revert")
    assert proc.returncode == 0 and "nothing to revert" in proc.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "minicpmo-cg-patch"
    assert script.exists()
    proc = subprocess.run([str(script), "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "apply" in proc.stdout and "--site-packages" in proc.stdout


def test_discovery_does_not_import_vllm():
    code = (
        "import sys; from minicpmo_cg import patchtool; inst = patchtool.discover_installation(); "
        "print(inst.lane, 'vllm' in sys.modules, 'vllm_omni' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lane, vllm_imported, omni_imported = proc.stdout.split()
    assert lane in ("current", "legacy") and vllm_imported == omni_imported == "False"


# ---------------------------------------------------------------------------
# Temp site: conflicts, hand edits, versions
# ---------------------------------------------------------------------------


def test_status_json_on_pristine_copy(tmp_site, versions):
    code, report = cli_json("status", "--site-packages", str(tmp_site))
    assert code == 0
    assert report["versions"] == versions
    assert report["lane"] == lanes.lane_for_versions(versions["vllm"], versions["vllm-omni"]).name
    assert Path(report["site_packages"]) == tmp_site.resolve()
    assert report["state_dir"] == str(tmp_site.resolve() / STATE_DIR)
    assert report["patch_program"].startswith("GNU patch")
    wiring = next(p for p in report["patches"] if p["name"] == WIRING)
    assert wiring == {**wiring, "package": "vllm-omni", "state": "pending", "files": [MODEL_REL]}
    assert report["adapter"] == {**report["adapter"], "path": ADAPTER_REL, "state": "missing"}
    shipped = {p.name: p for p in load_all_series(resources.patches_dir())}
    for patch in report["patches"]:
        assert patch["state"] in patchtool.PATCH_STATES
        if patch["package"] == "vllm":
            # a pristine copy: upstream where Upstream-Since holds (0001-0006 on 0.30.0), else
            # pending on the versions in Targets (0001-0006 on 0.28.0, 0007 on both), n/a elsewhere
            parsed = shipped[patch["name"]]
            since = parsed.upstream_since
            if since is not None and since.reached(versions[since.package]):
                expected = "upstream"
            else:
                expected = "pending" if parsed.targets_version(versions["vllm"]) else "n/a"
            assert patch["state"] == expected, patch
    assert report["conflicts"] == [] and report["changed"] == []


def test_check_exit_codes_and_check_writes_nothing(tmp_site):
    before = tree(tmp_site)
    proc = cli("check", "--site-packages", str(tmp_site))
    assert proc.returncode == 0 and "would apply" in proc.stdout
    assert tree(tmp_site) == before

    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    proc = cli("check", "--site-packages", str(tmp_site))
    assert proc.returncode == 0 and "nothing to apply" in proc.stdout

    assert cli("revert", "--site-packages", str(tmp_site)).returncode == 0
    model = tmp_site / MODEL_REL
    model.write_text(
        model.read_text().replace("selects_final_layer = self.audio_encoder_layer == -1", "x = 1")
    )
    before = tree(tmp_site)
    proc = cli("check", "--site-packages", str(tmp_site))
    assert proc.returncode == 1 and "conflict" in proc.stdout
    assert tree(tmp_site) == before


def test_conflict_leaves_every_file_unchanged(tmp_site, tmp_path):
    # A second, independent pending patch on another file: it must not be written either.
    extra = make_patch(
        tmp_path / "0002-extra.patch",
        INIT_REL,
        next(
            line for line in SITE_SOURCE[INIT_REL].splitlines() if line.strip() and not line.startswith("#")
        ),
        "# extra test line",
        targets="vllm-omni==0.30.0, vllm-omni==0.28.0",
    )
    patches = custom_patches(tmp_path, ("0002-extra.patch", extra))
    model = tmp_site / MODEL_REL
    model.write_text(
        model.read_text().replace("    def get_audio_hidden_states(self", "    def get_audio_states(self")
    )
    before = tree(tmp_site)

    proc = cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(patches), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    states = {p["name"]: p for p in report["patches"]}
    assert states[WIRING]["state"] == "conflict" and "does not apply" in states[WIRING]["detail"]
    assert "FAILED" in states[WIRING]["detail"]
    assert states["vllm-omni/0002-extra.patch"]["state"] == "pending"
    assert report["changed"] == [] and report["conflicts"]
    assert "no file was changed" in proc.stderr and "Traceback" not in proc.stderr
    assert tree(tmp_site) == before
    assert not (tmp_site / ADAPTER_REL).exists() and not (tmp_site / STATE_DIR).exists()

    # Without the conflict both patches apply together, and revert takes both back.
    model.write_text(SITE_SOURCE[MODEL_REL])
    assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(patches)).returncode == 0
    assert "# extra test line" in (tmp_site / INIT_REL).read_text()
    assert cli("revert", "--site-packages", str(tmp_site), "--patches-dir", str(patches)).returncode == 0
    assert (tmp_site / INIT_REL).read_text() == SITE_SOURCE[INIT_REL]


def test_hand_modified_after_apply_refuses_revert_and_apply(tmp_site):
    pristine = tree(tmp_site)
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    model = tmp_site / MODEL_REL
    applied_text = model.read_text()
    model.write_text(applied_text + "# hand edit\n")
    before = tree(tmp_site)

    proc = cli("revert", "--site-packages", str(tmp_site))
    assert proc.returncode == 1
    assert "modified after apply" in proc.stderr and "revert refused" in proc.stderr
    assert tree(tmp_site) == before
    proc = cli("apply", "--site-packages", str(tmp_site))
    assert proc.returncode == 1 and "conflict" in proc.stdout
    assert tree(tmp_site) == before
    code, status = cli_json("status", "--site-packages", str(tmp_site))
    assert code == 0 and next(p for p in status["patches"] if p["name"] == WIRING)["state"] == "conflict"

    model.write_text(applied_text)
    assert cli("revert", "--site-packages", str(tmp_site)).returncode == 0
    assert tree(tmp_site) == pristine


def test_hand_modified_adapter_refuses_revert(tmp_site):
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    adapter = tmp_site / ADAPTER_REL
    adapter.write_text(adapter.read_text() + "# local tweak\n")
    before = tree(tmp_site)
    proc = cli("revert", "--site-packages", str(tmp_site), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["adapter"]["state"] == "conflict" and any(ADAPTER_REL in c for c in report["conflicts"])
    assert tree(tmp_site) == before


def test_byte_identical_revert_restores_mode_and_bytes(tmp_site):
    model = tmp_site / MODEL_REL
    os.chmod(model, 0o640)
    pristine = tree(tmp_site)
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    assert (model.stat().st_mode & 0o777) == 0o640
    stored = tmp_site / STATE_DIR / "originals" / MODEL_REL
    assert stored.read_text() == SITE_SOURCE[MODEL_REL]
    state = json.loads((tmp_site / STATE_DIR / "state.json").read_text())
    assert state["files"][MODEL_REL]["original_sha256"] == pristine[MODEL_REL]
    assert state["files"][MODEL_REL]["written_sha256"] == sha(model)
    assert state["files"][ADAPTER_REL]["original_sha256"] is None
    assert cli("revert", "--site-packages", str(tmp_site)).returncode == 0
    assert tree(tmp_site) == pristine
    assert (model.stat().st_mode & 0o777) == 0o640


def test_edited_patch_is_reapplied_from_the_original(tmp_site, tmp_path):
    patches = custom_patches(tmp_path)
    assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(patches)).returncode == 0
    edit_wiring(patches)
    code, status = cli_json("status", "--site-packages", str(tmp_site), "--patches-dir", str(patches))
    assert code == 0
    entry = next(p for p in status["patches"] if p["name"] == WIRING)
    assert entry["state"] == "pending" and "older revision" in entry["detail"]
    assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(patches)).returncode == 0
    assert WIRING_LINE_EDITED in (tmp_site / MODEL_REL).read_text()
    assert cli("revert", "--site-packages", str(tmp_site), "--patches-dir", str(patches)).returncode == 0
    assert (tmp_site / MODEL_REL).read_text() == SITE_SOURCE[MODEL_REL]


def test_reinstalled_package_makes_the_record_stale(tmp_site):
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    # pip reinstall: pristine file back, adapter gone, state dir left behind
    (tmp_site / MODEL_REL).write_text(SITE_SOURCE[MODEL_REL])
    (tmp_site / ADAPTER_REL).unlink()
    code, status = cli_json("status", "--site-packages", str(tmp_site))
    assert code == 0
    assert next(p for p in status["patches"] if p["name"] == WIRING)["state"] == "pending"
    assert status["adapter"]["state"] == "missing" and status["conflicts"] == []
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    assert cli("revert", "--site-packages", str(tmp_site)).returncode == 0
    assert (tmp_site / MODEL_REL).read_text() == SITE_SOURCE[MODEL_REL]


def test_applied_without_a_record_is_reported_and_reverted(tmp_site):
    pristine = tree(tmp_site)
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    shutil.rmtree(tmp_site / STATE_DIR)  # state lost
    code, status = cli_json("status", "--site-packages", str(tmp_site))
    assert code == 0
    entry = next(p for p in status["patches"] if p["name"] == WIRING)
    assert entry["state"] == "applied" and "without a state record" in entry["detail"]
    assert cli("revert", "--site-packages", str(tmp_site)).returncode == 0
    assert tree(tmp_site) == pristine


def test_write_error_rolls_back_every_file(tmp_site):
    pristine = tree(tmp_site)
    calls = []

    def failing(step, path):  # the second file write fails (as the second atomic write did)
        if step == "tmp-create":
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")

    fsops.set_hook(failing)
    try:
        code = patchtool.run(["apply", "--site-packages", str(tmp_site)])
    finally:
        fsops.set_hook(None)
    assert code == 2 and len(calls) >= 2
    assert tree(tmp_site) == pristine


@pytest.mark.parametrize(
    "dist_glob, version, named",
    [
        ("vllm_omni-*.dist-info", "0.29.0", "vllm-omni 0.29.0"),
        ("vllm-*.dist-info", "0.33.0", "vllm 0.33.0"),
        ("vllm_omni-*.dist-info", "banana", "vllm-omni banana"),
    ],
)
def test_unsupported_version_pair_exits_2(tmp_site, dist_glob, version, named):
    set_version(tmp_site, dist_glob, version)
    before = tree(tmp_site)
    for command in ("status", "apply", "revert"):
        proc = cli(command, "--site-packages", str(tmp_site))
        assert proc.returncode == 2, command
        assert named in proc.stderr and "0.30.0" in proc.stderr and "0.28.0" in proc.stderr
        assert "Supported pairs" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1  # one paragraph
    code, report = cli_json("apply", "--site-packages", str(tmp_site))
    assert code == 2 and report["ok"] is False and named in report["error"]
    assert tree(tmp_site) == before


def test_missing_package_exits_2(tmp_site):
    for info in tmp_site.glob("vllm_omni-*.dist-info"):
        shutil.rmtree(info)
    proc = cli("status", "--site-packages", str(tmp_site))
    assert proc.returncode == 2
    assert "vllm-omni (not installed)" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_gnu_patch_exits_2(tmp_site, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = cli("check", "--site-packages", str(tmp_site), env={**os.environ, "PATH": str(empty)})
    assert proc.returncode == 2 and "GNU patch" in proc.stderr and "Traceback" not in proc.stderr


def test_upstream_since_and_probe(tmp_site, tmp_path, versions):
    omni = versions["vllm-omni"]
    # a line (and context) the shipped series leaves alone, so the extra patches stack on top of it
    line = "    def get_audio_embedding_streaming("
    cases = {
        "0002-upstream.patch": (
            f"Upstream-Since: vllm-omni=={omni}\nUpstream-Probe: ^    def get_audio_embedding_streaming\\(\n",
            "upstream",
        ),
        "0003-probe-miss.patch": (
            f"Upstream-Since: vllm-omni=={omni}\nUpstream-Probe: ^def no_such_function\n",
            "conflict",
        ),
        "0004-not-yet.patch": ("Upstream-Since: vllm-omni==99.0\n", "pending"),
        "0005-other-version.patch": ("", "n/a"),
    }
    extra = []
    for name, (header, _) in cases.items():
        targets = "vllm-omni==0.26.0" if name.startswith("0005") else f"vllm-omni=={omni}"
        extra.append(
            (
                name,
                make_patch(
                    tmp_path / name, MODEL_REL, line, line + "  # x", targets=targets, extra_header=header
                ),
            )
        )
    patches = custom_patches(tmp_path, *extra)
    code, report = cli_json("check", "--site-packages", str(tmp_site), "--patches-dir", str(patches))
    states = {p["name"].split("/")[1]: p for p in report["patches"]}
    for name, (_, expected) in cases.items():
        assert states[name]["state"] == expected, (name, states[name])
    assert "Upstream-Probe" in states["0003-probe-miss.patch"]["detail"]
    assert code == 1  # the probe miss is a conflict


# ---------------------------------------------------------------------------
# Series / header parsing
# ---------------------------------------------------------------------------

DIFF = """--- a/vllm_omni/x.py
+++ b/vllm_omni/x.py
@@ -1,3 +1,4 @@
 a
+b
 c
 d
"""
HEADER = {
    "Subject": "s",
    "Why": "w",
    "Origin": "o",
    "Upstream": "none",
    "Targets": "vllm-omni==0.30.0",
    "Drop-When": "d",
}


def write(tmp_path: Path, fields: dict, diff: str = DIFF, name: str = "0001-t.patch") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + "---\n" + diff)
    return path


def test_parse_valid_patch(tmp_path):
    fields = {
        **HEADER,
        "Why": "first line\n  second line",
        "Upstream-Since": "vllm==0.30.0",
        "Upstream-Probe": r"^class X\(",
        "Targets": "vllm-omni==0.30.0, vllm_omni==0.28.0",
    }
    patch = parse_patch(write(tmp_path, fields), "vllm-omni")
    assert patch.why == "first line second line"
    assert [str(t) for t in patch.targets] == ["vllm-omni==0.30.0", "vllm-omni==0.28.0"]
    assert patch.targets_version("0.28.0") and not patch.targets_version("0.29.0")
    since = patch.upstream_since
    assert str(since) == "vllm==0.30.0"
    assert since.reached("0.30.0") and since.reached("0.33.0") and since.reached("0.30.0+cu130")
    assert not since.reached("0.28.0") and not since.reached("0.30.0rc1")
    assert patch.upstream_probe.search("class X(Y):")
    assert patch.file_paths == ("vllm_omni/x.py",) and patch.name == "vllm-omni/0001-t.patch"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.pop("Subject"), "missing required header field(s): Subject"),
        (lambda f: f.pop("Drop-When"), "Drop-When"),
        (lambda f: f.update(Subject=""), "'Subject' is empty"),
        (lambda f: f.update({"Signed-off-by": "x"}), "unknown header field 'Signed-off-by'"),
        (lambda f: f.update(Subject="a\n  b"), "Subject: must be a single line"),
        (lambda f: f.update(Targets="vllm==0.30.0"), "names vllm, but the patch is in the vllm-omni/ folder"),
        (lambda f: f.update(Targets="vllm-omni>=0.30.0"), "must name exact versions"),
        (lambda f: f.update(Targets="vllm-omni 0.30.0"), "is not 'package==version'"),
        (lambda f: f.update(Targets="torch==2.13.0"), "unknown package 'torch'"),
        (lambda f: f.update({"Upstream-Probe": "x"}), "Upstream-Probe needs Upstream-Since"),
        (lambda f: f.update({"Upstream-Since": "vllm==0.30.0", "Upstream-Probe": "("}), "not a valid regex"),
    ],
)
def test_header_errors_name_the_file(tmp_path, mutate, message):
    fields = dict(HEADER)
    mutate(fields)
    path = write(tmp_path, fields)
    with pytest.raises(PatchFormatError) as info:
        parse_patch(path, "vllm-omni")
    assert str(path) in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("Subject: s\nWhy: w\n", "no line '---' ends the header"),
        ("Subject: s\n\nWhy: w\n---\n" + DIFF, "blank line inside the header"),
        ("Subject: s\nSubject: t\n---\n" + DIFF, "duplicate header field 'Subject'"),
        ("  Why: w\n---\n" + DIFF, "continuation line before any header field"),
        ("From 1234 Mon Sep 17 00:00:00 2001\n---\n" + DIFF, "expected 'Field: value'"),
    ],
)
def test_header_structure_errors(tmp_path, text, message):
    path = tmp_path / "bad.patch"
    path.write_text(text)
    with pytest.raises(PatchFormatError, match="line|---") as info:
        parse_patch(path, "vllm-omni")
    assert message in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "diff, message",
    [
        ("", "no unified diff"),
        (DIFF.replace("a/vllm_omni/x.py", "a/vllm/x.py"), "outside vllm_omni/"),
        (DIFF.replace("a/vllm_omni/x.py", "vllm_omni/x.py"), "must start with 'a/'"),
        (DIFF.replace("a/vllm_omni/x.py", "a/vllm_omni/../x.py"), "unsafe or malformed"),
        (DIFF.replace("b/vllm_omni/x.py", "b/vllm_omni/y.py"), "renames are not supported"),
        (DIFF.replace("@@ -1,3 +1,4 @@", "@@ -1,3 +1,5 @@"), "hunk ends early"),
        (DIFF.replace("@@ -1,3 +1,4 @@", "@@ -1,2 +1,4 @@"), "do not match"),
        (DIFF + DIFF, "appears twice in one patch"),
        (DIFF.replace("@@ -1,3 +1,4 @@\n", ""), "has no hunk"),
        ("diff --git a/vllm_omni/x.py b/vllm_omni/x.py\nold mode 100644\n", "unsupported diff feature"),
    ],
)
def test_diff_errors(tmp_path, diff, message):
    path = write(tmp_path, HEADER, diff)
    with pytest.raises(PatchFormatError) as info:
        parse_patch(path, "vllm-omni")
    assert message in str(info.value) and str(path) in str(info.value)


def test_series_errors(tmp_path):
    folder = tmp_path / "vllm-omni"
    folder.mkdir()
    assert load_series(folder) == []  # no series file: no patches
    write(folder, HEADER)
    (folder / "series").write_text("# comment\n\n0001-t.patch  # trailing comment\n")
    assert [p.name for p in load_series(folder)] == ["vllm-omni/0001-t.patch"]
    (folder / "series").write_text("0001-t.patch\n0001-t.patch\n")
    with pytest.raises(PatchFormatError, match="listed twice"):
        load_series(folder)
    (folder / "series").write_text("0002-missing.patch\n")
    with pytest.raises(PatchFormatError, match="0002-missing.patch does not exist"):
        load_series(folder)
    (folder / "series").write_text("../0001-t.patch\n")
    with pytest.raises(PatchFormatError, match="not a plain file name"):
        load_series(folder)
    (folder / "series").write_text("0001-t.patch\n")
    other = tmp_path / "torch"
    other.mkdir()
    (other / "series").write_text("")
    with pytest.raises(PatchFormatError, match="unknown patch folder"):
        load_all_series(tmp_path)


def test_shipped_series_parses_and_targets_both_lanes():
    patches = load_all_series(resources.patches_dir())
    wiring = next(p for p in patches if p.name == WIRING)
    assert wiring.targets_version("0.30.0") and wiring.targets_version("0.28.0")
    assert wiring.upstream.lower() == "none" and wiring.upstream_since is None
    assert wiring.file_paths == (MODEL_REL,)


def test_bad_patch_via_cli_exits_2_naming_the_file(tmp_site, tmp_path):
    patches = custom_patches(tmp_path)
    wiring = patches / WIRING
    wiring.write_text(wiring.read_text().replace("Drop-When:", "Drop-Whenever:", 1))
    proc = cli("status", "--site-packages", str(tmp_site), "--patches-dir", str(patches))
    assert proc.returncode == 2
    assert str(wiring) in proc.stderr and "Drop-Whenever" in proc.stderr and "Traceback" not in proc.stderr


def test_usage_error_names_the_option():
    proc = cli("apply", "--sitepackages", "/tmp")
    assert proc.returncode == 2 and "--sitepackages" in proc.stderr
    proc = cli("frobnicate")
    assert proc.returncode == 2 and "frobnicate" in proc.stderr
