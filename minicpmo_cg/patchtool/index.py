"""``patches/INDEX.md``: a one-page index of the series, generated from the patch headers."""

from __future__ import annotations

import re
from pathlib import Path

from minicpmo_cg.patchtool.series import Patch

__all__ = ["INDEX_NAME", "render_index"]

INDEX_NAME = "INDEX.md"

_SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z(])")


def first_sentence(text: str, limit: int = 240) -> str:
    """The first sentence of ``text`` (to ``.``, ``;`` or ``:`` before a capital), at most ``limit`` chars."""
    sentence = _SENTENCE_END.split(text.strip(), maxsplit=1)[0]
    if len(sentence) > limit:
        sentence = sentence[: limit - 3].rsplit(" ", 1)[0] + "..."
    return sentence


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(patch: Patch) -> str:
    folder, name = patch.name.split("/", 1)
    link = f"[{patch.name}]({folder}/{name})"
    files = "<br>".join(f"`{rel}`" for rel in patch.file_paths)
    versions = ", ".join(spec.version for spec in patch.targets)
    if patch.upstream_since is not None:
        versions += f"; upstream since {patch.upstream_since}"
    cells = [link, files, versions, first_sentence(patch.why), patch.upstream, patch.drop_when]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render_index(patches: list[Patch]) -> str:
    """The Markdown text of ``INDEX.md`` for ``patches`` (series order, vLLM first)."""
    lines = [
        "# Patch index",
        "",
        "Generated from the patch headers by `minicpmo-cg-patch index --write`; do not edit by hand",
        "(`tests/patches` fails when it is out of date). The format of the headers is in",
        "[README.md](README.md); the full `Why` is in each patch.",
        "",
        "| patch | changes | targets | why | upstream | drop when |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_row(patch) for patch in patches]
    return "\n".join(lines) + "\n"


def index_path(patches_dir: Path) -> Path:
    return patches_dir / INDEX_NAME
