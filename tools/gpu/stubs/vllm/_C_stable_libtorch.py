# STUB (offline GPU bundle, tools/gpu/). Stands in for vllm/_C_stable_libtorch.abi3.so (74 MB,
# 53 MB zipped, built for torch 2.13 while the GPU host has torch 2.11), which is not carried.
#
# Why it exists: vllm/platforms/cuda.py imports this module unconditionally at module level, and
# vllm/model_executor/layers/quantization/utils/w8a8_utils.py evaluates, at import time,
#     CUTLASS_BLOCK_FP8_SUPPORTED = cutlass_block_fp8_supported()
# -> torch.ops._C.cutlass_scaled_mm_supports_block_fp8(capability). That module is imported on
# the way to vllm.model_executor.models.minicpmv, the GPU model runner and vllm_omni (seen with
# tools/gpu/hostsim_check.py: without the op every one of those imports fails).
#
# What it does: registers that one capability query in torch.ops._C and answers False
# ("CUTLASS block-FP8 kernel not available"), which makes vLLM pick its non-CUTLASS fallback,
# exactly as on a build without CUTLASS.
#
# Why that is safe: the query only steers FP8 block-quantized linear layers, which no test, the
# main job or the benchmark builds (MiniCPM-o 4.5's encoders run in bf16). No kernel is provided:
# any other torch.ops._C op still raises AttributeError, so a path that needs vLLM's compiled
# kernels fails loudly instead of computing something else.
import torch

STUB = True
_lib = torch.library.Library("_C", "FRAGMENT")  # keep a reference: the registration lives with it

_SCHEMA = "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool"
if not hasattr(torch.ops._C, "cutlass_scaled_mm_supports_block_fp8"):
    _lib.define(_SCHEMA)
    _lib.impl("cutlass_scaled_mm_supports_block_fp8", lambda cuda_device_capability: False,
              "CompositeExplicitAutograd")
