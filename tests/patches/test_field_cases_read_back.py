# SPDX-License-Identifier: Apache-2.0
"""Six more hostile cases, numbered after ``test_field_cases.py``: the tool trusts nothing it reads back.

8. a path in ``state.json`` outside the packages the series patches (``../x``, absolute,
   a dist-info file, a created directory outside the site, a wheel file "created" by apply);
9. a FIFO where the tool expects a file (``state.json``, a stored original, a target);
10. symbolic links inside the state directory (the directory itself, ``originals/<package>``);
11. I/O errors outside apply/revert's writes (``base --out``, ``index --write``,
    an unusable temporary directory);
12. ``base`` with a path that leaves ``--out``;
13. a ``series`` that is not a regular file, or a package folder of the series that is a file.

Each case requires the documented exit code (2: damaged state, environment, format or I/O
error), a message naming the culprit, no traceback, and an installation (and everything outside
it) left byte-identical. Commands run in-process (``cli.run``) where they cannot hang, in a
subprocess where the defect was a hang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import patchkit
import pytest
from patchkit import (
    COMMANDS,
    HANG_GUARD_S,
    MODEL_REL,
    STATE_DIR,
    edit_record,
    full_tree,
    refused,
    sha,
    sp,
    tool,
)

from minicpmo_cg import resources

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> patchkit.Sites:
    return patchkit.Sites(tmp_path_factory.mktemp("read-back"))


# ---------------------------------------------------------------------------------------------
# 8. paths read back from state.json
# ---------------------------------------------------------------------------------------------


def _claims_created(record: dict, rel: str, data_path: Path) -> None:
    """Record ``rel`` as created by apply with the bytes ``data_path`` holds: revert would delete it."""
    digest = sha(data_path)
    record["files"][rel] = {"original_sha256": None, "written_sha256": digest, "role": "patch"}


@pytest.mark.parametrize("entry", ["parent", "absolute", "dist-info", "wheel-file", "created-dir"])
def test_8_a_path_in_the_journal_outside_the_patched_packages_is_refused_as_damage(sites, capsys, entry):
    site = sites.copy("applied")
    outside = site.parent / f"outside-{entry}"
    outside.mkdir()
    victim = outside / "victim.py"
    victim.write_text("not the tool's\n")
    if entry == "parent":
        rel = os.path.relpath(victim, site)
        assert rel.startswith("..")
    elif entry == "absolute":
        rel = str(victim)
    elif entry == "dist-info":
        (info,) = site.glob("vllm-*.dist-info")
        rel = f"{info.name}/RECORD"
        victim = site / rel
    elif entry == "wheel-file":  # a file pip installed cannot have been absent before apply
        rel = patchkit.INIT_REL
        victim = site / rel
    else:
        rel = os.path.relpath(outside / "emptydir", site)
        (outside / "emptydir").mkdir()
        victim = outside / "emptydir"
    if entry == "created-dir":
        state = edit_record(site, lambda r: r["created_dirs"].append(rel))
    else:
        state = edit_record(site, lambda r: _claims_created(r, rel, victim))
    outside_before = full_tree(outside)
    refused(capsys, site, "damaged", str(state), rel)
    assert victim.exists() and full_tree(outside) == outside_before


def test_8_malformed_hashes_and_roles_in_the_journal_are_damage(sites, capsys):
    site = sites.copy("applied")

    def damage(record: dict) -> None:
        entry = record["files"][MODEL_REL]
        entry["written_sha256"], entry["role"] = "../../etc/passwd", "owner"

    state = edit_record(site, damage)
    refused(capsys, site, "damaged", str(state), MODEL_REL)


# ---------------------------------------------------------------------------------------------
# 9. FIFOs where a file is expected
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["state.json", "stored original", "target"])
def test_9_a_fifo_is_refused_with_a_message_instead_of_hanging(sites, where):
    site = sites.copy("applied")
    path = {
        "state.json": site / STATE_DIR / "state.json",
        "stored original": site / STATE_DIR / "originals" / MODEL_REL,
        "target": site / MODEL_REL,
    }[where]
    path.unlink()
    os.mkfifo(path)
    before = full_tree(site)
    for command in COMMANDS:
        json_report = ["--json"] if command == "status" else []  # the table wraps long paths
        proc = patchkit.cli(command, *sp(site), *json_report, timeout=HANG_GUARD_S)
        text = proc.stdout + proc.stderr
        expected = 1 if where == "stored original" and command in ("check", "apply", "revert") else 2
        if where == "stored original" and command == "status":
            expected = 0  # a damaged stored original is a conflict, reported in the table
        assert proc.returncode == expected, f"{command}: {proc.returncode}\n{text}"
        assert "not a regular file" in text and str(path) in text and "Traceback" not in text, text
    assert full_tree(site) == before


# ---------------------------------------------------------------------------------------------
# 10. symbolic links inside the state directory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", ["applied", "pristine"])
def test_10_a_state_directory_that_is_a_link_is_refused_naming_the_link(sites, capsys, start):
    site = sites.copy(start)
    elsewhere = site.parent / f"elsewhere-{site.name}"
    link = site / STATE_DIR
    if start == "applied":
        shutil.move(link, elsewhere)
    else:
        elsewhere.mkdir()  # an empty directory apply would write into
    link.symlink_to(elsewhere)
    outside = full_tree(elsewhere)
    refused(capsys, site, str(link), "symbolic link")
    assert full_tree(elsewhere) == outside


@pytest.mark.parametrize("start", ["applied", "pristine"])
def test_10_a_linked_directory_among_the_stored_originals_is_refused_naming_the_link(sites, capsys, start):
    site = sites.copy(start)
    package = MODEL_REL.split("/", 1)[0]
    link = site / STATE_DIR / "originals" / package
    elsewhere = site.parent / f"elsewhere-{site.name}"
    if start == "applied":
        shutil.move(link, elsewhere)
    else:  # apply would store the originals through it
        link.parent.mkdir(parents=True)
        elsewhere.mkdir()
    link.symlink_to(elsewhere)
    outside = full_tree(elsewhere)
    refused(capsys, site, str(link), "symbolic link")
    assert full_tree(elsewhere) == outside and link.is_symlink()


# ---------------------------------------------------------------------------------------------
# 11. I/O errors outside apply/revert's writes
# ---------------------------------------------------------------------------------------------


def test_11_base_into_an_out_that_is_a_file_exits_2(sites, capsys):
    site = sites.copy("pristine")
    out = site.parent / f"{site.name}-out"
    out.write_text("a file\n")
    code, text = tool(capsys, "base", MODEL_REL, "--out", str(out), *sp(site))
    assert code == 2 and str(out) in text and "Traceback" not in text, text
    assert out.read_text() == "a file\n"


def test_11_index_write_onto_a_directory_exits_2(tmp_path, capsys):
    patches = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), patches)
    (patches / "INDEX.md").unlink()
    (patches / "INDEX.md").mkdir()
    code, text = tool(capsys, "index", "--write", "--patches-dir", str(patches))
    assert code == 2 and str(patches / "INDEX.md") in text and "Traceback" not in text, text
    assert (patches / "INDEX.md").is_dir()


@pytest.fixture
def unusable_tempdir(tmp_path):
    """The temporary directory the tool's GNU patch runs use, made unusable (a regular file)."""
    broken = tmp_path / "tmpdir-is-a-file"
    broken.write_text("")
    saved, tempfile.tempdir = tempfile.tempdir, str(broken)
    try:
        yield broken
    finally:
        tempfile.tempdir = saved


@pytest.mark.parametrize("start", ["applied", "pristine"])
def test_11_an_unusable_temporary_directory_exits_2_naming_it(sites, capsys, unusable_tempdir, start):
    site = sites.copy(start)
    from minicpmo_cg.patchtool import gnupatch

    gnupatch._RUNS.clear()  # results memoised by earlier tests would need no scratch directory
    refused(capsys, site, str(unusable_tempdir), "TMPDIR")
    code, text = tool(capsys, "base", MODEL_REL, "--out", str(site.parent / f"{site.name}-out"), *sp(site))
    assert code == 2 and "TMPDIR" in text, text


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    probe = subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _strace_works(), reason="strace is missing or may not trace here")
@pytest.mark.parametrize("errno_name", ["ENOSPC", "EACCES"])
def test_11_a_full_or_unwritable_temporary_directory_from_the_kernel_exits_2(sites, errno_name):
    """The kernel refuses every ``mkdir`` (a full or unwritable TMPDIR; the site needs none here)."""
    site = sites.copy("applied")
    before = full_tree(site)
    for command in COMMANDS:
        proc = subprocess.run(
            ["strace", "-qq", "-o", "/dev/null", "-e", "trace=mkdir,mkdirat"]
            + ["-e", f"inject=mkdir,mkdirat:error={errno_name}"]
            + [sys.executable, "-m", "minicpmo_cg.patchtool", command, *sp(site)],
            capture_output=True,
            text=True,
            check=False,
            timeout=HANG_GUARD_S,
        )
        assert proc.returncode == 2, f"{command}: {proc.returncode}\n{proc.stderr}"
        assert "TMPDIR" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert full_tree(site) == before


# ---------------------------------------------------------------------------------------------
# 12. base with a path that leaves --out
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["parent", "absolute", "outside the packages"])
def test_12_base_refuses_a_file_outside_the_patched_packages(sites, capsys, how):
    site = sites.copy("pristine")
    work = site.parent / f"{site.name}-work"
    work.mkdir()
    victim = site.parent / f"{site.name}-victim.py"
    victim.write_text("x = 1\n")
    rel = {
        "parent": os.path.relpath(victim, site),
        "absolute": str(victim),
        "outside the packages": "minicpmo_cg_patch_state/state.json",
    }[how]
    before = full_tree(site)
    code, text = tool(capsys, "base", rel, "--out", str(work), *sp(site))
    assert code == 2 and rel in text and "Traceback" not in text, text
    assert list(work.iterdir()) == [] and full_tree(site) == before and victim.read_text() == "x = 1\n"


# ---------------------------------------------------------------------------------------------
# 13. a series that is not a regular file
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["series is a directory", "series is a FIFO", "folder is a file"])
def test_13_a_series_that_is_not_a_file_is_refused_not_read_as_no_series(sites, tmp_path, what):
    site = sites.copy("applied")
    patches = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), patches)
    series = patches / "vllm-omni" / "series"
    if what == "folder is a file":
        shutil.rmtree(patches / "vllm-omni")
        (patches / "vllm-omni").write_text("")
        named = patches / "vllm-omni"
    else:
        series.unlink()
        series.mkdir() if what == "series is a directory" else os.mkfifo(series)
        named = series
    before = full_tree(site)
    for command in (*COMMANDS, "index"):
        args = ["--patches-dir", str(patches)] + (sp(site) if command != "index" else [])
        proc = patchkit.cli(command, *args, timeout=HANG_GUARD_S)
        assert proc.returncode == 2, f"{command}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
        assert str(named) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert full_tree(site) == before
