# SPDX-License-Identifier: Apache-2.0
"""The repository's Markdown: relative links resolve, and the design pages keep their shape.

- Every relative link of the repository's Markdown (the top-level pages, ``patches/``, ``docs/``)
  names a file or folder of the checkout and, when it carries an anchor into a Markdown file, one
  of that file's headings (GitHub's anchors).
- The design overview stays an overview (at most 250 lines) and links every topic page, which link
  back to it; the overview and its topic pages together hold at most 40,000 characters.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[1]
DESIGN = "docs/design/minicpmo_encoder_cuda_graph.md"
TOPICS = "docs/design/minicpmo_encoder_cuda_graph"
OVERVIEW_MAX_LINES = 250
DESIGN_MAX_CHARS = 40_000

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


def markdown_files() -> list[str]:
    """The repository's Markdown: the top-level pages, ``patches/`` and everything under ``docs/``."""
    found = [REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "patches").glob("*.md")]
    found += (REPO / "docs").rglob("*.md")
    return sorted(p.relative_to(REPO).as_posix() for p in found if p.is_file())


def _prose_lines(text: str) -> list[str]:
    """``text``'s lines with fenced code blanked and inline code spans removed (their brackets are no links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, link syntax reduced to its text, every character
    but letters, digits, ``_``, ``-`` and spaces dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of every heading outside fenced code; a repeated anchor gets ``-1``, ``-2``, ..."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            anchor = github_anchor(m.group(2))
            n = counts.get(anchor, 0)
            counts[anchor] = n + 1
            found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def relative_links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every link and image of ``text`` that is neither a URL nor ``mailto:``."""
    return [
        (n, m.group(1))
        for n, line in enumerate(_prose_lines(text), 1)
        for m in _LINK.finditer(line)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1))
    ]


def resolve(doc: str, target: str) -> tuple[str, str]:
    """``(repo-relative path, anchor)`` a link of ``doc`` points at."""
    path, _, anchor = target.partition("#")
    return (posixpath.normpath(posixpath.join(posixpath.dirname(doc), path)) if path else doc), anchor


def test_anchors_follow_github():
    assert github_anchor("Options (`--hf-overrides`)") == "options---hf-overrides"
    assert github_anchor("The image call: SigLIP attention × slices (run 1)") == (
        "the-image-call-siglip-attention--slices-run-1"
    )
    assert github_anchor("Demo (`minicpmo-cg-demo`, current lane, full size)") == (
        "demo-minicpmo-cg-demo-current-lane-full-size"
    )
    assert anchors("# A\n## A\n```\n## B\n```\n") == {"a", "a-1"}


def test_relative_links_are_found_outside_code():
    text = "[a](x.md) `[b](y.md)` [c](https://e.org)\n```\n[d](z.md)\n```\n![e](img.png#top)\n"
    assert relative_links(text) == [(1, "x.md"), (5, "img.png#top")]


@pytest.mark.parametrize("doc", markdown_files())
def test_every_relative_link_resolves(doc):
    problems = []
    for line, target in relative_links((REPO / doc).read_text(encoding="utf-8")):
        path, anchor = resolve(doc, target)
        if not (REPO / path).exists():
            problems.append(f"{doc}:{line}: {target}: no {path}")
        elif anchor and path.endswith(".md"):
            if anchor not in anchors((REPO / path).read_text(encoding="utf-8")):
                problems.append(f"{doc}:{line}: {target}: {path} has no heading with the anchor #{anchor}")
    assert not problems, "\n".join(problems)


def rendered(text: str) -> str:
    """``text`` as it renders: without HTML comments, a comment on lines of its own with those lines."""
    text = re.sub(r"^[ \t]*<!--.*?-->[ \t]*\n", "", text, flags=re.S | re.M)
    return re.sub(r"[ \t]*<!--.*?-->", "", text, flags=re.S)


def test_design_overview_is_short_and_links_every_topic_page():
    overview = (REPO / DESIGN).read_text(encoding="utf-8")
    assert len(rendered(overview).splitlines()) <= OVERVIEW_MAX_LINES
    linked = {resolve(DESIGN, target)[0] for _, target in relative_links(overview)}
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / TOPICS).glob("*.md"))
    assert pages and set(pages) <= linked
    for page in pages:
        back = {resolve(page, t)[0] for _, t in relative_links((REPO / page).read_text(encoding="utf-8"))}
        assert DESIGN in back, f"{page} does not link back to the overview"


def test_design_pages_stay_within_their_character_budget():
    pages = [REPO / DESIGN, *sorted((REPO / TOPICS).glob("*.md"))]
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8")) for p in pages}
    total = sum(sizes.values())
    assert total <= DESIGN_MAX_CHARS, f"design pages total {total} characters (limit {DESIGN_MAX_CHARS}): {sizes}"
