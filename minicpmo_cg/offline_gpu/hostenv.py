"""On the GPU host: unpack a lane bundle and describe the environment that runs against it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from minicpmo_cg.offline_gpu import native, payload

STAMP = ".offline-gpu-install.json"

#: Fixed variables of a run against a bundle (``PYTHONPATH`` is added by :func:`environment`).
FIXED_ENV = {
    "PYTHONUNBUFFERED": "1",
    # No network: fail at once instead of retrying downloads.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # The bundle carries no FlashInfer; vLLM's sampler imports it on CUDA unless told not to.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # NVLink multicast (NVLS / symmetric memory) off: the two-GPU tests need plain NCCL only, and
    # multicast objects need fabric support that a shared or virtualised host may not provide.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def default_site(lane: str) -> Path:
    return Path(tempfile.gettempdir()) / f"minicpmo-cg-site-{lane}"


def environment(site: Path, repo: Path) -> dict[str, str]:
    """Variables for a process that runs this checkout against the unpacked bundle ``site``."""
    return {"PYTHONPATH": f"{site}{os.pathsep}{repo}", **FIXED_ENV}


def shell_exports(env: dict[str, str]) -> str:
    return "\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items())


@dataclass
class Installed:
    """Outcome of :func:`install`."""

    code: int
    message: str
    status: payload.BundleStatus


def _stamp(status: payload.BundleStatus, repo: Path) -> dict:
    return {
        "archive_sha256": status.manifest.get("archive_sha256"),
        "checkout": payload.payload_fingerprint(repo),
    }


def _unpack(lane_dir: Path, site: Path, status: payload.BundleStatus) -> str:
    """Verify the archive's checksum and unpack it into a fresh ``site``; returns a report line."""
    t0 = time.time()
    archive = lane_dir / payload.ARCHIVE
    want = status.manifest.get("archive_sha256")
    if want and payload.file_sha256(archive) != want:
        raise ValueError(f"{archive}: checksum differs from {payload.MANIFEST} (incomplete copy?)")
    staging = site.with_name(site.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    payload.unpack(archive, staging)
    shutil.rmtree(site, ignore_errors=True)
    staging.rename(site)
    return f"install: unpacked {archive} into {site} in {time.time() - t0:.1f} s"


def repatch(site: Path, repo: Path, python: str, status: payload.BundleStatus) -> str:
    """Bring a stale unpacked bundle to this checkout's patch series, adapter and stubs.

    Raises:
        RuntimeError: the dependency list changed, or the patch tool failed.
    """
    lane = status.manifest.get("lane", "")
    if status.manifest.get("deps") != payload.read_deps(lane):
        raise RuntimeError("deps.txt changed since the bundle was built: rebuild it")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{repo}"}
    steps = (["revert"] if status.manifest.get("patched") else []) + ["apply"]
    for step in steps:
        argv = [python, "-m", "minicpmo_cg.patchtool", step, "--site-packages", str(site)]
        proc = subprocess.run(argv, check=False, cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"patch tool {step} failed: {(proc.stdout + proc.stderr).strip()[-1500:]}")
    shutil.copytree(payload.STUBS_DIR, site, dirs_exist_ok=True)
    return "WARNING: re-patched the unpacked bundle from this checkout (patch series, adapter, stubs)"


KERNEL_PROBE = "import torch, vllm._C_stable_libtorch; torch.ops._C.rms_norm.default"


def load_kernels(site: Path, python: str) -> str:
    """Check that vLLM's compiled kernels load from ``site`` here; otherwise fall back to the stub."""
    so = site / native.CARRIED[0]
    if not so.is_file():
        return f"WARNING: the bundle carries no {so.name}: the import stub stands in, vLLM's kernels fail when called"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([python, "-c", KERNEL_PROBE], env=env, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return f"install: vLLM's compiled kernels load ({so.name})"
    so.rename(so.with_name(so.name + ".unloadable"))
    why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return f"WARNING: vLLM's compiled kernels do not load here ({why}): the import stub stands in, vLLM's kernels fail when called"


def register_entry_points(site: Path, repo: Path) -> str:
    """Give ``site`` a dist-info holding the checkout's entry points (its vLLM plugins), as a
    ``pip install`` would: the checkout runs from ``PYTHONPATH`` there, uninstalled. Returns a line."""
    import ast

    setup = ast.parse((repo / "setup.py").read_text())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    groups = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    info = site / "minicpmo_cg-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: minicpmo-cg\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{line}\n" for line in lines) + "\n" for group, lines in groups.items())
    )
    return f"install: the checkout's entry points registered ({', '.join(groups)})"


def install(lane_dir: Path, site: Path, repo: Path, python: str = sys.executable) -> Installed:
    """Make ``site`` hold the bundle of ``lane_dir`` matching the checkout ``repo``."""
    status = payload.bundle_status(lane_dir, repo)
    if status.code == payload.MISSING:
        return Installed(payload.MISSING, f"FATAL: {status.message}", status)
    stamp = _stamp(status, repo)
    stamp_file = site / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return Installed(0, f"{status.message}\ninstall: reusing {site} (same archive and checkout)", status)
    lines = [status.message]
    try:
        lines.append(_unpack(lane_dir, site, status))
    except (OSError, ValueError) as exc:
        return Installed(
            payload.MISSING, "\n".join([*lines, f"FATAL: cannot unpack the bundle: {exc}"]), status
        )
    if status.code == payload.STALE:
        try:
            lines.append(repatch(site, repo, python, status))
        except (RuntimeError, OSError) as exc:
            lines.append(f"FATAL: stale bundle, re-patching here failed: {exc}")
            return Installed(payload.STALE, "\n".join(lines), status)
    lines.append(load_kernels(site, python))
    lines.append(register_entry_points(site, repo))
    stamp_file.write_text(json.dumps(stamp) + "\n")
    return Installed(0, "\n".join(lines), status)
