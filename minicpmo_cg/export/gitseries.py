"""A ``git format-patch`` series built in a scratch repository on top of the pinned release.

:class:`SeriesRepo` holds a throw-away git repository whose first commit is the base (the
released package tree); each :meth:`SeriesRepo.commit` writes files or applies a diff, lets
:mod:`.lint` format the touched Python with vllm-omni's ruff settings, and commits with a
``Signed-off-by`` trailer of the given identity (vllm-omni's DCO check compares it with the
author). :meth:`SeriesRepo.format_patch` writes the mbox files ``git am`` reads.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "Identity",
    "SeriesRepo",
    "authored_series_fingerprint",
    "git",
    "series_fingerprint",
    "tree_fingerprint",
    "wrap_body",
]


class Identity:
    """``Name <email>`` of the author and signer of every commit.

    ``address_required=False`` also takes an address without ``@`` (git's identity can be one, e.g.
    ``user.email = root``), which :mod:`.identity` then reports as a placeholder.

    Raises:
        ValueError: ``text`` is not ``Name <email>``.
    """

    def __init__(self, text: str, address_required: bool = True):
        address = r"[^<>\s]+@[^<>\s]+" if address_required else r"[^<>\s]+"
        m = re.fullmatch(rf"\s*([^<>]+?)\s*<({address})>\s*", text)
        if not m:
            raise ValueError(f"--author {text!r} is not 'Full Name <email@example.com>'")
        self.name, self.email = m.groups()

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"

    def env(self) -> dict[str, str]:
        return {
            "GIT_AUTHOR_NAME": self.name,
            "GIT_AUTHOR_EMAIL": self.email,
            "GIT_COMMITTER_NAME": self.name,
            "GIT_COMMITTER_EMAIL": self.email,
        }


def git(cwd: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    """Run ``git args`` in ``cwd`` with no user or system configuration; return stdout.

    Raises:
        RuntimeError: git exited non-zero and ``check`` is set (stderr in the message).
    """
    full_env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, **(env or {})}
    proc = subprocess.run(
        ["git", "-c", "core.autocrlf=false", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        check=False,
    )
    if check and proc.returncode:
        raise RuntimeError(
            f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


#: a ``git format-patch`` diff section's first line, naming the file it changes
_DIFF_START = re.compile(rb"^diff --git a/(\S+) b/(\S+)$", re.M)
#: git's version signature closing an mbox (``-- `` and the version of the git that wrote it)
_SIGNATURE = re.compile(rb"\n-- \n\d[\w.]*\n*\Z")


def series_fingerprint(patches: list[Path]) -> str:
    """sha256 (hex) of what a ``git format-patch`` series changes in code: each mbox's diff
    sections in order, except those of Markdown files (``*.md``: design pages), and nothing of its
    header or message (commit id, date, author, subject, message, ``Signed-off-by:``).

    It ties a CUDA test run on a GPU host to the code it ran (through :func:`tree_fingerprint`,
    :mod:`.gpuresults`). Those tests (``core_model and cuda``) observe the code and the tests and
    read no Markdown file (a test checks that; the design-page test is a CPU one, run on every
    export), so a re-export under another ``--author``, a reworded commit message or an edited
    design page keeps the runs, and any other changed line does not."""
    digest = hashlib.sha256()
    for patch in patches:
        data = patch.read_bytes()
        starts = list(_DIFF_START.finditer(data))
        for k, start in enumerate(starts):
            if start.group(2).endswith(b".md"):
                continue
            end = starts[k + 1].start() if k + 1 < len(starts) else len(data)
            section = _SIGNATURE.sub(b"\n", data[start.start() : end])
            digest.update(section + b"\0")
        digest.update(b"\1")  # the commit boundary
    return digest.hexdigest()


def tree_fingerprint(series_fingerprints: list[str]) -> str:
    """sha256 (hex) of a PR's tree as the stack builds it, from the :func:`series_fingerprint` of
    each series applied, in order (the vLLM PRs the tree needs, then the vllm-omni PRs up to this
    one).

    A test run counts for the tree it ran on, so a change to an earlier PR's code is a change to
    every later PR's tree, whose own series may be unchanged."""
    return hashlib.sha256("\n".join(series_fingerprints).encode()).hexdigest()


def authored_series_fingerprint(patches: list[Path]) -> str:
    """The fingerprint ``stack`` summaries recorded per series before they recorded
    :func:`tree_fingerprint`: every mbox whole but its ``From <commit id>`` line and ``Date:``
    header. It matches only an export by the run's author, with the same messages and design pages."""
    digest = hashlib.sha256()
    for patch in patches:
        header, sep, rest = patch.read_bytes().partition(b"\n\n")
        lines = header.split(b"\n")
        kept = [line for i, line in enumerate(lines) if not (i == 0 and line.startswith(b"From "))]
        kept = [line for line in kept if not line.startswith(b"Date: ")]
        digest.update(b"\n".join(kept) + sep + rest + b"\0")
    return digest.hexdigest()


def wrap_body(text: str, width: int = 72) -> str:
    """Paragraphs (blank-line separated) re-wrapped to ``width`` columns for a commit message."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "\n\n".join(
        textwrap.fill(p, width, break_on_hyphens=False, break_long_words=False) for p in paragraphs
    )


class SeriesRepo:
    """A scratch repository: ``base`` committed, then the series' commits on top."""

    def __init__(self, root: Path, identity: Identity, formatter: Callable[[Path, list[str]], None]):
        self.root = root
        self.identity = identity
        self.formatter = formatter
        self.titles: list[str] = []
        self.messages: list[str] = []
        self.files: list[list[str]] = []
        git(root, "init", "-q", "-b", "export")
        git(root, "add", "-A")
        git(root, "commit", "-q", "--allow-empty", "--no-verify", "-m", "base", env=identity.env())
        self.base = git(root, "rev-parse", "HEAD").strip()

    def commit(
        self,
        title: str,
        body: str,
        files: dict[str, str] | None = None,
        diff: str | None = None,
        format_paths: list[str] | None = None,
    ) -> list[str]:
        """Write ``files`` and/or apply ``diff`` (``a/``/``b/`` paths), format, commit; return the paths.

        Raises:
            RuntimeError: the diff does not apply (git's message), or nothing changed.
        """
        for rel, text in (files or {}).items():
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        if diff is not None:
            patch = self.root.parent / f".{self.root.name}.diff"
            patch.write_text(diff, encoding="utf-8")
            git(self.root, "apply", "--whitespace=nowarn", str(patch))
            patch.unlink()
        self.formatter(self.root, [p for p in (format_paths or list(files or {})) if p.endswith(".py")])
        git(self.root, "add", "-A")
        changed = git(self.root, "diff", "--cached", "--name-only").split()
        if not changed:
            raise RuntimeError(f"commit {title!r} changes nothing")
        message = f"{title}\n\n{body}" if body else title
        git(self.root, "commit", "-q", "-s", "--no-verify", "-m", message, env=self.identity.env())
        self.titles.append(title)
        self.messages.append(message)
        self.files.append(changed)
        return changed

    def head(self) -> str:
        return git(self.root, "rev-parse", "HEAD").strip()

    def format_patch(self, out: Path, since: str | None = None) -> list[Path]:
        """Write the commits after ``since`` (default: the base) as numbered mbox patches into ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        listed = git(
            self.root, "format-patch", "--no-signature", "-o", str(out), f"{since or self.base}..HEAD"
        )
        return [Path(line) for line in listed.split()] or sorted(out.glob("*.patch"))

    def shortstat(self, since: str) -> dict[str, int]:
        """``files``, ``insertions`` and ``deletions`` of the commits after ``since``."""
        text = git(self.root, "diff", "--shortstat", since, "HEAD")
        numbers = {
            key: int(m.group(1)) if (m := re.search(rf"(\d+) {word}", text)) else 0
            for key, word in (("files", "file"), ("insertions", "insertion"), ("deletions", "deletion"))
        }
        return numbers
