"""Edits to vllm-omni files that the release wheel does not carry: the Buildkite step and the docs nav.

The wheel has no ``.buildkite/`` or ``docs/``, and PyPI has no source archive of the pinned
releases (vllm-omni's sdists stop at 0.20.0), so these edits cannot be diffed against the release
and are not in the series. :func:`render` writes them out for the person opening the PR
(``UPSTREAM-EDITS.md``: the files, where, the exact lines; nothing about this project's tooling);
:func:`apply_to_checkout` makes the same edits in a vllm-omni git checkout, each anchored on what is
already there and failing when the anchor is missing (never guessing a place):

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

__all__ = [
    "EDITS_FILE",
    "STEP_KEY",
    "EditError",
    "apply_to_checkout",
    "clone_nav_line",
    "clone_step",
    "commit_title",
    "e2e_command",
    "render",
    "step_label",
]

#: The file of a PR's folder that describes these edits.
EDITS_FILE = "UPSTREAM-EDITS.md"


class EditError(RuntimeError):
    """An anchor of an edit is missing from the checkout's file (the message names both)."""


def e2e_command(files: list[str]) -> str | None:
    tests = [f for f in files if f.startswith("tests/e2e/") and PurePosixPath(f).name.startswith("test_")]
    # the e2e test skips without a checkpoint: let the step fetch it from the hub
    return f"{conv.E2E_HUB_ENV}=1 pytest -sv {' '.join(tests)}" if tests else None


#: The ``key:`` of the copied Buildkite step.
STEP_KEY = "minicpmo-4-5-encoder-cuda-graph"


#: What the hand edit of each file adds: the heading of its section in ``UPSTREAM-EDITS.md`` and
#: the PR text's note on its commit (:func:`hand_commits`).
EDIT_SUMMARY = {
    conv.BUILDKITE_READY: "a CI step for the eager vs graphed serving test",
    conv.NAV_FILE: "the design page in the docs navigation",
    conv.DESIGN_INDEX_FILE: "a link to the design page",
}


def commit_title(rel: str) -> str:
    """The title of the commit that makes the edit of ``rel`` (one commit per edited file)."""
    what = {
        conv.BUILDKITE_READY: "eager vs graphed encoder CUDA graph e2e step",
        conv.NAV_FILE: "list the design page in the docs navigation",
        conv.DESIGN_INDEX_FILE: "link the design page from the design index",
    }[rel]
    prefix = conv.TITLE_PREFIX_CI if rel.startswith(".buildkite/") else conv.TITLE_PREFIX_DOC
    return f"{prefix} {conv.MODEL_TITLE}: {what}"


def step_label() -> str:
    return f"Omni · {conv.MODEL_TITLE} Encoder CUDA Graph Test (eager vs graphed)"


def _page_title(design_rel: str) -> str:
    return f"{conv.MODEL_TITLE} Input Encoder CUDA Graphs"


def hand_commits(files: list[str], design_rel: str | None) -> list[tuple[str, str]]:
    """(commit title, what it edits) of the commits :func:`render` asks for, in its order."""
    edited = ([conv.BUILDKITE_READY] if e2e_command(files) else []) + (
        [conv.NAV_FILE, conv.DESIGN_INDEX_FILE] if design_rel else []
    )
    return [(commit_title(rel), f"`{rel}`: {EDIT_SUMMARY[rel]}") for rel in edited]


def render(files: list[str], design_rel: str | None, release: str | None = None) -> str | None:
    """``UPSTREAM-EDITS.md`` of a PR whose files are ``files`` and which adds the design page
    ``design_rel`` (or none), made against vllm-omni ``release``: for the person opening the PR,
    which files of vllm-omni's git tree to edit and how, with the exact lines to add (the edits
    :func:`apply_to_checkout` makes); None when the PR needs no such edit."""
    command = e2e_command(files)
    if not command and not design_rel:
        return None
    version = f"vllm-omni {release}" if release else "the vllm-omni release"
    lines = [
        "# Edits to vllm-omni files that are not in this patch series",
        "",
        f"The patch series of this folder was made and checked against the {version} wheel from PyPI,",
        "which holds only the `vllm_omni/` package (PyPI has no source archive of this release). The files",
        "named here are in vllm-omni's git repository but not in that wheel, so the series cannot carry",
        "them: after `git am --keep-non-patch` of the series on the branch of this PR, make these edits by",
        "hand, each as a commit of its own signed off like the others (`git commit -s`).",
        "",
    ]
    n = 0
    if command:
        n += 1
        lines += [
            f"## {n}. `{conv.BUILDKITE_READY}`: {EDIT_SUMMARY[conv.BUILDKITE_READY]}",
            "",
            f"Commit title: `{commit_title(conv.BUILDKITE_READY)}`",
            "",
            f"In the group whose `group:` line names `{conv.BUILDKITE_E2E_GROUP}`, find the step whose `label:`",
            f"contains `{conv.BUILDKITE_SIBLING_STEP}`. Add a copy of that whole step (same agents, plugins,",
            "environment, timeout and dependencies) right after it, and change three things in the copy:",
            "",
            f"1. its label: `{step_label()}`;",
            f"2. its `key:`, if the step has one: `{STEP_KEY}`;",
            "3. its pytest command: replace the step's `pytest` line (all of them, when it has several) by",
            "   this one line, at the same indentation:",
            "",
            f"       {command}",
            "",
            "The test starts the server four times, one after the other (the encoder CUDA graphs off and on,",
            "each with SigLIP's SDPA and eager attention), and compares the answers: the copy's timeout must",
            f"cover four model loads. `{conv.E2E_HUB_ENV}=1` lets it download `openbmb/MiniCPM-o-4_5` (without it,",
            "and without a cached checkpoint, the test skips). If the group has no such step, add one with the",
            "agents and plugins of the group's other steps that serve a model on a GPU.",
            "",
        ]
    if design_rel:
        page = PurePosixPath(design_rel).name
        nav_page = design_rel.removeprefix("docs/")
        title = _page_title(design_rel)
        lines += [
            f"## {n + 1}. `{conv.NAV_FILE}`: {EDIT_SUMMARY[conv.NAV_FILE]}",
            "",
            f"Commit title: `{commit_title(conv.NAV_FILE)}`",
            "",
            f"Right after the line that names `{conv.NAV_SIBLING_PAGE}`, add this line at the same",
            "indentation:",
            "",
            f"    - {title}: {nav_page}",
            "",
            f"## {n + 2}. `{conv.DESIGN_INDEX_FILE}`: {EDIT_SUMMARY[conv.DESIGN_INDEX_FILE]}",
            "",
            f"Commit title: `{commit_title(conv.DESIGN_INDEX_FILE)}`",
            "",
            f"Right after the line that links `{conv.NAV_SIBLING_PAGE}`, add this line at the same",
            "indentation:",
            "",
            f"    - [{title}]({page})",
            "",
            f"If `{conv.NAV_FILE}` or `{conv.DESIGN_INDEX_FILE}` does not name `{conv.NAV_SIBLING_PAGE}`, put",
            "its line with the other model-specific design pages of that file. The design page links its topic",
            "pages itself; they need no entry.",
            "",
        ]
    lines += [
        "The unit tests need no CI edit: `tests/model_executor/` is collected by the existing L1",
        "(`core_model and cpu`) and L2 (`core_model and cuda`) steps.",
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
    block = [re.sub(r"^(\s*key:\s*).*$", rf"\g<1>{STEP_KEY}", ln) for ln in block]
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
