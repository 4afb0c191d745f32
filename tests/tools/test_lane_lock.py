# SPDX-License-Identifier: Apache-2.0
"""The per-venv lock of the lane scripts (``tools/lane_env.sh``).

Lane venvs are shared by every checkout on a machine, and each run re-points the editable
install at its checkout and re-applies its patch set; without a lock, two checkouts testing at
once test each other's code. Here the test holds a venv's lock itself (``flock``, as another
run would) and drives the scripts: they wait, saying for which venv and who holds it, give up
after ``MINICPMO_CG_LOCK_TIMEOUT`` seconds, and go on once the lock is released. Nothing here
measures time: a script still waiting is one that has printed the message and not exited while
the lock is held, and every timeout is scripted (0 s) or only a guard against a hang.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[2]
LANE_ENV = REPO / "tools" / "lane_env.sh"
#: a guard against a script that never returns, so a regression fails instead of blocking the suite
HANG_GUARD_S = 120
GAVE_UP = 75


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINICPMO_CG_")}
    return {**env, "MINICPMO_CG_CACHE": str(cache), **extra}


def _lane_venv(cache: Path, lane: str = "current") -> Path:
    script = f'source "{LANE_ENV}"; lane_venv {lane}'
    out = subprocess.run(["bash", "-c", script], env=_env(cache), capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


class HeldLock:
    """The lock of ``venv`` held by this process, as a run of another checkout holds it."""

    def __init__(self, venv: Path) -> None:
        venv.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(f"{venv}.lock")
        self.handle = open(self.path, "a+")  # noqa: SIM115 - released explicitly by the tests
        fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path.write_text("pid 4242, checkout /elsewhere/other-checkout\n")

    def release(self) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def _locker(venv: Path, env: dict[str, str], after: str = "echo acquired") -> subprocess.Popen:
    script = f'source "{LANE_ENV}"; lock_lane_venv "$1" || exit $?; {after}'
    return subprocess.Popen(
        ["bash", "-c", script, "locker", str(venv)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_run_waits_for_the_lock_saying_whose_it_is_then_goes_on(tmp_path):
    venv = _lane_venv(tmp_path)
    held = HeldLock(venv)
    proc = _locker(venv, _env(tmp_path))
    try:
        line = proc.stderr.readline()  # blocks until the script speaks: no clock involved
        assert line.startswith(f"waiting for the lock of venv {venv} held by another run"), line
        assert "pid 4242, checkout /elsewhere/other-checkout" in line
        assert proc.poll() is None, "went on while the lock was held"
    finally:
        held.release()
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and out == "acquired\n", err
    assert f"checkout {REPO}" in held.path.read_text()  # the new holder says who it is


def test_a_scripted_timeout_gives_up_with_a_message(tmp_path):
    venv = _lane_venv(tmp_path)
    held = HeldLock(venv)
    try:
        proc = _locker(venv, _env(tmp_path, MINICPMO_CG_LOCK_TIMEOUT="0"))
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        held.release()
    assert proc.returncode == GAVE_UP and out == "", err
    assert f"waiting for the lock of venv {venv}" in err
    assert f"gave up waiting for the lock of venv {venv} after 0 s" in err


def test_a_script_started_by_the_holder_takes_no_second_lock(tmp_path):
    """tools/test.sh holds the lock and calls tools/setup_lane.sh: that must not wait for itself."""
    venv = _lane_venv(tmp_path)
    held = HeldLock(venv)
    try:
        env = _env(tmp_path, MINICPMO_CG_VENV_LOCKED=str(venv), MINICPMO_CG_LOCK_TIMEOUT="0")
        out, err = _locker(venv, env).communicate(timeout=HANG_GUARD_S)
    finally:
        held.release()
    assert out == "acquired\n" and "waiting" not in err, err


def test_unlock_releases_the_venv_while_the_shell_goes_on(tmp_path):
    """tools/test.sh all: the first lane's venv is free again before the second lane runs."""
    venv = _lane_venv(tmp_path)
    proc = _locker(venv, _env(tmp_path), after="unlock_lane_venv; echo released; read -r _")
    try:
        assert proc.stdout.readline() == "released\n"
        HeldLock(venv).release()  # raises BlockingIOError if the shell still held it
    finally:
        proc.communicate(input="done\n", timeout=HANG_GUARD_S)
    assert proc.returncode == 0


@pytest.mark.parametrize(
    "script",
    [
        ["tools/test.sh", "current"],
        ["tools/setup_lane.sh", "current"],
        ["tools/demo.sh", "current"],
        [".buildkite/scripts/lane_exec.sh", "current", "true"],
    ],
)
def test_every_lane_script_locks_the_venv_before_touching_it(tmp_path, script):
    venv = _lane_venv(tmp_path)
    held = HeldLock(venv)
    try:
        proc = subprocess.run(
            ["bash", *script],
            cwd=REPO,
            env=_env(tmp_path, MINICPMO_CG_LOCK_TIMEOUT="0"),
            capture_output=True,
            text=True,
            check=False,
            timeout=HANG_GUARD_S,
        )
    finally:
        held.release()
    assert proc.returncode != 0 and f"waiting for the lock of venv {venv}" in proc.stderr, proc.stderr
    assert not venv.exists() and "building" not in proc.stderr  # nothing built or re-pointed
