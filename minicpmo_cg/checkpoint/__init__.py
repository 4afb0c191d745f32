"""A MiniCPM-o 4.5 checkpoint built offline, for runs through vLLM's engine without the real weights.

``minicpmo-cg-checkpoint build OUT --size {full,reduced} [--seed N] [--device cpu|cuda]`` writes a
folder vllm-omni serves as it serves ``openbmb/MiniCPM-o-4_5`` (thinker stage):

- ``config.json`` (``model_type`` ``minicpmo``, ``architectures`` ``["MiniCPMO"]``, ``version`` ``"4.5"``,
  ``auto_map`` to ``configuration_minicpmo.py``, which re-exports vllm-omni's ``MiniCPMOConfig``);
- random bf16 weights under the real names (``vpm.``, ``resampler.``, ``apm.``, ``audio_projection_layer.``,
  ``llm.``), one ``model.safetensors`` or 2 GiB shards with ``model.safetensors.index.json``; no ``tts.*``;
- a byte-level tokenizer holding every marker vllm-omni uses at the ids it hardcodes;
- ``processing_minicpmo.py``, the processor ``AutoProcessor`` finds (``auto_map``), with
  ``preprocessor_config.json`` and ``generation_config.json``.

``minicpmo-cg-checkpoint check DIR`` validates a folder and names the first bad file in one line.
Layout: :mod:`.layout`; writing: :mod:`.build`; tokenizer: :mod:`.tokenizer`; validation: :mod:`.check`.
"""
