# SPDX-License-Identifier: Apache-2.0
"""The second round of hostile cases, numbered after ``test_field_cases_read_back.py``.

14. a recorded directory (or a recorded file's directory) that a symbolic link inside ``vllm_omni/``
    takes outside the site is damage; one a link takes elsewhere inside is never deleted through;
15. a FIFO in place of a dist-info ``METADATA`` or ``RECORD``, or inside the ``--owned-dir`` tree;
16. the lock held by another process (a stopped one): a message naming its PID, and a timeout;
17. GNU patch that cannot write, is killed or hangs: an I/O failure naming the directory or the
    limit, never a conflict or a patch to refresh;
18. owned files that do not belong (editor backups, hidden files) or whose names the record's
    checker refuses (a space, a non-ASCII letter);
19. ``apply`` under ``umask 077``: the package directories it creates can be read by everyone, as
    its files can;
20. malformed input (a deeply nested or huge ``state.json``, a non-UTF-8 ``series`` or
    ``INDEX.md``, a malformed dist-info ``METADATA`` or ``RECORD``): one line naming the file, exit 2;
21. ``--json`` prints exactly one JSON object, usage errors included.

As in the earlier rounds: the documented exit code, a message naming the culprit, no traceback,
and the installation (and everything outside it) left as it was. A subprocess runs a command that
used to hang, with :data:`~patchkit.HANG_GUARD_S` as a safety net; no test measures time.
"""

from __future__ import annotations

import base64
import csv
import fcntl
import io
import json
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import patchkit
import pytest
from patchkit import (
    ADAPTER_PACKAGE_REL,
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
from minicpmo_cg.patchtool import gnupatch, state

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

#: words that send a user to the patches or the packages; an I/O failure must not use them
PATCH_ADVICE = ("refresh", "regenerate", "reinstall", "conflict")


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> patchkit.Sites:
    return patchkit.Sites(tmp_path_factory.mktemp("escapes"))


def owned_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the shipped owned tree: (the --owned-dir root, the folder of the model's modules)."""
    root = tmp_path / "owned"
    shutil.copytree(
        resources.owned_root() / resources.OWNED_PACKAGE_DIR,
        root / resources.OWNED_PACKAGE_DIR,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root, root / Path(MODEL_REL).parent


def one_line_error(proc: subprocess.CompletedProcess, *names: str) -> None:
    """Exit 2 with a one-line message on stderr naming each of ``names``, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"{proc.returncode}\n{proc.stdout}{proc.stderr}"
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0], f"{name} not named: {proc.stderr}"


# ---------------------------------------------------------------------------------------------
# 14. recorded paths that a symbolic link takes elsewhere
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["created dir", "file"])
def test_14_a_recorded_path_a_link_takes_outside_the_site_is_damage_and_nothing_there_changes(
    sites, capsys, entry
):
    site = sites.copy("applied")
    elsewhere = site.parent / f"{site.name}-elsewhere"
    cache = elsewhere / "sub" / "__pycache__"
    cache.mkdir(parents=True)
    (cache / "mod.cpython-311.pyc").write_bytes(b"not the tool's")
    victim = elsewhere / "sub" / "victim.py"
    victim.write_text("not the tool's\n")
    (site / "vllm_omni" / "lnk").symlink_to(elsewhere)
    if entry == "created dir":
        rel = "vllm_omni/lnk/sub"
        state_json = edit_record(site, lambda r: r["created_dirs"].append(rel))
    else:
        rel = "vllm_omni/lnk/sub/victim.py"
        digest = sha(victim)
        state_json = edit_record(
            site,
            lambda r: r["files"].update(
                {rel: {"original_sha256": None, "written_sha256": digest, "role": "owned"}}
            ),
        )
    outside = full_tree(elsewhere)
    refused(capsys, site, "damaged", str(state_json), rel, str(elsewhere / "sub"))
    assert full_tree(elsewhere) == outside


def test_14_a_recorded_directory_a_link_takes_elsewhere_inside_is_not_deleted_through(sites):
    site = sites.copy("applied")
    inner = site / "vllm_omni" / "inner" / "sub"
    (inner / "__pycache__").mkdir(parents=True)
    (inner / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"not the tool's")
    (site / "vllm_omni" / "lnk").symlink_to(site / "vllm_omni" / "inner")
    edit_record(site, lambda r: r["created_dirs"].append("vllm_omni/lnk/sub"))
    before = full_tree(site / "vllm_omni" / "inner")
    code, report = patchkit.cli_json("revert", *sp(site))
    assert code == 0, report
    assert [w for w in report["warnings"] if "vllm_omni/lnk/sub/" in w and "symbolic link" in w], report
    assert full_tree(site / "vllm_omni" / "inner") == before
    assert not (site / STATE_DIR).exists()


# ---------------------------------------------------------------------------------------------
# 15. FIFOs in the dist-info metadata and in the owned tree
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dist_info, name",
    [("vllm-*.dist-info", "METADATA"), ("vllm_omni-*.dist-info", "METADATA"), ("vllm-*.dist-info", "RECORD")],
)
def test_15_a_fifo_in_place_of_dist_info_metadata_is_refused_instead_of_hanging(sites, dist_info, name):
    site = sites.copy("pristine")
    (info,) = site.glob(dist_info)
    fifo = info / name
    fifo.unlink()
    os.mkfifo(fifo)
    before = full_tree(site)
    for command in COMMANDS:
        proc = patchkit.cli(command, *sp(site), timeout=HANG_GUARD_S)
        one_line_error(proc, str(fifo), "not a regular file")
    assert full_tree(site) == before


def test_15_a_fifo_inside_the_owned_tree_is_refused_or_left_out_instead_of_hanging(sites, tmp_path):
    site = sites.copy("pristine")
    owned, models = owned_copy(tmp_path)
    os.mkfifo(models / "stray-fifo")  # not a module: never opened
    before = full_tree(site)
    proc = patchkit.cli("check", *sp(site), "--owned-dir", str(owned), timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module = models / "fifo_module.py"
    os.mkfifo(module)
    for command in COMMANDS:
        proc = patchkit.cli(command, *sp(site), "--owned-dir", str(owned), timeout=HANG_GUARD_S)
        one_line_error(proc, str(module), "not a regular file")
    assert full_tree(site) == before


# ---------------------------------------------------------------------------------------------
# 16. the lock of another process
# ---------------------------------------------------------------------------------------------

HOLDER = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(3600)\n"
)


def _stderr_line(proc: subprocess.Popen, needle: str) -> str:
    """The first stderr line of ``proc`` holding ``needle`` (the guard only stops a broken run)."""
    while True:
        ready, _, _ = select.select([proc.stderr], [], [], HANG_GUARD_S)
        assert ready, f"no line with {needle!r} on stderr"
        line = proc.stderr.readline()
        assert line, f"stderr closed before a line with {needle!r}"
        if needle in line:
            return line


def test_16_a_stopped_lock_holder_is_named_at_once_and_a_timeout_gives_up(sites):
    site = sites.copy("pristine")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(site)], stdout=subprocess.PIPE, text=True)
    waiter = None
    try:
        assert holder.stdout.readline() == "held\n"
        os.kill(holder.pid, signal.SIGSTOP)  # a stopped command keeps its lock
        waiting = f"waiting for the lock held by PID {holder.pid}"
        env = {**os.environ, "MINICPMO_CG_LOCK_TIMEOUT": "0"}
        for command in COMMANDS:
            proc = patchkit.cli(command, *sp(site), env=env, timeout=HANG_GUARD_S)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert waiting in proc.stderr and "gave up" in proc.stderr, proc.stderr
            assert "MINICPMO_CG_LOCK_TIMEOUT" in proc.stderr and "Traceback" not in proc.stderr
        assert full_tree(site) == full_tree(sites.pristine)
        # Without a timeout the command says whom it waits for while the lock is still held
        # (the holder is stopped: the command cannot have got past it), then waits.
        waiter = subprocess.Popen(
            [sys.executable, "-m", "minicpmo_cg.patchtool", "apply", *sp(site)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiting in _stderr_line(waiter, "waiting for the lock")
        assert waiter.poll() is None
    finally:
        holder.kill()
        holder.wait()
    assert waiter.wait(timeout=HANG_GUARD_S) == 0  # the lock is free: the apply went on
    assert (site / patchkit.ADAPTER_REL).is_file()


def test_16_the_lock_wait_honours_its_timeout_on_a_scripted_clock(tmp_path):
    now = [100.0]
    sleeps, told = [], []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    other = os.open(tmp_path, os.O_RDONLY)  # another open file: flock conflicts within a process too
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        with (
            pytest.raises(state.LockTimeoutError, match=rf"held by PID {os.getpid()} on .* after 5 s"),
            state.locked(
                tmp_path, exclusive=False, timeout=5, on_wait=told.append, clock=lambda: now[0], sleep=sleep
            ),
        ):
            pass
        assert told == [f"PID {os.getpid()}"] and 5 <= sum(sleeps) < 5 + 2 * state.LOCK_POLL_S

        def release_on_third(seconds: float) -> None:
            sleep(seconds)
            if len(sleeps) == 3:
                fcntl.flock(other, fcntl.LOCK_UN)

        sleeps.clear()
        with state.locked(tmp_path, exclusive=True, timeout=5, clock=lambda: now[0], sleep=release_on_third):
            assert len(sleeps) == 3
    finally:
        os.close(other)


# ---------------------------------------------------------------------------------------------
# 17. GNU patch that cannot write, is killed or hangs
# ---------------------------------------------------------------------------------------------


def fake_patch(tmp_path: Path, body: str) -> dict[str, str]:
    """An environment whose ``patch`` answers ``--version`` as GNU patch and runs ``body`` otherwise."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    script = bin_dir / "patch"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo "GNU patch 2.7.6"; exit 0; fi\n{body}\n'
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _no_patch_advice(text: str) -> None:
    lowered = text.lower()
    assert not [word for word in PATCH_ADVICE if word in lowered], text


@pytest.mark.parametrize("start", ["pristine", "applied without its state"])
def test_17_a_patch_killed_at_the_file_size_limit_is_an_io_failure_naming_the_limit(sites, start):
    site = sites.copy("pristine" if start == "pristine" else "applied")
    if start != "pristine":
        shutil.rmtree(site / STATE_DIR)
    # Room for every file the tool writes itself (the largest pre-apply file), none for the
    # patched model file GNU patch writes: it is killed by SIGXFSZ.
    limit = max(len(text.encode()) for text in patchkit.SITE_SOURCE.values())
    limit = max(limit, (sites.pristine / MODEL_REL).stat().st_size)
    before = full_tree(site)
    for command in COMMANDS:
        proc = subprocess.run(
            [sys.executable, "-m", "minicpmo_cg.patchtool", command, *sp(site)],
            capture_output=True,
            text=True,
            check=False,
            timeout=HANG_GUARD_S,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        )
        assert proc.returncode == 2, f"{command}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
        assert "ulimit -f" in proc.stderr and str(limit) in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        _no_patch_advice(proc.stdout + proc.stderr)
    assert full_tree(site) == before


@pytest.mark.parametrize(
    "how, said",
    [
        ('echo "patch: **** write error : No space left on device" >&2; exit 2', "No space left on device"),
        ("kill -9 $$", "killed by SIGKILL"),
    ],
    ids=["write error", "killed"],
)
def test_17_a_patch_that_cannot_write_or_is_killed_is_an_io_failure_naming_tmpdir(sites, tmp_path, how, said):
    site = sites.copy("applied")
    shutil.rmtree(site / STATE_DIR)  # revert's plan then runs patch on every file
    env = fake_patch(tmp_path, how)
    before = full_tree(site)
    for command in COMMANDS:
        proc = patchkit.cli(command, *sp(site), env=env, timeout=HANG_GUARD_S)
        one_line_error(proc, said, "TMPDIR")
        _no_patch_advice(proc.stdout + proc.stderr)
    assert full_tree(site) == before


def test_17_a_patch_that_hangs_is_stopped_and_reported(sites, tmp_path, capsys, monkeypatch):
    site = sites.copy("pristine")
    monkeypatch.setenv("PATH", fake_patch(tmp_path, "exec sleep 3600")["PATH"])
    monkeypatch.setattr(gnupatch, "PATCH_TIMEOUT_S", 1)
    code, text = tool(capsys, "status", *sp(site))
    assert code == 2 and "did not finish within 1 s" in text and "Traceback" not in text, text
    _no_patch_advice(text)


# ---------------------------------------------------------------------------------------------
# 18. owned files that do not belong
# ---------------------------------------------------------------------------------------------


def test_18_only_modules_with_plain_names_are_installed_and_the_record_stays_readable(sites, tmp_path):
    site = sites.copy("pristine")
    owned, models = owned_copy(tmp_path)
    stray = {
        "audio_lengths.py~": "an editor backup",
        ".#audio_lengths.py": "an editor lock",
        ".hidden.py": "hidden",
        "notes.txt": "not a module",
        "name with space.py": "x = 1\n",
        "m\u00f3dulo.py": "x = 1\n",
    }
    for name, text in stray.items():
        (models / name).write_text(text)
    (models / "__pycache__").mkdir()
    (models / "__pycache__" / "vision_path.cpython-311.pyc").write_bytes(b"bytecode")
    args = (*sp(site), "--owned-dir", str(owned))
    proc = patchkit.cli("apply", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = site / Path(MODEL_REL).parent
    assert not [name for name in [*stray, "__pycache__"] if (installed / name).exists()]
    for command in ("status", "check", "apply"):
        proc = patchkit.cli(command, *args)
        assert proc.returncode == 0, f"{command}: {proc.stdout}{proc.stderr}"
        assert "damaged" not in proc.stdout + proc.stderr
    _, report = patchkit.cli_json("status", *args)
    left_out = " ".join(n for n in report["notes"] if "is not installed" in n)
    assert "name with space.py" in left_out and "m\u00f3dulo.py" in left_out, report["notes"]
    assert patchkit.cli("revert", *args).returncode == 0
    assert full_tree(site) == full_tree(sites.pristine)


# ---------------------------------------------------------------------------------------------
# 19. umask 077
# ---------------------------------------------------------------------------------------------


def test_19_apply_under_umask_077_creates_directories_everyone_can_read(sites):
    site = sites.copy("pristine")
    before = {p for p in site.rglob("*") if p.is_dir()}
    proc = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.patchtool", "apply", *sp(site)],
        capture_output=True,
        text=True,
        check=False,
        timeout=HANG_GUARD_S,
        preexec_fn=lambda: os.umask(0o077),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    created = sorted(p for p in site.rglob("*") if p.is_dir() and p not in before)
    assert site / ADAPTER_PACKAGE_REL in created
    modes = {p.relative_to(site).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in created}
    assert set(modes.values()) == {0o755}, modes
    owned = [site / rel for rel in patchkit.OWNED_RELS]
    assert {stat.S_IMODE(p.stat().st_mode) for p in owned} == {0o644}


# ---------------------------------------------------------------------------------------------
# 20. malformed input: one line naming the file, exit 2
# ---------------------------------------------------------------------------------------------


def _rewrite_record(path: Path, edit) -> None:
    rows = list(csv.reader(io.StringIO(path.read_text())))
    with open(path, "w", newline="") as handle:
        csv.writer(handle, lineterminator="\n").writerows(edit(rows))


def _bad_hash(rows: list[list[str]]) -> list[list[str]]:
    return [[r[0], "sha256=!!not-base64!!", *r[2:]] if r and r[0] == MODEL_REL else r for r in rows]


def _huge_field(rows: list[list[str]]) -> list[list[str]]:
    return [
        *rows,
        ["vllm_omni/" + "x" * 200_000, "sha256=" + base64.urlsafe_b64encode(bytes(32)).decode(), "1"],
    ]


def _within_1_gib() -> None:
    """A machine without a GiB to spare: the tool must never read a huge file whole."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def _damage(site: Path, case: str) -> Path:
    """Damage ``site`` as ``case`` says; return the file the message must name."""
    (vllm_info,) = site.glob("vllm-*.dist-info")
    (omni_info,) = site.glob("vllm_omni-*.dist-info")
    if case == "deeply nested state.json":
        path = site / STATE_DIR / "state.json"
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "1 GB state.json":
        path = site / STATE_DIR / "state.json"
        with open(path, "r+b") as handle:
            handle.truncate(1 << 30)  # sparse: no disk space used
    elif case == "non-UTF-8 METADATA":
        path = vllm_info / "METADATA"
        path.write_bytes(path.read_bytes().replace(b"Version:", b"Summary: \xff\xfe\nVersion:", 1))
    elif case == "METADATA without a version":
        path = omni_info / "METADATA"
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if not line.startswith("Version:")))
    elif case == "non-UTF-8 RECORD":
        path = omni_info / "RECORD"
        path.write_bytes(path.read_bytes() + b"vllm_omni/\xff.py,,\n")
    elif case == "RECORD field over the CSV limit":
        path = omni_info / "RECORD"
        _rewrite_record(path, _huge_field)
    else:
        assert case == "RECORD hash that is not base64"
        path = omni_info / "RECORD"
        _rewrite_record(path, _bad_hash)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "deeply nested state.json",
        "1 GB state.json",
        "non-UTF-8 METADATA",
        "METADATA without a version",
        "non-UTF-8 RECORD",
        "RECORD field over the CSV limit",
        "RECORD hash that is not base64",
    ],
)
def test_20_malformed_state_or_dist_info_is_one_line_naming_the_file(sites, case):
    site = sites.copy("applied")
    named = _damage(site, case)
    before = full_tree(site)
    for command in COMMANDS:
        proc = patchkit.cli(command, *sp(site), timeout=HANG_GUARD_S, preexec_fn=_within_1_gib)
        one_line_error(proc, str(named))
        proc = patchkit.cli(command, *sp(site), "--json", timeout=HANG_GUARD_S, preexec_fn=_within_1_gib)
        assert proc.returncode == 2 and str(named) in json.loads(proc.stdout)["error"], proc.stdout
    assert full_tree(site) == before


def test_20_a_non_utf8_series_or_index_is_one_line_naming_the_file(sites, tmp_path):
    site = sites.copy("applied")
    patches = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), patches)
    index = patches / "INDEX.md"
    index.write_bytes(index.read_bytes() + b"\xff\xfe\n")
    one_line_error(patchkit.cli("index", "--check", "--patches-dir", str(patches)), str(index))
    series = patches / "vllm-omni" / "series"
    series.write_bytes(series.read_bytes() + b"# \xff\xfe\n")
    before = full_tree(site)
    for command in COMMANDS:
        one_line_error(patchkit.cli(command, *sp(site), "--patches-dir", str(patches)), str(series))
        proc = patchkit.cli(command, *sp(site), "--patches-dir", str(patches), "--json")
        assert proc.returncode == 2 and str(series) in json.loads(proc.stdout)["error"], proc.stdout
    one_line_error(patchkit.cli("index", "--patches-dir", str(patches)), str(series))
    assert full_tree(site) == before


# ---------------------------------------------------------------------------------------------
# 21. --json: one JSON object, usage errors included
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--json", "--no-such-option"],
        ["check", "--json", "--site-packages"],
        ["apply", "--json", "unexpected-argument"],
        ["index", "--json"],
        ["no-such-command", "--json"],
    ],
)
def test_21_a_usage_error_under_json_prints_one_json_object(argv):
    proc = patchkit.cli(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout: one object
    assert report["ok"] is False and report["exit_code"] == 2 and "usage:" in report["error"]
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
