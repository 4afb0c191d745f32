"""The pull request descriptions, in vllm-omni's template sections, written from the checkout.

One description per PR of the stack. Nothing here is fixed text about the change: the purpose
comes from the PR's patch headers, its new modules' docstrings and (for the PR adding it) the
design page as of that PR; the measurements from the results page's sections the stack table
gives the PR (its parts for other PRs left out); the dependencies from the stack; the versions
from the lane and the installed distributions' requirements; the test lines from the runs of
``--run-tests``. The fixed sentences say where and how it was tested and what was not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import testmarks, transform
from minicpmo_cg.export.pytestlog import Collection
from minicpmo_cg.export.vllm_main import MainCheck
from minicpmo_cg.patchtool.series import Patch

__all__ = [
    "PrInputs",
    "PytestRun",
    "heading_for_upstream",
    "lane_view",
    "markdown_sections",
    "omni_pr",
    "pin_differences",
    "plain_links",
    "run_lines",
    "stack_overview",
    "tables_with_captions",
    "pytest_commands",
    "vllm_changes_needed",
    "vllm_pr",
]


def markdown_sections(text: str) -> list[tuple[int, str, str]]:
    """``(level, heading, body)`` of every ATX heading outside code fences, in order."""
    out: list[tuple[int, str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if m:
            out.append((len(m.group(1)), m.group(2), []))
        elif out:
            out[-1][2].append(line)
    return [(level, heading, "\n".join(body).strip()) for level, heading, body in out]


def sentence_start(text: str) -> str:
    """``text`` as the start of a sentence: its first letter in upper case (a patch's Why may go on from
    its subject in lower case), unless its first word is a code name (``get_audio_hidden_states``,
    ``vpm.forward``), which keeps its case and is set in backticks instead."""
    word = re.match(r"[A-Za-z_][\w.]*(?:\(\))?", text)
    if word and re.search(r"[_.(]", word.group(0)):
        return f"`{word.group(0)}`{text[word.end() :]}"
    return text[:1].upper() + text[1:]


def section(text: str, prefix: str) -> str | None:
    """Body of the first heading starting with ``prefix`` (its subsections included), or None."""
    found = markdown_sections(text)
    for i, (level, heading, body) in enumerate(found):
        if heading.startswith(prefix):
            parts = [body]
            for sub_level, sub_heading, sub_body in found[i + 1 :]:
                if sub_level <= level:
                    break
                parts.append(f"{'#' * (sub_level + 1)} {sub_heading}\n\n{sub_body}")
            return "\n\n".join(p for p in parts if p)
    return None


def tables(body: str) -> list[str]:
    """The Markdown tables of ``body``: runs of ``|`` lines whose second line is the ``|---|`` row."""
    found, run = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            run.append(line)
            continue
        if len(run) >= 2 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", run[1].strip()):
            found.append("\n".join(run))
        run = []
    return found


def lead(body: str) -> str:
    """The first paragraph of ``body``, with the block after it when the paragraph ends with a colon."""
    blocks = re.split(r"\n\s*\n", body.strip())
    if len(blocks) > 1 and blocks[0].rstrip().endswith(":"):
        return "\n\n".join(blocks[:2])
    return blocks[0] if body.strip() else ""


def plain_links(text: str) -> str:
    """Relative links and anchors become their text (a PR body cannot resolve them); URLs stay."""
    return re.sub(
        r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)",
        lambda m: m.group(0) if re.match(r"^[a-z][a-z0-9+.-]*://", m.group(2)) else m.group(1),
        text,
    )


def first_paragraph(body: str) -> str:
    return re.split(r"\n\s*\n", body.strip(), maxsplit=1)[0] if body.strip() else ""


def _split_cell(cell: str, index: int, count: int) -> str:
    """Part ``index`` of a cell holding ``count`` values joined by `` / `` (bold kept), else the cell."""
    text = cell.strip()
    bold = text.startswith("**") and text.endswith("**") and len(text) > 4
    inner = text[2:-2] if bold else text
    parts = inner.split(" / ")
    if len(parts) != count:
        return cell
    return f" **{parts[index]}** " if bold else f" {parts[index]} "


def _lane_order(header: list[str], lanes: tuple[str, ...]) -> tuple[str, ...] | None:
    for cell in header:
        for m in re.finditer(r"\w+(?: / \w+)+", cell):
            names = tuple(m.group(0).split(" / "))
            if set(names) <= set(lanes):
                return names
    return None


def lane_view(table: str, lane: str, lanes: tuple[str, ...]) -> str:
    """A results table as measured on ``lane`` alone, for a reader who knows only the versions.

    - A table whose first column is ``lane``: only the rows of ``lane``, its first cell the
      versions in its parentheses (``current (vLLM 0.30.0 + vllm-omni 0.30.0)`` ->
      ``vLLM 0.30.0 + vllm-omni 0.30.0``), the column named ``versions``.
    - A table whose header names the lanes as ``a / b``: in each cell of that many `` / ``-joined
      values, ``lane``'s value; the lane names leave the header.
    Other tables are returned unchanged.
    """
    rows = [re.split(r"(?<!\\)\|", line.strip()[1:-1]) for line in table.splitlines()]
    header = [c.strip() for c in rows[0]]
    if header[0] == "lane":
        kept = [rows[0], rows[1]]
        for row in rows[2:]:
            first = row[0].strip()
            if first.split(" ", 1)[0] == lane:
                versions = re.search(r"\(([^)]*)\)", first)
                kept.append([f" {versions.group(1) if versions else first} ", *row[1:]])
        kept[0] = [" versions ", *rows[0][1:]]
        rows = kept
    elif (order := _lane_order(header, lanes)) and lane in order:
        at, count = order.index(lane), len(order)
        joined = re.escape(" / ".join(order))
        rows[0] = [re.sub(rf",?\s*{joined}", "", c) for c in rows[0]]
        rows = [rows[0], rows[1]] + [[_split_cell(c, at, count) for c in row] for row in rows[2:]]
    else:
        return table
    return "\n".join("|" + "|".join(row) + "|" for row in rows)


def heading_for_upstream(heading: str) -> str:
    """``heading`` without the parenthesised items that name this project or a lane:
    ``Demo (`minicpmo-cg-demo`, current lane, full size)`` -> ``Demo (full size)``."""

    def keep(m: re.Match[str]) -> str:
        items = [i for i in m.group(1).split(", ") if not transform.project_mentions({"": i})]
        return f" ({', '.join(items)})" if items else ""

    return re.sub(r"\s*\(([^()]*)\)", keep, heading)


#: :attr:`PytestRun.scope` of a run of the PR's own test files (those it adds or changes)
OWN = "own"
#: :attr:`PytestRun.scope` of a run of the earlier PRs' test files on the PR's tree
EARLIER = "earlier"


@dataclass
class PytestRun:
    """One pytest run of a PR's tests from its vllm-omni (or vLLM) tree.

    Attributes:
        marks: the ``-m`` expression ('' for none: every collected test runs).
        summary: pytest's summary line without its duration (``12 passed, 3 deselected``), or None.
        skipped: skip reason -> number of tests skipped for it.
        environment: where it ran (``Python 3.11.9, torch 2.13.0+cu130, transformers 5.14.1``).
        ok: pytest's exit status was 0 (or 5: no test of ``marks``).
        warnings: warning (category, where it is raised, its first sentence) -> how many times
            pytest's warnings summary counts it; the counts add up to the summary's ``N warnings``.
        files: the test files the run named, relative to the tree's root (the command runs them).
        scope: :data:`OWN` (the PR's own test files) or :data:`EARLIER` (the earlier PRs' test files
            that the PR leaves as they are, run on the PR's tree).
        collection: the tests the run collected with their marks and those ``-m`` deselected
            (:mod:`.pytestlog`); None where the run did not record them.
        warnings_unknown: the run's summary counts warnings that its record does not itemise.
        on_gpu: it ran where CUDA had a device (its CUDA tests could run).
    """

    marks: str
    summary: str | None
    skipped: dict[str, int] = field(default_factory=dict)
    environment: str = ""
    ok: bool = True
    warnings: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    scope: str = OWN
    collection: Collection | None = None
    warnings_unknown: bool = False
    on_gpu: bool = False

    @property
    def command(self) -> str:
        """The pytest command line of the run, from the tree's root (``pytest -m "..." FILES``)."""
        marks = f' -m "{self.marks}"' if self.marks else ""
        return f"pytest{marks} {' '.join(self.files)}".rstrip()


#: The repositories the PRs go to
OMNI_REPO, VLLM_REPO = "vllm-project/vllm-omni", "vllm-project/vllm"


@dataclass(frozen=True)
class PrRef:
    """How one PR's text names another PR of the export: by its number once it is opened
    (``export --pr-number KEY=N``), before that by what a reader can follow, its place in the stack
    (as ``STACK.md`` lists it) and the branch ``export --checkout`` makes for it.

    Attributes:
        title: the PR's title.
        folder: its folder in the export (``NN-key``, ``vllm-key``).
        repo: :data:`OMNI_REPO` or :data:`VLLM_REPO`.
        number: its number in ``repo`` once opened, else None.
        position: ``(k, n)``: PR k of the n vllm-omni PRs of the stack; None for a vLLM PR.
        branch: the branch ``--checkout`` makes for it (``PREFIX-NN-key``); None for a vLLM PR.
    """

    title: str
    folder: str
    repo: str
    number: int | None = None
    position: tuple[int, int] | None = None
    branch: str | None = None

    @property
    def link(self) -> str | None:
        """``vllm-project/vllm#123`` once the PR has a number, else None."""
        return f"{self.repo}#{self.number}" if self.number else None

    def text(self) -> str:
        """``vllm-project/vllm-omni#123: TITLE``, or before it is opened ``TITLE (not opened yet:
        PR 2 of the 6 of the stack, branch `prefix-02-key`)``."""
        if self.link:
            return f"{self.link}: {self.title}"
        if self.position:
            k, n = self.position
            where = f"PR {k} of the {n} of the stack, branch `{self.branch}`"
        else:
            where = f"the vLLM pull request `{self.folder}` of the stack"
        return f"{self.title} (not opened yet: {where})"


@dataclass
class PrInputs:
    """What one PR's description is made from (all read at export time)."""

    key: str
    number: int
    title: str
    patches: list[Patch]
    commits: list[str]
    vllm_version: str
    omni_version: str
    omni_commit: str | None = None
    #: (file name, docstring) of the owned modules the PR adds
    modules: list[tuple[str, str]] = field(default_factory=list)
    #: paragraphs the stack table adds to the Purpose after the new modules
    remarks: list[str] = field(default_factory=list)
    #: what the PR's own paths hold that no run measured (its text's "Not run" lists them)
    not_run: list[str] = field(default_factory=list)
    #: (page, its version as of this PR) when the PR adds a design page
    design: tuple[str, str] | None = None
    #: (page, its version) of the other design pages the PR adds (topic pages)
    pages_added: list[tuple[str, str]] = field(default_factory=list)
    #: (page, heading) of the sections the PR adds to a page an earlier PR added
    sections_added: list[tuple[str, str]] = field(default_factory=list)
    test_files: list[str] = field(default_factory=list)
    #: the ``-m`` expressions of :data:`UNIT_MARKS` that select at least one of the unit tests
    #: (:func:`minicpmo_cg.export.testmarks.levels_with_tests`); a level without tests is not listed
    unit_marks: tuple[str, ...] = ()
    #: the earlier PRs' test files this PR leaves as they are (:func:`.pytestlog.earlier_test_files`),
    #: which its tree runs too, and the levels of :data:`UNIT_MARKS` that select some of their tests
    earlier_test_files: list[str] = field(default_factory=list)
    earlier_marks: tuple[str, ...] = ()
    multi_gpu: bool = False
    #: (title, what it edits) of the commits made by hand on the branch (:func:`.upstream_edits.hand_commits`)
    hand_commits: list[tuple[str, str]] = field(default_factory=list)
    #: (title, folder) of the earlier PRs of the stack, of the vLLM PRs it needs, of the PRs needing it
    earlier: list[tuple[str, str]] = field(default_factory=list)
    vllm_deps: list[tuple[str, str]] = field(default_factory=list)
    #: (title, folder) of the vLLM PRs an earlier PR of the stack needs and this one does not name itself
    vllm_via: list[tuple[str, str]] = field(default_factory=list)
    needed_by: list[tuple[str, str]] = field(default_factory=list)
    total: int = 1
    results_headings: tuple[str, ...] = ()
    #: how many PRs of the stack, from the first, the tree of the GPU figures had applied (0: unknown)
    measured_upto: int = 0
    #: (title, folder) of the vLLM PRs that tree needs (its vLLM had them applied)
    measured_vllm: list[tuple[str, str]] = field(default_factory=list)
    #: the results page without project-only parts and without the parts of other PRs
    results_text: str | None = None
    #: distribution -> its requirements (``torch==2.13.0``, ``python>=3.10``)
    requirements: dict[str, list[str]] = field(default_factory=dict)
    lane: str = "current"
    lanes: tuple[str, ...] = ("current",)
    runs: list[PytestRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the series checked against an upstream ``main`` checkout (``export --vllm-checkout`` for a vLLM
    #: PR, ``--vllm-omni-checkout`` for the stack up to a vllm-omni PR); None: not checked
    main_check: MainCheck | None = None
    #: folder -> how this text names that PR (every PR of the export)
    refs: dict[str, PrRef] = field(default_factory=dict)

    def ref(self, title: str, folder: str) -> str:
        """How this text names the PR ``folder`` (:class:`PrRef`); its title where none is known."""
        found = self.refs.get(folder)
        return found.text() if found else title


UNIT_MARKS = ("core_model and cpu", "core_model and cuda")
_DIST_NAMES = {"vllm": "vLLM", "vllm-omni": "vllm-omni"}


def tables_with_captions(body: str) -> list[tuple[str, str]]:
    """``(caption, table)`` for every table of ``body``: the paragraph right before it ('' if none)."""
    blocks = re.split(r"\n\s*\n", body.strip())
    out = []
    for i, block in enumerate(blocks):
        for table in tables(block):
            before = block[: block.index(table)].strip() or (blocks[i - 1].strip() if i else "")
            out.append((before, table))
    return out


def _anchor_links(text: str, page: str | None, design_text: str | None) -> str:
    """Links to a heading of the design page name the section (a PR body has no anchors)."""
    if not design_text:
        return text
    from minicpmo_cg.export.docsplit import slug

    by_anchor = {slug(h): h for _, h, _ in markdown_sections(design_text)}

    def name(m: re.Match[str]) -> str:
        heading = by_anchor.get(m.group(2))
        if heading is None:
            return m.group(1)
        shown = plain_links(heading)
        if m.group(1).strip().lower() in ("above", "below", "here", "there"):
            return f'the section "{shown}" of `{page}`'
        if m.group(1).strip().lower() == shown.lower():
            return f'"{shown}" (`{page}`)'
        return f'{m.group(1)} ("{shown}" in `{page}`)'

    return re.sub(r"(?<!!)\[([^\]]+)\]\(#([^)\s]+)\)", name, text)


def _purpose(inp: PrInputs) -> list[str]:
    out = [conv.PR_TEMPLATE_HEADINGS[0], ""]
    where = f"on the v{inp.omni_version} release" + (
        " with the PRs it depends on applied" if inp.earlier else ""
    )
    out += [
        f"PR {inp.number} of {inp.total} of a stack of pull requests for MiniCPM-o 4.5's input encoders; "
        f"it applies {where}.",
        "",
    ]
    many = len(inp.patches) > 1
    for patch in inp.patches:
        subject = patch.subject.removeprefix("minicpmo_4_5: ")
        why = sentence_start(patch.why)
        out += [f"**{subject[0].upper()}{subject[1:]}.** {why}" if many else why, ""]
    for name, doc in inp.modules:
        summary = _plain_roles(first_paragraph(doc))
        if summary:
            out += [f"New module `{name}`: {summary}", ""]
    for remark in inp.remarks:
        out += [remark, ""]
    if inp.design:
        out += _design_parts(inp)
    for page, text in inp.pages_added:
        lead = plain_links(
            first_paragraph("\n".join(line for line in text.splitlines() if not line.startswith("# ")))
        )
        lead = re.sub(
            r"^Part of .*?\.\s+(?=[A-Z])", "", " ".join(lead.split())
        )  # the link back to the overview
        lead = lead.replace("This page ", "The page ")  # the PR text is not the page
        out += [f"New design page `{page}`: {lead}", ""]
    by_page: dict[str, list[str]] = {}
    for page, heading in inp.sections_added:
        by_page.setdefault(page, []).append(f'"{plain_links(heading)}"')
    for page, headings in by_page.items():
        which = f"the section {headings[0]}" if len(headings) == 1 else (
            f"the sections {', '.join(headings[:-1])} and {headings[-1]}"
        )  # fmt: skip
        out += [f"The design page `{page}` gains {which}.", ""]
    out += ["### Commits", ""] + [f"{i}. {t}" for i, t in enumerate(inp.commits, 1)] + [""]
    if inp.hand_commits:
        first = len(inp.commits) + 1
        out += [
            f"To add by hand on the branch, after the series: edits to files that are in vllm-omni's git tree "
            f"but not in the v{inp.omni_version} wheel the series was built on (not made yet):",
            "",
            *(f"{i}. {title} ({what})" for i, (title, what) in enumerate(inp.hand_commits, first)),
            "",
        ]
    return out + _depends_on(inp)


def _plain_roles(text: str) -> str:
    """Sphinx roles of a docstring as plain code spans (``:func:`.x``` -> ```x```): GitHub shows
    the roles literally."""
    return re.sub(r":(?:func|mod|class|meth|data|attr|exc|obj):`[~.]*([^`]+)`", r"`\1`", text)


def _design_parts(inp: PrInputs) -> list[str]:
    page, text = inp.design
    out = []
    why = section(text, "Why")
    if why:
        out += ["### Why", "", _anchor_links(plain_links_keep_anchors(why), page, text), ""]
    for prefix, name, whole in (("What is captured", "What is captured", True), ("Options", "Options", False),
                                ("Stats", "Stats", False)):  # fmt: skip
        body = section(text, prefix)
        if body is None:
            inp.notes.append(f"{page} has no section starting with {prefix!r}")
            continue
        if whole:
            picked = [body]
        else:
            picked = [first_paragraph(body)]
            for caption, table in tables_with_captions(body):
                picked += [caption, table] if caption and caption != picked[0] else [table]
        rendered = _anchor_links(plain_links_keep_anchors("\n\n".join(p for p in picked if p)), page, text)
        out += [f"### {name}", "", rendered, ""]
    out += [f"The whole design, limits included, is the new page `{page}`.", ""]
    return out


def plain_links_keep_anchors(text: str) -> str:
    """:func:`plain_links` for links to files; links to anchors are left for :func:`_anchor_links`."""
    return re.sub(
        r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)",
        lambda m: m.group(0) if re.match(r"^([a-z][a-z0-9+.-]*://|#)", m.group(2)) else m.group(1),
        text,
    )


def _vllm_changes(
    inp: PrInputs, changes: list[tuple[str, str]], needs: str, merge: str, tests: str
) -> list[str]:
    """The paragraph of :func:`_depends_on` on vLLM changes (the PR's own, or its earlier PRs')."""
    count = "a change" if len(changes) == 1 else f"{len(changes)} changes"
    return [
        f"{needs} {count} to vLLM that vLLM {inp.vllm_version} does not have, proposed to vllm-project/vllm as "
        "its own pull request:",
        "",
        *(f"- {inp.ref(title, folder)}" for title, folder in changes),
        "",
        f"{merge} vllm-omni's vLLM pin includes that change; {conv.TRACKER_RULE}. On a vLLM without it "
        "nothing breaks: the encoder graphs stay off, the encoders run eagerly and the model logs one WARNING "
        "saying why. "
        f"{tests} ran against vLLM {inp.vllm_version} with the change applied; on a vLLM without it, the tests "
        "that build vLLM's manager with the new argument fail, so CI can pass only after the pin bump.",
        "",
    ]


def _depends_on(inp: PrInputs) -> list[str]:
    out = ["### Depends on", ""]
    if inp.earlier:
        out.append("The earlier pull requests of the stack, in this order (this one applies on top of them):")
        out.append("")
        out += [f"{i}. {inp.ref(title, folder)}" for i, (title, folder) in enumerate(inp.earlier, 1)]
        out.append("")
    if inp.vllm_deps:
        out += _vllm_changes(inp, inp.vllm_deps, "It needs", "So it can merge only once", "Its tests")
    if inp.vllm_via:
        out += _vllm_changes(
            inp,
            inp.vllm_via,
            "Through the earlier pull requests it also needs",
            "So it can merge only after them, once",
            "The tests on its tree (its own and the earlier PRs')",
        )
    if not inp.earlier and not inp.vllm_deps:
        out += [
            f"Nothing beyond vLLM {inp.vllm_version} and vllm-omni {inp.omni_version}: it can merge on the "
            "current vLLM pin.",
            "",
        ]
    return out


def pytest_commands(files: list[str], levels: tuple[str, ...] = UNIT_MARKS) -> list[str]:
    """The pytest command lines of a PR's test files: one per unit level of ``levels`` (the ``-m``
    expressions that select some of its unit tests), then each serving test."""
    units = sorted(f for f in files if not f.startswith("tests/e2e/"))
    e2e = sorted(f for f in files if f.startswith("tests/e2e/"))
    out = [f'pytest -sv {" ".join(units)} -m "{marks}"' for marks in levels] if units else []
    return out + [
        f"{conv.E2E_HUB_ENV}=1 pytest -sv {f}  # serving, an 80 GB GPU; downloads openbmb/MiniCPM-o-4_5 "
        f"(or set {conv.E2E_MODEL_ENV} to a local copy instead); without either, and without the checkpoint in the Hugging Face cache, it skips"
        for f in e2e
    ]


def vllm_changes_needed(inp: PrInputs) -> str:
    """What the PR's tree needs on top of the vLLM release, for its Test Plan's vLLM line: the vLLM
    PRs it depends on itself or through an earlier PR of the stack, named by their stack keys
    (`` with the vLLM change (capture error mode)``); ``""`` when it needs none."""
    folders = list(dict.fromkeys(f for _, f in inp.vllm_deps + inp.vllm_via))
    links = {f: inp.refs[f].link for f in folders if f in inp.refs and inp.refs[f].link}
    names = [
        f.removeprefix("vllm-").replace("-", " ") + (f", {links[f]}" if f in links else "") for f in folders
    ]
    if not names:
        return ""
    return f" with the vLLM change{'s' if len(names) > 1 else ''} ({', '.join(names)})"


def _test_plan(inp: PrInputs) -> list[str]:
    omni = f"v{inp.omni_version} release"
    omni += f" (commit {inp.omni_commit})" if inp.omni_commit else " (its wheel records no commit id)"
    omni += " + the earlier PRs of the stack" if inp.earlier else ""
    vllm = inp.vllm_version + vllm_changes_needed(inp)
    out = [
        conv.PR_TEMPLATE_HEADINGS[1],
        "",
        f"{conv.PR_FIELD_VLLM} {vllm}",
        "",
        f"{conv.PR_FIELD_OMNI} {omni} + this PR",
        "",
    ]
    commands = pytest_commands(inp.test_files, inp.unit_marks)
    if commands:
        out += ["```bash", *commands, "```", ""]
    return out


def run_lines(runs: list[PytestRun], accounted: bool = False) -> list[str]:
    """One bullet per run: its command (the test files it named), pytest's summary, where it ran,
    why tests skipped and what warned (category, where raised, how many times). ``accounted``: the
    lines after these account for the collected tests (:func:`accounting_lines`), so a run's
    deselected tests need no sentence of their own."""
    out = []
    for run in runs:
        parts = [
            f"`{run.command}`: `{run.summary or 'no summary'}`"
            + (f", {run.environment}" if run.environment else "")
        ]
        if run.skipped:
            parts.append(
                "Skipped: " + "; ".join(f"{n} × {reason}" for reason, n in sorted(run.skipped.items()))
            )
        if run.warnings:
            parts.append("Warnings: " + "; ".join(f"{n} × {w}" for w, n in sorted(run.warnings.items())))
        elif run.warnings_unknown:
            parts.append("Warnings: counted by pytest, not itemised in the record of this run")
        if run.summary and "deselected" in run.summary and run.collection is None and not accounted:
            parts.append(f'Deselected: the collected tests that `-m "{run.marks}"` does not select')
        # one sentence each: a part that ends a sentence of its own (a warning's message) gets no second stop
        out.append("- " + " ".join(p if p.endswith((".", "!", "?")) else p + "." for p in parts))
    return out


@dataclass
class Accounting:
    """Where each test that some runs of one scope collected went (:func:`account`).

    Attributes:
        tests: every collected test (node id) -> its mark names, over the runs' collections.
        selected: per run (in the order given), the tests it selected.
        unrun: per unit level no run used (``-m`` expression), the tests it would select.
        unselected: the tests no run and no unrun level selects.
    """

    tests: dict[str, list[str]]
    selected: list[list[str]]
    unrun: list[tuple[str, list[str]]]
    unselected: list[str]


def _union(collections: list[Collection]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The tests of several runs' collections, once each (node id -> marks), and the ids that name
    one of them differently (id -> the id kept).

    A parametrized test's id is built from its values by the pytest of the host that collects it,
    and two hosts' pytest versions may build it differently: the k-th case of a test function
    collected under an id that another run collected as the k-th case under another id is the same
    test, kept under the id of the run given first.
    """
    tests: dict[str, list[str]] = {}
    alias: dict[str, str] = {}
    cases: dict[str, list[str]] = {}  # test function -> its cases kept, in collection order
    for collection in collections:
        seen: dict[str, int] = {}
        for node, marks in collection.tests.items():
            function = node.split("[", 1)[0]
            k = seen.get(function, 0)
            seen[function] = k + 1
            kept = cases.setdefault(function, [])
            if node in tests:
                continue
            if "[" in node and k < len(kept) and kept[k] not in collection.tests:
                alias[node] = kept[k]
                continue
            tests[node] = marks
            kept.append(node)
    return tests, alias


def _selects(expression: str, marks: list[str]) -> bool:
    return not expression or testmarks.expression_selects(expression, frozenset(marks))


def account(runs: list[PytestRun], levels: tuple[str, ...] = UNIT_MARKS) -> Accounting | None:
    """Account for every test the runs of one scope collected: which each run selected, which a
    unit level of ``levels`` that no run used would select, and which none selects. None when no
    run recorded its collection."""
    tests, alias = _union([run.collection for run in runs if run.collection is not None])
    if not tests:
        return None
    selected = []
    for run in runs:
        if run.collection is not None:
            selected.append([alias.get(n, n) for n in run.collection.selected])
            continue
        try:  # no record of its own: its expression on the others' marks
            selected.append([n for n, marks in tests.items() if _selects(run.marks, marks)])
        except ValueError:  # not a conjunction of marks: which tests it selected is not known
            return None
    ran = {run.marks for run in runs}
    unrun = []
    for level in levels:
        would = [n for n, marks in tests.items() if _selects(level, marks)]
        if level not in ran and would:
            unrun.append((level, would))
    taken = {n for group in selected for n in group} | {n for _, group in unrun for n in group}
    return Accounting(tests, selected, unrun, [n for n in tests if n not in taken])


#: pytest's own marks: they say how a test runs, not which level selects it
_PYTEST_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}


def _why_unselected(marks: list[str], levels: list[str]) -> str:
    shown = ", ".join(f"`{m}`" for m in marks) or "no marks"
    if "core_model" not in marks:
        return f"marked {shown}, not `core_model`, which each unit level requires"
    return f"marked {shown}, which none of {', '.join(f'`{lv}`' for lv in levels)} selects"


def _unselected_groups(acc: Accounting, levels: list[str]) -> list[tuple[str, list[str], str]]:
    """``(file, node ids, why)`` of the tests no run selects, grouped by file and marks."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for node in acc.unselected:
        marks = tuple(m for m in acc.tests[node] if m not in _PYTEST_MARKS)
        groups.setdefault((node.split("::", 1)[0], marks), []).append(node)
    out = []
    for (path, marks), nodes in groups.items():
        why = _why_unselected(list(marks), levels)
        if path.startswith("tests/e2e/"):
            why += "; the serving end to end tests (an 80 GB GPU and the MiniCPM-o 4.5 checkpoint)"
        out.append((path, nodes, why))
    return out


def accounting_lines(runs: list[PytestRun], levels: tuple[str, ...] = UNIT_MARKS) -> list[str]:
    """The bullets that account for the tests the runs (of one scope) collected, after their run
    lines: how many each unit level that no run used would select, and which tests no run selects
    and why. ``[]`` when no run recorded its collection."""
    acc = account(runs, levels)
    if acc is None:
        return []
    used = list(dict.fromkeys([r.marks for r in runs if r.marks] + [lv for lv, _ in acc.unrun]))
    out = [f'- `-m "{level}"` selects {len(nodes)} of them: not run.' for level, nodes in acc.unrun]
    for path, nodes, why in _unselected_groups(acc, used):
        count = "1 test" if len(nodes) == 1 else f"{len(nodes)} tests"
        out.append(f"- No run selects {count} of `{path}`: {why}.")
    by_runs = {n for group in acc.selected for n in group}
    by_levels = {n for _, group in acc.unrun for n in group} - by_runs
    parts = [f"{len(by_runs)} selected by the runs"]
    parts += [f"{len(by_levels)} only by a level not run"] if by_levels else []
    parts += [f"{len(acc.unselected)} by none"] if acc.unselected else []
    out.append(f"- In all, the {len(acc.tests)} collected tests: {', '.join(parts)}.")
    return out


def collected_count(runs: list[PytestRun]) -> int | None:
    """How many tests the runs (of one scope) collected together; None when none recorded it."""
    acc = account(runs)
    return len(acc.tests) if acc else None


def _versions_in(text: str) -> dict[str, str]:
    found = {}
    for name, version in re.findall(r"\b(torch|transformers|Python)\s+(\d[\w.+]*\w)", text):
        found.setdefault(name.lower(), version)
    return found


def pin_differences(setup: str, requirements: dict[str, list[str]], versions: dict[str, str]) -> list[str]:
    """Where the versions named in ``setup`` fall outside a requirement of a pinned distribution.

    ``requirements``: distribution -> requirement strings; ``versions``: distribution -> its pinned
    version (for the sentence). Returns ``"torch 2.11.0+cu130 (vLLM 0.30.0 requires torch==2.13.0)"``
    items; requirements on packages ``setup`` does not name are not compared.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    used = _versions_in(setup)
    out = []
    for dist, reqs in requirements.items():
        for text in reqs:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            name = req.name.lower()
            if name not in used or not str(req.specifier):
                continue
            try:
                inside = req.specifier.contains(Version(used[name]), prereleases=True)
            except InvalidVersion:
                continue
            if not inside:
                shown = "Python" if name == "python" else name
                pin = f"{_DIST_NAMES.get(dist, dist)} {versions.get(dist, '')}".strip()
                out.append(f"{shown} {used[name]} ({pin} requires {shown}{req.specifier})")
    return out


def _results_sections(inp: PrInputs) -> list[str]:
    found = markdown_sections(inp.results_text or "")
    out = []
    for wanted in inp.results_headings:
        hits = [i for i, (_, heading, _) in enumerate(found) if heading.startswith(wanted)]
        if not hits:
            inp.notes.append(f"the results page has no section {wanted!r}")
            continue
        i = hits[0]
        level = found[i][0]
        for sub_level, heading, body in [found[i]] + [s for s in _until_level(found[i + 1 :], level)]:
            if not body.strip() and sub_level == level:
                continue
            hashes = "#" * (3 + sub_level - level)
            body = plain_links(body)
            for table in tables(body):
                body = body.replace(table, plain_links(lane_view(table, inp.lane, inp.lanes)))
            out += [f"{hashes} {heading_for_upstream(plain_links(heading))}", "", body, ""]
    return out


def measured_tree(inp: PrInputs) -> str:
    """Which tree the PR's GPU figures were measured on (``inp.measured_upto``), as a sentence."""
    release = f"the v{inp.omni_version} release"
    upto, total, number = inp.measured_upto, inp.total, inp.number
    if upto == number:
        earlier = "the earlier PRs of the stack and " if number > 1 else ""
        tree = f"this PR's own tree: {release} with {earlier}this PR applied"
    elif upto == total:
        tree = f"the whole stack of {total} PRs applied to {release}"
    elif upto > number:
        later = "the one" if upto - number == 1 else f"the {upto - number}"
        tree = f"PRs 1 to {upto} of the stack applied to {release} (this one and {later} after it)"
    else:
        raise ValueError(f"PR {number}: its figures' tree ({upto} PRs) lacks the PR itself")
    # a tree with a PR that needs a vLLM change ran against vLLM with that change applied
    names = [folder.removeprefix("vllm-").replace("-", " ") for _, folder in inp.measured_vllm]
    vllm = (
        f"vLLM {inp.vllm_version} with the vLLM change{'s' if len(names) > 1 else ''} ({', '.join(names)}) applied"
        if names
        else f"the pinned vLLM {inp.vllm_version} as released"
    )
    return f"The figures were measured on {tree}, against {vllm}; this PR shows the figures of the paths it adds."


def _until_level(rest: list[tuple[int, str, str]], level: int) -> list[tuple[int, str, str]]:
    out = []
    for item in rest:
        if item[0] <= level:
            break
        out.append(item)
    return out


def _test_result(inp: PrInputs) -> list[str]:
    out = [conv.PR_TEMPLATE_HEADINGS[2], ""]
    if inp.runs:
        stacked = " and the earlier PRs of the stack" if inp.earlier else ""
        where = (
            f"the v{inp.omni_version} release wheel's `vllm_omni/` with this PR{stacked} applied by "
            "`git am --keep-non-patch`"
        )
        out += ["### Unit tests", "", f"Run from this PR's tree ({where}).", ""]
        out += _scope_lines(inp, OWN) + _scope_lines(inp, EARLIER)
    if inp.results_text:
        setup = section(inp.results_text, "Setup")
        if setup:
            out += ["### Setup of the GPU measurements", "", plain_links(setup), ""]
            diffs = pin_differences(
                first_paragraph(setup),
                inp.requirements,
                {"vllm": inp.vllm_version, "vllm-omni": inp.omni_version},
            )
            if diffs:
                out += ["Versions that differ from the pins: " + "; ".join(diffs) + ".", ""]
            method = section(inp.results_text, conv.RESULTS_METHOD_HEADING)
            if method is None:
                inp.notes.append(f"the results page has no {conv.RESULTS_METHOD_HEADING} section")
            if method:  # empty where every part of it is tagged for other PRs: the PR's sections say how
                out += [
                    "### How the figures were measured",
                    "",
                    plain_links(method),
                    "",
                    measured_tree(inp),
                    "",
                ]
        else:
            inp.notes.append("the results page has no Setup section: the PR names no GPU environment")
        out += _results_sections(inp)
    elif inp.results_headings:
        inp.notes.append("no results page: the Test Result section has no GPU measurements")
    out += ["### Not run", ""] + [f"- {item}" for item in _not_run(inp)] + [""]
    return out


def _scope_lines(inp: PrInputs, scope: str) -> list[str]:
    """The runs of one scope of the Test Result, under a sentence saying which files and how many
    tests they collected, then the accounting of those tests (:func:`accounting_lines`)."""
    runs = [run for run in inp.runs if run.scope == scope]
    if not runs:
        return []
    count = collected_count(runs)
    collected = f"; they collect {count} test{'s' if count != 1 else ''}" if count is not None else ""
    if scope == OWN:
        intro = f"This PR's tests (the test files it adds or changes){collected}:"
    else:
        intro = (
            "The earlier PRs' tests on this tree (the test files of the earlier PRs of the stack that this "
            f"PR leaves as they are){collected}:"
        )
    accounting = accounting_lines(runs, _levels(inp, scope))
    return [intro, "", *run_lines(runs, accounted=bool(accounting)), *accounting, ""]


def _levels(inp: PrInputs, scope: str) -> tuple[str, ...]:
    return inp.unit_marks if scope == OWN else inp.earlier_marks


def _scope_not_run(inp: PrInputs, scope: str) -> list[str]:
    """Not run items of one scope: the unit levels no run used (those that select some of its
    tests), and the tests that no run of Test Result selects, each named."""
    runs = [run for run in inp.runs if run.scope == scope]
    whose, where = (
        ("This PR's", "from its own tree") if scope == OWN else ("The earlier PRs'", "on this tree")
    )
    acc = account(runs, _levels(inp, scope)) if runs else None
    if acc is None:  # nothing recorded what the runs collected: the levels without a run
        files = inp.test_files if scope == OWN else inp.earlier_test_files
        units = [f for f in files if not f.startswith("tests/e2e/")]
        ran = {run.marks for run in runs}
        levels = [lv for lv in _levels(inp, scope) if lv not in ran] if units and inp.number else []
    else:
        levels = [lv for lv, _ in acc.unrun]
    items = [f'{whose} tests with `-m "{level}"` {where}.' for level in levels]
    if acc and acc.unselected:
        names = ", ".join(f"`{node}`" for node in acc.unselected)
        count = "test" if len(acc.unselected) == 1 else f"{len(acc.unselected)} tests"
        items.append(
            f"{whose} {count} that no `-m` expression of Test Result selects (why: Test Result): {names}."
        )
    return items


def _not_run(inp: PrInputs) -> list[str]:
    items = []
    e2e = [f for f in inp.test_files if f.startswith("tests/e2e/")]
    serving = (
        "Serving end to end with the MiniCPM-o 4.5 checkpoint (`vllm serve openbmb/MiniCPM-o-4_5 --omni`): the GPU "
        "measurements used the encoders at the checkpoint's dimensions with random weights"
    )
    if e2e:
        serving += f"; {', '.join(f'`{f}`' for f in e2e)} is this PR's serving test (an 80 GB GPU and the checkpoint)"
    items.append(serving + ".")
    if inp.multi_gpu:
        items.append(
            "The tests that need two GPUs, this PR's or the earlier PRs' on its tree (they skip on one GPU)."
        )
    if not inp.results_headings:
        items.append(
            f"{conv.PR_NO_MEASUREMENTS}: no GPU measurement of them is recorded for this PR; the "
            "measurements of the earlier PRs of the stack cover the paths those add."
        )
    items += _scope_not_run(inp, OWN) + _scope_not_run(inp, EARLIER)
    items += inp.not_run
    items.append(_omni_main(inp))
    where = (
        "the tests of Test Result ran with pytest outside them" if inp.runs else "no test of this PR ran yet"
    )
    items.append(
        "vllm-omni's Buildkite pipelines on its agents (L1 `core_model and cpu`, L2 `core_model and cuda`): "
        f"{where}."
    )
    return items


def _omni_main(inp: PrInputs) -> str:
    """The Not run item on vllm-omni ``main``: where the tests ran instead, and whether the stack up to
    this PR applies there (``export --vllm-omni-checkout``) or that this was not checked."""
    if inp.number <= 1:
        subject, it, applies = "this PR is", "it", "applies"
    else:
        subject, it, applies = "this PR and the ones before it are", "they", "apply"
    text = f"vllm-omni `main`: {subject} built and tested on the v{inp.omni_version} release"
    check = inp.main_check
    if check is None:
        return text + f"; whether {it} {applies} to `main` was not checked."
    if check.applies:
        return text + f"; {it} {applies} to {check.where} (`{check.how}`), but no test ran there."
    negated = "does not apply" if it == "it" else "do not apply"
    return (
        text + f"; {it} {negated} to {check.where} (`{check.how}`: {check.detail}), so a rebase comes first."
    )


def omni_pr(inp: PrInputs) -> str:
    """The vllm-omni pull request body (``.github/PULL_REQUEST_TEMPLATE.md`` sections)."""
    inp.notes.clear()
    lines = [conv.PR_TEMPLATE_FIRST_LINE, ""] + _purpose(inp) + _test_plan(inp) + _test_result(inp)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def vllm_pr(inp: PrInputs) -> str:
    """The vLLM pull request body for the vLLM patches of one PR (from their headers): Purpose, Test
    Plan, Test Result (its runs, the versions they used that vLLM's requirements exclude, and, when
    checked, whether it applies to vLLM's ``main``) and Not run (what no run of this text covered,
    vLLM ``main`` first)."""
    out = ["## Purpose", ""]
    out += [p for patch in inp.patches for p in (patch.why, "")]
    if inp.needed_by:
        out.append("The vllm-omni pull request(s) that need it:")
        out.append("")
        out += [f"- {inp.ref(title, folder)}" for title, folder in inp.needed_by] + [""]
    out += ["## Test Plan", "", f"vLLM {inp.vllm_version} with this change:", ""]
    if inp.test_files:
        out += ["```bash", f"pytest -sv {' '.join(inp.test_files)}", "```", ""]
    out += ["## Test Result", ""]
    if inp.runs:
        count = collected_count(inp.runs)
        collected = (
            f" (the tests collect {count} test{'s' if count != 1 else ''})" if count is not None else ""
        )
        out += [f"Against vLLM {inp.vllm_version} with this change applied{collected}:", ""]
        accounting = accounting_lines(inp.runs, ())
        out += run_lines(inp.runs, accounted=bool(accounting)) + accounting + [""]
        diffs = list(
            dict.fromkeys(
                d
                for run in inp.runs
                for d in pin_differences(run.environment, inp.requirements, {"vllm": inp.vllm_version})
            )
        )
        if diffs:
            out += ["Versions that differ from vLLM's pins: " + "; ".join(diffs) + ".", ""]
    else:
        out += ["No test run is recorded for this description.", ""]
    check = inp.main_check
    if check and check.applies:
        out += [f"The series applies to {check.where} (`{check.how}`).", ""]
    elif check:
        out += [f"The series does not apply to {check.where} (`{check.how}`): {check.detail}", ""]
    out += ["## Not run", ""] + [f"- {item}" for item in _vllm_not_run(inp)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def _vllm_not_run(inp: PrInputs) -> list[str]:
    """What the vLLM PR's Test Result does not cover: vLLM ``main`` (its tests, and whether the
    series applies there unless checked), the CUDA tests where no run had a GPU, vLLM's compiled
    kernels where the GPU run lacked them, and vLLM's own checks."""
    if inp.runs:
        main = (
            f"vLLM `main`: the tests ran against vLLM {inp.vllm_version} with this change applied, not `main`"
        )
    else:
        main = f"vLLM `main`: the series was made against vLLM {inp.vllm_version}, not `main`"
    check = inp.main_check
    if check is None:
        main += "; whether the series applies to `main` was not checked."
    elif check.applies:
        main += f" (the series applies to {check.where}, but its tests did not run there)."
    else:
        main += f"; the series does not apply to {check.where}, so it needs a rebase first."
    items = [main]
    if not inp.runs and inp.test_files:
        items.append(f"This change's tests (`pytest -sv {' '.join(inp.test_files)}`).")
    skipped = {r: n for run in inp.runs for r, n in run.skipped.items() if re.search(r"CUDA|GPU", r)}
    if inp.runs and not any(run.on_gpu for run in inp.runs) and skipped:
        reasons = "; ".join(f"{n} × {r}" for r, n in sorted(skipped.items()))
        items.append(
            f"The tests that need a GPU: no run of Test Result had one, so they skipped ({reasons})."
        )
    if any(run.on_gpu and "without its compiled kernels" in run.environment for run in inp.runs):
        items.append(
            "vLLM with its compiled kernels installed: the GPU run of Test Result imported vLLM's Python "
            "code only."
        )
    where = (
        "the tests of Test Result ran with pytest outside them" if inp.runs else "no test of this PR ran yet"
    )
    items.append(f"vLLM's pre-commit hooks and its CI (Buildkite) on this change: {where}.")
    return items


def _runs_cell(pr) -> str:
    runs = pr.inputs.runs if pr.inputs else []
    scopes = {OWN: "own", EARLIER: "earlier PRs'"}
    return "; ".join(f"{scopes[run.scope]} {run.marks or 'all'}: {run.summary}" for run in runs) or "not run"


def _ref_cell(ref: PrRef | None) -> str:
    return (ref.link if ref else None) or "not opened yet"


def stack_overview(prs: list, vllm_prs: list) -> str:
    """``STACK.md``: the stack in merge order, each PR's size, dependencies and test runs (for the author)."""
    lines = [
        "# The pull requests of this export",
        "",
        "vllm-omni PRs in merge order; each applies on the release once the ones before it are applied, with "
        "`git am --keep-non-patch` (plain `git am` drops the `[Model]`-style tags from the commit titles). "
        "Each PR's text names the others by number once they are opened (re-export with `--pr-number KEY=N`), "
        "before that by their place in this order and the branch `--checkout` makes for them.",
        "",
        "| # | folder | title | PR | branch | commits | files | + / − lines | series bytes | needs vLLM PR | "
        "tests from its tree |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    needed: list[str] = []  # the vLLM PRs of the PRs so far: a PR needs those of the PRs it applies on
    for i, pr in enumerate(prs, 1):
        size = pr.size
        ref = pr.inputs.refs.get(pr.folder) if pr.inputs else None
        inherited = [v for v in needed if v not in pr.vllm]
        needs = [f"`{v}`" for v in pr.vllm] + [f"`{v}` (through the PRs before it)" for v in inherited]
        needed += [v for v in pr.vllm if v not in needed]
        lines.append(
            f"| {i} | `{pr.folder}` | {pr.title} | {_ref_cell(ref)} | "
            f"{f'`{ref.branch}`' if ref and ref.branch else '—'} | {len(pr.commits)} | {size.get('files', 0)} | "
            f"+{size.get('insertions', 0)} / −{size.get('deletions', 0)} | {size.get('bytes', 0)} | "
            f"{', '.join(needs) or '—'} | {_runs_cell(pr)} |"
        )
    if vllm_prs:
        lines += [
            "",
            "vLLM PRs (vllm-project/vllm):",
            "",
            "| folder | title | PR | commits | + / − lines | series bytes | tests |",
            "|---|---|---|---|---|---|---|",
        ]
        for pr in vllm_prs:
            size = pr.size
            ref = pr.inputs.refs.get(pr.folder) if pr.inputs else None
            lines.append(
                f"| `{pr.folder}` | {pr.title} | {_ref_cell(ref)} | {len(pr.commits)} | +{size.get('insertions', 0)} / "
                f"−{size.get('deletions', 0)} | {size.get('bytes', 0)} | {_runs_cell(pr)} |"
            )
    return "\n".join(lines) + "\n"
