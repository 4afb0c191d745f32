# SPDX-License-Identifier: Apache-2.0
"""Fault injection: a kill or an I/O error at every file-writing step of apply, re-apply and revert.

Each scenario starts from a copy of the lane's files (pristine, or applied with the shipped
series), runs one command with a fault injected through the tool's file-writing layer
(:func:`minicpmo_cg.patchtool.fsops.set_hook`) at step k, for every k, and then requires:

- ``status`` still describes the site (exit 0);
- from that state, ``apply`` leaves the site byte-identical (every file, directory and the
  state directory) to a clean apply, and ``revert`` byte-identical to the pristine copy;
- an I/O error that the command reports as rolled back (exit 2) changed nothing at all,
  and every file state the message lists is what the disk holds.

The owned tree used here has an extra module in a new sub-package, so directory creation
and removal are among the steps.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import patchkit
import pytest
from patchkit import STATE_DIR, full_tree, litter

from minicpmo_cg import resources
from minicpmo_cg.patchtool import cli, fsops

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

EXTRA_PKG = "vllm_omni/model_executor/models/minicpmo_4_5/cg_test_extra"


class World:
    """The sites and series of one lane's scenarios, built once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pristine = patchkit.make_site(root, "pristine")
        self.owned = root / "owned"
        shutil.copytree(resources.owned_root() / "vllm_omni", self.owned / "vllm_omni")
        (self.owned / EXTRA_PKG).mkdir(parents=True)
        (self.owned / EXTRA_PKG / "__init__.py").write_text('"""test-only owned sub-package"""\n')
        (self.owned / EXTRA_PKG / "helpers.py").write_text("VALUE = 1\n")
        self.rev1 = root / "rev1"
        shutil.copytree(resources.patches_dir(), self.rev1)
        self.rev2 = root / "rev2"
        shutil.copytree(resources.patches_dir(), self.rev2)
        patchkit.edit_wiring(self.rev2)
        self.applied1 = self.copy(self.pristine, "applied1")
        assert self.run("apply", self.applied1, self.rev1) == 0
        applied2 = self.copy(self.pristine, "applied2")
        assert self.run("apply", applied2, self.rev2) == 0
        self.trees = {
            "pristine": full_tree(self.pristine),
            "rev1": full_tree(self.applied1),
            "rev2": full_tree(applied2),
        }
        assert self.trees["rev1"] != self.trees["rev2"] != self.trees["pristine"]

    def copy(self, site: Path, name: str) -> Path:
        target = self.root / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(site, target, symlinks=True)
        return target

    def run(self, command: str, site: Path, patches: Path, hook=None) -> int:
        fsops.set_hook(hook)
        try:
            return cli.run(
                [
                    command,
                    "--site-packages",
                    str(site),
                    "--patches-dir",
                    str(patches),
                    "--owned-dir",
                    str(self.owned),
                ]
            )
        finally:
            fsops.set_hook(None)


#: name -> (command, start site attribute, series attribute, tree after a clean apply of that series)
SCENARIOS = {
    "apply": ("apply", "pristine", "rev1", "rev1"),
    "re-apply": ("apply", "applied1", "rev2", "rev2"),
    "revert": ("revert", "applied1", "rev1", "rev1"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """The scenarios' sites, on a RAM-backed directory when the machine has one (fsync-heavy work)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="minicpmo-cg-crash-", dir=shm))
        saved, tempfile.tempdir = tempfile.tempdir, str(root)  # GNU patch's scratch trees too
        try:
            yield World(root)
        finally:
            tempfile.tempdir = saved
            shutil.rmtree(root, ignore_errors=True)
    else:
        yield World(tmp_path_factory.mktemp("crash"))


def _steps(world: World, scenario: str) -> list[tuple[str, str]]:
    command, start, series, _ = SCENARIOS[scenario]
    site = world.copy(getattr(world, start), "count")
    steps: list[tuple[str, str]] = []
    assert (
        world.run(command, site, getattr(world, series), lambda step, path: steps.append((step, str(path))))
        == 0
    )
    return steps


def _recovers(world: World, crashed: Path, scenario: str, where: str) -> None:
    """From ``crashed``, status describes it, apply finishes and revert undoes, byte-identically."""
    _, _, series, applied = SCENARIOS[scenario]
    patches = getattr(world, series)
    assert world.run("status", crashed, patches) == 0, where
    forward = world.copy(crashed, "forward")
    assert world.run("apply", forward, patches) == 0, where
    assert full_tree(forward) == world.trees[applied], f"apply after {where}"
    backward = world.copy(crashed, "backward")
    assert world.run("revert", backward, patches) == 0, where
    assert full_tree(backward) == world.trees["pristine"], f"revert after {where}"
    assert not litter(forward) and not litter(backward)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kill_at_every_step_recovers(world, scenario):
    command, start, series, _ = SCENARIOS[scenario]
    steps = _steps(world, scenario)
    kinds = {step for step, _ in steps}
    assert {"tmp-create", "tmp-write", "rename"} <= kinds, kinds
    if scenario != "re-apply":
        assert {"mkdir", "rmdir"} & kinds, kinds  # the extra owned sub-package comes and goes
    for k, (step, path) in enumerate(steps, start=1):
        site = world.copy(getattr(world, start), "crashed")
        calls = 0

        def kill(name, _path, k=k):
            nonlocal calls
            calls += 1
            if calls == k:
                raise fsops.SimulatedKill(f"killed at step {k}")

        with pytest.raises(fsops.SimulatedKill):
            world.run(command, site, getattr(world, series), kill)
        _recovers(world, site, scenario, f"a kill before step {k}/{len(steps)} ({step} {path})")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_io_error_at_every_step_is_rolled_back_or_recoverable(world, scenario, capsys):
    command, start, series, _ = SCENARIOS[scenario]
    steps = _steps(world, scenario)
    for k, (step, path) in enumerate(steps, start=1):
        site = world.copy(getattr(world, start), "failed")
        before = full_tree(site)
        calls = 0

        def fail(name, _path, k=k):
            nonlocal calls
            calls += 1
            if calls == k:
                raise OSError(errno.EIO, "injected", str(_path))

        capsys.readouterr()
        result = world.run(command, site, getattr(world, series), fail)
        where = f"EIO at step {k}/{len(steps)} ({step} {path})"
        out, err = capsys.readouterr()
        assert result in (0, 2, 3), where
        assert "Traceback" not in out + err, where
        if result == 2:
            assert full_tree(site) == before, f"{where}: reported as rolled back"
            assert "rolled back: no file was changed" in err, where
        if result == 3:
            assert "stopped part-way" in err or "could not be removed" in err, where
        _recovers(world, site, scenario, where)


def test_persistent_io_errors_never_report_a_false_state(world, capsys):
    """From the n-th rename on, every rename fails, so the roll-back fails too: the listed states are true."""
    steps = [s for s in _steps(world, "apply") if s[0] == "rename"]
    for k in range(1, len(steps) + 1):
        site = world.copy(world.pristine, "stuck")
        seen = 0

        def fail(name, path, k=k):
            nonlocal seen
            if name == "rename":
                seen += 1
                if seen >= k:
                    raise OSError(errno.EIO, "injected", str(path))

        capsys.readouterr()
        result = world.run("apply", site, world.rev1, fail)
        err = capsys.readouterr().err
        assert result in (2, 3), k
        listed = [line.strip() for line in err.splitlines() if line.startswith("  ") and ": " in line]
        assert listed, err
        for line in listed:
            rel, state = line.split(": ", 1)
            on_disk = patchkit.sha(site / rel)
            pristine = patchkit.sha(world.pristine / rel)
            applied = patchkit.sha(world.applied1 / rel)
            claims = set(state.removesuffix(" (absent)").split(" = "))
            assert ("pristine" in claims) == (on_disk == pristine), (k, line)
            assert ("applied" in claims) == (on_disk == applied), (k, line)
        _recovers(world, site, "apply", f"renames failing from the {k}-th on")


def test_litter_of_a_killed_run_is_removed_by_the_next_run(world):
    site = world.copy(world.pristine, "littered")
    renames = 0

    def kill_at_third_rename(name, path):
        nonlocal renames
        renames += name == "rename"
        if renames == 3:
            raise fsops.SimulatedKill("killed before a rename")

    with pytest.raises(fsops.SimulatedKill):
        world.run("apply", site, world.rev1, kill_at_third_rename)
    assert litter(site), "the kill before a rename leaves the temporary file"
    assert world.run("status", site, world.rev1) == 0
    assert litter(site), "status writes nothing"
    assert world.run("apply", site, world.rev1) == 0
    assert not litter(site)
    assert full_tree(site) == world.trees["rev1"]


def test_revert_deletes_originals_only_after_the_commit(world):
    """Fail every unlink under the state directory: the files are pristine, the record is gone, exit 3."""
    site = world.copy(world.applied1, "keep-originals")
    state = site / STATE_DIR

    def fail_in_state_dir(name, path):
        if name in ("unlink", "rmdir") and Path(path).is_relative_to(state / "originals"):
            raise PermissionError(errno.EACCES, "injected", str(path))

    assert world.run("revert", site, world.rev1, fail_in_state_dir) == 3
    tree = full_tree(site)
    for rel, digest in world.trees["pristine"].items():
        assert tree[rel] == digest, rel
    assert not (state / "state.json").exists() and (state / "originals").is_dir()
    assert world.run("status", site, world.rev1) == 0
    assert world.run("revert", site, world.rev1) == 0
    assert full_tree(site) == world.trees["pristine"]


# ---------------------------------------------------------------------------------------------
# damaged state, permissions
# ---------------------------------------------------------------------------------------------


def test_a_damaged_state_json_stops_every_command_until_moved_aside(world, capsys):
    site = world.copy(world.applied1, "damaged-json")
    (site / STATE_DIR / "state.json").write_text('{"format": 2, "files": ')
    before = full_tree(site)
    for command in ("status", "apply", "revert"):
        capsys.readouterr()
        assert world.run(command, site, world.rev1) == 2, command
        err = capsys.readouterr().err
        assert "the state is damaged" in err and "aside" in err and "Traceback" not in err
    assert full_tree(site) == before
    # Without the record, revert un-applies the series, checks it against RECORD, removes the owned tree.
    shutil.move(site / STATE_DIR, world.root / "aside")
    assert world.run("revert", site, world.rev1) == 0
    assert full_tree(site) == world.trees["pristine"]


@pytest.mark.parametrize("damage", ["missing", "altered", "symlink"])
def test_a_damaged_stored_original_is_a_conflict_until_the_file_is_reinstalled(world, capsys, damage):
    site = world.copy(world.applied1, f"damaged-{damage}")
    stored = site / STATE_DIR / "originals" / patchkit.MODEL_REL
    if damage == "missing":
        stored.unlink()
    elif damage == "altered":
        stored.write_text(stored.read_text() + "# changed\n")
    else:
        stored.unlink()
        stored.symlink_to(world.pristine / patchkit.MODEL_REL)
    before = full_tree(site)
    capsys.readouterr()
    assert world.run("status", site, world.rev1) == 0
    out = capsys.readouterr().out
    assert "conflict" in out and "damaged" in out
    for command in ("apply", "revert"):
        assert world.run(command, site, world.rev1) == 1, command
        assert str(stored) in capsys.readouterr().err
    assert full_tree(site) == before
    # Reinstalling the file (pip install --force-reinstall) puts the pristine bytes back: both finish.
    shutil.copy2(world.pristine / patchkit.MODEL_REL, site / patchkit.MODEL_REL)
    forward = world.copy(site, "damaged-forward")
    assert world.run("apply", forward, world.rev1) == 0
    assert full_tree(forward) == world.trees["rev1"]
    assert world.run("revert", site, world.rev1) == 0
    assert full_tree(site) == world.trees["pristine"]


def test_a_read_only_target_directory_changes_nothing(world):
    prefix = patchkit.unprivileged_prefix(world.root)
    if prefix is None:
        pytest.skip("cannot drop the privilege to override file permissions here")
    site = world.copy(world.pristine, "read-only")
    folder = (site / patchkit.MODEL_REL).parent
    before = full_tree(site)
    folder.chmod(0o555)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "minicpmo_cg.patchtool", "apply", "--site-packages", str(site)]
            + ["--patches-dir", str(world.rev1), "--owned-dir", str(world.owned)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Permission denied" in proc.stderr and "no file was changed" in proc.stderr
    finally:
        folder.chmod(0o755)
    assert full_tree(site) == before


def test_a_record_of_the_first_format_is_read(world):
    """A state directory written by the first release (format 1) is applied, re-applied and reverted."""
    site = world.copy(world.applied1, "format-1")
    path = site / STATE_DIR / "state.json"
    record = json.loads(path.read_text())
    assert record.pop("complete") is True and record.pop("created_dirs")
    record["format"] = 1
    for entry in record["files"].values():
        entry["role"] = "adapter" if entry["role"] == "owned" else entry["role"]
    path.write_text(json.dumps(record))
    assert world.run("status", site, world.rev1) == 0
    forward = world.copy(site, "format-1-forward")
    assert world.run("apply", forward, world.rev2) == 0
    assert full_tree(forward) == world.trees["rev2"]
    assert world.run("revert", site, world.rev1) == 0
    assert full_tree(site) == world.trees["pristine"]
