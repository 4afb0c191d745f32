# STUB (offline GPU bundle, minicpmo_cg/offline_gpu/). Stands in for PyAV (`av`, a 35 MB wheel with
# FFmpeg inside), which is not carried.
#
# Why it exists: vllm-omni's OpenAI server imports its video routes at start-up, and those import
# `av` at module level (vllm_omni/diffusion/utils/media_utils.py), so `vllm serve --omni` cannot
# start without it.
#
# What it does: lets `import av` succeed; any attribute raises an AttributeError saying that PyAV is
# not carried.
#
# Why that is safe: nothing this project serves decodes video. vLLM's audio loader tries soundfile
# (carried) before PyAV, so WAV inputs never reach this module; a path that does needs PyAV and
# fails loudly instead of computing something else.
STUB = True


def __getattr__(name: str):
    raise AttributeError(f"av.{name}: PyAV is not carried by the offline GPU bundle (stub)")
