# SPDX-License-Identifier: Apache-2.0
"""Constants and readers shared by the export tests and their conftest."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AUTHOR = "Export Test <export-test@example.com>"


def patch_texts(folder: Path) -> list[str]:
    """The ``git format-patch`` files of one PR folder, in order."""
    return [p.read_text() for p in sorted(folder.glob("*.patch"))]


def created_file(folder: Path, rel: str) -> str | None:
    """The content a PR folder's series gives the new file ``rel`` (None: the series does not create it)."""
    for text in reversed(patch_texts(folder)):
        m = re.search(
            rf"^--- /dev/null\n\+\+\+ b/{re.escape(rel)}\n@@[^\n]*\n((?:[+\\][^\n]*\n?)*)", text, re.MULTILINE
        )
        if m:
            return "\n".join(line[1:] for line in m.group(1).splitlines() if line.startswith("+"))
    return None


def series_names(folder: Path) -> list[str]:
    """The patch names of a ``series`` file, in order."""
    lines = (folder / "series").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def tracked(*paths: str) -> list[str]:
    """``git ls-files`` of ``paths`` in this checkout."""
    return subprocess.run(
        ["git", "ls-files", *paths], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()


def no_git_identity(home: Path, monkeypatch) -> None:
    """A git with no identity of its own: ``home`` as HOME (made if missing), no system config and
    none of the identity variables, so only what a test writes into ``home`` counts."""
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL",
                 "GIT_CONFIG_GLOBAL", "GIT_CONFIG_COUNT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
