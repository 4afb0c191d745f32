"""A vllm-omni general plugin: MiniCPM-o 4.5's thinker as a pipeline of its own (text out).

vllm-omni 0.30 registers MiniCPM-o 4.5 as three stages (thinker, talker, Code2Wav); a deploy
config cannot drop the last two, which need the ``tts.*`` weights and the token2wav assets.
Like vllm-omni's own ``qwen2_5_omni_thinker_only``, this registers ``minicpmo_4_5_thinker_only``:
the thinker stage alone, as vllm-omni defines it. Select it with a deploy config holding
``pipeline: minicpmo_4_5_thinker_only`` (``vllm serve DIR --omni --deploy-config FILE``).
"""

from __future__ import annotations

import dataclasses

THINKER_ONLY = "minicpmo_4_5_thinker_only"


def register_thinker_only() -> None:
    """Register :data:`THINKER_ONLY` with vllm-omni's pipeline registry (once per process)."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.model_executor.models.minicpmo_4_5.pipeline import MINICPMO_4_5_PIPELINE

    if THINKER_ONLY in OMNI_PIPELINES:
        return
    register_pipeline(
        dataclasses.replace(
            MINICPMO_4_5_PIPELINE,
            model_type=THINKER_ONLY,
            default_deploy_config_name=None,
            duplex_plugin=None,
            hf_architectures=(),  # only an explicit deploy config selects it
            hf_config_predicate=None,
            stages=(MINICPMO_4_5_PIPELINE.stages[0],),
        )
    )
