# SPDX-License-Identifier: Apache-2.0
"""The upstream stack (``minicpmo_cg/export``): its table covers the patch set once, in series order;
its hand-written PR texts link nowhere dead and name only files of their PR; the export writes every
PR as a series that applies on the one before; the patch tool does not import the export."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from minicpmo_cg.export import cli
from minicpmo_cg.export.stack import STACK, VLLM

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = cli.REPO
_FILE = re.compile(r"[\w./-]+\.(?:py|patch)\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _series(package: str) -> list[str]:
    lines = (REPO / "patches" / package / "series").read_text().splitlines()
    return [line[:4] for line in lines if line.strip() and not line.startswith("#")]


def test_every_patch_owned_file_and_model_test_is_in_one_pr_in_series_order():
    assert [n for pr in STACK for n in pr.patches] == _series("vllm-omni")
    assert set(VLLM.patches) <= set(_series("vllm"))
    owned = [f for pr in STACK for f in pr.owned]
    assert sorted(owned) == sorted(_tracked("vllm_omni")), "owned files: each in exactly one PR"
    tests = [f for pr in STACK for f in cli.test_files(pr)]
    model_tests = [f for f in _tracked("tests/model_executor/models/minicpmo_4_5") if "/test_" in f]
    assert sorted(tests) == sorted(model_tests), "model tests: each in exactly one PR"


def _texts() -> list[tuple[Path, list[str]]]:
    """Each PR's text and the file names it may name: its own files and those its patches change."""
    out = []
    for name, pr, package in [(cli.folder(i, pr), pr, "vllm-omni") for i, pr in enumerate(STACK, 1)] + [
        (f"vllm-{VLLM.key}", VLLM, "vllm")
    ]:
        patches = cli.patches_of(pr, package)
        files = [*pr.owned, *cli.test_files(pr), *(p.path.name for p in patches)]
        files += [rel for p in patches for rel in p.file_paths]
        out.append((cli.pr_text(name), files))
    return out


def test_pr_texts_exist_link_to_existing_files_and_name_only_their_prs_files():
    problems = []
    for text, files in _texts():
        assert text.is_file(), f"{text.relative_to(REPO)} is missing"
        body = text.read_text(encoding="utf-8")
        for target in _LINK.findall(body):
            if not (text.parent / target.split("#")[0]).exists():
                problems.append(f"{text.name}: dead link {target}")
        for named in _FILE.findall(_LINK.sub("", body)):
            if not any(f == named or f.endswith("/" + named) for f in files):
                problems.append(f"{text.name}: names {named}, which its PR does not contain")
    assert not problems, "\n".join(problems)


def test_patch_tool_does_not_import_the_export():
    for path in (REPO / "minicpmo_cg" / "patchtool").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("minicpmo_cg.export") for n in names), path


def test_export_writes_each_pr_as_a_series_that_applies_on_the_one_before(tmp_path, capsys):
    import importlib.metadata

    from minicpmo_cg.lanes import get_lane

    if importlib.metadata.version("vllm-omni") != get_lane("current").vllm_omni:
        pytest.skip("the export starts from the current lane's release (this venv holds another lane)")
    out = tmp_path / "out"
    code = cli.main([str(out), "--verify", "--no-tests"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    for i, pr in enumerate(STACK, 1):
        folder = out / cli.folder(i, pr)
        assert len(list(folder.glob("*.patch"))) == len(cli.upstream_patches(pr)), folder
        assert (folder / "PR.md").read_text() == cli.pr_text(folder.name).read_text()
        assert f"{folder.name}: checked" in printed.out
    vllm = out / f"vllm-{VLLM.key}"
    assert len(list(vllm.glob("*.patch"))) == len(VLLM.patches)
    assert "tests/v1/cudagraph/" in next(vllm.glob("*.patch")).read_text()


def test_export_refuses_an_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("a file\n")
    assert cli.main([str(out)]) == 2
    assert str(out) in capsys.readouterr().err and out.read_text() == "a file\n"
