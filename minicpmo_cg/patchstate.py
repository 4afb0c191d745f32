"""What ``minicpmo-cg-patch`` remembers inside an installation, and how it writes files.

State lives in ``<site-packages>/minicpmo_cg_patch_state/``::

    state.json                 the record (format below)
    originals/<relpath>        byte-exact pre-apply copy of every file apply changed
                               (absent when the file did not exist before apply)

``state.json``::

    {"format": 1,
     "versions": {"vllm": "0.30.0", "vllm-omni": "0.30.0"},
     "patches": {"vllm-omni/0001-....patch": "<sha256 of the patch file>", ...},
     "files": {"vllm_omni/.../minicpmo_4_5_omni_llm.py":
                  {"original_sha256": "<hex>" | null, "written_sha256": "<hex>" | null,
                   "role": "patch" | "adapter"}, ...}}

``original_sha256`` null means "did not exist before apply"; ``written_sha256``
null means apply removed the file. A record made for other package versions
is stale (pip replaced the files) and is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "STATE_DIRNAME",
    "FileRecord",
    "StateError",
    "StateRecord",
    "StateStore",
    "atomic_write",
    "locked",
    "sha256_or_none",
    "write_contents",
]

STATE_DIRNAME = "minicpmo_cg_patch_state"
FORMAT = 1


class StateError(RuntimeError):
    """The state directory is unreadable or inconsistent; the message names the path."""


def sha256_or_none(data: bytes | None) -> str | None:
    """Hex sha256 of ``data``; None for an absent file."""
    return None if data is None else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileRecord:
    """One file apply changed: its hash before (None = absent) and after (None = removed)."""

    original_sha256: str | None
    written_sha256: str | None
    role: str = "patch"


@dataclass
class StateRecord:
    """In-memory form of ``state.json``."""

    versions: dict[str, str]
    patches: dict[str, str] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "versions": dict(sorted(self.versions.items())),
            "patches": dict(self.patches),
            "files": {
                rel: {
                    "original_sha256": r.original_sha256,
                    "written_sha256": r.written_sha256,
                    "role": r.role,
                }
                for rel, r in sorted(self.files.items())
            },
        }


class StateStore:
    """Reads and writes the state directory of one site-packages directory.

    Args:
        site: the site-packages directory.
    """

    def __init__(self, site: Path) -> None:
        self.site = site
        self.root = site / STATE_DIRNAME
        self.json_path = self.root / "state.json"
        self.originals = self.root / "originals"

    def load(self) -> StateRecord | None:
        """The record, or None when there is none.

        Raises:
            StateError: ``state.json`` is not valid JSON of the known format.
        """
        if not self.json_path.exists():
            return None
        try:
            raw = json.loads(self.json_path.read_text(encoding="utf-8"))
            if raw.get("format") != FORMAT:
                raise ValueError(f"unknown format {raw.get('format')!r}")
            files = {
                rel: FileRecord(v["original_sha256"], v["written_sha256"], v.get("role", "patch"))
                for rel, v in raw["files"].items()
            }
            return StateRecord(dict(raw["versions"]), dict(raw["patches"]), files)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(
                f"cannot read {self.json_path}: {exc}. If the installation was reinstalled, remove "
                f"{self.root} and re-run apply"
            ) from None

    def load_original(self, rel: str, record: FileRecord) -> bytes | None:
        """The stored pre-apply bytes of ``rel``, verified against the record.

        Raises:
            StateError: the stored copy is missing or its hash differs.
        """
        if record.original_sha256 is None:
            return None
        path = self.originals / rel
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StateError(f"stored original {path} is unreadable ({exc}); the state is damaged") from None
        if sha256_or_none(data) != record.original_sha256:
            raise StateError(
                f"stored original {path} does not match its recorded sha256; the state is damaged"
            )
        return data

    def save(self, record: StateRecord, originals: Mapping[str, bytes | None]) -> None:
        """Write the originals first, then ``state.json`` (both atomically).

        Args:
            record: the new record; files not in it lose their stored original.
            originals: pre-apply bytes for every file of ``record`` (None = absent).
        """
        for rel in record.files:
            data = originals[rel]
            path = self.originals / rel
            if data is None:
                continue
            if not (path.is_file() and sha256_or_none(path.read_bytes()) == sha256_or_none(data)):
                atomic_write(path, data, mode=0o644)
        atomic_write(self.json_path, (json.dumps(record.to_json(), indent=2) + "\n").encode(), mode=0o644)
        if self.originals.is_dir():
            for path in sorted(self.originals.rglob("*"), reverse=True):
                rel = path.relative_to(self.originals).as_posix()
                if path.is_file() and (rel not in record.files or record.files[rel].original_sha256 is None):
                    path.unlink()
                elif path.is_dir() and not any(path.iterdir()):
                    path.rmdir()

    def remove(self) -> None:
        """Delete the whole state directory (after a complete revert)."""
        if self.root.exists():
            shutil.rmtree(self.root)


def atomic_write(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` via a temporary file in the same directory and ``os.replace``.

    Args:
        mode: permission bits for the new file; default keeps the old file's
            mode, or 0o644 for a new file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".minicpmo-cg-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_contents(
    site: Path, changes: Mapping[str, bytes | None], previous: Mapping[str, bytes | None]
) -> None:
    """Write every change (None = delete) or, on any error, restore what was written so far.

    Args:
        site: site-packages directory the relative paths live in.
        changes: relpath -> new bytes (None removes the file).
        previous: relpath -> bytes before the change (None = was absent), for the rollback.

    Raises:
        OSError: the first failing write, after the rollback.
    """
    done: list[str] = []
    try:
        for rel, data in changes.items():
            path = site / rel
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            else:
                atomic_write(path, data)
            done.append(rel)
    except BaseException:
        for rel in reversed(done):
            old = previous[rel]
            path = site / rel
            with contextlib.suppress(OSError):
                if old is None:
                    path.unlink(missing_ok=True)
                else:
                    atomic_write(path, old)
        raise


@contextlib.contextmanager
def locked(site: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold an advisory ``flock`` on the site-packages directory itself.

    Serialises concurrent ``minicpmo-cg-patch`` runs on one installation without
    creating a lock file there.
    """
    fd = os.open(site, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
