# SPDX-License-Identifier: Apache-2.0
"""A placeholder identity (an address no person has) is warned about, noted in STACK.md and reported
by the export's checks; a real one passes silently. CPU only, no network: the export is stopped
before its first download, the series are made in a scratch git repository."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
from exportkit import REPO, no_git_identity

from minicpmo_cg.export import build, fetch, identity, verify
from minicpmo_cg.export.gitseries import Identity

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

SEED = "Seed 5d678970 maintainers <maintainers@users.noreply.a-seed-5d678970.example>"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("maintainers@users.noreply.a-seed-5d678970.example", "top-level domain .example"),
        ("someone@example.com", "reserved domain example.com"),
        ("someone@ci.example.net", "under the reserved domain example.net"),
        ("Someone@EXAMPLE.ORG.", "reserved domain example.org"),
        ("a@b.invalid", "top-level domain .invalid"),
        ("a@host.test", "top-level domain .test"),
        ("a@box.localhost", "top-level domain .localhost"),
        ("root@localhost", "reserved name localhost"),
        ("root", "has no @"),
        ("root@", "nothing before or after"),
    ],
)
def test_reserved_names_and_addresses_without_a_domain_are_placeholders(address, why):
    reason = identity.placeholder_reason(address)
    assert reason is not None and why in reason


@pytest.mark.parametrize(
    "address",
    [
        "someone@gmail.com",
        "12345+someone@users.noreply.github.com",
        "a@example.co",  # not reserved: only .com, .net and .org are
        "a@myexample.com",
        "a@example.com.cn",
        "a@localhost.company.org",
        "a@testing.dev",
    ],
)
def test_addresses_a_person_can_have_are_not_placeholders(address):
    assert identity.placeholder_reason(address) is None
    assert identity.placeholder_problem(f"Some One <{address}>") is None


def test_the_problem_names_the_identity_why_and_the_fix():
    problem = identity.placeholder_problem(Identity(SEED))
    assert SEED in problem and ".example" in problem and "DCO" in problem
    assert problem.endswith(identity.REEXPORT) and "--author 'Name <email>'" in problem
    assert identity.placeholder_problem("Root <root>") == identity.placeholder_problem(
        Identity("Root <root>", address_required=False)
    )


def test_a_placeholder_is_logged_as_a_warning_naming_author(caplog):
    caplog.set_level(logging.INFO, logger=identity.logger.name)
    assert identity.warn_if_placeholder(Identity("Some One <someone@gmail.com>")) is None
    assert caplog.records == []
    problem = identity.warn_if_placeholder(Identity(SEED))
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.name == "minicpmo_cg.export.identity"
    assert problem in record.getMessage() and "--author" in record.getMessage()


def test_the_export_warns_before_its_first_download(tmp_path, monkeypatch, caplog):
    """The export takes minutes (downloads, one commit per change, lint): the warning comes first."""

    def no_network(*_args, **_kw):
        raise fetch.FetchError("no network in this test")

    monkeypatch.setattr(fetch, "ruff_binary", no_network)
    monkeypatch.setattr(fetch, "wheel", no_network)
    caplog.set_level(logging.WARNING, logger=identity.logger.name)
    for author, warned in ((SEED, True), ("Some One <someone@gmail.com>", False)):
        caplog.clear()
        opts = build.ExportOptions(repo=REPO, out=tmp_path / "pr", author=Identity(author))
        with pytest.raises(fetch.FetchError, match="no network"):
            build.export(opts)
        messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert (messages == [f"export: {identity.placeholder_problem(author)}"]) == warned, messages
        assert bool(messages) == warned


def _result(problem: str | None) -> build.ExportResult:
    return build.ExportResult(out=Path("pr"), prs=[], vllm_prs=[], identity_problem=problem)


def test_stack_md_opens_with_the_placeholder_note_under_its_title():
    plain = build._stack_text(_result(None))
    problem = identity.placeholder_problem(SEED)
    flagged = build._stack_text(_result(problem))
    title, rest = plain.split("\n\n", 1)
    assert title.startswith("# ")
    assert flagged == f"{title}\n\n{identity.stack_note(problem)}\n{rest}"
    note = flagged.split("\n\n")[1]
    assert note.startswith("> **Placeholder identity.**") and SEED in note and identity.REEXPORT in note


def _git(cwd: Path, *args: str, author: str | None = None) -> str:
    env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin"}
    if author:
        ident = Identity(author, address_required=False)
        env.update(ident.env())
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def _export_folder(tmp_path: Path, authors: list[str]) -> Path:
    """An export folder holding one vllm-omni PR whose commits are by ``authors`` (one each) and an
    ``export.json`` naming its series."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "base", author="Base <base@gmail.com>")
    for i, author in enumerate(authors):
        (repo / f"f{i}.txt").write_text(f"{i}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-s", "-m", f"[Model] change {i}", author=author)
    names = _git(repo, "format-patch", "-q", "-o", str(out / "01-a"), "HEAD~%d" % len(authors)).split()
    series = [f"01-a/{Path(n).name}" for n in names] or sorted(
        f"01-a/{p.name}" for p in (out / "01-a").glob("*.patch")
    )
    manifest = {"prs": [{"folder": "01-a", "series": series}], "vllm_prs": []}
    (out / "export.json").write_text(json.dumps(manifest))
    return out


def test_verify_reports_each_placeholder_author_of_the_series(tmp_path):
    out = _export_folder(tmp_path, [SEED, "Some One <someone@gmail.com>", SEED, "Root <root>"])
    manifest = json.loads((out / "export.json").read_text())
    authors = verify.series_authors([out / s for s in manifest["prs"][0]["series"]])
    assert {a: len(n) for a, n in authors.items()} == {
        SEED: 2,
        "Some One <someone@gmail.com>": 1,
        "Root <root>": 1,
    }
    problems = verify.identity_problems(out, manifest)
    assert problems == [
        f"2 of the 4 commits: {identity.placeholder_problem(SEED)}",
        f"1 of the 4 commits: {identity.placeholder_problem('Root <root>')}",
    ]
    report = verify.VerifyReport(identity=problems)
    assert report.prs_ok and not report.ok and report.all_problems()[:2] == problems


def test_verify_finds_nothing_to_report_for_a_real_author(tmp_path):
    out = _export_folder(tmp_path, ["Some One <someone@gmail.com>"] * 2)
    assert verify.identity_problems(out, json.loads((out / "export.json").read_text())) == []
    assert verify.VerifyReport().ok


def test_gits_identity_without_an_address_is_taken_and_flagged(tmp_path, monkeypatch):
    from minicpmo_cg.export import cli

    no_git_identity(tmp_path, monkeypatch)
    (tmp_path / ".gitconfig").write_text("[user]\n\tname = Root\n\temail = root\n")
    found = cli.git_identity(tmp_path)
    assert str(found) == "Root <root>"
    assert "has no @" in identity.placeholder_problem(found)
    with pytest.raises(ValueError, match="not 'Full Name"):
        Identity("Root <root>")  # --author still needs an address
