"""A lane bundle on disk: its payload fingerprint, archive, manifest and freshness."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.resources import owned_files

PACKAGE_DIR = Path(__file__).resolve().parent
STUBS_DIR = PACKAGE_DIR / "stubs"
DEPS_FILE = PACKAGE_DIR / "deps.txt"
ARCHIVE = "site.tar.xz"
MANIFEST = "MANIFEST.json"
MIB = 1 << 20
#: Fixed mtime of every archive member: the same site always packs to the same bytes.
ARCHIVE_MTIME = 1_700_000_000

# Freshness of a bundle against this checkout; the values double as exit statuses.
FRESH, STALE, MISSING = 0, 3, 4


def read_deps(lane: str, path: Path = DEPS_FILE) -> list[str]:
    """Dependency pins for ``lane`` from ``deps.txt``.

    Raises:
        ValueError: a line is not an exact pin or carries an unknown option.
    """
    specs = []
    for raw in path.read_text().splitlines():
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        spec, lanes = words[0], None
        for opt in words[1:]:
            if not opt.startswith("lanes="):
                raise ValueError(f"{path.name}: unknown option {opt!r} in {raw!r}")
            lanes = opt.removeprefix("lanes=").split(",")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", spec):
            raise ValueError(f"{path.name}: pin each dependency exactly (name==version): {raw!r}")
        if lanes is None or lane in lanes:
            specs.append(spec)
    return specs


def payload_files(repo: Path, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Files that decide a bundle's content besides the pinned upstream wheels."""
    files = sorted(
        p
        for p in (repo / "patches").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".md"
    )
    files += list(owned_files(repo).values())
    files += sorted((package_dir / "stubs").rglob("*.py"))
    if (package_dir / "deps.txt").is_file():
        files.append(package_dir / "deps.txt")
    return files


def payload_fingerprint(repo: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 over the names and contents of :func:`payload_files` (first 16 hex digits)."""
    digest = hashlib.sha256()
    for path in payload_files(repo, package_dir):
        base = package_dir if path.is_relative_to(package_dir) else repo
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = ARCHIVE_MTIME
    return info


def pack(site: Path, out: Path, preset: int = 9) -> int:
    """Write the files below ``site`` to the xz tarball ``out`` (sorted, owner root, fixed mtime)."""
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:xz", preset=preset) as tf:
        for path in sorted(site.rglob("*")):
            if not path.is_dir():
                tf.add(path, arcname=path.relative_to(site).as_posix(), recursive=False, filter=_normalised)
    tmp.replace(out)
    return out.stat().st_size


def unpack(archive: Path, dest: Path) -> None:
    """Extract ``archive`` into ``dest`` (members may not leave ``dest``)."""
    with tarfile.open(archive) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # Python < 3.11.4: check the names by hand
            for member in tf.getmembers():
                if not (dest / member.name).resolve().is_relative_to(dest.resolve()):
                    raise ValueError(f"{archive}: member escapes {dest}: {member.name}")
            tf.extractall(dest)


def read_manifest(lane_dir: Path) -> dict:
    return json.loads((lane_dir / MANIFEST).read_text())


def write_manifest(lane_dir: Path, items: dict) -> Path:
    path = lane_dir / MANIFEST
    path.write_text(json.dumps(items, indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class BundleStatus:
    """Whether a lane bundle can serve this checkout."""

    code: int
    message: str
    manifest: dict = field(default_factory=dict)


def bundle_status(lane_dir: Path, repo: Path, package_dir: Path = PACKAGE_DIR) -> BundleStatus:
    """Compare the bundle in ``lane_dir`` with the checkout ``repo``."""
    lane = lane_dir.name
    rebuild = f"build it: python -m minicpmo_cg.offline_gpu bundle {lane}"
    if not (lane_dir / MANIFEST).is_file() or not (lane_dir / ARCHIVE).is_file():
        return BundleStatus(MISSING, f"bundle missing: {lane_dir} ({rebuild})")
    meta = read_manifest(lane_dir)
    want = payload_fingerprint(repo, package_dir)
    if not meta.get("patched", False):
        return BundleStatus(
            STALE, f"bundle {lane_dir} was built unpatched (development only; {rebuild})", meta
        )
    if meta.get("payload_fingerprint") != want:
        return BundleStatus(
            STALE,
            f"bundle STALE: built for payload {meta.get('payload_fingerprint')}, this checkout has {want} "
            f"(patches, adapter, stubs or deps.txt changed; {rebuild})",
            meta,
        )
    return BundleStatus(
        FRESH,
        f"bundle OK: lane {meta.get('lane')} vllm {meta.get('vllm')} vllm-omni {meta.get('vllm_omni')} "
        f"payload {want} built {meta.get('built_at')}",
        meta,
    )


def size_report(bundle_dir: Path, max_mib: float | None = None) -> tuple[str, bool]:
    """Archive size of every lane bundle below ``bundle_dir`` and of all of them together."""
    lanes = (
        sorted(p for p in bundle_dir.glob("*/") if (p / MANIFEST).is_file()) if bundle_dir.is_dir() else []
    )
    lines, total = [], 0
    for lane_dir in lanes:
        size = sum(f.stat().st_size for f in lane_dir.iterdir() if f.is_file())
        total += size
        lines.append(f"  {lane_dir.name:10s} {size / MIB:7.2f} MiB  {lane_dir}")
    ok = max_mib is None or total <= max_mib * MIB
    limit = "" if max_mib is None else f" (limit {max_mib:g} MiB: {'OK' if ok else 'TOO BIG'})"
    lines.append(f"  {'together':10s} {total / MIB:7.2f} MiB{limit}")
    return "\n".join(lines), ok


def git_head(repo: Path) -> str:
    """Short commit id of ``repo`` ("none" outside a git checkout or without git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "none"
    return out.stdout.strip()
