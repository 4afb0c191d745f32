# SPDX-License-Identifier: Apache-2.0
"""The vLLM general plugin that warns in the server log when the patch set is not applied.

``vllm serve`` loads it in every process (``vllm.plugins.load_general_plugins``); here it runs
against temporary site-packages copies: pristine (a warning), applied (none), damaged (a
warning, not a crash), and it must stay cheap: no subprocess, nothing written.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

import patchkit
import pytest
from patchkit import MODEL_REL, STATE_DIR

from minicpmo_cg import vllm_plugin
from minicpmo_cg.patchtool import cli

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

ENTRY_POINT = "minicpmo_cg_patch_check"
LOGGER = f"vllm.{vllm_plugin.__name__}"


class Sites:
    def __init__(self, root: Path) -> None:
        self.pristine = patchkit.make_site(root, "pristine")
        self.applied = root / "applied"
        shutil.copytree(self.pristine, self.applied, symlinks=True)
        assert cli.run(["apply", "--site-packages", str(self.applied)]) == 0

    def copy(self, which: str, name: str) -> Path:
        target = getattr(self, which).parent / name
        shutil.copytree(getattr(self, which), target, symlinks=True)
        return target


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> Sites:
    return Sites(tmp_path_factory.mktemp("plugin"))


@pytest.fixture
def warnings(monkeypatch):
    """The plugin's log records (vLLM's loggers do not propagate to pytest's handler)."""
    monkeypatch.setenv(vllm_plugin.ENV_CHECKED, "")  # empty: not checked yet; restored afterwards
    # vLLM configures logging when vllm.logger is first imported (the plugin imports it to warn), and
    # that configuration empties the handlers of the loggers below "vllm": import it first, so the
    # handler added here survives when this file runs before anything else imported vLLM
    import vllm.logger  # noqa: F401

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_pristine_site_gets_one_warning_naming_the_fix(sites, warnings):
    vllm_plugin.check_patch_set(
        argv=["vllm", "serve", "openbmb/MiniCPM-o-4_5", "--omni"], site=sites.pristine
    )
    (record,) = warnings
    text = record.getMessage()
    assert record.levelno == logging.WARNING and record.name == LOGGER
    assert "minicpmo-cg-patch apply" in text and str(sites.pristine) in text and "no state record" in text
    # once per server: the processes vLLM starts inherit the mark and stay quiet
    vllm_plugin.check_patch_set(argv=[], site=sites.pristine)
    assert len(warnings) == 1


def test_an_applied_site_gets_no_warning(sites, warnings):
    vllm_plugin.check_patch_set(argv=[], site=sites.applied)
    assert warnings == [] and vllm_plugin.patch_set_warning(sites.applied) is None


def test_turning_encoder_graphs_off_silences_it(sites, warnings):
    for argv in (
        ["--hf-overrides", json.dumps({"encoder_cuda_graph": False})],
        ["--hf-overrides=" + json.dumps({"encoder_cuda_graph": False, "x": 1})],
        ["--hf-overrides.encoder_cuda_graph", "false"],
    ):
        assert vllm_plugin.encoder_graphs_disabled(argv), argv
    assert not vllm_plugin.encoder_graphs_disabled(["--hf-overrides", '{"encoder_cuda_graph": true}'])
    assert not vllm_plugin.encoder_graphs_disabled(["--hf-overrides", "not json"])
    vllm_plugin.check_patch_set(argv=["--hf-overrides", '{"encoder_cuda_graph": false}'], site=sites.pristine)
    assert warnings == []


@pytest.mark.parametrize("damage", ["hand-edited model file", "damaged state.json", "missing owned file"])
def test_a_broken_site_gets_a_warning_with_the_reason_not_a_crash(sites, warnings, damage):
    site = sites.copy("applied", damage.replace(" ", "-"))
    if damage == "hand-edited model file":
        (site / MODEL_REL).write_text((site / MODEL_REL).read_text() + "# edit\n")
        reason = f"{MODEL_REL} is not what apply wrote"
    elif damage == "damaged state.json":
        (site / STATE_DIR / "state.json").write_text('{"format": 2, "files": ')
        reason = "the state is damaged"
    else:
        (site / patchkit.ADAPTER_REL).unlink()
        reason = f"the owned file {patchkit.ADAPTER_REL} is missing or outdated"
    vllm_plugin.check_patch_set(argv=[], site=site)
    (record,) = warnings
    assert reason in record.getMessage() and "minicpmo-cg-patch apply" in record.getMessage()


def test_the_check_runs_no_subprocess_and_writes_nothing(sites, monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the plugin started a process: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    broken = tmp_path / "no-tmpdir"
    broken.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(broken))  # any temporary file would fail
    before = {name: patchkit.full_tree(getattr(sites, name)) for name in ("pristine", "applied")}
    assert vllm_plugin.patch_set_warning(sites.applied) is None
    assert "not applied" in vllm_plugin.patch_set_warning(sites.pristine)
    assert {name: patchkit.full_tree(getattr(sites, name)) for name in before} == before


def test_vllm_finds_the_plugin_in_its_general_plugins_group():
    """The editable install registers the entry point (setup.py); vLLM's loader returns it."""
    (entry,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == ENTRY_POINT
    ]
    assert entry.value == "minicpmo_cg.vllm_plugin:check_patch_set"
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[ENTRY_POINT] is vllm_plugin.check_patch_set
