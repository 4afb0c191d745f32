"""What ``minicpmo-cg-patch`` remembers inside an installation: the journal and the originals."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from minicpmo_cg.patchtool import fsops
from minicpmo_cg.patchtool.series import KNOWN_PACKAGES, package_relpath_problem

__all__ = [
    "MAX_RECORD_BYTES",
    "STATE_DIRNAME",
    "FileRecord",
    "LockTimeoutError",
    "StateError",
    "StateRecord",
    "StateStore",
    "lock_holders",
    "locked",
    "sha256_or_none",
]

STATE_DIRNAME = "minicpmo_cg_patch_state"
FORMAT = 2
_READABLE_FORMATS = (1, 2)
_HEX = re.compile(r"[0-9a-f]{64}")
_ROLES = {"patch": "patch", "owned": "owned", "adapter": "owned"}  # "adapter": format 1
#: owned files are this project's modules in vllm-omni's tree
_OWNED_DIRS = (KNOWN_PACKAGES["vllm-omni"],)
#: the largest ``state.json`` read (the tool's own records are a few KiB)
MAX_RECORD_BYTES = 16 << 20
#: how often a command waiting for the lock with a timeout tries it again, in seconds
LOCK_POLL_S = 0.1


class StateError(RuntimeError):
    """The state directory is unreadable or inconsistent; the message names the path."""


def sha256_or_none(data: bytes | None) -> str | None:
    """Hex sha256 of ``data``; None for an absent file."""
    return None if data is None else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """One file a command changes."""

    original_sha256: str | None
    written_sha256: str | None
    role: str = "patch"
    interim_sha256: tuple[str | None, ...] = ()

    def allows(self, digest: str | None) -> bool:
        """Whether a file with this sha256 is in a state the record explains."""
        return digest in (self.original_sha256, self.written_sha256) or digest in self.interim_sha256


@dataclass
class StateRecord:
    """In-memory form of ``state.json``."""

    versions: dict[str, str]
    patches: dict[str, str] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    complete: bool = True
    created_dirs: tuple[str, ...] = ()

    def to_json(self) -> dict:
        files = {}
        for rel, r in sorted(self.files.items()):
            entry = {"original_sha256": r.original_sha256, "written_sha256": r.written_sha256, "role": r.role}
            if r.interim_sha256:
                entry["interim_sha256"] = list(r.interim_sha256)
            files[rel] = entry
        return {
            "format": FORMAT,
            "complete": self.complete,
            "versions": dict(sorted(self.versions.items())),
            "patches": dict(self.patches),
            "files": files,
            "created_dirs": sorted(self.created_dirs),
        }

    def committed(self) -> StateRecord:
        """The same record marked complete, without interim contents."""
        files = {rel: replace(r, interim_sha256=()) for rel, r in self.files.items()}
        return replace(self, files=files, complete=True)


def _digest(value: object, where: str) -> str | None:
    if value is None or (isinstance(value, str) and _HEX.fullmatch(value)):
        return value
    raise ValueError(f"{where}: {value!r} is not a sha256 (64 hex digits) or null")


def _path(rel: object, where: str, import_dirs: tuple[str, ...] = tuple(KNOWN_PACKAGES.values())) -> str:
    problem = package_relpath_problem(rel, import_dirs)
    if problem:
        raise ValueError(f"{where}: {rel!r} {problem}")
    assert isinstance(rel, str)
    return rel


def _file_record(rel: str, v: object) -> FileRecord:
    if not isinstance(v, dict):
        raise TypeError(f"files: {rel!r}: not an object")
    role = _ROLES.get(v.get("role", "patch"))
    if role is None:
        raise ValueError(f"files: {rel!r}: unknown role {v.get('role')!r}")
    if role == "owned":
        _path(rel, "files", _OWNED_DIRS)
    else:
        _path(rel, "files")
    interim = v.get("interim_sha256", ())
    if not isinstance(interim, list | tuple):
        raise TypeError(f"files: {rel!r}: interim_sha256 is not a list")
    return FileRecord(
        _digest(v["original_sha256"], f"files: {rel!r}: original_sha256"),
        _digest(v["written_sha256"], f"files: {rel!r}: written_sha256"),
        role,
        tuple(_digest(d, f"files: {rel!r}: interim_sha256") for d in interim),
    )


def _record_from_json(raw: dict) -> StateRecord:
    """The record ``raw`` describes, every path and hash checked (nothing read back is trusted).

    Raises:
        ValueError: an unknown format, a path outside the patched packages, a malformed hash
            or role (the message names the entry); KeyError/TypeError/AttributeError for a
            missing or mistyped field.
    """
    if raw.get("format") not in _READABLE_FORMATS:
        raise ValueError(f"unknown format {raw.get('format')!r}")
    files = {rel: _file_record(rel, v) for rel, v in raw["files"].items()}
    patches = {str(name): _digest(d, f"patches: {name!r}") for name, d in dict(raw["patches"]).items()}
    versions = {str(k): str(v) for k, v in dict(raw["versions"]).items()}
    dirs = raw.get("created_dirs", ())
    if not isinstance(dirs, list | tuple):
        raise TypeError("created_dirs is not a list")
    return StateRecord(
        versions,
        patches,
        files,
        bool(raw.get("complete", True)),
        tuple(_path(d, "created_dirs") for d in dirs),
    )


def _damaged_hint(root: Path) -> str:
    return (
        f"the state is damaged. Move {root} aside and run revert: without a record it un-applies the "
        "series and checks the result against the installed wheels' RECORD hashes"
    )


def _holds(path: Path, digest: str | None) -> bool:
    try:
        return sha256_or_none(fsops.read_regular(path, follow_links=False)) == digest
    except OSError:
        return False


class StateStore:
    """Reads and writes the state directory of one site-packages directory."""

    def __init__(self, site: Path) -> None:
        self.site = site
        self.root = site / STATE_DIRNAME
        self.json_path = self.root / "state.json"
        self.originals = self.root / "originals"

    def damaged(self, what: str) -> StateError:
        """The error for a record that says ``what`` (a reason naming the entry), with the remedy."""
        return StateError(f"{self.json_path}: {what}: {_damaged_hint(self.root)}")

    def check_tree(self) -> None:
        """Refuse a state directory that is not what the tool made: links are never followed.

        Raises:
            StateError: the state directory is a symbolic link or not a directory, or a
                directory below it is a symbolic link; the message names it.
        """
        try:
            mode = os.lstat(self.root).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StateError(f"cannot inspect {self.root} ({exc}); {_damaged_hint(self.root)}") from None
        if stat.S_ISLNK(mode):
            raise StateError(
                f"{self.root} is a symbolic link (to {os.readlink(self.root)}); the tool never follows links "
                "in its state directory. If it holds this installation's state, replace the link by the "
                "directory it points to (mv), otherwise remove the link; then re-run"
            )
        if not stat.S_ISDIR(mode):
            raise StateError(
                f"{self.root} is not a directory ({fsops.file_kind(mode)}); move it aside and re-run"
            )
        for dirpath, dirnames, _ in os.walk(self.root, onerror=None, followlinks=False):
            for name in dirnames:
                path = Path(dirpath) / name
                if path.is_symlink():
                    raise StateError(
                        f"{path} is a symbolic link (to {os.readlink(path)}) inside the state directory; "
                        f"the tool never stores or reads originals through links: {_damaged_hint(self.root)}"
                    )

    def load(self) -> StateRecord | None:
        """The record, or None when there is none.

        Raises:
            StateError: the state directory fails :meth:`check_tree`, or ``state.json`` is not a
                regular file (a link, a FIFO, ...) holding valid JSON of a known format whose
                paths and hashes pass the checks of the State section of patches/README.md.
        """
        self.check_tree()
        try:
            data = fsops.read_regular(self.json_path, follow_links=False, limit=MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read {self.json_path} ({exc}): {_damaged_hint(self.root)}") from None
        try:
            record = _record_from_json(json.loads(data.decode("utf-8")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # UnicodeDecodeError is a ValueError
            raise StateError(
                f"{self.json_path} is not a valid record ({exc}): {_damaged_hint(self.root)}"
            ) from None
        except (RecursionError, MemoryError) as exc:  # nested deeper, or larger, than any record
            raise StateError(
                f"{self.json_path} is not a valid record (too deeply nested or too large to read: "
                f"{type(exc).__name__}): {_damaged_hint(self.root)}"
            ) from None
        self._check_resolved(record)
        return record

    def _check_resolved(self, record: StateRecord) -> None:
        """Refuse a recorded directory (or a recorded file's directory) that a symbolic link takes
        out of its package: revert would remove bytecode and directories, or restore files, there.

        Raises:
            StateError: the entry, where it resolves and the remedy.
        """
        entries = [("files", rel, str(Path(rel).parent)) for rel in record.files]
        entries += [("created_dirs", rel, rel) for rel in record.created_dirs]
        for what, rel, directory in entries:
            root = self.site / rel.split("/", 1)[0]
            real = fsops.resolves_outside(root, self.site / directory)
            if real is not None:
                raise self.damaged(
                    f"{what}: {rel!r} resolves to {real} through a symbolic link, outside {root}/"
                )

    def load_original(self, rel: str, record: FileRecord) -> bytes | None:
        """The stored pre-apply bytes of ``rel``, verified against the record.

        Raises:
            StateError: the stored copy is missing, a link, or its hash differs.
        """
        if record.original_sha256 is None:
            return None
        path = self.originals / rel
        try:
            data = fsops.read_regular(path, follow_links=False)
        except fsops.NotRegularFileError as exc:
            raise StateError(f"stored original {exc}; the state is damaged") from None
        except OSError as exc:
            raise StateError(f"stored original {path} is unreadable ({exc}); the state is damaged") from None
        if sha256_or_none(data) != record.original_sha256:
            raise StateError(
                f"stored original {path} does not match its recorded sha256; the state is damaged"
            )
        return data

    def store_originals(self, record: StateRecord, originals: Mapping[str, bytes | None]) -> None:
        """Write the pre-apply bytes of every file of ``record`` not stored correctly yet."""
        for rel, entry in sorted(record.files.items()):
            data = originals[rel]
            if data is None:
                continue
            path = self.originals / rel
            if _holds(path, entry.original_sha256):
                continue
            fsops.make_dirs(path.parent, self.site)
            if path.is_symlink():
                fsops.remove_file(path)
            fsops.write_file(path, data, mode=0o644)

    def save(self, record: StateRecord) -> None:
        """Replace ``state.json`` with ``record`` (by rename)."""
        fsops.make_dirs(self.root, self.site)
        fsops.write_file(self.json_path, (json.dumps(record.to_json(), indent=2) + "\n").encode(), mode=0o644)

    def remove_record(self) -> None:
        """Delete ``state.json`` (the commit point of a revert)."""
        fsops.remove_file(self.json_path)

    def garbage(self, record: StateRecord | None) -> list[Path]:
        """Files in the state directory that ``record`` does not need (all of them without one)."""
        if not self.root.is_dir():
            return []
        keep = {self.json_path} if record is not None else set()
        if record is not None:
            keep |= {self.originals / rel for rel, r in record.files.items() if r.original_sha256 is not None}
        return [
            p for p in sorted(self.root.rglob("*")) if (p.is_symlink() or not p.is_dir()) and p not in keep
        ]

    def collect_garbage(self, record: StateRecord | None) -> None:
        """Delete what ``record`` does not need, then empty directories (the root too without a record).

        Raises:
            OSError: a file or directory could not be removed; nothing the record needs was touched.
        """
        for path in self.garbage(record):
            fsops.remove_file(path)
        if not self.root.is_dir():
            return
        dirs = sorted((p for p in self.root.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True)
        for directory in dirs:
            fsops.remove_dir(directory)
        if record is None:
            fsops.remove_dir(self.root)

    def directories(self) -> list[Path]:
        """The state directory and every directory below it (where temporary files can be left)."""
        if not self.root.is_dir():
            return []
        return [self.root, *(p for p in sorted(self.root.rglob("*")) if p.is_dir() and not p.is_symlink())]


class LockTimeoutError(RuntimeError):
    """The lock stayed taken for the whole timeout; the message names the holder and the timeout."""


def lock_holders(fd: int) -> list[int]:
    """PIDs holding an ``flock`` on the file open at ``fd``, from ``/proc/locks`` (empty where it
    cannot be read, e.g. not on Linux)."""
    info = os.fstat(fd)
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        text = fsops.read_regular(Path("/proc/locks")).decode("ascii", "replace")
    except OSError:
        return []
    pids = []
    for line in text.splitlines():  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; "->": waiting
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))


def _holder_text(fd: int) -> str:
    pids = lock_holders(fd)
    if not pids:
        return "another process (its PID is not listed in /proc/locks)"
    return ("PID " if len(pids) == 1 else "PIDs ") + ", ".join(map(str, pids))


@contextlib.contextmanager
def locked(
    site: Path,
    *,
    exclusive: bool,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[None]:
    """Hold an advisory ``flock`` on the site-packages directory itself.

    Raises:
        LockTimeoutError: the lock was still taken after ``timeout`` seconds.
    """
    fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        operation = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if not _try_lock(fd, operation):
            holder = _holder_text(fd)
            if on_wait is not None:
                on_wait(holder)
            if timeout is None:
                fcntl.flock(fd, operation)
            else:
                start = clock()
                while not _try_lock(fd, operation):
                    if clock() - start >= timeout:
                        raise LockTimeoutError(
                            f"gave up waiting for the lock held by {holder} on {site} after {timeout:g} s"
                        )
                    sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)


def _try_lock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
