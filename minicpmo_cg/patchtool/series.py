"""The patch series format shared by every upstream folder under ``patches/``."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from minicpmo_cg.patchtool.fsops import NotRegularFileError, file_kind, read_regular

__all__ = [
    "KNOWN_PACKAGES",
    "FileChange",
    "Hunk",
    "Patch",
    "PatchFormatError",
    "VersionSpec",
    "canonical_package",
    "load_all_series",
    "load_series",
    "package_relpath_problem",
    "parse_patch",
    "parse_version",
    "version_at_least",
    "version_equal",
]

#: distribution name -> top-level import directory in site-packages
KNOWN_PACKAGES: dict[str, str] = {"vllm": "vllm", "vllm-omni": "vllm_omni"}

REQUIRED_FIELDS = ("Subject", "Why", "Origin", "Upstream", "Targets", "Drop-When")
OPTIONAL_FIELDS = ("Upstream-Since", "Upstream-Probe")
#: fields whose value must fit on one line (no indented continuation)
SINGLE_LINE_FIELDS = frozenset({"Subject", "Upstream-Since", "Upstream-Probe"})
_FIELD_BY_LOWER = {f.lower(): f for f in REQUIRED_FIELDS + OPTIONAL_FIELDS}

_FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):(.*)$")
_SPEC_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(==|>=)\s*([0-9][0-9A-Za-z.+!-]*)\s*$")
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_SAFE_PATH_RE = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_SERIES_NAME_RE = re.compile(r"^[A-Za-z0-9_.+\-]+$")
# Extended git header lines that carry no content change we could honour.
_GIT_UNSUPPORTED = (
    "old mode",
    "new mode",
    "rename from",
    "rename to",
    "copy from",
    "copy to",
    "similarity index",
    "dissimilarity index",
    "GIT binary patch",
    "Binary files",
)
_GIT_IGNORED = ("diff --git ", "index ", "new file mode ", "deleted file mode ")


class PatchFormatError(ValueError):
    """A series file or patch file breaks the format; the message names the file (and line)."""


def canonical_package(name: str) -> str:
    """Normalise a distribution name the PEP 503 way (``vllm_omni`` -> ``vllm-omni``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_version(text: str):
    """Return a comparable, hashable version object for ``text``.

    Raises:
        ValueError: ``text`` is not a version.
    """
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - every lane venv has packaging
        match = re.fullmatch(r"(\d+(?:\.\d+)*)(?:\+[A-Za-z0-9.]+)?", text.strip())
        if not match:
            raise ValueError(f"not a plain release version: {text!r}") from None
        parts = [int(p) for p in match.group(1).split(".")]
        while len(parts) > 1 and parts[-1] == 0:
            parts.pop()
        return tuple(parts)
    try:
        version = Version(text)
    except InvalidVersion as exc:
        raise ValueError(f"not a version: {text!r}") from exc
    # "==0.30.0" matches 0.30.0+cu130, as in PEP 440 when the spec has no local label.
    return Version(version.public)


def version_equal(installed: str, wanted: str) -> bool:
    """True when ``installed`` equals ``wanted`` ignoring a local label and trailing zeros."""
    return parse_version(installed) == parse_version(wanted)


def version_at_least(installed: str, wanted: str) -> bool:
    """True when ``installed >= wanted`` (local labels ignored)."""
    return parse_version(installed) >= parse_version(wanted)


@dataclass(frozen=True)
class VersionSpec:
    """``package==version`` or ``package>=version``; ``package`` is canonical."""

    package: str
    op: str
    version: str

    def __str__(self) -> str:
        return f"{self.package}{self.op}{self.version}"

    def holds(self, installed: str) -> bool:
        """The spec's own operator: ``==`` exact (``Targets``), ``>=`` at least."""
        if self.op == "==":
            return version_equal(installed, self.version)
        return version_at_least(installed, self.version)

    def reached(self, installed: str) -> bool:
        """``Upstream-Since`` semantics: ``installed`` is this version or later, whatever the operator."""
        return version_at_least(installed, self.version)


def _parse_spec(text: str, where: str, field: str) -> VersionSpec:
    match = _SPEC_RE.match(text)
    if not match:
        raise PatchFormatError(f"{where}: {field}: {text.strip()!r} is not 'package==version'")
    package, op, version = match.groups()
    package = canonical_package(package)
    if package not in KNOWN_PACKAGES:
        raise PatchFormatError(
            f"{where}: {field}: unknown package {package!r} (known: {', '.join(sorted(KNOWN_PACKAGES))})"
        )
    try:
        parse_version(version)
    except ValueError as exc:
        raise PatchFormatError(f"{where}: {field}: {exc}") from None
    return VersionSpec(package, op, version)


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk of a file's diff."""

    header: str
    old_start: int
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


@dataclass(frozen=True)
class FileChange:
    """One file of a diff."""

    path: str
    creates: bool = False
    deletes: bool = False
    hunks: tuple[Hunk, ...] = ()


@dataclass(frozen=True)
class Patch:
    """A parsed patch file."""

    name: str
    path: Path
    package: str
    subject: str
    why: str
    origin: str
    upstream: str
    targets: tuple[VersionSpec, ...]
    upstream_since: VersionSpec | None
    upstream_probe: re.Pattern[str] | None
    drop_when: str
    diff: str
    files: tuple[FileChange, ...]
    sha256: str

    @property
    def file_paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    def targets_version(self, installed: str) -> bool:
        """True when the installed version of :attr:`package` is one of :attr:`targets`."""
        return any(spec.holds(installed) for spec in self.targets)


def _parse_header(lines: list[str], where: str) -> tuple[dict[str, str], int]:
    """Parse the header block; return (fields, index of the first diff line)."""
    fields: dict[str, str] = {}
    current: str | None = None
    for index, line in enumerate(lines):
        lineno = index + 1
        if line == "---":
            if not fields:
                raise PatchFormatError(f"{where}: line {lineno}: the header block before '---' is empty")
            return fields, index + 1
        if not line.strip():
            raise PatchFormatError(
                f"{where}: line {lineno}: blank line inside the header (the header ends at a line '---')"
            )
        if line[0] in " \t":
            if current is None:
                raise PatchFormatError(f"{where}: line {lineno}: continuation line before any header field")
            if current in SINGLE_LINE_FIELDS:
                raise PatchFormatError(f"{where}: line {lineno}: {current}: must be a single line")
            fields[current] = f"{fields[current]} {line.strip()}".strip()
            continue
        match = _FIELD_RE.match(line)
        if not match:
            raise PatchFormatError(
                f"{where}: line {lineno}: expected 'Field: value' or '---', got {line[:60]!r}"
            )
        raw_name, value = match.groups()
        name = _FIELD_BY_LOWER.get(raw_name.lower())
        if name is None:
            allowed = ", ".join(REQUIRED_FIELDS + OPTIONAL_FIELDS)
            raise PatchFormatError(
                f"{where}: line {lineno}: unknown header field {raw_name!r} (allowed: {allowed})"
            )
        if name in fields:
            raise PatchFormatError(f"{where}: line {lineno}: duplicate header field {name!r}")
        fields[name] = value.strip()
        current = name
    raise PatchFormatError(f"{where}: no line '---' ends the header block")


def package_relpath_problem(
    rel: object, import_dirs: tuple[str, ...] = tuple(KNOWN_PACKAGES.values())
) -> str | None:
    """Why ``rel`` is not a site-relative path of a file below one of ``import_dirs``, or None."""
    inside = " or ".join(f"{d}/" for d in import_dirs)
    if not isinstance(rel, str) or not rel:
        return f"is not a path (expected a site-relative path inside {inside})"
    if rel.startswith("/"):
        return f"is an absolute path (expected a site-relative path inside {inside})"
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts) or not _SAFE_PATH_RE.match(rel):
        return (
            "is not a plain relative path (no '..', '.' or empty parts, no unusual characters) "
            f"inside {inside}"
        )
    if parts[0] not in import_dirs or len(parts) < 2:
        return f"is outside {inside} (the packages the series patches)"
    return None


def _validate_rel_path(raw: str, prefix: str, where: str, lineno: int, import_dir: str) -> str:
    path = raw.split("\t", 1)[0].rstrip()
    if not path.startswith(prefix):
        raise PatchFormatError(
            f"{where}: line {lineno}: diff path {path!r} must start with {prefix!r} or be /dev/null"
        )
    rel = path[len(prefix) :]
    pure = PurePosixPath(rel)
    if (
        not rel
        or not _SAFE_PATH_RE.match(rel)
        or pure.is_absolute()
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise PatchFormatError(f"{where}: line {lineno}: unsafe or malformed diff path {path!r}")
    if pure.parts[0] != import_dir or len(pure.parts) < 2:
        raise PatchFormatError(
            f"{where}: line {lineno}: diff path {path!r} is outside {import_dir}/ "
            f"(paths are relative to site-packages: a/{import_dir}/...)"
        )
    return rel


def _parse_diff(lines: list[str], first: int, where: str, import_dir: str) -> tuple[FileChange, ...]:
    """Walk the unified diff strictly (hunk line counts included) and list its files."""
    changes: list[FileChange] = []
    seen: set[str] = set()
    index = first
    n = len(lines)
    # Free text (e.g. a diffstat) may precede the first file header.
    while index < n and not lines[index].startswith(("--- ", "diff --git ")):
        index += 1
    while index < n:
        line = lines[index]
        lineno = index + 1
        if line == "-- ":  # git's signature separator ends the diff
            break
        if line.startswith(_GIT_UNSUPPORTED):
            raise PatchFormatError(f"{where}: line {lineno}: unsupported diff feature: {line[:60]!r}")
        if line.startswith(_GIT_IGNORED):
            index += 1
            continue
        if line.startswith("--- "):
            if index + 1 >= n or not lines[index + 1].startswith("+++ "):
                raise PatchFormatError(f"{where}: line {lineno}: '---' file line is not followed by '+++'")
            old_raw, new_raw = line[4:], lines[index + 1][4:]
            old_null = old_raw.split("\t", 1)[0].rstrip() == "/dev/null"
            new_null = new_raw.split("\t", 1)[0].rstrip() == "/dev/null"
            if old_null and new_null:
                raise PatchFormatError(f"{where}: line {lineno}: both sides of a diff are /dev/null")
            old_rel = None if old_null else _validate_rel_path(old_raw, "a/", where, lineno, import_dir)
            new_rel = None if new_null else _validate_rel_path(new_raw, "b/", where, lineno + 1, import_dir)
            if old_rel is not None and new_rel is not None and old_rel != new_rel:
                raise PatchFormatError(
                    f"{where}: line {lineno}: renames are not supported ({old_rel} -> {new_rel})"
                )
            rel = old_rel if old_rel is not None else new_rel
            assert rel is not None
            if rel in seen:
                raise PatchFormatError(
                    f"{where}: line {lineno}: {rel} appears twice in one patch "
                    "(merge its hunks into one diff)"
                )
            seen.add(rel)
            index += 2
            if index >= n or not _HUNK_RE.match(lines[index]):
                raise PatchFormatError(f"{where}: line {index + 1}: file {rel} has no hunk")
            hunks: list[Hunk] = []
            while index < n and _HUNK_RE.match(lines[index]):
                hunk, index = _consume_hunk(lines, index, where)
                hunks.append(hunk)
            changes.append(FileChange(rel, creates=old_null, deletes=new_null, hunks=tuple(hunks)))
            continue
        if not line.strip():
            index += 1
            continue
        raise PatchFormatError(f"{where}: line {lineno}: unexpected line outside a hunk: {line[:60]!r}")
    if not changes:
        raise PatchFormatError(f"{where}: no unified diff after the '---' line")
    return tuple(changes)


def _consume_hunk(lines: list[str], index: int, where: str) -> tuple[Hunk, int]:
    """Read the hunk whose ``@@`` line is ``lines[index]``; return it and the index after it."""
    match = _HUNK_RE.match(lines[index])
    assert match
    old = 1 if match.group(2) is None else int(match.group(2))
    new = 1 if match.group(4) is None else int(match.group(4))
    old_lines: list[str] = []
    new_lines: list[str] = []
    start = index + 1
    index += 1
    while old > 0 or new > 0:
        if index >= len(lines):
            raise PatchFormatError(f"{where}: line {start}: hunk ends early (file truncated?)")
        line = lines[index]
        tag, text = line[:1], line[1:]
        if tag in (" ", ""):  # an empty line is a context line whose blank was stripped
            old, new = old - 1, new - 1
            old_lines.append(text)
            new_lines.append(text)
        elif tag == "-":
            old -= 1
            old_lines.append(text)
        elif tag == "+":
            new -= 1
            new_lines.append(text)
        elif tag != "\\":
            raise PatchFormatError(f"{where}: line {index + 1}: bad line inside a hunk: {line[:60]!r}")
        if old < 0 or new < 0:
            raise PatchFormatError(f"{where}: line {start - 1}: hunk line counts do not match its @@ header")
        index += 1
    while index < len(lines) and lines[index].startswith("\\"):
        index += 1
    hunk = Hunk(lines[start - 1], int(match.group(1)), tuple(old_lines), tuple(new_lines))
    return hunk, index


def _check_fields(
    fields: dict[str, str], where: str, package: str
) -> tuple[tuple[VersionSpec, ...], VersionSpec | None, re.Pattern[str] | None]:
    """Validate the header fields; return ``Targets``, ``Upstream-Since`` and the compiled probe."""
    missing = [f for f in REQUIRED_FIELDS if f not in fields]
    if missing:
        raise PatchFormatError(f"{where}: missing required header field(s): {', '.join(missing)}")
    for field, value in fields.items():
        if not value:
            raise PatchFormatError(f"{where}: header field {field!r} is empty")

    import_dir = KNOWN_PACKAGES[package]
    targets = tuple(_parse_spec(part, where, "Targets") for part in fields["Targets"].split(","))
    for spec in targets:
        if spec.op != "==":
            raise PatchFormatError(f"{where}: Targets: {spec} must name exact versions with '=='")
        if spec.package != package:
            raise PatchFormatError(
                f"{where}: Targets: {spec} names {spec.package}, but the patch is in the {package}/ folder "
                f"and edits {import_dir}/"
            )

    since = None
    if "Upstream-Since" in fields:
        since = _parse_spec(fields["Upstream-Since"], where, "Upstream-Since")
    probe = None
    if "Upstream-Probe" in fields:
        if since is None:
            raise PatchFormatError(f"{where}: Upstream-Probe needs Upstream-Since")
        try:
            probe = re.compile(fields["Upstream-Probe"], re.MULTILINE)
        except re.error as exc:
            raise PatchFormatError(f"{where}: Upstream-Probe is not a valid regex: {exc}") from None

    return targets, since, probe


def parse_patch(path: Path, package: str, *, name: str | None = None) -> Patch:
    """Parse and validate one patch file of the ``package`` folder.

    Raises:
        PatchFormatError: a missing/duplicate/unknown/empty header field, a bad
            ``Targets``/``Upstream-Since`` spec, an uncompilable
            ``Upstream-Probe``, or a malformed diff; the message names the file.
    """
    where = str(path)
    data = _read(path)
    text = _utf8(data, where)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    fields, diff_start = _parse_header(lines, where)

    targets, since, probe = _check_fields(fields, where, package)
    diff_text = "\n".join(lines[diff_start:]) + "\n"
    files = _parse_diff(lines, diff_start, where, KNOWN_PACKAGES[package])
    return Patch(
        name=name or f"{package}/{path.name}",
        path=path,
        package=package,
        subject=fields["Subject"],
        why=fields["Why"],
        origin=fields["Origin"],
        upstream=fields["Upstream"],
        targets=targets,
        upstream_since=since,
        upstream_probe=probe,
        drop_when=fields["Drop-When"],
        diff=diff_text,
        files=files,
        sha256=hashlib.sha256(data).hexdigest(),
    )


def _read(path: Path) -> bytes:
    """A series or patch file's bytes; one that is not a regular file is a format error."""
    try:
        return read_regular(path)
    except NotRegularFileError as exc:
        raise PatchFormatError(str(exc)) from None


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchFormatError(f"{where}: not UTF-8 ({exc})") from None


def _kind(path: Path) -> str:
    """What is at ``path`` (following links), for messages; "a dangling symbolic link" when nothing."""
    try:
        return file_kind(path.stat().st_mode)
    except OSError:
        return "a dangling symbolic link" if path.is_symlink() else "unreadable"


def load_series(folder: Path) -> list[Patch]:
    """Parse ``folder/series`` and every patch it lists, in order.

    Raises:
        PatchFormatError: unknown folder, a ``series`` that is not a regular file, a listed
            file that is missing, not a regular file or listed twice, a name with a path
            separator, or any patch error.
    """
    package = canonical_package(folder.name)
    if package not in KNOWN_PACKAGES or folder.name != package:
        raise PatchFormatError(
            f"{folder}: unknown patch folder (expected one of: {', '.join(sorted(KNOWN_PACKAGES))})"
        )
    series = folder / "series"
    if not os.path.lexists(series):
        return []
    if not series.is_file():  # read as "no series", a directory or FIFO would un-apply the folder
        raise PatchFormatError(
            f"{series}: not a regular file ({_kind(series)}); a series is a file of patch names "
            "(a folder without patches has no series file)"
        )
    patches: list[Patch] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(_utf8(_read(series), str(series)).splitlines(), start=1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        if not _SERIES_NAME_RE.match(entry):
            raise PatchFormatError(
                f"{series}: line {lineno}: {entry!r} is not a plain file name in {folder.name}/"
            )
        if entry in seen:
            raise PatchFormatError(f"{series}: line {lineno}: {entry} is listed twice")
        seen.add(entry)
        path = folder / entry
        if not path.is_file():
            what = f"is not a regular file ({_kind(path)})" if os.path.lexists(path) else "does not exist"
            raise PatchFormatError(f"{series}: line {lineno}: {entry} {what} in {folder}")
        patches.append(parse_patch(path, package))
    return patches


def load_all_series(patches_dir: Path) -> list[Patch]:
    """Load every known upstream folder of ``patches_dir`` (``vllm`` first, then ``vllm-omni``).

    Raises:
        PatchFormatError: see :func:`load_series`; also a missing ``patches_dir`` and a
            package folder that is not a directory.
    """
    if not patches_dir.is_dir():
        found = f"not a directory ({_kind(patches_dir)})" if os.path.lexists(patches_dir) else "not found"
        raise PatchFormatError(f"{patches_dir}: patch directory {found}")
    patches: list[Patch] = []
    for package in sorted(KNOWN_PACKAGES):
        folder = patches_dir / package
        if folder.is_dir():
            patches.extend(load_series(folder))
        elif os.path.lexists(folder):
            raise PatchFormatError(
                f"{folder}: not a directory ({_kind(folder)}); a package's patches live in a folder "
                "(leave it out for a package without patches)"
            )
    for child in sorted(patches_dir.iterdir()):
        if child.is_dir() and child.name not in KNOWN_PACKAGES and (child / "series").exists():
            load_series(child)  # raises with the folder named
    return patches
