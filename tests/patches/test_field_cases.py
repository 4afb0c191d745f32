# SPDX-License-Identifier: Apache-2.0
"""The seven ways a hostile run left an installation stuck or misreported it, one test each.

These drive the command line only (``python -m minicpmo_cg.patchtool``) on copies of the
lane's files, so they judge the tool by what it does to a site. Kills and I/O errors come
from the tool's step hook (``hookrun.py``) and, where ``strace`` can inject faults, from the
kernel's side as well (``strace -e inject=rename...``), which needs no cooperation from
the tool at all.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import patchkit
import pytest
from patchkit import ADAPTER_REL, MODEL_REL, STATE_DIR, WIRING, cli, full_tree, litter, sha

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

HOOKRUN = Path(__file__).with_name("hookrun.py")
RENAMES = "rename,renameat,renameat2"


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    probe = subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True, check=False)
    return probe.returncode == 0


STRACE = pytest.param(
    "strace", marks=pytest.mark.skipif(not _strace_works(), reason="strace is missing or may not trace here")
)


def faulty(mechanism: str, fault: str, nth: int, args: list[str], *, from_on: bool = False):
    """Run the tool with ``fault`` (``kill``, ``EIO``) at its ``nth`` rename (and later, with ``from_on``)."""
    if mechanism == "hook":
        argv = [
            sys.executable,
            str(HOOKRUN),
            fault,
            "rename",
            str(nth),
            *(["--from"] if from_on else []),
            "--",
        ]
    else:
        action = "signal=SIGKILL" if fault == "kill" else f"error={fault}"
        when = f"{nth}+" if from_on else str(nth)
        inject = f"inject={RENAMES}:{action}:when={when}"
        argv = [
            "strace",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            f"trace={RENAMES}",
            "-e",
            inject,
            sys.executable,
            "-m",
        ]
        argv.append("minicpmo_cg.patchtool")
    return subprocess.run([*argv, *args], capture_output=True, text=True, check=False, timeout=300)


def killed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def edited_series(tmp_path: Path) -> Path:
    """The shipped series with one added line of the vllm-omni patch edited (a new revision)."""
    patches = patchkit.custom_patches(tmp_path)
    patchkit.edit_wiring(patches)
    return patches


def copy_site(site: Path, name: str) -> Path:
    target = site.parent / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(site, target, symlinks=True)
    return target


def sp(site: Path, *extra: str) -> list[str]:
    return ["--site-packages", str(site), *extra]


def targets_of(site: Path) -> dict[str, str | None]:
    return patchkit.hashes(site, patchkit.target_rels())


# ---------------------------------------------------------------------------------------------
# 1. a kill during a re-apply
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["hook", STRACE])
def test_1_kill_at_any_rename_of_a_reapply_leaves_a_site_apply_and_revert_finish(
    tmp_site, tmp_path, mechanism
):
    rev2 = edited_series(tmp_path)
    pristine = full_tree(tmp_site)
    reference = copy_site(tmp_site, "reference")
    assert cli("apply", *sp(reference, "--patches-dir", str(rev2))).returncode == 0
    applied2 = full_tree(reference)
    assert cli("apply", *sp(tmp_site)).returncode == 0  # revision 1 applied
    for nth in range(1, 50):
        site = copy_site(tmp_site, "crashed")
        proc = faulty(mechanism, "kill", nth, ["apply", *sp(site, "--patches-dir", str(rev2))])
        if not killed(proc):
            assert proc.returncode == 0 and nth > 1, proc.stderr
            break
        where = f"killed at rename #{nth}"
        assert cli("status", *sp(site, "--patches-dir", str(rev2))).returncode == 0, where
        forward, backward = copy_site(site, "forward"), copy_site(site, "backward")
        proc = cli("apply", *sp(forward, "--patches-dir", str(rev2)))
        assert proc.returncode == 0, f"{where}: {proc.stderr}"
        assert full_tree(forward) == applied2, where
        proc = cli("revert", *sp(backward, "--patches-dir", str(rev2)))
        assert proc.returncode == 0, f"{where}: {proc.stderr}"
        assert full_tree(backward) == pristine, where


# ---------------------------------------------------------------------------------------------
# 2. a revert that cannot delete the stored originals
# ---------------------------------------------------------------------------------------------


def test_2_revert_with_an_unwritable_originals_folder_restores_every_file_and_says_what_is_left(
    tmp_site, tmp_path
):
    prefix = patchkit.unprivileged_prefix(tmp_path)
    if prefix is None:
        pytest.skip("cannot drop the privilege to override file permissions here")
    pristine_files = targets_of(tmp_site)
    pristine = full_tree(tmp_site)
    assert cli("apply", *sp(tmp_site)).returncode == 0
    folder = (tmp_site / STATE_DIR / "originals" / MODEL_REL).parent
    folder.chmod(0o555)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "minicpmo_cg.patchtool", "revert", *sp(tmp_site)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert targets_of(tmp_site) == pristine_files, proc.stdout + proc.stderr  # every file restored
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert str(tmp_site / STATE_DIR) in proc.stdout + proc.stderr  # names what is left behind
        status = cli("status", *sp(tmp_site))
        assert status.returncode == 0, status.stderr
    finally:
        folder.chmod(0o755)
    assert cli("revert", *sp(tmp_site)).returncode == 0
    assert full_tree(tmp_site) == pristine


# ---------------------------------------------------------------------------------------------
# 3. symbolic links
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linked", ["file", "directory"])
def test_3_a_symlinked_target_is_refused_and_left_as_it_is(tmp_site, tmp_path, linked):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_site / (MODEL_REL if linked == "file" else str(Path(MODEL_REL).parent))
    real = elsewhere / link.name
    shutil.move(link, real)
    link.symlink_to(real)
    before, real_before = full_tree(tmp_site), full_tree(elsewhere)
    for command in ("apply", "check"):
        proc = cli(command, *sp(tmp_site))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "symbolic link" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert link.is_symlink() and link.readlink() == real
    assert full_tree(tmp_site) == before and full_tree(elsewhere) == real_before
    proc = cli("status", *sp(tmp_site), "--json")
    assert proc.returncode == 0
    wiring = next(p for p in json.loads(proc.stdout)["patches"] if p["name"] == WIRING)
    assert wiring["state"] == "conflict" and "symbolic link" in wiring["detail"]


def test_3_a_target_replaced_by_a_link_after_apply_blocks_revert(tmp_site, tmp_path):
    assert cli("apply", *sp(tmp_site)).returncode == 0
    model = tmp_site / MODEL_REL
    real = tmp_path / "copy.py"
    shutil.copy2(model, real)
    model.unlink()
    model.symlink_to(real)
    before = full_tree(tmp_site)
    proc = cli("revert", *sp(tmp_site))
    assert proc.returncode == 1 and "symbolic link" in proc.stderr
    assert full_tree(tmp_site) == before and model.is_symlink()


# ---------------------------------------------------------------------------------------------
# 4. revert without a state record
# ---------------------------------------------------------------------------------------------


def test_4_revert_without_a_record_never_half_reverts(tmp_site, tmp_path):
    pristine = full_tree(tmp_site)
    rev2 = edited_series(tmp_path)
    assert cli("apply", *sp(tmp_site, "--patches-dir", str(rev2))).returncode == 0
    shutil.rmtree(tmp_site / STATE_DIR)  # state lost; the files are from another revision of the series
    before = full_tree(tmp_site)
    proc = cli("revert", *sp(tmp_site))
    if proc.returncode == 0:
        assert full_tree(tmp_site) == pristine, "reported success but did not restore every file"
    else:
        assert full_tree(tmp_site) == before, "refused but changed files"
        assert proc.returncode == 1 and MODEL_REL in proc.stderr and "reinstall" in proc.stderr
    # After reinstalling the named file from the wheel, revert finishes.
    (tmp_site / MODEL_REL).write_text(patchkit.SITE_SOURCE[MODEL_REL])
    proc = cli("revert", *sp(tmp_site))
    assert proc.returncode == 0, proc.stderr
    assert targets_of(tmp_site) == {rel: pristine.get(rel) for rel in patchkit.target_rels()}


# ---------------------------------------------------------------------------------------------
# 5. temporary files of a killed run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["hook", STRACE])
def test_5_a_killed_run_leaves_no_litter_after_the_next_run(tmp_site, mechanism):
    reference = copy_site(tmp_site, "reference")
    assert cli("apply", *sp(reference)).returncode == 0
    proc = faulty(mechanism, "kill", 1, ["apply", *sp(tmp_site)])
    assert killed(proc), proc.stderr
    assert litter(tmp_site), "a kill at the first rename leaves its temporary file"
    assert cli("apply", *sp(tmp_site)).returncode == 0
    assert not litter(tmp_site)
    assert full_tree(tmp_site) == full_tree(reference)


# ---------------------------------------------------------------------------------------------
# 6. messages after an I/O error
# ---------------------------------------------------------------------------------------------


def _claims_true(site: Path, pristine: dict, applied: dict, text: str) -> None:
    files = patchkit.target_rels()
    now = targets_of(site)
    if "no file was changed" in text or "every file was restored" in text:
        assert now == {rel: pristine[rel] for rel in files}, f"claims nothing changed: {text}"
    for line in text.splitlines():
        rel, _, state = line.strip().partition(": ")
        if (
            rel in files
            and state
            and set(state.removesuffix(" (absent)").split(" = "))
            <= {
                "pristine",
                "applied",
                "as before this run",
            }
        ):
            claims = set(state.removesuffix(" (absent)").split(" = "))
            assert ("pristine" in claims) == (now[rel] == pristine[rel]), line
            assert ("applied" in claims) == (now[rel] == applied[rel]), line


@pytest.mark.parametrize("mechanism", ["hook", STRACE])
def test_6_after_an_io_error_the_message_tells_each_file_s_true_state(tmp_site, mechanism):
    pristine = targets_of(tmp_site)
    reference = copy_site(tmp_site, "reference")
    assert cli("apply", *sp(reference)).returncode == 0
    applied = targets_of(reference)
    for nth in range(1, 50):
        site = copy_site(tmp_site, "failing")
        proc = faulty(mechanism, "EIO", nth, ["apply", *sp(site)], from_on=True)
        if proc.returncode == 0:
            assert nth > 1
            break
        assert proc.returncode in (2, 3) and "Traceback" not in proc.stderr, (nth, proc.stderr)
        _claims_true(site, pristine, applied, proc.stdout + proc.stderr)
        assert cli("revert", *sp(site)).returncode == 0, nth
        assert targets_of(site) == pristine and not (site / STATE_DIR).exists(), nth


# ---------------------------------------------------------------------------------------------
# 7. exit codes when the report cannot be written
# ---------------------------------------------------------------------------------------------


def _with_stdout(how: str, args: list[str]) -> subprocess.CompletedProcess:
    tool = [sys.executable, "-m", "minicpmo_cg.patchtool", *args]
    if how == "closed":
        return subprocess.run(
            ["sh", "-c", '"$@" >&-', "sh", *tool], capture_output=True, text=True, check=False
        )
    if how == "full":
        with open("/dev/full", "w") as full:
            return subprocess.run(tool, stdout=full, stderr=subprocess.PIPE, text=True, check=False)
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        return subprocess.run(tool, stdout=reader.stdin, stderr=subprocess.PIPE, text=True, check=False)
    finally:
        reader.stdin.close()
        reader.wait()


@pytest.mark.parametrize("how", ["closed", "full", "pipe"])
def test_7_exit_codes_mean_what_help_says_when_stdout_is_closed_or_full(tmp_site, how):
    if how == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    proc = _with_stdout(how, ["apply", *sp(tmp_site)])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sha(tmp_site / ADAPTER_REL) is not None and cli("check", *sp(tmp_site)).returncode == 0
    model = tmp_site / MODEL_REL
    model.write_text(model.read_text() + "# hand edit\n")
    proc = _with_stdout(how, ["check", *sp(tmp_site)])
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
