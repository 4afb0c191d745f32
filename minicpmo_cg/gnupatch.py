"""Apply one unified diff to in-memory file contents with GNU ``patch``.

Why GNU ``patch`` (not ``git apply``): it needs no repository, so running it
from inside a git checkout (this repo, a CI workspace) cannot redirect paths to
that repository; ``--fuzz=0`` makes it as strict as ``git apply`` about context
while still accepting line offsets (vllm-omni 0.28.0 and 0.30.0 place the same
code at different line numbers, so one diff serves both).

Every call materialises the given files in a fresh temporary directory, runs
``patch`` there and reads the result back; the installation is never touched
here. Options: ``-p1`` (strip ``a/``/``b/``), ``--force`` (never guess that a
patch is reversed: an already-applied patch must *fail* the forward direction),
``--fuzz=0`` (every context line must match), ``--no-backup-if-mismatch``,
``--reject-file=-`` (no ``.rej`` files), ``--batch``-free so nothing prompts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GnuPatch", "PatchRun", "PatchToolMissingError", "summarize_failure"]

Contents = dict[str, "bytes | None"]
"""site-packages-relative POSIX path -> file bytes, or None for an absent file."""


class PatchToolMissingError(RuntimeError):
    """GNU ``patch`` is not on ``PATH`` or is not GNU patch."""


@dataclass(frozen=True)
class PatchRun:
    """Result of one :meth:`GnuPatch.run`.

    Attributes:
        ok: the whole diff applied (every hunk of every file).
        contents: the resulting files (only the diff's files), or None when not ok.
        output: ``patch``'s combined stdout/stderr (for the report on failure).
    """

    ok: bool
    contents: Contents | None
    output: str


class GnuPatch:
    """Thin wrapper around the GNU ``patch`` executable.

    Args:
        executable: path or name of ``patch`` (default: looked up on ``PATH``).

    Raises:
        PatchToolMissingError: not found, or ``patch --version`` is not GNU patch.
    """

    def __init__(self, executable: str | None = None) -> None:
        found = shutil.which(executable or "patch")
        if found is None:
            raise PatchToolMissingError(
                "GNU patch is required but 'patch' was not found on PATH; install it "
                "(e.g. 'apt-get install patch' or 'dnf install patch') and retry"
            )
        try:
            probe = subprocess.run(
                [found, "--version"], capture_output=True, text=True, check=False, timeout=30
            )
        except OSError as exc:
            raise PatchToolMissingError(f"cannot run {found}: {exc}") from None
        first = (probe.stdout or "").splitlines()[:1]
        if probe.returncode != 0 or not first or "GNU patch" not in first[0]:
            raise PatchToolMissingError(
                f"{found} is not GNU patch ('{first[0] if first else probe.stderr.strip()}'); "
                "install GNU patch and put it first on PATH"
            )
        self.executable = found
        self.version = first[0].strip()

    def run(self, diff: str, files: Contents, *, reverse: bool = False) -> PatchRun:
        """Apply ``diff`` (forward or reversed) to ``files``.

        Args:
            diff: unified diff text with ``a/``/``b/`` prefixed site-relative paths.
            files: the current content of every file the diff touches (None = absent).
            reverse: un-apply instead of apply.

        Returns:
            A :class:`PatchRun`; a failing diff leaves ``files`` untouched
            (they are copies on disk in a temporary directory).
        """
        with tempfile.TemporaryDirectory(prefix="minicpmo-cg-patch-") as tmp:
            root = Path(tmp) / "tree"
            root.mkdir()
            for rel, data in files.items():
                if data is None:
                    continue
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            diff_file = Path(tmp) / "change.diff"
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
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=120)
            output = (proc.stdout + proc.stderr).strip()
            if proc.returncode != 0:
                return PatchRun(False, None, output)
            result: Contents = {}
            for rel in files:
                target = root / rel
                result[rel] = target.read_bytes() if target.is_file() else None
            return PatchRun(True, result, output)


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
