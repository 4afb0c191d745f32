"""The pull request descriptions, in vllm-omni's template sections, written from the checkout's pages.

Nothing here is fixed text about the change: the purpose, design, options and stats come from the
design page's sections, the measurements from the results page, the dependency from the vLLM
patches' headers, the versions from the lane, so a refreshed page or patch shows in the next export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import transform
from minicpmo_cg.patchtool.series import Patch

__all__ = [
    "PrInputs",
    "heading_for_upstream",
    "lane_view",
    "markdown_sections",
    "omni_pr",
    "plain_links",
    "title",
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


@dataclass
class PrInputs:
    """What the descriptions are made from (all read at export time)."""

    design_text: str
    design_path: str
    results_text: str | None
    vllm_version: str
    omni_version: str
    omni_commit: str | None
    commits: list[str]
    vllm_patches: list[Patch]
    vllm_series: list[str]
    test_commands: list[str]
    cpu_result: str | None = None
    notes: list[str] = field(default_factory=list)
    #: The exported lane's name and every lane's name, in the order the results page lists them.
    lane: str = "current"
    lanes: tuple[str, ...] = ("current",)


def title(design_text: str) -> str:
    """``[Model][Perf] <the design page's title>`` (the model name is in that title)."""
    head = next((h for level, h, _ in markdown_sections(design_text) if level == 1), "encoder CUDA graphs")
    if conv.MODEL_TITLE not in head:
        head = f"{conv.MODEL_TITLE}: {head}"
    return f"{conv.TITLE_PREFIX_MODEL}{conv.TITLE_PREFIX_PERF} {head}"


def _purpose(inp: PrInputs) -> list[str]:
    out = [conv.PR_TEMPLATE_HEADINGS[0], ""]
    out += [plain_links(section(inp.design_text, "Why") or ""), ""]
    for prefix, name in (("What is captured", "Design"), ("Options", "Options"), ("Stats", "Stats")):
        body = section(inp.design_text, prefix)
        if body is None:
            inp.notes.append(f"the design page has no section starting with {prefix!r}")
            continue
        picked = [first_paragraph(body), *tables(body)] if name != "Design" else [body]
        out += [f"### {name}", "", plain_links("\n\n".join(p for p in picked if p)), ""]
    out += [f"The whole design (limits included) is the new page `{inp.design_path}`.", ""]
    out += ["### Commits", ""] + [f"{i}. {t}" for i, t in enumerate(inp.commits, 1)] + [""]
    return out + _depends_on(inp)


def _depends_on(inp: PrInputs) -> list[str]:
    if not inp.vllm_patches:
        return ["### Depends on", "", f"Nothing beyond vLLM {inp.vllm_version}.", ""]
    out = ["### Depends on: a vLLM change", ""]
    count = "a change" if len(inp.vllm_patches) == 1 else f"{len(inp.vllm_patches)} changes"
    out.append(
        f"This needs {count} to vLLM that vLLM {inp.vllm_version} does not have. "
        "The vLLM side belongs to vllm-project/vllm, not to this repository, and is exported as a separate "
        "series for a vLLM pull request; this PR can merge only once vllm-omni's vLLM pin includes it "
        "(encoder-graph PRs merge after the vLLM pin bump, issue #7452)."
    )
    out.append("")
    for patch, name in zip(inp.vllm_patches, inp.vllm_series):
        out.append(f"- **{patch.subject}** (`{name}`; upstream: {patch.upstream}): {patch.why}")
    return out + [""]


def _test_plan(inp: PrInputs) -> list[str]:
    omni = f"v{inp.omni_version} release"
    omni += f" (commit {inp.omni_commit})" if inp.omni_commit else " (its wheel records no commit id)"
    vllm = f"{inp.vllm_version}" + (" with the vLLM change above applied" if inp.vllm_patches else "")
    out = [
        conv.PR_TEMPLATE_HEADINGS[1],
        "",
        f"{conv.PR_FIELD_VLLM} {vllm}",
        "",
        f"{conv.PR_FIELD_OMNI} {omni} + this PR",
        "",
    ]
    return out + ["```bash", *inp.test_commands, "```", ""]


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


def _test_result(inp: PrInputs) -> list[str]:
    out = [conv.PR_TEMPLATE_HEADINGS[2], ""]
    if inp.cpu_result:
        out += [
            f"Unit tests of this PR's tree (the v{inp.omni_version} release + this series): {inp.cpu_result}",
            "",
        ]
    if not inp.results_text:
        inp.notes.append("no results page: the Test Result section has no GPU measurements")
        return out
    setup = section(inp.results_text, "Setup")
    if setup:
        out += ["### Setup", "", plain_links(first_paragraph(setup)), ""]
    out += [f"{conv.PR_SOURCE_NOTE_PREFIX} {conv.PR_SOURCE_NOTE}", ""]
    for level, heading, _ in markdown_sections(inp.results_text):
        body = section(inp.results_text, heading) if level == 2 else None
        found = [lane_view(t, inp.lane, inp.lanes) for t in tables(body)] if body else []
        if found:
            out += [f"### {heading_for_upstream(plain_links(heading))}", ""]
            out += [plain_links(t) + "\n" for t in found]
    return out


def omni_pr(inp: PrInputs) -> str:
    """The vllm-omni pull request body (``.github/PULL_REQUEST_TEMPLATE.md`` sections)."""
    lines = [conv.PR_TEMPLATE_FIRST_LINE, ""] + _purpose(inp) + _test_plan(inp) + _test_result(inp)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def vllm_pr(patch: Patch, vllm_version: str, name: str) -> tuple[str, str]:
    """Title and body of the vLLM pull request for one vLLM patch (from its header)."""
    body = [
        "## Purpose",
        "",
        patch.why,
        "",
        "## Test Plan",
        "",
        f"The patch applies with `git am {name}` to vLLM {vllm_version} (checked by the export).",
        "",
        "## Test Result",
        "",
        "See the vllm-omni pull request that depends on this change: its tests run with it applied.",
    ]
    return f"[Core] {patch.subject}", "\n".join(body) + "\n"
