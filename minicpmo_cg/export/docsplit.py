"""Which parts of a Markdown page belong to which pull request of the stack.

The design page describes the whole change set; each PR of the stack carries the page as far as
that PR and the ones before it go, and each PR's text shows only its own results. The page says
which part belongs where with HTML comments, invisible where the page is rendered:

- ``<!-- pr: KEY -->`` alone on a line opens a block that ``<!-- /pr -->`` closes: the lines
  between belong to the PR ``KEY``;
- a line ending in ``<!-- pr: KEY -->`` (a table row, a list item) belongs to ``KEY``;
- ``<!-- pr: KEY, KEY2 -->`` (either form) names several PRs: a results page's part that each of
  them shows (a sentence true of each), a design page's part shown from the first of them on;
- ``<!-- pr-before: KEY`` alone on a line opens a hidden block that ``-->`` alone on a line
  closes: the page's text *before* ``KEY`` (what ``KEY`` replaces). The page as this repository
  renders it (every PR applied) hides it;
- the stack table's ``page#Heading`` entries: the section and its subsections belong to that PR.

Python files (the owned modules beside the model file, the tests and the helper modules vendored
beside them) use comments alike: a line ``# pr: KEY`` alone opens a block that ``# /pr`` closes,
and a line ending in ``# pr: KEY`` belongs to ``KEY`` (a docstring's line too: a list item of a
later PR); a part of a later PR is left out of the file as the earlier PRs carry it
(:func:`source_version`), so a module arrives with the PR that adds it and grows with the PRs
whose code uses its later parts (an ``--hf-overrides`` key with the PR that reads it). Where a PR
*changes* lines an earlier PR carries (a rule that only its code needs), ``# pr-before: KEY``
alone on a line opens a block that ``# /pr-before`` closes, holding the earlier lines commented
out at the opener's indentation (``# `` before each, ``#`` alone for an empty line): the versions
before ``KEY`` carry them uncommented, the file itself (every PR applied) and the versions from
``KEY`` on leave them out, and the lines that replace them are tagged ``KEY``.

:func:`page_version` gives a design page as of a PR (parts of later PRs left out, hidden parts of
PRs not reached yet shown); :func:`own_parts` gives a results page with the parts tagged for other
PRs left out. Both drop the markers, and fail on a key the stack does not have, an unbalanced
marker, or (for a page version) a link to an anchor the version no longer has.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from minicpmo_cg.export.transform import ExportError

__all__ = ["anchors", "dangling_anchors", "own_parts", "page_version", "slug", "source_version"]

_KEYS = r"([\w-]+(?:\s*,\s*[\w-]+)*)"
_OPEN = re.compile(rf"^\s*<!--\s*pr:\s*{_KEYS}\s*-->\s*$")
_CLOSE = re.compile(r"^\s*<!--\s*/pr\s*-->\s*$")
_TRAILING = re.compile(rf"\s*<!--\s*pr:\s*{_KEYS}\s*-->\s*$")
_BEFORE_OPEN = re.compile(r"^\s*<!--\s*pr-before:\s*([\w-]+)\s*$")
_BEFORE_CLOSE = re.compile(r"^\s*-->\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_PY_OPEN = re.compile(rf"^\s*#\s*pr:\s*{_KEYS}\s*$")
_PY_CLOSE = re.compile(r"^\s*#\s*/pr\s*$")
_PY_TRAILING = re.compile(rf"\s*#\s*pr:\s*{_KEYS}\s*$")
_PY_BEFORE_OPEN = re.compile(r"^(\s*)#\s*pr-before:\s*([\w-]+)\s*$")
_PY_BEFORE_CLOSE = re.compile(r"^\s*#\s*/pr-before\s*$")
#: (open, close, trailing, before-open, before-close) markers by syntax.
_MARKERS = {
    "md": (_OPEN, _CLOSE, _TRAILING, _BEFORE_OPEN, _BEFORE_CLOSE),
    "py": (_PY_OPEN, _PY_CLOSE, _PY_TRAILING, _PY_BEFORE_OPEN, _PY_BEFORE_CLOSE),
}


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading: ``Options (`--hf-overrides`)`` -> ``options---hf-overrides``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _keys(group: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in group.split(","))


def _uncomment(line: str, indent: str, where: str, n: int) -> str:
    """A line of a Python ``pr-before`` block without its comment mark: ``indent + "# " + code`` ->
    ``indent + code``, ``indent + "#"`` -> an empty line."""
    if line.rstrip() == indent + "#":
        return ""
    if not line.startswith(indent + "# "):
        raise ExportError(
            f"{where}:{n}: a line of a pr-before block must be commented out at the block's indentation "
            f"({indent + '# '!r} before the code, {indent + '#'!r} alone for an empty line)"
        )
    return indent + line[len(indent) + 2 :]


def _tag_lines(
    text: str, where: str, syntax: str = "md"
) -> list[tuple[str, tuple[str, ...] | None, str | None]]:
    """``(line, in_keys, before_key)`` per kept line; marker lines dropped, trailing markers cut, the
    lines of a Python ``pr-before`` block uncommented."""
    open_re, close_re, trailing_re, before_open_re, before_close_re = _MARKERS[syntax]
    close_marker = "<!-- /pr -->" if syntax == "md" else "# /pr"
    open_marker = "<!-- pr: KEY -->" if syntax == "md" else "# pr: KEY"
    out: list[tuple[str, tuple[str, ...] | None, str | None]] = []
    block: tuple[str, tuple[str, ...], int] | None = None  # (kind, keys, line number)
    indent = ""  # the opener's indentation of a Python pr-before block
    for n, line in enumerate(text.split("\n"), 1):
        if m := open_re.match(line):
            if block:
                raise ExportError(f"{where}:{n}: a pr block inside the block opened at line {block[2]}")
            block = ("in", _keys(m.group(1)), n)
            continue
        if m := before_open_re.match(line):
            if block:
                raise ExportError(
                    f"{where}:{n}: a pr-before block inside the block opened at line {block[2]}"
                )
            block = ("before", (m.group(m.lastindex),), n)
            indent = m.group(1) if syntax == "py" else ""
            continue
        if close_re.match(line):
            if not block or block[0] != "in":
                raise ExportError(f"{where}:{n}: {close_marker} without {open_marker} before it")
            block = None
            continue
        if block and block[0] == "before" and before_close_re.match(line):
            block = None
            continue
        if syntax == "py" and before_close_re.match(line):
            raise ExportError(f"{where}:{n}: # /pr-before without # pr-before: KEY before it")
        in_key = block[1] if block and block[0] == "in" else None
        before_key = block[1][0] if block and block[0] == "before" else None
        if before_key and syntax == "py":
            out.append((_uncomment(line, indent, where, n), None, before_key))
            continue
        if m := trailing_re.search(line):
            if in_key and set(in_key) != set(_keys(m.group(1))):
                raise ExportError(f"{where}:{n}: a line tagged {m.group(1)!r} inside a block of {in_key!r}")
            line, in_key = line[: m.start()], _keys(m.group(1))
        out.append((line, in_key, before_key))
    if block:
        raise ExportError(
            f"{where}:{block[2]}: the {block[0]} block of {', '.join(block[1])!r} is never closed"
        )
    return out


def _section_keys(lines: list[str], sections: dict[str, str]) -> list[list[str]]:
    """Per line, the keys of the assigned sections (headings of the stack table) it lies in."""
    stack: list[tuple[int, str]] = []  # (level, key) of the open assigned sections
    fenced = False
    out = []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if m:
            level = len(m.group(1))
            stack = [(lv, key) for lv, key in stack if lv < level]
            if m.group(2) in sections:
                stack.append((level, sections[m.group(2)]))
        out.append([key for _, key in stack])
    return out


def _check_keys(tagged, known: set[str], where: str) -> None:
    used = {k for _, a, b in tagged for k in (*(a or ()), b) if k}
    unknown = sorted(used - known)
    if unknown:
        raise ExportError(
            f"{where}: tagged for {', '.join(unknown)}, no PR of the stack (keys: {', '.join(sorted(known))})"
        )


def _tidy(lines: list[str]) -> str:
    """Join ``lines``, at most one blank line in a row outside code fences."""
    out: list[str] = []
    fenced = False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and not line.strip() and out and not out[-1].strip():
            continue
        out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def _select(
    text: str,
    where: str,
    known: set[str],
    keep: Callable[[tuple[str, ...] | None, str | None, list[str]], bool],
    sections,
) -> str:
    tagged = _tag_lines(text, where)
    _check_keys(tagged, known, where)
    in_sections = _section_keys([line for line, _, _ in tagged], sections)
    kept = [line for (line, a, b), secs in zip(tagged, in_sections) if keep(a, b, secs)]
    return _tidy(kept)


def page_version(
    text: str, where: str, included: list[str], known: set[str], sections: dict[str, str] | None = None
) -> str:
    """The page as of the PR whose keys up to itself are ``included`` (stack order).

    A part tagged (or a section assigned) to a key outside ``included`` is left out (a part tagged
    with several keys shows once one of them is included); a ``pr-before`` part of a key outside
    ``included`` is shown.

    Raises:
        ExportError: an unknown key, an unbalanced marker, or a link to an anchor the version lacks.
    """
    inc = set(included)
    out = _select(
        text,
        where,
        known,
        lambda a, b, secs: (a is None or bool(inc & set(a)))
        and (b is None or b not in inc)
        and set(secs) <= inc,
        sections or {},
    )
    missing = dangling_anchors(out)
    if missing:
        raise ExportError(
            f"{where} as of PR {included[-1]}: links to {', '.join('#' + a for a in missing)}, which that version "
            "does not have; tag the link with the PR that adds the section"
        )
    return out


def source_version(text: str, where: str, included: list[str], known: set[str]) -> str:
    """A Python file as of the PR whose keys up to itself are ``included`` (stack order): the parts
    tagged for a key outside ``included`` left out, the ``pr-before`` parts of such a key uncommented
    and those of an included key left out, the markers dropped; the lines are otherwise kept as they
    are (blank lines too: the export's formatter tidies them). Other files are returned unchanged.

    Raises:
        ExportError: an unknown key, an unbalanced marker or a pr-before line that is not commented
            out at its block's indentation (the message names the line).
    """
    if not where.endswith(".py"):
        return text
    inc = set(included)
    tagged = _tag_lines(text, where, "py")
    _check_keys(tagged, known, where)
    kept = [
        line
        for line, keys, before in tagged
        if (keys is None or inc & set(keys)) and (before is None or before not in inc)
    ]
    return "\n".join(kept)


def own_parts(text: str, where: str, key: str, known: set[str]) -> str:
    """``text`` without the parts tagged for other PRs only (and without hidden ``pr-before`` parts):
    a part tagged ``KEY, KEY2`` is kept for both."""
    return _select(text, where, known, lambda a, b, secs: b is None and (a is None or key in a), {})


def anchors(text: str) -> set[str]:
    """The anchors of ``text``'s headings (outside code fences)."""
    out, fenced = set(), False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and (m := _HEADING.match(line)):
            out.add(slug(m.group(2)))
    return out


def dangling_anchors(text: str) -> list[str]:
    """Anchors linked as ``](#anchor)`` that no heading of ``text`` has, in order of appearance."""
    have = anchors(text)
    found = re.findall(r"\]\(#([^)\s]+)\)", text)
    return list(dict.fromkeys(a for a in found if a not in have))
