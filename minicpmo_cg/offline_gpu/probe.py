"""Print the interpreter, torch, CUDA devices, package versions and vLLM platform of this environment."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

PACKAGES = ("vllm", "vllm-omni", "transformers", "triton", "numpy")
ADAPTER = "vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph"


def describe_torch() -> list[str]:
    import torch

    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    if not torch.cuda.is_available():
        return [*lines, "cuda devices: none (torch.cuda.is_available() is False)"]
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        lines.append(
            f"cuda:{index} {p.name}, cc {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
            f"{p.multi_processor_count} SMs"
        )
    return lines


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    return "; ".join(found)


def main() -> int:
    print(f"python {platform.python_version()} ({sys.executable})")
    for line in describe_torch():
        print(line)
    print(versions())
    try:
        import importlib

        import vllm
        from vllm.platforms import current_platform

        print(f"vllm from {vllm.__file__}; platform {type(current_platform).__name__}")
        print(f"adapter {importlib.import_module(ADAPTER).__file__}")
    except Exception as exc:  # noqa: BLE001 - the run log must show why, whatever it is
        print(f"FAILED to import vLLM / the adapter: {exc!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
