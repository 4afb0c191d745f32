# SPDX-License-Identifier: Apache-2.0
"""One export of this checkout (current lane) shared by the export tests, verified PR by PR as CI does."""

from __future__ import annotations

import json

import pytest
from exportkit import AUTHOR, REPO


def installed_lane() -> str | None:
    from minicpmo_cg.patchtool import ToolError, discover_installation

    try:
        return discover_installation(None).lane
    except ToolError:
        return None


@pytest.fixture(scope="session")
def current_lane_only():
    lane = installed_lane()
    if lane != "current":
        pytest.skip(
            f"the export is of the current lane; its vLLM series is diffed against that lane's vLLM (here: {lane})"
        )


@pytest.fixture(scope="session")
def exported(tmp_path_factory, current_lane_only):
    """``(out dir, manifest, verify report)`` of ``export --run-tests`` on this checkout: every PR of
    the stack applied on the ones before it, linted, its imports resolved and its CPU tests run from
    its own tree; the PR texts rewritten with those runs (the test author is a placeholder address,
    which the report's ``identity`` flags; the PRs' own checks are what ``prs_ok`` says)."""
    from minicpmo_cg.export import build, verify
    from minicpmo_cg.export.gitseries import Identity

    out = tmp_path_factory.mktemp("export") / "pr"
    result = build.export(build.ExportOptions(repo=REPO, out=out, author=Identity(AUTHOR)))
    report = verify.verify(out, REPO, run_tests=True)
    if report.prs_ok:
        build.rewrite_prs(result, report.runs())
    return out, json.loads((out / "export.json").read_text()), report
