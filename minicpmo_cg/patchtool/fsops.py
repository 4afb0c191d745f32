"""Every write the patch tool makes, in one place, one observable step at a time."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "TMP_SUFFIX",
    "NotRegularFileError",
    "SimulatedKill",
    "TooLargeError",
    "file_kind",
    "find_litter",
    "make_dirs",
    "read_regular",
    "remove_dir",
    "remove_file",
    "remove_litter",
    "resolves_outside",
    "set_hook",
    "write_file",
]

TMP_SUFFIX = ".minicpmo-cg-tmp"
#: mode of a file the tool creates (an existing file keeps its own)
FILE_MODE = 0o644
#: mode of a directory the tool creates: FILE_MODE with search permission where it grants read
DIR_MODE = 0o755

Hook = Callable[[str, Path], None]
_hook: Hook | None = None
_killed = False


class SimulatedKill(BaseException):
    """Raised by a test hook to stop the tool as a ``kill -9`` would (no cleanup runs)."""


class NotRegularFileError(OSError):
    """A path that should hold a regular file holds something else; the message names it and what it is."""


class TooLargeError(OSError):
    """A file is larger than its reader accepts; the message names it and both sizes."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISREG, "a regular file"),
)


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for an ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def read_regular(path: Path, *, follow_links: bool = True, limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path``, read without ever blocking on it.

    Raises:
        FileNotFoundError: nothing at ``path``.
        NotRegularFileError: a directory, FIFO, socket or device (or a link, without
            ``follow_links``); the message names the path and what it is.
        TooLargeError: a file larger than ``limit``.
        OSError: any other error of ``stat``/``open``/``read``.
    """
    mode = os.stat(path, follow_symlinks=follow_links).st_mode
    if stat.S_ISLNK(mode):
        raise NotRegularFileError(f"{path} is not a regular file (a symbolic link to {os.readlink(path)})")
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(f"{path} is not a regular file ({file_kind(mode)})")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | (0 if follow_links else os.O_NOFOLLOW))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFileError(f"{path} is not a regular file ({file_kind(info.st_mode)})")
        if limit is not None and info.st_size > limit:
            raise TooLargeError(f"{path} is {info.st_size} bytes, more than the {limit} such a file holds")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def resolves_outside(root: Path, path: Path) -> Path | None:
    """Where ``path`` really is, every symbolic link on its way resolved, when that is outside
    ``root`` (itself resolved); None when it is ``root`` or lies below it."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    return None if real == real_root or real_root in real.parents else real


def set_hook(hook: Hook | None) -> None:
    """Install (or with None remove) the step hook; also clears a previous simulated kill."""
    global _hook, _killed
    _hook, _killed = hook, False


def _step(step: str, path: Path) -> None:
    global _killed
    if _killed:
        raise SimulatedKill(f"{step} {path}: the process was killed earlier")
    if _hook is not None:
        try:
            _hook(step, path)
        except SimulatedKill:
            _killed = True
            raise


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink durable; best effort, as the step itself has happened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dirs(directory: Path, stop: Path) -> list[Path]:
    """Create ``directory`` and its missing parents below ``stop``, each with :data:`DIR_MODE` (the
    umask would make a 0o700 package whose files nobody else can import under ``umask 077``);
    return those created, top first.
    """
    missing = []
    current = directory
    while current != stop and not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        _step("mkdir", path)
        path.mkdir()
        os.chmod(path, DIR_MODE)
    return list(reversed(missing))


def write_file(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` by rename; the parent directory must exist.

    Raises:
        OSError: from any step; the temporary file is removed unless the process is gone.
    """
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = FILE_MODE
    _step("tmp-create", path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            _step("tmp-write", path)
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        _step("rename", path)
        os.replace(tmp, path)
    except Exception:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def remove_file(path: Path) -> None:
    """Unlink ``path`` if it exists (a file or a symbolic link, never a directory)."""
    if not os.path.lexists(path):
        return
    _step("unlink", path)
    os.unlink(path)
    _fsync_dir(path.parent)


def remove_dir(path: Path) -> bool:
    """``rmdir`` ``path`` when it exists and is empty; return whether it is gone."""
    if not path.is_dir() or path.is_symlink():
        return not os.path.lexists(path)
    if any(path.iterdir()):
        return False
    _step("rmdir", path)
    path.rmdir()
    return True


def find_litter(directories: Iterable[Path]) -> list[Path]:
    """Temporary files of this tool (``.*.minicpmo-cg-tmp``) directly in ``directories``."""
    found = []
    for directory in sorted(set(directories)):
        with contextlib.suppress(OSError):
            found += [
                p
                for p in sorted(directory.iterdir())
                if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX) and not p.is_dir()
            ]
    return found


def remove_litter(directories: Iterable[Path]) -> list[Path]:
    """Remove the temporary files a killed run left in ``directories``; return them."""
    found = find_litter(directories)
    for path in found:
        remove_file(path)
    return found
