"""Mechanical rewrites that turn this project's files into vllm-omni's (no file is edited by hand).

- Python: vllm-omni's two-line SPDX header; the tests' imports of this project's ``minicpmo_cg``
  package and of ``tests/helpers`` pointed at vendored copies beside them (see :func:`vendor_tests`);
  markers vllm-omni does not register dropped (``multi_gpu``: the tests keep their own device-count
  skip); a level mark for an end-to-end module that has none. Formatting is ruff's (:mod:`.lint`).
- Markdown: relative links to files the export does not carry become plain text (vllm-omni's
  docs build fails on warnings).
"""

from __future__ import annotations

import ast
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.export import conventions as conv

__all__ = [
    "ExportError",
    "Vendored",
    "add_spdx",
    "export_test_source",
    "leftover_mentions",
    "strip_dead_links",
    "vendor_tests",
]

#: Builtin and plugin marks that need no registration.
_BUILTIN_MARKS = frozenset(
    {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings", "timeout", "asyncio"}
)
#: Packages of this project the tests may import, and the folder their modules are read from.
_VENDORED_PACKAGES = {"minicpmo_cg": "minicpmo_cg", "helpers": "tests/helpers"}
_VENDOR_PREFIX = {"minicpmo_cg": "minicpmo45_cg_", "helpers": "minicpmo45_cg_helpers_"}
_MENTION = re.compile(r"minicpmo[_-]cg", re.IGNORECASE)
#: This project's tooling, never vendored into vllm-omni's tests: a test that needs it imports it
#: with ``pytest.importorskip("minicpmo_cg.patchtool")`` and skips in vllm-omni's tree.
NOT_VENDORED = ("minicpmo_cg.patchtool", "minicpmo_cg.export", "minicpmo_cg.offline_gpu")


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


def export_test_source(text: str, relpath: str) -> tuple[str, set[tuple[str, str]]]:
    """A test module or test helper as exported: SPDX, vendored imports, markers, level mark."""
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
                f'import it with pytest.importorskip("{tool}") so the test skips in vllm-omni\'s tree'
            )


def vendor_tests(repo: Path, tests: dict[str, Path]) -> Vendored:
    """Export ``tests`` (relpath -> file) and copy every project module they need beside them.

    A test folder that imports ``minicpmo_cg.x`` (or ``helpers.x``) gets ``minicpmo45_cg_x.py``
    (``minicpmo45_cg_helpers_x.py``), itself exported the same way, transitively; pytest puts a
    test's folder on ``sys.path``, so the vendored modules import as top-level modules there.
    """
    out = Vendored()
    queue = [(rel, path, posixpath.dirname(rel)) for rel, path in sorted(tests.items())]
    while queue:
        rel, path, folder = queue.pop(0)
        if rel in out.files:
            continue
        text, used = export_test_source(path.read_text(encoding="utf-8"), rel)
        out.files[rel] = text
        for package, dotted in sorted(used):
            _check_vendorable(package, dotted, rel)
            source_rel, source = _module_source(repo, package, dotted)
            target = f"{folder}/{_vendor_name(package, dotted)}.py"
            out.vendored.setdefault(target, source_rel)
            queue.append((target, source, folder))
    return out


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


def leftover_mentions(files: dict[str, str]) -> list[str]:
    """``relpath:line: text`` of every mention of this project's package or tools left in ``files``."""
    found = []
    for rel, text in sorted(files.items()):
        for n, line in enumerate(text.splitlines(), 1):
            if _MENTION.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:100]}")
    return found
