"""The per-PR "before and after" sections of the results page, made from one ``stack-run --figures`` run.

``python -m minicpmo_cg.bench.tree_report RUN_DIR`` prints Markdown: for each vllm-omni PR of the
run, in stack order, a section tagged for that PR (``<!-- pr: KEY -->``, see
:mod:`minicpmo_cg.export.docsplit`) with one table of the call sites of
:mod:`minicpmo_cg.bench.tree_figures`, the tree before the PR against the PR's own tree (or the
tree the stack table says its figures were measured on, :func:`measured_tree`). ``RUN_DIR``
holds ``stack-LANE.json`` (the run's summary: date, device, software) and ``figures/`` (one JSON per
tree and ``compare.json``). Every number of the sections comes from those files; nothing is typed.

Columns: the eager call (``encoder_cuda_graph`` false) before and with the PR; the call as served by
default (graphed where the tree wires the encoder graphs, whose adapters then decide what to
capture; eager where it does not) before and with the PR, with the replays among its timed calls;
the default path's speed-up, divided from the two medians as the table shows them (two decimals),
so that it agrees with them; how the PR's default output compares with the output before it
(``max |after - before| / max |before|``; "bitwise" for 0); and, on a tree with graphs, how its
graphed output compares with its eager one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from minicpmo_cg.bench.tree_figures import CALLS, DUPLEX

__all__ = ["main", "overlap", "pr_section", "sections", "setup_line", "speed_up", "spread"]

FIGURES = "figures"
#: the heading every PR's section starts with (the export's ``results`` entry of each PR)
HEADING = "Before and after this PR"


def _load(run: Path) -> tuple[dict, dict[str, dict], dict]:
    (summary_path,) = sorted(run.glob("stack-*.json"))[:1] or [None]
    if summary_path is None:
        raise FileNotFoundError(f"{run} has no stack-LANE.json")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    trees = {}
    for entry in summary.get("figures", []):
        path = run / FIGURES / f"{entry['folder']}.json"
        if entry["status"] == "ok" and path.is_file():
            trees[entry["folder"]] = {**json.loads(path.read_text(encoding="utf-8")), "title": entry["title"]}
    compare_path = run / FIGURES / "compare.json"
    compare = json.loads(compare_path.read_text(encoding="utf-8")) if compare_path.is_file() else {}
    return summary, trees, compare


def _key(folder: str) -> str:
    return re.sub(r"^\d+-", "", folder)


def pr_title(key: str, measured: str) -> str:
    """The title of the stack's PR ``key`` as the export writes it (its prefixes, then its title); the
    title the run recorded (``measured``) for a key the stack no longer has."""
    from minicpmo_cg.export import stack

    pr = next((pr for pr in stack.STACK if pr.key == key), None)
    return f"{''.join(pr.prefixes)} {pr.title}" if pr is not None else measured


def _default(tree: dict, call: str) -> tuple[str, dict | None]:
    """``("graphed" | "eager", row)`` of the call as the tree serves it by default."""
    graphed = tree.get("graphed")
    if graphed and call in graphed:
        return "graphed", graphed[call]
    return "eager", tree["eager"].get(call)


def _declined(tree: dict, call: str) -> bool:
    """Whether the tree wires graphs for ``call`` yet its timed default calls replayed none."""
    kind, row = _default(tree, call)
    return kind == "graphed" and row is not None and not row.get("replayed")


def _ms(row: dict | None, field: str = "median") -> str:
    return "—" if row is None or row.get(field) is None else f"{row[field]:.2f}"


def speed_up(before: dict | None, after: dict | None) -> str:
    """``before``'s median over ``after``'s, computed from the two values as the table shows them
    (:func:`_ms`, two decimals): a reader who divides the displayed medians gets the displayed
    speed-up. ``"—"`` when either is missing or the shown ``after`` is zero."""
    shown_b, shown_a = _ms(before), _ms(after)
    if "—" in (shown_b, shown_a) or float(shown_a) == 0.0:
        return "—"
    return f"{float(shown_b) / float(shown_a):.2f}×"


def _blocks(row: dict | None) -> list[float]:
    """A row's block medians (a run that measured in blocks, :class:`.tree_figures.TreeRun`), else []."""
    return list((row or {}).get("blocks") or [])


def _range(row: dict | None) -> str:
    """``lowest–highest`` of a row's block medians (ms)."""
    b = _blocks(row)
    return f"{min(b):.2f}–{max(b):.2f}"


def overlap(before: dict | None, after: dict | None) -> bool:
    """Whether the two rows' ranges of block medians overlap: the trees' difference is then no larger
    than how much one tree's own blocks moved (False where either row has no blocks)."""
    b, a = _blocks(before), _blocks(after)
    return bool(b and a) and min(b) <= max(a) and min(a) <= max(b)


def spread(rows: list[dict | None]) -> float | None:
    """The largest ``max / min - 1`` of one row's block medians over ``rows`` (None: no blocks)."""
    ratios = [max(b) / min(b) - 1 for b in map(_blocks, rows) if b and min(b) > 0]
    return max(ratios) if ratios else None


def _rel(value: float | None) -> str:
    if value is None:
        return "shapes differ"
    return "bitwise" if value == 0.0 else f"{value:.1e}"


def _replayed(kind: str, row: dict | None) -> bool:
    """Whether the tree's timed default calls of a row replayed a graph."""
    return kind == "graphed" and row is not None and row.get("replayed", 0) > 0


def _replays(kind: str, row: dict | None) -> str:
    if kind != "graphed" or row is None:
        return "eager"
    if not row["replayed"]:
        return f"eager: no graph replayed (0/{row['calls']})"
    return f"graphed, {row['replayed']}/{row['calls']} replayed"


def _duplex_cell(kind: str, row: dict | None) -> str:
    if row is None:
        return "—"
    cell = f"{row['median']:.2f} (worst {row['worst']:.2f})"
    if kind == "graphed" and row.get("first_session"):
        first = row["first_session"]
        cell += f"; first session {first['median']:.2f} (worst {first['worst']:.2f})"
    elif kind == "graphed" and row.get("startup"):  # captured before it: the timed session is the first
        cell += ", the first session after start-up capture"
    return cell


def measured_tree(key: str) -> str:
    """How a section names the tree measured for PR ``key``: "this PR's own tree", or, where the stack
    table says the PR's figures were measured on a tree that also had later PRs (its ``measured_on``:
    the run predates a split of the PR), that tree."""
    from minicpmo_cg.export import stack

    keys = [pr.key for pr in stack.STACK]
    if key not in keys:
        return "this PR's own tree"
    on = next(pr.measured_on for pr in stack.STACK if pr.key == key)
    later = keys[keys.index(key) + 1 : stack.measured_upto(keys, key, on)]
    if not later:
        return "this PR's own tree"
    names = ", ".join(later)
    which = "the next PR of the stack" if len(later) == 1 else f"the {len(later)} PRs after it"
    return f"the tree of this PR and {which} ({names}), which this PR's figures were measured on"


def pr_section(folder: str, before: str, trees: dict[str, dict], compare: dict) -> list[str]:
    """The Markdown lines of one PR's section (``before``: the folder of the tree before it)."""
    after_t, before_t = trees[folder], trees[before]
    key = _key(folder)
    cmp = compare.get(folder, {})
    before_name = (
        "the release's tree (no PR applied)"
        if before_t["title"].startswith("the vllm-omni")
        else "the tree before this PR (the earlier PRs of the stack applied)"
    )
    blocked = any(_blocks(row) for tree in (after_t, before_t) for row in tree["eager"].values())
    if blocked:
        rounds = max(len(_blocks(row)) for row in after_t["eager"].values())
        how = (
            f"each tree in its own process, the processes taking turns on one host: {rounds} rounds of one "
            "block of calls per tree, in an order that rotates from round to round, eager rounds first"
        )
        noise = (
            " A speed-up marked *within noise* is one where the two trees' block medians overlap: the "
            "difference is no larger than how much one tree's own blocks moved. Where neither tree replayed "
            "a graph of a call, its default call is the eager one, and the eager calls' blocks decide."
        )
    else:
        how, noise = "each tree in its own process, one after the other on one host", ""
    lines = [
        f"<!-- pr: {key} -->",
        f"### {HEADING}: {pr_title(key, after_t['title'])}",
        "",
        f"Each call site on {before_name} and on {measured_tree(key)}, {how}, with "
        "the same seeded weights and inputs (ms per call: median of the timed calls; a duplex session: "
        "ms per 1 s chunk, median and worst of the session). No target is set on this comparison: it "
        f"shows what the PR changes.{noise}",
        "",
    ]
    # neither tree has encoder graphs: every call runs eagerly, so the default and graphed columns
    # would only repeat the eager ones
    graphless = not before_t.get("graphed") and not after_t.get("graphed")
    if graphless:
        lines += [
            "Neither tree has encoder graphs: every call runs eagerly.",
            "",
            "| call site | eager before | eager with this PR | speed-up | output vs before |",
            "|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| call site | eager before | eager with this PR | default before | default with this PR "
            "| default path with this PR | speed-up (default) | output vs before | graphed vs eager |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    judged: list[str] = []  # per call: the block-median ranges its "within noise" mark compares
    for call in [*CALLS, DUPLEX]:
        kind_b, row_b = _default(before_t, call)
        kind_a, row_a = _default(after_t, call)
        eb, ea = before_t["eager"].get(call), after_t["eager"].get(call)
        if call == DUPLEX:
            cells = [_duplex_cell("eager", eb), _duplex_cell("eager", ea), _duplex_cell(kind_b, row_b),
                     _duplex_cell(kind_a, row_a)]  # fmt: skip
        else:
            cells = [_ms(eb), _ms(ea), _ms(row_b), _ms(row_a)]
        speed = speed_up(row_b, row_a)
        # where neither tree replayed a graph, the default call is the eager path: the eager rows'
        # blocks measure its noise (a default duplex session is timed once and has none of its own)
        eager_both = not _replayed(kind_b, row_b) and not _replayed(kind_a, row_a)
        # the blocks that decide the mark: the default rows', or the eager rows' where both are eager
        rb, ra = (eb, ea) if eager_both else (row_b, row_a)
        if speed != "—":
            if _blocks(rb) and _blocks(ra):
                judged.append(f"{call} {_range(rb)} → {_range(ra)}")
                if overlap(rb, ra):
                    speed += ", within noise"
            elif blocked and call == DUPLEX:  # a default duplex session is timed once: no blocks to judge by
                speed += ", one measurement each"
        vs_before = cmp.get("vs_previous", {}).get(f"{kind_a}/{call}", "n/a")
        if kind_a != kind_b:  # the default path changed: compare the PR's default with the eager before
            vs_before = _eager_vs(trees, before, folder, call, compare)
        output = _rel(vs_before) if vs_before != "n/a" else "n/a"
        if graphless:
            lines.append(f"| {call} | {' | '.join(cells[:2])} | {speed} | {output} |")
            continue
        # a graphed output that no replay made is the eager one: nothing to compare
        replayed = _replayed(kind_a, row_a)
        graphed_vs_eager = cmp.get("graphed_vs_eager", {})
        g_vs_e = _rel(graphed_vs_eager[call]) if replayed and call in graphed_vs_eager else "no replay"
        lines.append(
            f"| {call} | {' | '.join(cells)} | {_replays(kind_a, row_a)} | {speed} | {output} | {g_vs_e} |"
        )
    startup = (after_t.get("graphed") or {}).get(DUPLEX, {}).get("startup")
    lines.append("")
    declined = [c for c in CALLS if _declined(after_t, c)]
    admitted = [c for c in CALLS if _declined(before_t, c) and not _declined(after_t, c)]
    lost = [c for c in CALLS if _declined(after_t, c) and _replayed(*_default(before_t, c))]
    if declined:
        lines += [
            f"No graph replayed ({'; '.join(declined)}): the encoder graphs are on, but by default a shape is "
            "captured only when its measured saving pays for its capture and memory (cost admission), and these "
            "shapes' savings did not on this tree.",
            "",
        ]
    if admitted:
        lines += [
            f"Graphed here, no graph replayed before ({'; '.join(admitted)}): the cost admission declined these "
            "shapes on the tree before and admits them on this one, whose calls it measured to save enough.",
            "",
        ]
    if lost:
        lines += [
            f"Graphed before, no graph replayed here ({'; '.join(lost)}): the cost admission admitted these "
            "shapes on the tree before and declined them on this one. Each process decides from its own "
            "measurements of the call (the saving per replay against the capture time and the memory), so a "
            "shape whose saving is close to that price can go either way between two processes; the eager "
            "columns compare the two trees' code.",
            "",
        ]
    if judged:
        lines += [
            "The block medians each speed-up was judged on (ms, lowest–highest, before → with this PR): "
            + "; ".join(judged)
            + ".",
            "",
        ]
    if blocked:
        eager = spread([t["eager"].get(c) for t in (before_t, after_t) for c in [*CALLS, DUPLEX]])
        default = spread([_default(t, c)[1] for t in (before_t, after_t) for c in CALLS])
        # neither tree has graphs: the default calls are the eager ones, stated once
        measured = (("eager", eager),) if graphless else (("eager", eager), ("default", default))
        parts = [f"{name} calls by up to {value:.0%}" for name, value in measured if value is not None]
        if parts:
            lines += [
                f"Within one tree's process, the block medians of a call moved: {', '.join(parts)}.",
                "",
            ]
    if startup:
        lines.append(
            f"Start-up capture on this tree: {startup['graphs']} graphs, {startup['mib']} MiB, "
            f"{startup['seconds']} s, before the first session (what the worker does before serving)."
        )
        lines.append("")
    lines += ["<!-- /pr -->", ""]
    return lines


def _eager_vs(trees: dict, before: str, folder: str, call: str, compare: dict) -> float | None | str:
    """The PR's default (graphed) output against the tree before it's eager one: the PR's graphed
    output equals its own eager one (``graphed_vs_eager``) and its eager one the tree before
    (``vs_previous``); both bitwise means bitwise."""
    cmp = compare.get(folder, {})
    eager_vs = cmp.get("vs_previous", {}).get(f"eager/{call}")
    g_vs_e = cmp.get("graphed_vs_eager", {}).get(call)
    if eager_vs is None or g_vs_e is None:
        return "n/a"
    return 0.0 if eager_vs == 0.0 and g_vs_e == 0.0 else max(eager_vs, g_vs_e)


def setup_line(summary: dict) -> str:
    """The run's date, device and software, as the results page's Setup sentences say them."""
    return (
        f"**{summary.get('date')}, {summary.get('device') or 'no GPU'}** ({summary.get('environment')}); "
        f"vLLM {summary.get('vllm')} and vllm-omni {summary.get('vllm_omni')}, the trees built at commit "
        f"`{summary.get('stack_commit')}`."
    )


def sections(run: Path) -> str:
    """All PR sections of the run at ``run``, in stack order, as Markdown."""
    summary, trees, compare = _load(run)
    order = [e["folder"] for e in summary.get("figures", []) if e["folder"] in trees]
    lines: list[str] = []
    for before, folder in zip(order, order[1:]):
        lines += pr_section(folder, before, trees, compare)
    return "\n".join(lines).rstrip() + "\n"


#: the heading of the results page (``docs/results/stack.md``) whose body the sections are
PAGE_HEADING = "## Before and after each PR"


def page_span(text: str) -> tuple[int, int]:
    """Where the generated sections sit in the page ``text``: from the line after
    :data:`PAGE_HEADING` to the next level-2 heading (or the end).

    Raises:
        ValueError: the page has no such heading.
    """
    at = text.find(f"\n{PAGE_HEADING}\n")
    if at < 0:
        raise ValueError(f"the page has no heading {PAGE_HEADING!r}")
    start = at + len(PAGE_HEADING) + 2
    end = text.find("\n## ", start)
    return start, len(text) if end < 0 else end + 1


def write_into(page: Path, run: Path) -> None:
    """Replace the generated part of ``page`` with the sections of ``run``."""
    text = page.read_text(encoding="utf-8")
    start, end = page_span(text)
    tail = "\n" + text[end:] if end < len(text) else ""
    page.write_text(text[:start] + "\n" + sections(run) + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minicpmo_cg.bench.tree_report", description=__doc__.split("\n")[0]
    )
    p.add_argument("run", type=Path, help="a stack-run --figures output folder")
    p.add_argument("--setup", action="store_true", help="print the run's setup sentence instead")
    p.add_argument(
        "--into", type=Path, metavar="PAGE", help=f"write the sections into PAGE, below {PAGE_HEADING!r}"
    )
    args = p.parse_args(argv)
    try:
        summary = _load(args.run)[0]
        if args.into:
            write_into(args.into, args.run)
        else:
            sys.stdout.write(setup_line(summary) + "\n" if args.setup else sections(args.run))
    except (FileNotFoundError, ValueError) as exc:
        print(f"tree_report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
