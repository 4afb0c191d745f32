"""Every tree's figures process alive at once, taking turns block by block (``stack-run --figures``).

Each tree's :mod:`minicpmo_cg.bench.tree_figures` process (``measure --serve``) builds its model,
says ``ready`` and then runs one block per line it reads. :func:`interleave` starts them all, waits
until each is ready, and runs the blocks in rounds: round ``r`` gives one ``eager`` block (then, in
the later rounds, one ``graphed`` block) to every tree, starting at tree ``r`` of the list and
wrapping around, so that no tree always goes first and a drift of the host over the run (clocks,
other load) reaches every tree alike. Only one process computes at a time; the others wait on their
input. A process that fails, stops answering or outruns its time limit is killed and reported; the
others carry on.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["ServedTree", "interleave", "round_order"]

#: seconds a process gets to exit after ``finish`` (it writes its JSON and outputs then)
FINISH_S = 120
#: seconds a block may take (the first graphed block captures every graph of the tree)
BLOCK_S = 120


def round_order(trees: list[str], round_index: int) -> list[str]:
    """``trees`` starting at ``round_index`` (modulo their number), wrapping around."""
    if not trees:
        return []
    k = round_index % len(trees)
    return trees[k:] + trees[:k]


@dataclass
class ServedTree:
    """One tree's ``tree_figures measure --serve`` process: lines in, lines out, stderr to ``log``."""

    label: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    proc: subprocess.Popen | None = None
    #: why the process is out ("" while it runs or after a clean finish)
    error: str = ""
    #: it failed by outrunning a time limit
    timed_out: bool = False
    blocks: list[tuple[str, float]] = field(default_factory=list)
    _lines: queue.Queue = field(default_factory=queue.Queue)
    _log_fh: IO | None = None

    def start(self) -> None:
        self._log_fh = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_fh,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.strip())
        self._lines.put(None)  # end of output: the process exited

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.error

    def expect(self, prefix: str, timeout_s: float) -> str | None:
        """The next reply line if it starts with ``prefix``; else mark the tree failed and return None."""
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            self.timed_out = True
            self.fail(f"no {prefix!r} within {timeout_s:.0f} s")
            return None
        if line is None:
            self.fail(f"exited (code {self.proc.wait()}) before {prefix!r}")
            return None
        if not line.startswith(prefix):
            self.fail(f"answered {line!r} where {prefix!r} was expected")
            return None
        return line

    def send(self, command: str) -> bool:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.fail(f"could not send {command!r}: {exc}")
            return False
        return True

    def block(self, command: str, timeout_s: float) -> bool:
        """Run one block; record its seconds. False (and the tree failed) when it did not finish."""
        if not self.send(command):
            return False
        line = self.expect(f"done {command}", timeout_s)
        if line is None:
            return False
        self.blocks.append((command, float(line.split()[-1])))
        return True

    def finish(self, timeout_s: float) -> int | None:
        """Send ``finish`` and wait for the exit; the return code, or None when killed."""
        if self.send("finish"):
            self.proc.stdin.close()
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.fail(f"did not exit within {timeout_s:.0f} s of 'finish'")
        return None

    def fail(self, why: str) -> None:
        self.error = self.error or why
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.fail("still running at the end")
        if self._log_fh is not None:
            self._log_fh.close()


def interleave(
    trees: list[ServedTree],
    *,
    rounds: int,
    ready_s: float,
    deadline: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, int | None]:
    """Start every tree, then ``rounds`` eager rounds and ``rounds`` graphed rounds, then finish.

    Args:
        trees: the processes to run (not started yet), in stack order.
        rounds: blocks per pass; fewer when ``deadline`` comes first (every tree ran as many).
        ready_s: seconds each process gets to build its model and say ``ready``.
        deadline: the ``clock()`` value by which every process must have been told ``finish``.
        say: where progress lines go.

    Returns:
        label -> the process's exit code (None: it failed; its ``error`` says why).
    """
    started = clock()
    for tree in trees:
        tree.start()
    for tree in trees:
        tree.expect("ready", ready_s - (clock() - started))
    say(f"[figures] {sum(t.alive for t in trees)} of {len(trees)} trees ready in {clock() - started:.0f} s")
    done_rounds = {"eager": 0, "graphed": 0}
    per_round: dict[str, float] = {}
    for command in ("eager", "graphed"):
        for r in range(rounds):
            live = [t for t in trees if t.alive]
            if not live:
                break
            guess = per_round.get(command, per_round.get("eager", 0.0))
            # a later eager round only where a graphed round (as long, at a guess) still fits after it
            need = guess * (2 if command == "eager" else 1) + FINISH_S
            if r > 0 and clock() + need > deadline:
                say(f"[figures] {command} round {r + 1} not run: the budget would be spent")
                break
            if command == "graphed" and r == 0 and clock() + FINISH_S > deadline:
                say("[figures] no graphed round: the budget is spent")
                break
            t0 = clock()
            for tree in round_order(live, r):
                tree.block(command, BLOCK_S)
            per_round[command] = clock() - t0
            done_rounds[command] += 1
            say(f"[figures] {command} round {r + 1}: {' '.join(t.label for t in round_order(live, r))} "
                f"in {per_round[command]:.0f} s")  # fmt: skip
    codes: dict[str, int | None] = {}
    for tree in trees:
        codes[tree.label] = tree.finish(FINISH_S) if tree.alive else None
        tree.close()
    say(f"[figures] rounds run: {done_rounds['eager']} eager, {done_rounds['graphed']} graphed")
    return codes
