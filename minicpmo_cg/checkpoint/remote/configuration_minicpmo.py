"""MiniCPM-o 4.5's configuration for ``AutoConfig`` (``auto_map``): vllm-omni's ``MiniCPMOConfig``."""

from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm import MiniCPMOConfig

__all__ = ["MiniCPMOConfig"]
