"""Import the GPU-side modules from a bundle the way a GPU host will, on a machine without a GPU."""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path

#: What the tests, the demo and the benchmark import from a bundle. ``?`` = checked only if present.
DEFAULT_MODULES = (
    "vllm",
    "vllm.config",
    "vllm.v1.worker.encoder_cudagraph",
    "vllm.v1.worker.encoder_cudagraph_defs",
    "vllm.model_executor.models.interfaces",
    "vllm.model_executor.models.minicpmv",
    "vllm.model_executor.models.idefics2_vision_model",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.distributed",
    "vllm_omni",
    "vllm_omni.platforms",
    "vllm_omni.model_executor.models.minicpmo_4_5",
    "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm",
    "vllm_omni.worker.gpu_model_runner",
    # the engine: vLLM's in-process engine with vllm-omni's stage arguments, and both servers
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.openai.api_server",
    "vllm_omni.engine.arg_utils",
    "vllm_omni.worker.gpu_ar_worker",
    "vllm_omni.entrypoints.omni",
    "vllm_omni.entrypoints.cli.main",
    "vllm_omni.entrypoints.openai.api_server",
    "?vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph",
    "?minicpmo_cg.vllm_config",
    "?minicpmo_cg.standalone",
    "?minicpmo_cg.inputs",
    "?minicpmo_cg.demo",
    "?minicpmo_cg.bench",
)
FAKE_NVML_NAMES = ("pynvml", "vllm.third_party.pynvml")


def fake_nvml() -> types.ModuleType:
    """A ``pynvml`` module reporting one Hopper GPU (compute capability 9.0, 80 GiB)."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class _Memory:
        total, free, used = 81559 << 20, 80000 << 20, 1559 << 20

    handle = object()
    m.NVMLError = NVMLError
    m.NVML_SUCCESS = 0
    m.nvmlInit = m.nvmlShutdown = lambda *a, **k: None
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: handle
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: _Memory()
    m.nvmlDeviceGetUUID = lambda h: "GPU-00000000-0000-0000-0000-000000000000"
    m.nvmlSystemGetDriverVersion = lambda: "580.00.00"
    m.nvmlDeviceGetP2PStatus = lambda a, b, c: 0
    m.nvmlDeviceIsMigDeviceHandle = lambda h: False
    m.__file__ = "<fake pynvml: minicpmo_cg.offline_gpu.importcheck>"
    return m


KERNELS = "vllm._C_stable_libtorch"


class _FakeNvmlFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the fake under both names vLLM imports it by (its vendored copy is loaded while
    ``import vllm`` runs), through the normal machinery so parents bind the attribute. vLLM's
    compiled kernels need a CUDA driver, so their import stub stands in, as on a host where they
    do not load.
    """

    def __init__(self) -> None:
        self.module = fake_nvml()

    def find_spec(self, fullname, path=None, target=None):
        if fullname == KERNELS:
            stubs = [Path(p, "_C_stable_libtorch.py") for p in path or ()]
            stub = next((f for f in stubs if f.is_file()), None)
            return importlib.util.spec_from_file_location(fullname, stub) if stub else None
        return importlib.util.spec_from_loader(fullname, self) if fullname in FAKE_NVML_NAMES else None

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


def try_import(spec: str) -> bool:
    """Import one module (``?name``: a missing ``name`` is skipped); print one line; True if fine."""
    optional, name = spec.startswith("?"), spec.lstrip("?")
    t0 = time.time()
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if optional and exc.name and name.startswith(exc.name):
            print(f"skip  {name} (not present)")
            return True
        print(f"FAIL  {name}: {exc!r}")
        traceback.print_exc(limit=-6)
        return False
    except Exception as exc:  # noqa: BLE001 - report every failure, keep going
        print(f"FAIL  {name}: {exc!r}")
        traceback.print_exc(limit=-6)
        return False
    print(f"ok    {name} ({time.time() - t0:.1f} s)")
    return True


def report_dep_usage(site: Path) -> None:
    loaded = {m.split(".", 1)[0] for m in sys.modules}
    for top in sorted(p for p in site.iterdir() if not p.name.endswith((".dist-info", ".libs"))):
        name = top.name.removesuffix(".py")
        if name not in ("vllm", "vllm_omni", "bin", "minicpmo_cg_patch_state"):
            print(f"dep {'LOADED' if name in loaded else 'unused':6s} {name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m minicpmo_cg.offline_gpu.importcheck", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("modules", nargs="*", help="modules to import (default: the GPU-side set)")
    ap.add_argument(
        "--fake-cuda-platform", action="store_true", help="fake NVML: vLLM picks its CUDA platform"
    )
    ap.add_argument(
        "--dep-usage", metavar="SITE", type=Path, help="report which bundled dependencies got loaded"
    )
    args = ap.parse_args(argv)
    if args.fake_cuda_platform:
        sys.meta_path.insert(0, _FakeNvmlFinder())
    failed = [name for name in args.modules or DEFAULT_MODULES if not try_import(name)]
    if "vllm.platforms" in sys.modules:
        from vllm.platforms import current_platform

        print(f"platform: {type(current_platform).__name__}")
    if args.dep_usage:
        report_dep_usage(args.dep_usage)
    print(f"{len(failed)} failed" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
