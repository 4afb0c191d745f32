"""The interleaved figures runs (:mod:`minicpmo_cg.offline_gpu.figuresrun`) and the serving side of
``tree_figures measure --serve``, with stand-in processes that speak the protocol (no model)."""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest

from minicpmo_cg.bench import tree_figures
from minicpmo_cg.offline_gpu import figuresrun

pytestmark = pytest.mark.cpu

#: a stand-in tree process: appends each block it runs to the shared journal, like a tree's blocks
#: taking turns; ``--die-at N`` exits without a word at its N-th command, ``--hang-at N`` never answers it
STAND_IN = textwrap.dedent(
    """
    import sys, time
    label, journal = sys.argv[1], sys.argv[2]
    die = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else -1
    hang = int(sys.argv[sys.argv.index("--hang-at") + 1]) if "--hang-at" in sys.argv else -1
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        command = line.strip()
        n += 1
        if n == die:
            sys.exit(3)
        if n == hang:
            time.sleep(600)
        if command == "finish":
            sys.exit(0)
        with open(journal, "a") as fh:
            fh.write(f"{label} {command}\\n")
        print(f"done {command} 0.01", flush=True)
    """
)


def _trees(tmp_path: Path, labels: list[str], extra: dict[str, list[str]] | None = None) -> list:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    journal = tmp_path / "journal"
    return [
        figuresrun.ServedTree(
            label,
            [sys.executable, str(script), label, str(journal), *(extra or {}).get(label, [])],
            {},
            tmp_path,
            tmp_path / f"{label}.log",
        )  # fmt: skip
        for label in labels
    ]


def _journal(tmp_path: Path) -> list[str]:
    return (tmp_path / "journal").read_text().splitlines()


def test_round_order_rotates_and_wraps() -> None:
    trees = ["a", "b", "c"]
    assert [figuresrun.round_order(trees, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]  # fmt: skip
    assert figuresrun.round_order([], 2) == []


def test_every_tree_takes_one_block_per_round_in_a_rotating_order(tmp_path: Path) -> None:
    trees = _trees(tmp_path, ["r", "p1", "p2"])
    lines: list[str] = []
    codes = figuresrun.interleave(trees, rounds=2, ready_s=60, deadline=float("inf"), say=lines.append)
    assert codes == {"r": 0, "p1": 0, "p2": 0}
    assert _journal(tmp_path) == [
        "r eager", "p1 eager", "p2 eager",
        "p1 eager", "p2 eager", "r eager",
        "r graphed", "p1 graphed", "p2 graphed",
        "p1 graphed", "p2 graphed", "r graphed",
    ]  # fmt: skip
    assert [c for c, _ in trees[0].blocks] == ["eager", "eager", "graphed", "graphed"]
    assert "rounds run: 2 eager, 2 graphed" in lines[-1]


def test_a_tree_that_dies_or_hangs_is_reported_and_the_others_finish(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(figuresrun, "BLOCK_S", 3)
    trees = _trees(tmp_path, ["r", "dies", "hangs"], {"dies": ["--die-at", "2"], "hangs": ["--hang-at", "1"]})
    codes = figuresrun.interleave(trees, rounds=2, ready_s=60, deadline=float("inf"), say=lambda _: None)
    assert codes == {"r": 0, "dies": None, "hangs": None}
    by = {t.label: t for t in trees}
    assert "exited (code 3)" in by["dies"].error and not by["dies"].timed_out
    assert "no 'done eager' within 3 s" in by["hangs"].error and by["hangs"].timed_out
    assert by["hangs"].proc.poll() is not None  # killed, not left behind
    assert _journal(tmp_path).count("r eager") == 2 and _journal(tmp_path).count("r graphed") == 2


def test_later_rounds_give_way_to_the_deadline(tmp_path: Path, monkeypatch) -> None:
    """A scripted clock that moves 50 s per block: two trees, so a round takes 100 s. With the
    deadline at 450 s, after the first eager round (at 100 s) a second one needs 100 s more plus a
    graphed round at a guess (100 s) plus the finish allowance (120 s): 420 s, which fits; after it
    (at 200 s) a third needs 520 s, which does not. The first graphed round always runs."""
    now = [0.0]
    block = figuresrun.ServedTree.block

    def scripted_block(self, command: str, timeout_s: float) -> bool:
        now[0] += 50.0
        return block(self, command, timeout_s)

    monkeypatch.setattr(figuresrun.ServedTree, "block", scripted_block)
    trees = _trees(tmp_path, ["a", "b"])
    lines: list[str] = []
    codes = figuresrun.interleave(
        trees, rounds=3, ready_s=60, deadline=450.0, say=lines.append, clock=lambda: now[0]
    )
    journal = _journal(tmp_path)
    assert codes == {"a": 0, "b": 0}
    assert journal.count("a eager") == 2 and journal.count("a graphed") == 1
    assert any("eager round 3 not run" in line for line in lines)
    assert any("graphed round 2 not run" in line for line in lines)


class _Run:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def eager_block(self) -> None:
        self.calls.append("eager")

    def graphed_block(self) -> None:
        self.calls.append("graphed")


def test_serve_runs_one_block_per_line_until_finish() -> None:
    run, replies = _Run(), io.StringIO()
    n = tree_figures.serve(run, io.StringIO("eager\neager\ngraphed\nfinish\nignored\n"), replies)
    assert n == 3 and run.calls == ["eager", "eager", "graphed"]
    lines = replies.getvalue().splitlines()
    assert lines[0] == "ready" and [line.rsplit(" ", 1)[0] for line in lines[1:]] == [
        "done eager", "done eager", "done graphed"]  # fmt: skip


@pytest.mark.parametrize(("commands", "error"), [("eager\nbogus\n", ValueError), ("eager\n", EOFError)])
def test_serve_refuses_unknown_commands_and_a_closed_input(commands: str, error: type) -> None:
    with pytest.raises(error):
        tree_figures.serve(_Run(), io.StringIO(commands), io.StringIO())


def test_pin_threads_refuses_a_core_the_process_may_not_use() -> None:
    if not hasattr(__import__("os"), "sched_getaffinity"):
        pytest.skip("no sched_getaffinity on this platform")
    assert tree_figures.pin_threads(10_000) is False
