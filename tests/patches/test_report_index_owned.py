# SPDX-License-Identifier: Apache-2.0
"""What the tool prints (120 columns, --verbose, --json), the patch index, the owned tree, its size."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import patchkit
import pytest
from patchkit import (
    ADAPTER_PACKAGE_REL,
    ADAPTER_REL,
    MODEL_REL,
    OWNED_RELS,
    STATE_DIR,
    WIRING,
    cli,
    cli_json,
    full_tree,
)

from minicpmo_cg import resources

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = "vllm_omni/model_executor/models/minicpmo_4_5"
EXTRA = f"{MODEL_DIR}/cg_test_extra"


# ---------------------------------------------------------------------------------------------
# status output
# ---------------------------------------------------------------------------------------------


def _deep_site(tmp_site: Path, tmp_path: Path) -> Path:
    """The same site under a path long enough that a naive header line would not fit."""
    deep = tmp_path / ("nested-" * 12) / "lib" / "python3.x" / "site-packages"
    deep.parent.mkdir(parents=True)
    shutil.move(tmp_site, deep)
    return deep


def test_status_fits_120_columns_and_verbose_has_the_details(tmp_site, tmp_path):
    site = _deep_site(tmp_site, tmp_path)
    model = site / MODEL_REL
    model.write_text(
        model.read_text().replace("    def get_audio_hidden_states(self", "    def get_audio_states(self")
    )
    for command in ("status", "check"):
        proc = cli(command, "--site-packages", str(site))
        lines = proc.stdout.splitlines()
        assert lines and max(len(line) for line in lines) <= 120, max(lines, key=len)
        assert any(line.split()[:1] == ["PATCH"] for line in lines)
        assert "conflict" in proc.stdout and "FAILED" in proc.stdout  # the conflict's reason, wrapped
    proc = cli("status", "--site-packages", str(site), "--verbose")
    assert proc.returncode == 0
    assert str(site) in proc.stdout and WIRING in proc.stdout and MODEL_REL in proc.stdout
    assert "patch program: GNU patch" in proc.stdout and f"{MODEL_REL}: pristine" in proc.stdout
    code, report = cli_json("status", "--site-packages", str(site))
    assert code == 0 and next(p for p in report["patches"] if p["name"] == WIRING)["state"] == "conflict"
    assert ADAPTER_REL in [o["path"] for o in report["owned"]] and report["journal"] == {
        "present": False,
        "complete": None,
    }


def test_status_rows_keep_patch_target_state_columns(tmp_site):
    """Column 1 is the patch (or ``owned``), column 3 its state: what scripts that read the table rely on."""
    assert cli("apply", "--site-packages", str(tmp_site)).returncode == 0
    proc = cli("status", "--site-packages", str(tmp_site))
    rows = [line.split() for line in proc.stdout.splitlines()[3:] if line and not line.startswith(" ")]
    rows = [r for r in rows if len(r) == 3]
    code, report = cli_json("status", "--site-packages", str(tmp_site))
    assert code == 0
    expected = sum(len(p["files"]) for p in report["patches"]) + len(report["owned"])
    assert len(rows) == expected
    assert {r[2] for r in rows} <= {"applied", "upstream", "n/a", "installed"}
    assert rows[-1][0] == "owned" and rows[-1][2] == "installed"


# ---------------------------------------------------------------------------------------------
# the patch index
# ---------------------------------------------------------------------------------------------


def test_committed_index_is_up_to_date():
    proc = cli("index", "--check")
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "patches" / "INDEX.md").read_text()
    code, report = cli_json("status")
    assert code == 0
    for patch in report["patches"]:
        row = next(line for line in text.splitlines() if f"[{patch['name']}]" in line)
        assert all(f"`{rel}`" in row for rel in patch["files"])


def test_index_check_fails_on_a_changed_header_and_write_fixes_it(tmp_path):
    root = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), root)
    wiring = root / WIRING
    wiring.write_text(wiring.read_text().replace("Upstream: none", "Upstream: vllm-project/vllm-omni#1", 1))
    proc = cli("index", "--check", "--patches-dir", str(root))
    assert proc.returncode == 1 and "out of date" in proc.stderr and "index --write" in proc.stderr
    assert cli("index", "--write", "--patches-dir", str(root)).returncode == 0
    assert cli("index", "--check", "--patches-dir", str(root)).returncode == 0
    assert "vllm-project/vllm-omni#1" in (root / "INDEX.md").read_text()
    assert cli("index", "--patches-dir", str(root)).stdout == (root / "INDEX.md").read_text()


# ---------------------------------------------------------------------------------------------
# the owned tree
# ---------------------------------------------------------------------------------------------


def _owned_dir(tmp_path: Path) -> Path:
    owned = tmp_path / "owned"
    shutil.copytree(resources.owned_root() / "vllm_omni", owned / "vllm_omni")
    (owned / EXTRA).mkdir(parents=True)
    (owned / EXTRA / "__init__.py").write_text('"""owned sub-package"""\n')
    (owned / EXTRA / "capture.py").write_text("CAPTURED = True\n")
    (owned / EXTRA / "__pycache__").mkdir()
    (owned / EXTRA / "__pycache__" / "capture.cpython-311.pyc").write_bytes(b"not shipped")
    return owned


def pristine_dirs(site: Path) -> set[str]:
    """Every directory under ``site``, relative to it."""
    return {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_dir()}


def test_every_file_of_the_owned_tree_is_installed_and_reverted(tmp_site, tmp_path):
    owned = _owned_dir(tmp_path)
    pristine = full_tree(tmp_site)
    # the owned packages (the adapter's, the kernels' ops/) are directories apply creates
    new_dirs = {rel.rsplit("/", 1)[0] for rel in OWNED_RELS} - pristine_dirs(tmp_site)
    args = ["--site-packages", str(tmp_site), "--owned-dir", str(owned)]
    code, report = cli_json("apply", *args)
    assert code == 0, report
    installed = {o["path"] for o in report["owned"] if o["state"] == "installed"}
    assert f"{MODEL_DIR}/streaming_audio.py" in OWNED_RELS  # the modules beside the model file
    assert installed == {*OWNED_RELS, f"{EXTRA}/__init__.py", f"{EXTRA}/capture.py"}
    assert (tmp_site / EXTRA / "capture.py").read_text() == "CAPTURED = True\n"
    assert not (tmp_site / EXTRA / "__pycache__").exists()
    state = json.loads((tmp_site / STATE_DIR / "state.json").read_text())
    assert ADAPTER_PACKAGE_REL in new_dirs  # the adapter is a package too
    assert set(state["created_dirs"]) == new_dirs | {EXTRA}
    assert state["files"][f"{EXTRA}/capture.py"]["role"] == "owned"
    (tmp_site / EXTRA / "__pycache__").mkdir()  # as an import would leave it
    (tmp_site / EXTRA / "__pycache__" / "capture.cpython-311.pyc").write_bytes(b"bytecode")
    assert cli("revert", *args).returncode == 0
    assert full_tree(tmp_site) == pristine


def test_an_owned_file_that_left_the_project_is_removed_by_the_next_apply(tmp_site, tmp_path):
    owned = _owned_dir(tmp_path)
    args = ["--site-packages", str(tmp_site), "--owned-dir", str(owned)]
    assert cli("apply", *args).returncode == 0
    (owned / EXTRA / "capture.py").unlink()
    code, report = cli_json("status", *args)
    gone = next(o for o in report["owned"] if o["path"] == f"{EXTRA}/capture.py")
    assert gone["state"] == "outdated" and "no longer part" in gone["detail"]
    assert cli("apply", *args).returncode == 0
    assert not (tmp_site / EXTRA / "capture.py").exists() and (tmp_site / EXTRA / "__init__.py").exists()
    code, report = cli_json("status", *args)
    assert code == 0 and all(o["state"] == "installed" for o in report["owned"])


def test_a_foreign_file_at_an_owned_path_is_stored_and_restored(tmp_site, tmp_path):
    owned = _owned_dir(tmp_path)
    (tmp_site / EXTRA).mkdir()
    (tmp_site / EXTRA / "capture.py").write_text("# somebody else's module\n")
    pristine = full_tree(tmp_site)
    args = ["--site-packages", str(tmp_site), "--owned-dir", str(owned)]
    code, report = cli_json("status", *args)
    assert code == 0
    foreign = next(o for o in report["owned"] if o["path"] == f"{EXTRA}/capture.py")
    assert foreign["state"] == "outdated" and "different file" in foreign["detail"]
    assert cli("apply", *args).returncode == 0
    assert (tmp_site / EXTRA / "capture.py").read_text() == "CAPTURED = True\n"
    assert cli("revert", *args).returncode == 0
    assert full_tree(tmp_site) == pristine


def test_an_owned_file_that_is_also_patched_is_a_format_error(tmp_site, tmp_path):
    owned = tmp_path / "owned"
    shutil.copytree(resources.owned_root() / "vllm_omni", owned / "vllm_omni")
    (owned / MODEL_REL).write_text("# would shadow the patched model file\n")
    proc = cli("status", "--site-packages", str(tmp_site), "--owned-dir", str(owned))
    assert proc.returncode == 2 and MODEL_REL in proc.stderr and "both an owned file" in proc.stderr


# ---------------------------------------------------------------------------------------------
# size
# ---------------------------------------------------------------------------------------------


def test_no_function_of_the_tool_is_longer_than_60_lines():
    sources = sorted((REPO / "minicpmo_cg" / "patchtool").glob("*.py")) + [
        REPO / "minicpmo_cg" / "lanes.py",
        REPO / "minicpmo_cg" / "resources.py",
    ]
    long = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.name}:{node.name} {length}")
    assert not long, long
    assert patchkit.target_rels()  # the tool still lists the series
