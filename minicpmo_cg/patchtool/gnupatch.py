"""Apply one unified diff to in-memory file contents with GNU ``patch``."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from minicpmo_cg.patchtool.series import FileChange

__all__ = [
    "GnuPatch",
    "PatchRun",
    "PatchRunError",
    "PatchToolMissingError",
    "ScratchDirError",
    "ambiguous_hunks",
    "summarize_failure",
]

Contents = dict[str, "bytes | None"]
"""site-packages-relative POSIX path -> file bytes, or None for an absent file."""


class PatchToolMissingError(RuntimeError):
    """GNU ``patch`` is not on ``PATH``, is not GNU patch, or cannot be run."""


class ScratchDirError(OSError):
    """The temporary directory (``TMPDIR``) cannot hold the scratch copies: full, unwritable, gone."""


class PatchRunError(OSError):
    """GNU ``patch`` failed for a reason other than a conflict: it could not write, was killed or hung."""


#: seconds one ``patch`` run may take (a run takes milliseconds; a hung one is stopped)
PATCH_TIMEOUT_S = 120


def _scratch_dir() -> str:
    return tempfile.tempdir or os.environ.get("TMPDIR") or "/tmp"


def _file_size_limit() -> str:
    """``" (file size limit, ulimit -f: N bytes)"`` when there is one, else empty."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return "" if soft == resource.RLIM_INFINITY else f" (file size limit, ulimit -f: {soft} bytes)"


@dataclass(frozen=True)
class PatchRun:
    """Result of one :meth:`GnuPatch.run`."""

    ok: bool
    contents: Contents | None
    output: str


@functools.lru_cache(maxsize=8)
def _probe(found: str | None) -> tuple[str, str]:
    """(path, first line of ``--version``) of a GNU patch executable; cached per path.

    Raises:
        PatchToolMissingError: ``found`` is None or not GNU patch.
    """
    if found is None:
        raise PatchToolMissingError(
            "GNU patch is required but 'patch' was not found on PATH; install it "
            "(e.g. 'apt-get install patch' or 'dnf install patch') and retry"
        )
    try:
        probe = subprocess.run(
            [found, "--version"], capture_output=True, text=True, check=False, timeout=PATCH_TIMEOUT_S
        )
    except OSError as exc:
        raise PatchToolMissingError(f"cannot run {found}: {exc}") from None
    except subprocess.TimeoutExpired:
        raise PatchToolMissingError(
            f"{found} --version did not finish within {PATCH_TIMEOUT_S} s; install GNU patch and put it first on PATH"
        ) from None
    first = (probe.stdout or "").splitlines()[:1]
    if probe.returncode != 0 or not first or "GNU patch" not in first[0]:
        raise PatchToolMissingError(
            f"{found} is not GNU patch ('{first[0] if first else probe.stderr.strip()}'); "
            "install GNU patch and put it first on PATH"
        )
    return found, first[0].strip()


_RUNS: dict[tuple, PatchRun] = {}
_RUNS_KEPT = 128


def _run_key(executable: str, diff: str, files: Contents, reverse: bool) -> tuple:
    digests = tuple(
        sorted(
            (rel, None if data is None else hashlib.sha256(data).hexdigest()) for rel, data in files.items()
        )
    )
    return (executable, hashlib.sha256(diff.encode()).hexdigest(), reverse, digests)


class GnuPatch:
    """Thin wrapper around the GNU ``patch`` executable.

    Raises:
        PatchToolMissingError: not found, or ``patch --version`` is not GNU patch.
    """

    def __init__(self, executable: str | None = None) -> None:
        found = shutil.which(executable or "patch")
        self.executable, self.version = _probe(found)

    def run(self, diff: str, files: Contents, *, reverse: bool = False) -> PatchRun:
        """Apply ``diff`` (forward or reversed) to ``files``."""
        key = _run_key(self.executable, diff, files, reverse)
        cached = _RUNS.get(key)
        if cached is None:
            cached = self._run(diff, files, reverse)
            if len(_RUNS) >= _RUNS_KEPT:
                _RUNS.pop(next(iter(_RUNS)))
            _RUNS[key] = cached
        return PatchRun(
            cached.ok, dict(cached.contents) if cached.contents is not None else None, cached.output
        )

    def _run(self, diff: str, files: Contents, reverse: bool) -> PatchRun:
        """One ``patch`` run in a fresh scratch directory.

        Raises:
            ScratchDirError: the scratch directory cannot be made, written, read or removed.
            PatchRunError: ``patch`` failed without a conflict (exit status 2, a signal, a hang).
            PatchToolMissingError: ``patch`` cannot be started.
        """
        try:
            with tempfile.TemporaryDirectory(prefix="minicpmo-cg-patch-") as tmp:
                return self._run_in(Path(tmp), diff, files, reverse)
        except PatchRunError:
            raise
        except OSError as exc:
            where = _scratch_dir()
            detail = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
            if exc.errno == errno.EFBIG:
                detail += _file_size_limit()
            raise ScratchDirError(
                f"cannot use the temporary directory {where} (TMPDIR) for GNU patch's scratch copies: "
                f"{detail}; free space there or point TMPDIR at a writable directory"
            ) from None

    def _run_in(self, tmp: Path, diff: str, files: Contents, reverse: bool) -> PatchRun:
        root = tmp / "tree"
        root.mkdir()
        for rel, data in files.items():
            if data is None:
                continue
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        diff_file = tmp / "change.diff"
        diff_file.write_text(diff, encoding="utf-8")
        argv = [
            self.executable,
            "-p1",
            "--force",
            "--fuzz=0",
            "--no-backup-if-mismatch",
            "--reject-file=-",
            "--quoting-style=literal",
            "-d",
            str(root),
            "-i",
            str(diff_file),
        ]
        if reverse:
            argv.insert(1, "--reverse")
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("POSIXLY_CORRECT", "PATCH_GET", "SIMPLE_BACKUP_SUFFIX")
        }
        env["LC_ALL"] = "C"
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=env, check=False, timeout=PATCH_TIMEOUT_S
            )
        except OSError as exc:  # not a scratch problem: the program itself
            raise PatchToolMissingError(f"cannot run {self.executable}: {exc}") from None
        except subprocess.TimeoutExpired:
            raise PatchRunError(
                f"GNU patch ({self.executable}) did not finish within {PATCH_TIMEOUT_S} s and was stopped "
                "(a run takes milliseconds: is the machine overloaded, or the executable not GNU patch?)"
            ) from None
        output = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 1:  # hunks that do not apply: a conflict
            return PatchRun(False, None, output)
        if proc.returncode != 0:
            raise PatchRunError(self._failure(proc.returncode, output))
        result: Contents = {}
        for rel in files:
            target = root / rel
            result[rel] = target.read_bytes() if target.is_file() else None
        return PatchRun(True, result, output)

    def _failure(self, returncode: int, output: str) -> str:
        """Why ``patch`` failed without a conflict, naming the directory or limit at fault."""
        where = f"the temporary directory {_scratch_dir()} (TMPDIR)"
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            cause = {
                "SIGXFSZ": f"a file it wrote outgrew the file size limit{_file_size_limit()}; raise the limit",
                "SIGKILL": "out of memory, or killed by another process; re-run",
            }.get(name, "re-run")
            return f"GNU patch was killed by {name} while it wrote in {where}: {cause}"
        fatal = [line.strip() for line in output.splitlines() if line.startswith("patch: **** ")]
        said = "; ".join(fatal or [line.strip() for line in output.splitlines() if line.strip()][-2:])
        return (
            f"GNU patch failed in {where} with exit status {returncode} ({said or 'no output'})"
            f"{_file_size_limit()}: an I/O failure, not a problem of the patches; free space there or point "
            "TMPDIR at a writable directory"
        )


def summarize_failure(output: str, limit: int = 3) -> str:
    """The most telling lines of a failed ``patch`` run (``Hunk #2 FAILED at 4112``...)."""
    keep = [
        line.strip()
        for line in output.splitlines()
        if "FAILED" in line
        or "can't find file" in line
        or "No such file" in line
        or "already exists" in line
        or "malformed" in line
        or "Only garbage" in line
    ]
    lines = keep or [line.strip() for line in output.splitlines() if line.strip()]
    text = "; ".join(lines[:limit])
    if len(lines) > limit:
        text += f"; ... ({len(lines) - limit} more)"
    return text or "patch failed without output"


def _text_lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _occurrences(haystack: list[str], needle: tuple[str, ...]) -> list[int]:
    """1-based line numbers where ``needle`` starts in ``haystack``."""
    if not needle:
        return []
    first, size = needle[0], len(needle)
    return [
        i + 1
        for i in range(len(haystack) - size + 1)
        if haystack[i] == first and tuple(haystack[i : i + size]) == needle
    ]


def ambiguous_hunks(
    changes: Iterable[FileChange], files: dict[str, bytes | None], *, reverse: bool = False
) -> list[str]:
    """Hunks whose old side (new side when ``reverse``) occurs more than once in the file."""
    problems = []
    for change in changes:
        data = files.get(change.path)
        if data is None:
            continue
        lines = _text_lines(data)
        for number, hunk in enumerate(change.hunks, start=1):
            side = hunk.new_lines if reverse else hunk.old_lines
            found = _occurrences(lines, side)
            if len(found) > 1:
                shown = ", ".join(map(str, found[:5])) + (", ..." if len(found) > 5 else "")
                problems.append(
                    f"{change.path}: hunk #{number} ({hunk.header.split(' @@')[0]} @@) matches at "
                    f"{len(found)} places (lines {shown}); GNU patch could apply it at the wrong one"
                )
    return problems
