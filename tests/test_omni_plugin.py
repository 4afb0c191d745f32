# SPDX-License-Identifier: Apache-2.0
"""The thinker-only pipeline the project's vLLM plugin registers with vllm-omni."""

from __future__ import annotations

import importlib.metadata

import pytest

from minicpmo_cg import omni_plugin

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def test_the_thinker_stage_alone_is_registered_once(monkeypatch):
    from vllm_omni.config import pipeline_registry
    from vllm_omni.model_executor.models.minicpmo_4_5.pipeline import MINICPMO_4_5_PIPELINE

    monkeypatch.setattr(pipeline_registry, "OMNI_PIPELINES", dict(pipeline_registry.OMNI_PIPELINES))
    monkeypatch.delitem(pipeline_registry.OMNI_PIPELINES, omni_plugin.THINKER_ONLY, raising=False)
    omni_plugin.register_thinker_only()
    registered = pipeline_registry.OMNI_PIPELINES[omni_plugin.THINKER_ONLY]
    omni_plugin.register_thinker_only()  # a second process-local call changes nothing
    assert pipeline_registry.OMNI_PIPELINES[omni_plugin.THINKER_ONLY] is registered
    (stage,) = registered.stages
    assert stage is MINICPMO_4_5_PIPELINE.stages[0] and stage.final_output_type == "text"
    assert registered.model_arch == MINICPMO_4_5_PIPELINE.model_arch
    # auto-detection still picks the three-stage pipeline: only a deploy config selects this one
    assert registered.hf_architectures == () and getattr(registered, "duplex_plugin", None) is None


def test_vllm_loads_it_as_a_general_plugin():
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("minicpmo_cg_thinker_only") == "minicpmo_cg.omni_plugin:register_thinker_only"


def test_a_vllm_omni_without_the_registry_gets_a_warning_not_a_failed_start(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "vllm_omni.config.pipeline_registry", None)  # import fails
    omni_plugin.register_thinker_only()  # must not raise: vLLM loads it in every process
