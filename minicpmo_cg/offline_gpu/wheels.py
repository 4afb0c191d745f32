"""Fetching and installing the CPython 3.12 manylinux wheels of a bundle with pip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: Target interpreter of every bundle: the GPU host's CPython 3.12 on x86-64 Linux.
PYTHON_VERSION = "3.12"
_MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 26, 27, 28, 31, 34, 35)]
PLATFORMS = (*_MANYLINUX, "manylinux2014_x86_64", "manylinux1_x86_64", "any")


def target_flags() -> list[str]:
    """pip options selecting binary wheels for CPython 3.12 on x86-64 Linux, whatever runs pip."""
    flags = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def run_pip(args: list[str], python: str = sys.executable) -> None:
    """Run ``python -m pip ARGS`` quietly.

    Raises:
        RuntimeError: pip failed; the message carries the end of its output.
    """
    proc = subprocess.run(
        [python, "-m", "pip", *args], check=False, env=pip_env(), capture_output=True, text=True
    )
    if proc.returncode:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"pip {args[0]} failed (exit {proc.returncode}):\n{tail}")


def _norm(name: str) -> str:
    """Wheel file name normalisation of a project name (``vllm-omni`` -> ``vllm_omni``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def cached_wheel(folder: Path, spec: str) -> Path | None:
    """The wheel of ``spec`` (``name==version``) in ``folder``, or None."""
    name, version = spec.split("==", 1)
    for wheel in sorted(folder.glob("*.whl")):
        parts = wheel.name.split("-")
        if len(parts) >= 2 and _norm(parts[0]) == _norm(name) and parts[1] == version:
            return wheel
    return None


def fetch(specs: list[str], folder: Path) -> list[Path]:
    """The wheels of ``specs`` (exact pins), downloading into ``folder`` the ones it lacks.

    Raises:
        RuntimeError: pip failed, or a download did not produce the pinned wheel.
    """
    folder.mkdir(parents=True, exist_ok=True)
    missing = [spec for spec in specs if cached_wheel(folder, spec) is None]
    if missing:
        run_pip(["download", "-q", "--no-deps", *target_flags(), "-d", str(folder), *missing])
    found = {spec: cached_wheel(folder, spec) for spec in specs}
    lost = [spec for spec, wheel in found.items() if wheel is None]
    if lost:
        raise RuntimeError(f"pip download left no wheel for {', '.join(lost)} in {folder}")
    return [found[spec] for spec in specs]


def install_target(wheels: list[Path], site: Path) -> None:
    """Install ``wheels`` (no dependencies, no bytecode) into the directory ``site``."""
    if not wheels:
        return
    run_pip(
        ["install", "-q", "--no-index", "--no-deps", "--no-compile", *target_flags(), "--target", str(site)]
        + [str(w) for w in wheels]
    )
