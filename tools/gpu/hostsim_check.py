"""Check a bundle's import graph on this CPU machine, the way the GPU host will see it.

Run with a Python 3.12 environment that holds only the GPU host's packages (torch 2.11,
transformers 5.17, ...; ``build_bundle.sh --hostsim`` makes one under the download cache) and
``PYTHONPATH=<unpacked site>:<repo>``::

    python tools/gpu/hostsim_check.py [--fake-cuda-platform] [--dep-usage SITE] [MODULE ...]

``--fake-cuda-platform`` puts a fake ``pynvml`` (one "NVIDIA H200", capability 9.0) into
``sys.modules`` *in this process only*, so vLLM resolves its CUDA platform and imports the same
modules it imports on the GPU host (``vllm/platforms/cuda.py`` pulls the stubbed
``vllm._C_stable_libtorch``, the attention backends pull ``vllm.vllm_flash_attn``). torch
itself still has no GPU, so nothing here runs a kernel. This fake never travels to the host:
it is local verification only.

``--dep-usage SITE`` lists, per top-level package installed in SITE from the dependency
wheels, whether the imports loaded it (a dependency nobody loads is a candidate to drop).
Exit status: 0 when every module imported, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
import types
from pathlib import Path

#: What the tests, the main job and the benchmark import from the bundle (GPU-side paths).
DEFAULT_MODULES = [
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
    "?vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph",  # '?' = only if present
    "?minicpmo_cg.vllm_config",
    "?minicpmo_cg.standalone",
    "?minicpmo_cg.inputs",
]


def install_fake_nvml() -> None:
    """A ``pynvml`` stand-in reporting one H200 (local verification only)."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class _Mem:
        total, free, used = 143771 << 20, 140000 << 20, 3771 << 20

    handle = object()
    m.NVMLError = NVMLError
    m.NVML_SUCCESS = 0
    m.nvmlInit = lambda *a, **k: None
    m.nvmlShutdown = lambda *a, **k: None
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: handle
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetMemoryInfo = lambda h: _Mem()
    m.nvmlDeviceGetUUID = lambda h: "GPU-00000000-0000-0000-0000-000000000000"
    m.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    m.nvmlDeviceGetP2PStatus = lambda a, b, c: 0
    m.nvmlDeviceIsMigDeviceHandle = lambda h: False
    m.__file__ = "<fake pynvml: tools/gpu/hostsim_check.py>"
    # vLLM imports its vendored copy (vllm.utils.import_utils.import_pynvml), already while
    # `import vllm` runs. A meta-path finder serves the fake under both names, so the normal
    # import machinery loads the parent package and binds the attribute (`import a.b.c as x`).
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname in ("pynvml", "vllm.third_party.pynvml"):
                return importlib.util.spec_from_loader(fullname, self)
            return None

        def create_module(self, spec):
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help="modules to import (default: the GPU-side set)")
    ap.add_argument("--fake-cuda-platform", action="store_true")
    ap.add_argument("--dep-usage", metavar="SITE", help="report which installed deps got loaded")
    args = ap.parse_args()
    if args.fake_cuda_platform:
        install_fake_nvml()
    failed = []
    for name in args.modules or DEFAULT_MODULES:
        optional = name.startswith("?")
        name = name.lstrip("?")
        t0 = time.time()
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if optional and exc.name and name.startswith(exc.name):
                print(f"skip  {name} (not present)")
                continue
            failed.append(name)
            print(f"FAIL  {name}: {exc!r}")
            traceback.print_exc(limit=-6)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going
            failed.append(name)
            print(f"FAIL  {name}: {exc!r}")
            traceback.print_exc(limit=-6)
        else:
            print(f"ok    {name} ({time.time() - t0:.1f} s)")
    if "vllm.platforms" in sys.modules:
        from vllm.platforms import current_platform

        print(f"platform: {type(current_platform).__name__}")
    if args.dep_usage:
        site = Path(args.dep_usage)
        loaded = {m.split(".", 1)[0] for m in sys.modules}
        for top in sorted(p for p in site.iterdir() if not p.name.endswith((".dist-info", ".libs"))):
            name = top.name.removesuffix(".py")
            if name in ("vllm", "vllm_omni", "bin"):
                continue
            print(f"dep {'LOADED' if name in loaded else 'unused':6s} {name}")
    print(f"{len(failed)} failed" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
