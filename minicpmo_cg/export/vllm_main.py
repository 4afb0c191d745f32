"""Whether a vLLM PR's series applies to a vLLM git checkout (vLLM's ``main``), for its PR text.

The vLLM PR is written and tested against the lane's pinned vLLM release; vllm-project/vllm merges
into ``main``, whose files may have moved on. ``export --vllm-checkout DIR`` names a git checkout of
vLLM (a clone of vllm-project/vllm at ``main``, on a machine that reaches github.com): each vLLM
PR's series is checked with ``git apply --check`` against that checkout's work tree, nothing in it
changed, and the PR text says which commit it applies to, or why it does not. Without the option
the text says that this was not checked.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MainCheck", "check_series", "checkout_commit"]


@dataclass(frozen=True)
class MainCheck:
    """The result of checking one series against a vLLM checkout.

    Attributes:
        commit: the checkout's ``HEAD`` (full hash).
        branch: its branch (``main``), or None for a detached ``HEAD``.
        applies: ``git apply --check`` of the series succeeded.
        detail: git's message when it did not ('' when it did).
    """

    commit: str
    branch: str | None
    applies: bool
    detail: str = ""

    @property
    def where(self) -> str:
        """``vLLM `main` at commit 0123456789ab`` (or ``vLLM at commit ...`` when detached)."""
        on = f" `{self.branch}`" if self.branch else ""
        return f"vLLM{on} at commit {self.commit[:12]}"


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False)


def checkout_commit(checkout: Path) -> tuple[str, str | None]:
    """``(HEAD, branch or None)`` of the vLLM git checkout ``checkout``.

    Raises:
        ValueError: ``checkout`` is not a git work tree (the message names ``--vllm-checkout``).
    """
    head = _git(checkout, "rev-parse", "--verify", "HEAD")
    inside = _git(checkout, "rev-parse", "--is-inside-work-tree")
    if head.returncode or inside.stdout.strip() != "true":
        reason = (head.stderr or inside.stderr).strip().splitlines()
        raise ValueError(
            f"--vllm-checkout {checkout}: not a git checkout of vLLM with a commit "
            f"({reason[-1] if reason else 'no HEAD'}); clone https://github.com/vllm-project/vllm there"
        )
    branch = _git(checkout, "symbolic-ref", "--short", "-q", "HEAD").stdout.strip() or None
    return head.stdout.strip(), branch


def check_series(checkout: Path, series: list[Path]) -> MainCheck:
    """``git apply --check`` of ``series`` (``git format-patch`` files, in order) against the work
    tree of ``checkout``; nothing is written there.

    Raises:
        ValueError: ``checkout`` is not a git work tree, or ``series`` is empty.
    """
    if not series:
        raise ValueError("no patch to check against the vLLM checkout")
    commit, branch = checkout_commit(checkout)
    proc = _git(checkout, "apply", "--check", *(str(p.resolve()) for p in series))
    detail = " ".join(line.strip() for line in proc.stderr.strip().splitlines()[:4])
    return MainCheck(commit, branch, proc.returncode == 0, "" if proc.returncode == 0 else detail)
