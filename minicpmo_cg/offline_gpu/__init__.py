"""Run this project's CUDA tests, demo and benchmark on an offline GPU host.

The host has Python 3.12, torch and transformers but no vLLM and no network. On a networked
machine, ``bundle`` packs each lane's pinned vLLM / vllm-omni pure-Python code, patched with this
checkout's series, with the dependencies the host lacks; on the host, ``run`` (or ``env``) unpacks
it and runs against it from the source tree. Commands: ``python -m minicpmo_cg.offline_gpu
{bundle,check,env,run}``; the guide is ``docs/offline_gpu_host.md``. Standard library only.
"""
