"""Mechanical rewrites that turn this project's files into vllm-omni's (no file is edited by hand).

- Python: vllm-omni's two-line SPDX header; the tests' imports of this project's ``minicpmo_cg``
  package and of ``tests/helpers`` pointed at vendored copies beside them (see :func:`vendor_tests`);
  markers vllm-omni does not register dropped (``multi_gpu``: the tests keep their own device-count
  skip); a level mark for an end-to-end module that has none. Formatting is ruff's (:mod:`.lint`).
- Markdown: relative links to files the export does not carry become plain text (vllm-omni's
  docs build fails on warnings).
- Both: lines between project-only markers (:data:`conventions.PROJECT_ONLY_MARKERS`) are dropped,
  names with this project's prefix renamed (:data:`conventions.UPSTREAM_RENAMES`), and references
  to vendored modules (``minicpmo_cg.inputs.VisionInput``) point at the vendored copy.
  :func:`project_mentions` finds what still names this project (:data:`conventions.PROJECT_WORDS`).
"""

from __future__ import annotations

import ast
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv

__all__ = [
    "NOT_UPSTREAM",
    "POSITIONAL",
    "ExportError",
    "Vendored",
    "add_spdx",
    "drop_project_only",
    "export_test_source",
    "project_mentions",
    "rename_project_names",
    "strip_dead_links",
    "vendor_tests",
]

#: Builtin and plugin marks that need no registration.
_BUILTIN_MARKS = frozenset(
    {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings", "timeout", "asyncio"}
)
#: Packages of this project the tests may import, and the folder their modules are read from.
_VENDORED_PACKAGES = {"minicpmo_cg": "minicpmo_cg", "helpers": "tests/helpers"}
_VENDOR_PREFIX = {"minicpmo_cg": "minicpmo45_", "helpers": "minicpmo45_helpers_"}
_MENTION = re.compile("|".join(f"(?:{w})" for w in conv.PROJECT_WORDS), re.IGNORECASE)
#: What vllm-omni does not have (this project's demo, benchmark and results page), for
#: :func:`project_mentions` ``words``.
NOT_UPSTREAM = re.compile("|".join(f"(?:{w})" for w in conv.NOT_UPSTREAM_WORDS), re.IGNORECASE)
#: Positional references, which a pull request body assembled from several pages cannot keep.
POSITIONAL = re.compile("|".join(f"(?:{w})" for w in conv.POSITIONAL_WORDS), re.IGNORECASE)
#: This project's tooling, never vendored into vllm-omni's tests: a test that needs it is marked
#: project-only (:func:`drop_project_only`) and left out of the export.
NOT_VENDORED = ("minicpmo_cg.patchtool", "minicpmo_cg.export", "minicpmo_cg.offline_gpu")


_PY_MARKERS = conv.PROJECT_ONLY_MARKERS[".py"]


class ExportError(RuntimeError):
    """The change set cannot be exported as it is (the message names the file and the reason)."""


def add_spdx(text: str, lines: tuple[str, ...] = conv.SPDX_LINES) -> str:
    """``text`` with its SPDX lines replaced by ``lines`` (after a shebang, if any)."""
    body = text.splitlines(keepends=True)
    head = [body.pop(0)] if body and body[0].startswith("#!") else []
    while body and body[0].startswith(("# SPDX-License-Identifier:", "# SPDX-FileCopyrightText:")):
        body.pop(0)
    return "".join(head) + "".join(f"{line}\n" for line in lines) + "".join(body)


def _vendor_name(package: str, dotted: str) -> str:
    return _VENDOR_PREFIX[package] + dotted.replace(".", "_")


def _rewrite_from_names(indent: str, package: str, names: str, where: str) -> str:
    if "(" in names or names.rstrip().endswith("\\"):
        raise ExportError(f"{where}: `from {package} import ...` over several lines is not supported")
    out = []
    for item in names.split(","):
        parts = item.split()
        if len(parts) not in (1, 3) or (len(parts) == 3 and parts[1] != "as"):
            raise ExportError(f"{where}: cannot read the import of {item.strip()!r} from {package}")
        module, alias = parts[0], parts[-1]
        out.append(f"{indent}import {_vendor_name(package, module)} as {alias}")
    return "\n".join(out)


def rewrite_imports(text: str, where: str) -> tuple[str, set[tuple[str, str]]]:
    """Point every import of a vendored package at its vendored module.

    Returns the new text and the ``(package, dotted module)`` pairs it now imports. Works line
    by line, so code inside strings (a subprocess script) is rewritten too.

    Raises:
        ExportError: an import form without a vendored equivalent (``import minicpmo_cg.x``
            without ``as``, a parenthesised ``from minicpmo_cg import (...)``).
    """
    used: set[tuple[str, str]] = set()
    lines = text.split("\n")
    for i, line in enumerate(lines):
        for package in _VENDORED_PACKAGES:
            pkg = re.escape(package)
            if m := re.match(rf"^(\s*)from {pkg}\.([\w.]+) import (.+)$", line):
                used.add((package, m.group(2)))
                line = f"{m.group(1)}from {_vendor_name(package, m.group(2))} import {m.group(3)}"
            elif m := re.match(rf"^(\s*)from {pkg} import (.+)$", line):
                used.update((package, item.split()[0]) for item in m.group(2).split(",") if item.strip())
                line = _rewrite_from_names(m.group(1), package, m.group(2), f"{where}:{i + 1}")
            elif m := re.match(rf"^(\s*)import {pkg}\.([\w.]+) as (\w+)\s*$", line):
                used.add((package, m.group(2)))
                line = f"{m.group(1)}import {_vendor_name(package, m.group(2))} as {m.group(3)}"
            elif re.match(rf"^\s*import {pkg}\b", line):
                raise ExportError(
                    f"{where}:{i + 1}: `{line.strip()}`: import with `as` or `from` to export it"
                )
        lines[i] = line
    return "\n".join(lines), used


def _drop_markers(text: str) -> str:
    for name in conv.DROPPED_MARKERS:
        mark = re.escape(f"pytest.mark.{name}")
        text = re.sub(rf"(?m)^[ \t]*@?{mark},?[ \t]*\n", "", text)
        text = re.sub(rf",[ \t]*{mark}\b|\b{mark},[ \t]*", "", text)
    return text


def _check_markers(text: str, where: str) -> None:
    unknown = sorted(
        set(re.findall(r"pytest\.mark\.(\w+)", text)) - _BUILTIN_MARKS - set(conv.UPSTREAM_MARKERS)
    )
    if unknown:
        raise ExportError(
            f"{where}: marker(s) {', '.join(unknown)} are not registered in vllm-omni "
            f"(known: {', '.join(conv.UPSTREAM_MARKERS)}); add them to DROPPED_MARKERS or use a known one"
        )


def _ensure_level(text: str, relpath: str) -> str:
    if not Path(relpath).name.startswith("test_"):
        return text
    if any(f"pytest.mark.{level}" in text for level in conv.LEVEL_MARKERS):
        return text
    if not relpath.startswith("tests/e2e/"):
        raise ExportError(
            f"{relpath}: no level mark ({', '.join(conv.LEVEL_MARKERS)}); vllm-omni's CI needs one"
        )
    tree = ast.parse(text)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if not imports:
        raise ExportError(f"{relpath}: no top-level import to put the level mark after")
    lines = text.split("\n")
    lines.insert(imports[-1].end_lineno, f"\npytestmark = [pytest.mark.{conv.E2E_DEFAULT_LEVEL}]")
    return "\n".join(lines)


def drop_project_only(text: str, relpath: str) -> str:
    """``text`` without its project-only blocks: the marker lines and every line between them.

    The markers (:data:`conventions.PROJECT_ONLY_MARKERS`, by file suffix) stand alone on their
    lines, indented or not. Files of other suffixes are returned unchanged.

    Raises:
        ExportError: a block opened inside another, a closing marker without an opening one, or
            a block left open at the end of the file (the message names the line).
    """
    markers = conv.PROJECT_ONLY_MARKERS.get(PurePosixPath(relpath).suffix)
    if markers is None:
        return text
    begin, end = markers
    kept: list[str] = []
    opened: int | None = None
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped == begin:
            if opened is not None:
                raise ExportError(f"{relpath}:{n}: {begin!r} inside the block opened at line {opened}")
            opened = n
        elif stripped == end:
            if opened is None:
                raise ExportError(f"{relpath}:{n}: {end!r} without {begin!r} before it")
            opened = None
        elif opened is None:
            kept.append(line)
    if opened is not None:
        raise ExportError(f"{relpath}:{opened}: {begin!r} is never closed by {end!r}")
    return "".join(kept)


def rename_project_names(text: str) -> str:
    """``text`` with each name of :data:`conventions.UPSTREAM_RENAMES` replaced (whole words)."""
    for old, new in conv.UPSTREAM_RENAMES.items():
        text = re.sub(rf"(?<![\w-]){re.escape(old)}", new, text)
    return text


def export_test_source(text: str, relpath: str) -> tuple[str, set[tuple[str, str]]]:
    """A test module or test helper as exported: project-only blocks dropped, names renamed,
    SPDX, vendored imports, markers, level mark."""
    text = rename_project_names(drop_project_only(text, relpath))
    text, used = rewrite_imports(text, relpath)
    text = _drop_markers(text)
    _check_markers(text, relpath)
    text = _ensure_level(text, relpath)
    return add_spdx(text), used


@dataclass
class Vendored:
    """The exported tests: relpath -> text, and what was vendored where (for the report)."""

    files: dict[str, str] = field(default_factory=dict)
    vendored: dict[str, str] = field(default_factory=dict)  # exported relpath -> project source relpath


def _module_source(repo: Path, package: str, dotted: str) -> tuple[str, Path]:
    base = repo / _VENDORED_PACKAGES[package] / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(repo).as_posix(), candidate
    raise ExportError(f"the exported tests import {package}.{dotted}, which is not in {repo}")


def _check_vendorable(package: str, dotted: str, importer: str) -> None:
    full = f"{package}.{dotted}"
    for tool in NOT_VENDORED:
        if full == tool or full.startswith(tool + "."):
            raise ExportError(
                f"{importer}: imports {full}, this project's tooling, which does not go into vllm-omni; "
                f"put the code that needs it between {_PY_MARKERS[0]!r} and {_PY_MARKERS[1]!r} lines"
            )


def vendor_tests(
    repo: Path, tests: dict[str, Path], version: Callable[[str, str], str] | None = None
) -> Vendored:
    """Export ``tests`` (relpath -> file) and copy every project module they need beside them.

    A test folder that imports ``minicpmo_cg.x`` (or ``helpers.x``) gets ``minicpmo45_x.py``
    (``minicpmo45_helpers_x.py``), itself exported the same way, transitively; pytest puts a
    test's folder on ``sys.path``, so the vendored modules import as top-level modules there.
    ``version(text, relpath)`` gives each file as of the PR being exported (its parts of later PRs
    left out, :func:`.docsplit.source_version`) before it is exported.
    """
    out = Vendored()
    queue = [(rel, path, posixpath.dirname(rel)) for rel, path in sorted(tests.items())]
    while queue:
        rel, path, folder = queue.pop(0)
        if rel in out.files:
            continue
        source = path.read_text(encoding="utf-8")
        text, used = export_test_source(version(source, rel) if version else source, rel)
        out.files[rel] = text
        for package, dotted in sorted(used):
            _check_vendorable(package, dotted, rel)
            source_rel, source = _module_source(repo, package, dotted)
            target = f"{folder}/{_vendor_name(package, dotted)}.py"
            out.vendored.setdefault(target, source_rel)
            queue.append((target, source, folder))
    out.files = {rel: point_references_at_vendored(text, out.vendored) for rel, text in out.files.items()}
    return out


def point_references_at_vendored(text: str, vendored: dict[str, str]) -> str:
    """References in prose to a vendored module name its copy; others stay as they are.

    ``vendored`` maps each copy's relpath to its source's (``tests/x/minicpmo45_inputs.py`` ->
    ``minicpmo_cg/inputs.py``): the source path becomes the copy's path, a dotted reference
    (``minicpmo_cg.inputs.VisionInput``, ``helpers.host_reads.HostReads``) the copy's module name
    (``minicpmo45_inputs.VisionInput``, ``minicpmo45_helpers_host_reads.HostReads``).
    """
    modules = {PurePosixPath(target).stem for target in vendored}
    for target, source in sorted(vendored.items()):
        text = re.sub(rf"(?<![\w/.]){re.escape(source)}\b", target, text)

    def dotted(m: re.Match[str]) -> str:
        name = _vendor_name(m.group(1), m.group(2))
        return name if name in modules else m.group(0)

    # a dotted reference: ``minicpmo_cg.inputs.X``, ``helpers.host_reads.HostReads`` (not ``x.helpers.y``)
    return re.sub(r"(?<![\w.])(minicpmo_cg|helpers)\.([a-z_]\w*)", dotted, text)


_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def strip_dead_links(text: str, doc_relpath: str, exported: set[str]) -> str:
    """Turn relative links to files outside ``exported`` into their plain text."""
    folder = posixpath.dirname(doc_relpath)

    def keep_or_strip(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)
        resolved = posixpath.normpath(posixpath.join(folder, target.split("#", 1)[0]))
        return m.group(0) if resolved in exported else m.group(1)

    return _LINK.sub(keep_or_strip, text)


def project_mentions(
    files: dict[str, str], allowed_prefix: str | None = None, words: re.Pattern[str] | None = None
) -> list[str]:
    """``name:line: text`` of every line of ``files`` (name -> text) that names this project.

    What names it is :data:`conventions.PROJECT_WORDS`, or ``words`` (e.g. :data:`NOT_UPSTREAM`,
    :data:`POSITIONAL`). A line starting with ``allowed_prefix`` (the pull request's note on where
    its measurements come from) is allowed once per file.
    """
    pattern = words or _MENTION
    found = []
    for rel, text in sorted(files.items()):
        allowed = allowed_prefix
        for n, line in enumerate(text.splitlines(), 1):
            if not pattern.search(line):
                continue
            if allowed and line.startswith(allowed):
                allowed = None
                continue
            found.append(f"{rel}:{n}: {line.strip()[:120]}")
    return found
