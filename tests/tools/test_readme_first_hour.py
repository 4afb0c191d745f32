# SPDX-License-Identifier: Apache-2.0
"""The README as a new user pastes it: the install block ends patched, serving finds it patched.

The commands of "Installing into your own environment" are replayed in order as far as the
patch state goes (``minicpmo-cg-patch apply`` / ``revert``): the first block must leave the set
applied, ``vllm serve`` must come after an apply with no revert in between, and ``revert`` only
after serving, in its own block. The same section must tell a user without network how not to
wait minutes for hub retries.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Installing into your own environment"


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def _blocks(section: str) -> list[list[str]]:
    """The commands of each fenced block (comments and blank lines dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [
        [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]
        for block in blocks
    ]


def test_pasting_the_install_section_in_order_serves_a_patched_install():
    blocks = _blocks(_section())
    applied, seen_serve, trail = False, False, []
    for number, block in enumerate(blocks):
        for command in block:
            if command.startswith("minicpmo-cg-patch apply"):
                applied = True
            elif command.startswith("minicpmo-cg-patch revert"):
                assert seen_serve, f"block {number} reverts before `vllm serve`: {command}"
                assert block == [command], "the undo line stands alone in its block"
                applied = False
            elif command.startswith("vllm serve"):
                assert applied, "`vllm serve` would run an unpatched vllm-omni"
                seen_serve = True
        trail.append(applied)
    assert trail[0], "the install block does not end with the patch set applied"
    assert seen_serve and any("minicpmo-cg-patch revert" in c for b in blocks for c in b)


def test_the_checkpoint_paragraph_says_how_to_skip_the_hub_retries():
    paragraph = next(p for p in _section().split("\n\n") if "checkpoint" in p and "hub" in p)
    assert "HF_HUB_OFFLINE=1" in paragraph and "httpx.ConnectError" in paragraph
