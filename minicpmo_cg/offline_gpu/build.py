"""``bundle``: build the offline GPU bundle of one or more lanes, on a machine that reaches PyPI."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minicpmo_cg.lanes import Lane
from minicpmo_cg.offline_gpu import hostlike, native, payload, strip, wheels


def default_cache() -> Path:
    """``$MINICPMO_CG_CACHE/offline-gpu`` (default ``~/.cache/minicpmo-cg/offline-gpu``)."""
    return Path(os.environ.get("MINICPMO_CG_CACHE") or Path.home() / ".cache" / "minicpmo-cg") / "offline-gpu"


@dataclass
class BuildOptions:
    """Options of ``bundle``."""

    repo: Path
    out: Path
    cache: Path
    patched: bool = True
    verify: str = "auto"
    host_python: str | None = None


def _print_strip_stats(stats: dict) -> None:
    print(
        f"  {stats['wheel']}: kept {stats['kept_files']} files, {stats['kept_bytes'] / payload.MIB:.1f} MiB"
    )
    for rule, (files, size) in sorted(stats["dropped"].items(), key=lambda kv: -kv[1][1]):
        print(f"    dropped {files:5d} files {size / payload.MIB:8.1f} MiB  {rule}")


def apply_patches(site: Path, repo: Path, log: Path) -> None:
    """Apply and check this checkout's patch series on ``site`` with the patch tool.

    Raises:
        RuntimeError: ``apply`` or ``check`` failed (the message names ``log``).
    """
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with open(log, "w") as fh:
        for command in ("apply", "check"):
            argv = [sys.executable, "-m", "minicpmo_cg.patchtool", command, "--site-packages", str(site)]
            fh.write(f"$ {' '.join(argv)}\n")
            fh.flush()
            if subprocess.run(
                argv, check=False, cwd=repo, env=env, stdout=fh, stderr=subprocess.STDOUT
            ).returncode:
                raise RuntimeError(f"patch tool {command} failed on {site} (log: {log})")
    print(f"  patch series applied and checked (log: {log.name})")


def import_check(opts: BuildOptions, site: Path, log: Path) -> str:
    """``"ok"``, ``"skipped"`` (no host-like environment) or raises RuntimeError on a failed import."""
    if opts.verify == "no":
        return "skipped"
    python = hostlike.ensure(
        opts.cache / "hostlike-py3.12", make=opts.verify == "yes", python312=opts.host_python
    )
    if python is None:
        print("  host-like import check skipped (pass --verify to create the host-like environment)")
        return "skipped"
    ok, summary = hostlike.check_imports(python, site, opts.repo, log)
    strip.remove_bytecode(site)
    if not ok:
        raise RuntimeError(f"host-like import check failed: {summary} (log: {log})")
    print(f"  host-like import check: {summary}")
    return "ok"


def prepare_site(lane: Lane, opts: BuildOptions, work: Path) -> dict:
    """Build the site-packages tree of ``lane`` in ``work/site``; returns the manifest facts so far."""
    upstream = wheels.fetch(
        [lane.requirement("vllm"), lane.requirement("vllm-omni")], opts.cache / "upstream"
    )
    deps = payload.read_deps(lane.name)
    dep_wheels = wheels.fetch(deps, opts.cache / "wheels-py312")
    site = work / "site"
    site.mkdir()
    stats = [strip.extract_wheel(wheel, site) for wheel in upstream]
    for item in stats:
        _print_strip_stats(item)
    slimmed = [native.slim(site / rel) for rel in native.CARRIED if (site / rel).is_file()]
    for line in slimmed:
        print(f"  {line}")
    if opts.patched:
        apply_patches(site, opts.repo, work / "patch.log")
    wheels.install_target(dep_wheels, site)
    pruned = strip.strip_site(site)
    print(
        "  pruned from the dependencies: "
        + ", ".join(f"{k} {v / payload.MIB:.1f} MiB" for k, v in pruned.items())
    )
    shutil.copytree(payload.STUBS_DIR, site, dirs_exist_ok=True)
    strip.remove_bytecode(site)
    return {
        "lane": lane.name,
        "vllm": lane.vllm,
        "vllm_omni": lane.vllm_omni,
        "patched": opts.patched,
        "payload_fingerprint": payload.payload_fingerprint(opts.repo),
        "python": f"cp{wheels.PYTHON_VERSION.replace('.', '')}",
        "deps": deps,
        "strip": stats,
        "native": slimmed,
        "import_check": import_check(opts, site, work / "importcheck.log"),
        "git_head": payload.git_head(opts.repo),
    }


def pack_and_publish(lane: Lane, opts: BuildOptions, work: Path, facts: dict) -> Path:
    """Pack ``work/site`` and replace ``opts.out/<lane>`` by the finished bundle; returns that directory."""
    t0 = time.time()
    staged = work / "out"
    staged.mkdir()
    site = work / "site"
    size = payload.pack(site, staged / payload.ARCHIVE)
    facts |= {
        "archive_bytes": size,
        "archive_sha256": payload.file_sha256(staged / payload.ARCHIVE),
        "site_bytes": sum(f.stat().st_size for f in site.rglob("*") if f.is_file()),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    payload.write_manifest(staged, facts)
    lane_dir, old = opts.out / lane.name, opts.out / f"{lane.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if lane_dir.exists():
        lane_dir.rename(old)
    shutil.move(str(staged), lane_dir)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"== lane {lane.name}: {lane_dir / payload.ARCHIVE} {size / payload.MIB:.1f} MiB (packed in {time.time() - t0:.0f} s)"
    )
    return lane_dir


@contextlib.contextmanager
def build_lock(out: Path):
    """One build per bundle directory at a time (a second one waits)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"bundle: another build holds {out / '.build.lock'}; waiting ...", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def build(lanes: list[Lane], opts: BuildOptions) -> int:
    """Build every lane of ``lanes``; returns 0 when all were built, 1 otherwise."""
    failed: list[str] = []
    with build_lock(opts.out), ThreadPoolExecutor(max_workers=2) as packers:
        packing: dict[str, Future] = {}
        for lane in lanes:
            print(
                f"== lane {lane.name}: vllm {lane.vllm} + vllm-omni {lane.vllm_omni} (patched: {opts.patched})"
            )
            work = Path(tempfile.mkdtemp(prefix=f"offline-gpu-{lane.name}-"))
            try:
                facts = prepare_site(lane, opts, work)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
                print(
                    f"bundle: lane {lane.name} FAILED: {exc} (work directory kept: {work})", file=sys.stderr
                )
                failed.append(lane.name)
                continue
            packing[lane.name] = packers.submit(pack_and_publish, lane, opts, work, facts)
        for name, future in packing.items():
            try:
                future.result()
            except OSError as exc:
                print(f"bundle: packing lane {name} FAILED: {exc}", file=sys.stderr)
                failed.append(name)
    text, _ = payload.size_report(opts.out)
    print(f"== bundles in {opts.out}:\n{text}")
    if failed:
        print(f"bundle: FAILED lanes: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
