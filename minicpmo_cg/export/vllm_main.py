"""Whether the exported series apply to the upstream projects' ``main`` branches, for the PR texts.

The PRs are written and tested against the lane's pinned releases; vllm-project/vllm and
vllm-project/vllm-omni merge into ``main``, whose files may have moved on.

- ``export --vllm-checkout DIR`` names a git checkout of vLLM (a clone of vllm-project/vllm at
  ``main``, on a machine that reaches github.com): each vLLM PR's series is checked with
  ``git apply --check`` against that checkout's work tree (:func:`check_series`).
- ``export --vllm-omni-checkout DIR`` names a git checkout of vllm-omni at ``main``: the vllm-omni
  PRs' series are applied in stack order with ``git am --3way`` in a scratch clone of its ``HEAD``
  (:func:`check_stack`), so each PR is checked on top of the ones before it.

Nothing is written in either checkout. The PR text says which commit a series applies to, or why it
does not; without the option it says that this was not checked.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OMNI", "VLLM", "MainCheck", "Upstream", "check_series", "check_stack", "checkout_commit"]


@dataclass(frozen=True)
class Upstream:
    """An upstream project whose checkout a series is checked against."""

    #: the project as the texts name it
    name: str
    #: the export option that names its checkout
    option: str
    url: str


VLLM = Upstream("vLLM", "--vllm-checkout", "https://github.com/vllm-project/vllm")
OMNI = Upstream("vllm-omni", "--vllm-omni-checkout", "https://github.com/vllm-project/vllm-omni")


@dataclass(frozen=True)
class MainCheck:
    """The result of checking one series against an upstream checkout.

    Attributes:
        commit: the checkout's ``HEAD`` (full hash).
        branch: its branch (``main``), or None for a detached ``HEAD``.
        applies: the series applied (``git apply --check``, or ``git am --3way`` after the series
            before it in the stack).
        detail: git's message when it did not ('' when it did).
        project: the project checked against (its name in :attr:`where`).
        how: the git command that decided ``applies``, as the texts quote it.
    """

    commit: str
    branch: str | None
    applies: bool
    detail: str = ""
    project: str = VLLM.name
    how: str = "git apply --check"

    @property
    def where(self) -> str:
        """``vLLM `main` at commit 0123456789ab`` (or ``vLLM at commit ...`` when detached)."""
        on = f" `{self.branch}`" if self.branch else ""
        return f"{self.project}{on} at commit {self.commit[:12]}"


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False)


def checkout_commit(checkout: Path, upstream: Upstream = VLLM) -> tuple[str, str | None]:
    """``(HEAD, branch or None)`` of the git checkout ``checkout`` of ``upstream``.

    Raises:
        ValueError: ``checkout`` is not a git work tree (the message names ``upstream.option``).
    """
    head = _git(checkout, "rev-parse", "--verify", "HEAD")
    inside = _git(checkout, "rev-parse", "--is-inside-work-tree")
    if head.returncode or inside.stdout.strip() != "true":
        reason = (head.stderr or inside.stderr).strip().splitlines()
        raise ValueError(
            f"{upstream.option} {checkout}: not a git checkout of {upstream.name} with a commit "
            f"({reason[-1] if reason else 'no HEAD'}); clone {upstream.url} there"
        )
    branch = _git(checkout, "symbolic-ref", "--short", "-q", "HEAD").stdout.strip() or None
    return head.stdout.strip(), branch


def _first_lines(text: str) -> str:
    """git's first four lines of ``text``, on one line."""
    return " ".join(line.strip() for line in text.strip().splitlines()[:4])


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
    return MainCheck(
        commit, branch, proc.returncode == 0, "" if proc.returncode == 0 else _first_lines(proc.stderr)
    )


def _am_failure(output: str) -> str:
    """What ``git am``'s output says went wrong: its ``CONFLICT``/``error:`` lines and the patch
    that failed, without git's hints on how to go on."""
    keep = [
        line.strip()
        for line in output.splitlines()
        if line.startswith(("CONFLICT", "error:", "fatal:", "Patch failed at"))
        and "Failed to merge in the changes" not in line
    ]
    return " ".join(keep[:4]) or _first_lines(output)


def check_stack(checkout: Path, stack: list[list[Path]]) -> list[MainCheck]:
    """Each series of ``stack`` (one PR's ``git format-patch`` files, PRs in merge order) applied with
    ``git am --3way`` on top of the ones before it, in a scratch clone of ``checkout`` at its
    ``HEAD``; nothing is written in ``checkout``.

    Returns:
        One :class:`MainCheck` per series. Once a series does not apply, the later ones are not
        applied and say so in ``detail``.

    Raises:
        ValueError: ``checkout`` is not a git work tree of vllm-omni with a commit, or the scratch
            clone cannot be made (git's message).
    """
    commit, branch = checkout_commit(checkout, OMNI)
    checks: list[MainCheck] = []
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-main-") as tmp:
        clone = Path(tmp) / "tree"
        made = subprocess.run(
            ["git", "clone", "-q", "--shared", "--no-checkout", str(checkout), str(clone)],
            capture_output=True,
            text=True,
            check=False,
        )
        checked_out = _git(clone, "checkout", "-q", "--detach", commit) if not made.returncode else made
        if checked_out.returncode:
            raise ValueError(
                f"{OMNI.option} {checkout}: no scratch clone of {commit[:12]}: {_first_lines(checked_out.stderr)}"
            )
        failed: str | None = None
        for number, series in enumerate(stack, 1):
            if failed is None:
                applied = _git(
                    clone,
                    "-c", "user.name=check", "-c", "user.email=check@localhost",
                    "am", "--3way", *(str(p.resolve()) for p in series),
                )  # fmt: skip
                if applied.returncode:
                    _git(clone, "am", "--abort")
                    detail = _am_failure(applied.stdout + "\n" + applied.stderr)
                    failed = f"not tried: PR {number} of the stack, which it applies on, does not apply"
                else:
                    detail = ""
                ok = not applied.returncode
            else:
                ok, detail = False, failed
            checks.append(MainCheck(commit, branch, ok, detail, project=OMNI.name, how="git am --3way"))
    return checks
