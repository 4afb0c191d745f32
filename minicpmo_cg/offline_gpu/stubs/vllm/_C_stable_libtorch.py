# STUB (offline GPU bundle, minicpmo_cg/offline_gpu/): a fallback for vllm/_C_stable_libtorch.abi3.so.
# The bundle carries that extension (built on torch's stable C ABI, it loads under the host's torch;
# slimmed to sm_90 by minicpmo_cg/offline_gpu/native.py), and Python imports it before this file.
# Only where it does not load does the host-side install rename it, with a WARNING, so that this
# stub is imported instead (hostenv.load_kernels).
#
# Why it exists: vllm/platforms/cuda.py imports this module unconditionally at module level, and
# vllm/model_executor/layers/quantization/utils/w8a8_utils.py asks CUTLASS capability queries at
# import time:
#     CUTLASS_FP8_SUPPORTED = cutlass_fp8_supported()              (vllm 0.28 only)
#     CUTLASS_BLOCK_FP8_SUPPORTED = cutlass_block_fp8_supported()  (vllm 0.28 and 0.30)
# -> torch.ops._C.cutlass_scaled_mm_supports_{fp8,block_fp8}(capability). That module is imported
# on the way to vllm.model_executor.models.minicpmv, the GPU model runner and vllm_omni (seen with
# minicpmo_cg.offline_gpu.importcheck: without these ops every one of those imports fails).
#
# What it does: registers exactly those two queries in torch.ops._C and answers False ("CUTLASS
# FP8 kernels not available"), so vLLM picks its non-CUTLASS fallbacks, as on a build without
# CUTLASS.
#
# Why that is safe: the queries only steer FP8-quantized linear layers, which no test, the demo
# or the benchmark builds (MiniCPM-o 4.5's encoders run in bf16). No kernel is provided: any other
# torch.ops._C op (e.g. cutlass_group_gemm_supported, asked only when an FP8 MoE is built) still
# raises AttributeError, so a path that needs vLLM's compiled kernels fails loudly instead of
# computing something else.
import torch

STUB = True
_lib = torch.library.Library("_C", "FRAGMENT")  # keep a reference: the registrations live with it

#: the import-time capability queries; both answer False
QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8")
for _name in QUERIES:
    if not hasattr(torch.ops._C, _name):
        _lib.define(f"{_name}(int cuda_device_capability) -> bool")
        _lib.impl(_name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
