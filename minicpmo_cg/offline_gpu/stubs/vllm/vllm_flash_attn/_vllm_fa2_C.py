# STUB (offline GPU bundle, minicpmo_cg/offline_gpu/). Stands in for
# vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (294 MB, built for the torch vLLM pins, not loadable with
# another), which is not carried.
#
# Why it exists: vllm/vllm_flash_attn/__init__.py raises ImportError unless _vllm_fa2_C or
# _vllm_fa3_C imports, and vllm/v1/attention/backends/fa_utils.py imports that package
# unconditionally on the CUDA platform (reached through vLLM's MMEncoderAttention on the way to
# vllm.model_executor.models.minicpmv and the GPU model runner).
#
# What it does: nothing; an empty module lets the import succeed. torch.ops._vllm_fa2_C.* kernels
# do NOT exist, so any FLASH_ATTN path fails with an AttributeError when it is called.
#
# Why that is safe: MiniCPM-o 4.5's encoders in vllm-omni use their own (eager / SDPA) attention,
# never vLLM's flash-attention ops; tests that build vLLM attention layers (the MiniCPM-V / Idefics2
# ones) select TORCH_SDPA. Nothing computes differently because of this stub: a path that would
# need the kernel fails loudly.
STUB = True
