"""Edits to vllm-omni files that the release wheel does not carry: the Buildkite step and the docs nav.

The wheel has no ``.buildkite/`` or ``docs/``, so these edits cannot be diffed against the pinned
release. :func:`render` describes them (``UPSTREAM-EDITS.md``); :func:`apply_to_checkout` makes them
in a vllm-omni git checkout, each anchored on what is already there and failing when the anchor
is missing (never guessing a place):

- Buildkite: the MiniCPM-o online e2e step of ``.buildkite/cuda/test-ready.yml`` is cloned (same
  agents, plugins, environment and dependency group) into one that runs the exported serving test,
  which starts an eager and a graphed server and compares their answers;
- docs: the design page is listed next to the MiniCPM-o performance page in ``docs/.nav.yml`` and
  ``docs/design/index.md``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv

__all__ = ["EDITS_FILE", "EditError", "clone_nav_line", "clone_step", "e2e_command", "render", "step_label"]

#: The file of a PR's folder that describes these edits.
EDITS_FILE = "UPSTREAM-EDITS.md"


class EditError(RuntimeError):
    """An anchor of an edit is missing from the checkout's file (the message names both)."""


def e2e_command(files: list[str]) -> str | None:
    tests = [f for f in files if f.startswith("tests/e2e/") and PurePosixPath(f).name.startswith("test_")]
    return f"pytest -sv {' '.join(tests)}" if tests else None


def step_label() -> str:
    return f"Omni · {conv.MODEL_TITLE} Encoder CUDA Graph Test (eager vs graphed)"


def _page_title(design_rel: str) -> str:
    return f"{conv.MODEL_TITLE} Input Encoder CUDA Graphs"


def render(files: list[str], design_rel: str | None) -> str | None:
    """``UPSTREAM-EDITS.md`` of a PR whose files are ``files`` and which adds the design page
    ``design_rel`` (or none): what :func:`apply_to_checkout` does, for a maintainer without the
    tool; None when the PR needs no such edit."""
    command = e2e_command(files)
    if not command and not design_rel:
        return None
    lines = [
        "# Edits to files the vllm-omni release wheel does not carry",
        "",
        "The series of this folder is checked against the release wheel, which has no `.buildkite/` or",
        "`docs/`. These edits are made by `minicpmo-cg-patch export --checkout DIR` in a vllm-omni git",
        "checkout (each next to an anchor that must exist there); by hand they are:",
        "",
    ]
    n = 0
    if command:
        n += 1
        lines += [
            f"{n}. `{conv.BUILDKITE_READY}`: in the group `{conv.BUILDKITE_E2E_GROUP}`, a copy of the step",
            f"   `{conv.BUILDKITE_SIBLING_STEP}` labelled `{step_label()}`, whose pytest command is:",
            "",
            f"       {command}",
            "",
            "   It serves MiniCPM-o 4.5 twice (encoder graphs off, then on) and compares the answers.",
        ]
    if design_rel:
        page = PurePosixPath(design_rel).name
        lines += [
            f"{n + 1}. `{conv.NAV_FILE}`: `{page}` listed next to `{conv.NAV_SIBLING_PAGE}`.",
            f"{n + 2}. `{conv.DESIGN_INDEX_FILE}`: a link `[{_page_title(design_rel)}]({page})` next to the one to",
            f"   `{conv.NAV_SIBLING_PAGE}`.",
        ]
    lines += [
        "",
        "The unit tests need no step: `tests/model_executor/` is collected by the existing L1 (`core_model and cpu`)",
        "and L2 (`core_model and cuda`) steps.",
    ]
    return "\n".join(lines) + "\n"


def _block_end(lines: list[str], start: int, indent: int) -> int:
    end = start + 1
    while end < len(lines):
        line = lines[end]
        if line.strip() and (len(line) - len(line.lstrip())) <= indent:
            break
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return end


def clone_step(text: str, command: str, path: str = conv.BUILDKITE_READY) -> str:
    """``text`` (a pipeline file) with the sibling step cloned after itself, relabelled, running ``command``.

    Raises:
        EditError: no E2E group, no sibling step in it, or a sibling without a pytest command line.
    """
    lines = text.split("\n")
    group = next((i for i, ln in enumerate(lines) if "group:" in ln and conv.BUILDKITE_E2E_GROUP in ln), None)
    if group is None:
        raise EditError(f"{path}: no group named {conv.BUILDKITE_E2E_GROUP!r}")
    start = next(
        (
            i
            for i in range(group, len(lines))
            if "label:" in lines[i] and conv.BUILDKITE_SIBLING_STEP in lines[i]
        ),
        None,
    )
    if start is None:
        raise EditError(
            f"{path}: no step labelled {conv.BUILDKITE_SIBLING_STEP!r} in {conv.BUILDKITE_E2E_GROUP!r}"
        )
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = _block_end(lines, start, indent)
    block = lines[start:end]
    pytest_lines = [i for i, ln in enumerate(block) if re.search(r"\bpytest\b", ln)]
    if not pytest_lines:
        raise EditError(
            f"{path}: the step {conv.BUILDKITE_SIBLING_STEP!r} has no pytest command line to replace"
        )
    first = pytest_lines[0]
    m = re.match(r"^(\s*(?:-\s+)?(?:command:\s*)?)(.*?)(\s*\\?)$", block[first])
    block[first] = f"{m.group(1)}{command}"
    block = [ln for i, ln in enumerate(block) if i not in pytest_lines[1:]]
    block = [re.sub(r"(label:\s*['\"]?)[^'\"]*", rf"\g<1>{step_label()}", block[0], count=1)] + block[1:]
    block = [re.sub(r"^(\s*key:\s*).*$", r"\1minicpmo-4-5-encoder-cuda-graph", ln) for ln in block]
    return "\n".join(lines[:end] + [""] + block + lines[end:])


def clone_nav_line(text: str, page_rel: str, title: str, path: str) -> str:
    """``text`` with the line naming the sibling page cloned after itself for ``page_rel``/``title``.

    Raises:
        EditError: no line names the sibling page.
    """
    lines = text.split("\n")
    at = next((i for i, ln in enumerate(lines) if conv.NAV_SIBLING_PAGE in ln), None)
    if at is None:
        raise EditError(f"{path}: no line names {conv.NAV_SIBLING_PAGE!r} to list the design page next to")
    sibling = lines[at]
    new = sibling.replace(conv.NAV_SIBLING_PAGE, PurePosixPath(page_rel).name)
    if m := re.search(r"\[([^\]]+)\]\(", new):
        new = new[: m.start(1)] + title + new[m.end(1) :]
    elif m := re.match(r"^(\s*-\s*)([^:]+?)(\s*:\s*\S+\s*)$", new):
        new = f"{m.group(1)}{title}{m.group(3)}"
    lines.insert(at + 1, new)
    return "\n".join(lines)


def apply_to_checkout(checkout: Path, files: list[str], design_rel: str | None) -> dict[str, str]:
    """Make a PR's edits in ``checkout``'s files (the Buildkite step when the PR has a serving test,
    the navigation entries when it adds ``design_rel``); return relpath -> new text (nothing written).

    Raises:
        EditError: a file or an anchor is missing.
    """
    out = {}
    command = e2e_command(files)
    edits = [(conv.NAV_FILE, None), (conv.DESIGN_INDEX_FILE, None)] if design_rel else []
    if command:
        edits.insert(0, (conv.BUILDKITE_READY, command))
    for rel, cmd in edits:
        path = checkout / rel
        if not path.is_file():
            raise EditError(f"{path}: missing in the vllm-omni checkout")
        text = path.read_text(encoding="utf-8")
        if cmd is not None:
            out[rel] = clone_step(text, cmd, rel)
        else:
            page = design_rel if rel == conv.NAV_FILE else PurePosixPath(design_rel).name
            page = page.removeprefix("docs/")
            out[rel] = clone_nav_line(text, page, _page_title(design_rel), rel)
    return out
