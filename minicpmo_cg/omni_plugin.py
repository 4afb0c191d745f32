"""A vllm-omni general plugin: MiniCPM-o 4.5's thinker as a pipeline of its own (text out)."""

from __future__ import annotations

import dataclasses

THINKER_ONLY = "minicpmo_4_5_thinker_only"


def register_thinker_only() -> None:
    """Register :data:`THINKER_ONLY` with vllm-omni's pipeline registry (once per process)."""
    try:
        from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
        from vllm_omni.model_executor.models.minicpmo_4_5.pipeline import MINICPMO_4_5_PIPELINE
    except ImportError as exc:
        _warn(f"vllm-omni has no pipeline registry for MiniCPM-o 4.5 ({exc})")
        return
    if THINKER_ONLY in OMNI_PIPELINES:
        return
    changes = {
        "model_type": THINKER_ONLY,
        "stages": MINICPMO_4_5_PIPELINE.stages[:1],
        "hf_architectures": (),  # only an explicit deploy config selects it
        "hf_config_predicate": None,
        "default_deploy_config_name": None,
        "duplex_plugin": None,
    }
    fields = {f.name for f in dataclasses.fields(MINICPMO_4_5_PIPELINE)}  # 0.28 lacks the last two
    register_pipeline(dataclasses.replace(MINICPMO_4_5_PIPELINE, **{k: v for k, v in changes.items() if k in fields}))


def _warn(message: str) -> None:
    from vllm.logger import init_logger

    init_logger(__name__).warning("%s: the %s pipeline is not registered", message, THINKER_ONLY)
