"""A host-like Python 3.12 environment, to check a bundle's imports before it goes to a GPU host."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from minicpmo_cg.offline_gpu import wheels

#: The host's packages that vLLM, vllm-omni, the tests, the demo and the benchmark touch.
HOST_PACKAGES = (
    "torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "transformers==5.17.0", "numpy", "pillow",
    "scipy", "scikit-image", "pytest", "pytest-timeout", "regex", "psutil", "sentencepiece", "requests", "tqdm",
    "py-cpuinfo", "huggingface_hub", "tokenizers", "safetensors", "protobuf", "aiohttp", "prometheus_client",
    "tiktoken", "opencv-python-headless", "pyyaml", "six", "setuptools", "einops", "cloudpickle", "ninja",
    "numba", "msgpack", "filelock", "typing_extensions", "jinja2", "uvloop", "accelerate", "onnxruntime",
    "flatbuffers",
)  # fmt: skip
#: Pulled in by the packages above but absent on the host: the bundle carries them (deps.txt).
NOT_ON_HOST = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
IMPORT_TIMEOUT_S = 900


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def find_python312(explicit: str | None = None) -> str:
    """A Python 3.12 interpreter to create the environment with.

    Raises:
        RuntimeError: none found (pass ``--host-python``).
    """
    probe = "import sys; assert sys.version_info[:2] == (3, 12)"
    for candidate in (explicit, shutil.which("python3.12")):
        if (
            candidate
            and subprocess.run([candidate, "-c", probe], check=False, capture_output=True).returncode == 0
        ):
            return candidate
    raise RuntimeError(
        "the host-like check needs a Python 3.12 interpreter: put python3.12 on PATH or pass --host-python"
    )


def create(venv: Path, python312: str) -> Path:
    """(Re)create the host-like environment at ``venv`` (a few GB; minutes); returns its python."""
    print(
        f"== creating the host-like Python 3.12 environment {venv} (torch 2.11, transformers 5.17)",
        flush=True,
    )
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python312, "-m", "venv", str(venv)], check=True)
    py = str(venv_python(venv))
    wheels.run_pip(["install", "-q", *HOST_PACKAGES], python=py)
    wheels.run_pip(["uninstall", "-q", "-y", *NOT_ON_HOST], python=py)
    (venv / ".complete").touch()
    return venv_python(venv)


def ensure(venv: Path, make: bool, python312: str | None = None) -> Path | None:
    """The environment's python: an existing complete one, a new one when ``make``, else None."""
    if (venv / ".complete").is_file():
        return venv_python(venv)
    return create(venv, find_python312(python312)) if make else None


def check_imports(python: Path, site: Path, repo: Path, log: Path) -> tuple[bool, str]:
    """Import the GPU-side modules from ``site`` with the faked CUDA platform; output goes to ``log``."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{repo}", "PYTHONDONTWRITEBYTECODE": "1"}
    with open(log, "w") as fh:
        argv = [str(python), "-m", "minicpmo_cg.offline_gpu.importcheck", "--fake-cuda-platform"]
        run = subprocess.run(
            argv,
            check=False,
            cwd=repo,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=IMPORT_TIMEOUT_S,
        )
    rc = run.returncode
    lines = log.read_text().splitlines()
    if rc == 0:
        return True, f"{sum(line.startswith('ok ') for line in lines)} modules imported"
    failures = [line for line in lines if line.startswith("FAIL")]
    return False, "; ".join(failures) or f"exit {rc} (see {log})"
