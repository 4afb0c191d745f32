"""Helpers of the offline GPU bundle (``tools/gpu/build_bundle.sh``, ``tools/gpu/run.sh``).

The GPU host has Python 3.12, torch 2.11, transformers 5.17, no network and no vLLM; at most
64 MiB of files travel with one command. ``build_bundle.sh`` therefore carries, per lane, one
``site.tar.xz``: the pure-Python code of that lane's vllm + vllm-omni wheels with this repo's
patches already applied, the py3.12 wheels of the dependencies the host lacks (installed, not
as wheels), and two stub modules. This module holds the parts worth testing on their own:

- :func:`classify`: the strip rules (what of an upstream wheel is dropped, and why);
- :func:`extract_wheel`: unpack a wheel into a site dir through those rules;
- :func:`payload_fingerprint`: a hash of what the patch tool installs (patches, adapter, tool),
  recorded in the bundle so a stale bundle is caught before a GPU call is spent on it;
- :func:`read_lane_pins` / :func:`read_deps`: the lane pins and the dependency list;
- :func:`pack` / :func:`carry_report`: the tarball and the size report.

Command line (used by the shell scripts)::

    python3 tools/gpu/bundle_lib.py pins LANE                      # "vllm==X vllm-omni==Y"
    python3 tools/gpu/bundle_lib.py deps LANE                      # dependency specs, one a line
    python3 tools/gpu/bundle_lib.py extract SITE WHEEL...          # stripped unpack + stats
    python3 tools/gpu/bundle_lib.py strip-site SITE                # drop caches/tests of installed deps
    python3 tools/gpu/bundle_lib.py fingerprint                    # payload hash of this checkout
    python3 tools/gpu/bundle_lib.py pack SITE OUT.tar.xz
    python3 tools/gpu/bundle_lib.py manifest LANE_DIR KEY=VALUE... # write MANIFEST.json (@FILE = JSON)
    python3 tools/gpu/bundle_lib.py check LANE_DIR                 # fresh? exit 0 / 3 stale / 4 missing
    python3 tools/gpu/bundle_lib.py carry-report BUNDLE_DIR        # sizes vs the 64 MiB limit

Only the standard library is used: this runs here (any Python >= 3.10) and on the GPU host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MIB = 1 << 20
#: What travels with one device call (working tree + carried paths), bytes.
CARRY_LIMIT = 64 * MIB
LANES = ("current", "legacy")

# ---------------------------------------------------------------------------------------------
# Strip rules
# ---------------------------------------------------------------------------------------------

#: Native code: built for torch 2.13 / other Pythons, useless against the host's torch 2.11.
NATIVE_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".a", ".o", ".lib")
#: C/C++/CUDA sources and headers (JIT/AOT build inputs; nothing imports them).
SOURCE_SUFFIXES = (".h", ".hpp", ".hh", ".cuh", ".inl", ".cu", ".cpp", ".cc", ".cxx", ".c")
#: Web UI assets of vLLM's OpenAI server (swagger page); only served over HTTP.
WEB_SUFFIXES = (".js", ".css", ".map")
#: Prose documentation; never read by code.
DOC_SUFFIXES = (".md", ".rst")
#: Pictures inside *vllm* are documentation figures. vllm-omni's media (voice .wav, .npy
#: speaker prompts) are model assets and are kept: the main job can use them as real inputs.
VLLM_DOC_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".svg")
#: dist-info files kept: METADATA (importlib.metadata.version(), the patch tool's lane check),
#: entry points, top_level, WHEEL and licenses. RECORD would list the dropped files: dropped.
DIST_INFO_KEEP = re.compile(
    r"\.dist-info/(METADATA|WHEEL|entry_points\.txt|top_level\.txt|licenses/.*|LICENSE.*)$"
)
ELF_MAGIC = b"\x7fELF"


def classify(name: str, head: bytes = b"") -> tuple[bool, str]:
    """Decide whether wheel member ``name`` goes into the bundle.

    Args:
        name: the member's path inside the wheel (``/``-separated).
        head: the member's first bytes (at least 4), to recognise executables without an
            extension such as ``vllm/vllm-rs``; may be empty for extension-based rules only.

    Returns:
        ``(keep, rule)``: ``rule`` names the reason (``"keep"`` when kept).
    """
    base = name.rsplit("/", 1)[-1]
    top = name.split("/", 1)[0]
    lower = base.lower()
    if name.endswith("/"):
        return False, "directory entry"
    if ".dist-info/" in name:
        return (True, "keep") if DIST_INFO_KEEP.search(name) else (False, "dist-info RECORD/misc")
    if "/__pycache__/" in f"/{name}" or lower.endswith((".pyc", ".pyo")):
        return False, "bytecode cache"
    if lower.endswith(NATIVE_SUFFIXES) or re.search(r"\.so\.\d", lower):
        return False, "native extension (built for another torch)"
    if head[:4] == ELF_MAGIC:
        return False, "native executable"
    if lower.endswith(SOURCE_SUFFIXES):
        return False, "C/C++/CUDA source or header"
    if "/csrc/" in f"/{name}":
        return False, "C/C++/CUDA source or header"
    if lower.endswith(WEB_SUFFIXES):
        return False, "web UI asset"
    if lower.endswith(DOC_SUFFIXES) or base in ("Makefile", "README"):
        return False, "documentation"
    if top == "vllm" and lower.endswith(VLLM_DOC_IMAGE_SUFFIXES):
        return False, "documentation figure"
    return True, "keep"


def extract_wheel(wheel: str | os.PathLike, site: str | os.PathLike) -> dict:
    """Unpack ``wheel`` into ``site`` through :func:`classify`.

    Returns:
        ``{"wheel", "kept_files", "kept_bytes", "dropped": {rule: [files, bytes]}}``.
    """
    site = Path(site)
    dropped: dict[str, list[int]] = {}
    kept_files = kept_bytes = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            head = b""
            if not info.is_dir() and "." not in info.filename.rsplit("/", 1)[-1]:
                with zf.open(info) as fh:
                    head = fh.read(4)
            keep, rule = classify(info.filename, head)
            if not keep:
                entry = dropped.setdefault(rule, [0, 0])
                entry[0] += 1
                entry[1] += info.file_size
                continue
            dest = site / info.filename
            if not dest.resolve().is_relative_to(site.resolve()):
                raise ValueError(f"{wheel}: member escapes the site dir: {info.filename}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode | 0o600)
            kept_files += 1
            kept_bytes += info.file_size
    return {
        "wheel": os.path.basename(wheel),
        "kept_files": kept_files,
        "kept_bytes": kept_bytes,
        "dropped": dropped,
    }


#: Removed from the *installed dependency wheels* (their native code is needed and kept).
#: Not ``tests``/``testing``: xgrammar imports its ``testing`` subpackage at import time (seen
#: with tools/gpu/hostsim_check.py), so test-looking packages of deps are kept.
SITE_PRUNE_DIRS = {"__pycache__"}
SITE_PRUNE_TOPS_KEEP = {"vllm", "vllm_omni"}  # upstream code: only classify() decides there


def strip_site(site: str | os.PathLike) -> dict:
    """Drop bytecode caches, ``bin/`` scripts, RECORD files and C headers of installed deps.

    vllm/vllm_omni trees are left alone (already stripped by :func:`extract_wheel`; a
    ``tests`` package there could be imported by code). ``.pyi`` stubs are kept (tiny).
    """
    site = Path(site)
    removed = Counter()
    for top in sorted(site.iterdir()):
        if top.name in SITE_PRUNE_TOPS_KEEP:
            continue
        if top.name == "bin" and top.is_dir():  # console scripts of deps: never run here
            removed["bin"] += sum(f.stat().st_size for f in top.rglob("*") if f.is_file())
            shutil.rmtree(top)
            continue
        if not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top, topdown=True):
            for d in list(dirnames):
                if d in SITE_PRUNE_DIRS and not d.endswith(".dist-info"):
                    p = Path(dirpath, d)
                    removed[d] += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                    shutil.rmtree(p)
                    dirnames.remove(d)
            for f in filenames:
                if f.endswith((".pyc", ".h", ".hpp", ".cuh")) or (
                    dirpath.endswith(".dist-info") and f == "RECORD"
                ):
                    p = Path(dirpath, f)
                    removed["files"] += p.stat().st_size
                    p.unlink()
    return dict(removed)


# ---------------------------------------------------------------------------------------------
# Lane pins, dependency list, payload fingerprint
# ---------------------------------------------------------------------------------------------


def read_lane_pins(lane: str, repo: Path = REPO) -> dict[str, str]:
    """``{"vllm": "0.30.0", "vllm-omni": "0.30.0"}`` from ``lanes/<lane>.txt``."""
    path = repo / "lanes" / f"{lane}.txt"
    if not path.is_file():
        raise SystemExit(f"unknown lane {lane!r}: no {path}")
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*(vllm|vllm-omni|vllm_omni)\s*==\s*([\w.+-]+)", line)
        if m:
            pins[m.group(1).replace("_", "-")] = m.group(2)
    if set(pins) != {"vllm", "vllm-omni"}:
        raise SystemExit(f"{path}: expected vllm== and vllm-omni== pins, found {pins}")
    return pins


def read_deps(lane: str, path: Path = HERE / "deps.txt") -> list[str]:
    """Dependency specs for ``lane`` from ``deps.txt``.

    Format: ``name==version  [lanes=current,legacy]  # why``. Without ``lanes=`` a line applies
    to every lane.
    """
    specs = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        spec, opts = parts[0], parts[1:]
        lanes = LANES
        for opt in opts:
            if opt.startswith("lanes="):
                lanes = tuple(opt[len("lanes=") :].split(","))
            else:
                raise ValueError(f"deps.txt: unknown option {opt!r} in {raw!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", spec):
            raise ValueError(f"deps.txt: pin each dependency exactly (name==version): {raw!r}")
        if lane in lanes:
            specs.append(spec)
    return specs


def payload_files(repo: Path = REPO) -> list[Path]:
    """Files that decide a lane bundle's content besides the pinned upstream wheels.

    The patch series (``patches/**`` except prose), the adapter the patch tool copies, the stubs
    and the dependency list. The patch tool's own code is not included: a change there that
    changes its output would also change ``patches/`` or the adapter.
    """
    files = sorted(
        p
        for p in (repo / "patches").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".md"
    )
    adapter = repo / "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph.py"
    if adapter.is_file():
        files.append(adapter)
    gpu = repo / "tools" / "gpu"
    files += sorted(p for p in (gpu / "stubs").rglob("*.py"))
    if (gpu / "deps.txt").is_file():
        files.append(gpu / "deps.txt")
    return files


def payload_fingerprint(repo: Path = REPO) -> str:
    """sha256 over the relative paths and contents of :func:`payload_files` (first 16 hex digits)."""
    h = hashlib.sha256()
    for p in payload_files(repo):
        h.update(str(p.relative_to(repo)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Packing, manifest, freshness, sizes
# ---------------------------------------------------------------------------------------------


def pack(site: str | os.PathLike, out: str | os.PathLike, preset: int = 9) -> int:
    """Write ``site``'s contents (sorted, owner root, fixed mtime) to an xz tarball; returns bytes.

    xz packs Python source about twice as tightly as the wheels' deflate, which is what
    lets both lanes fit the 64 MiB carry limit.
    """
    site = Path(site)

    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = 1_700_000_000
        return ti

    tmp = Path(str(out) + ".part")
    with tarfile.open(tmp, "w:xz", preset=preset) as tf:
        for path in sorted(site.rglob("*")):
            if path.is_dir():
                continue
            tf.add(path, arcname=str(path.relative_to(site)), recursive=False, filter=norm)
    tmp.replace(out)
    return Path(out).stat().st_size


def write_manifest(lane_dir: Path, items: dict) -> Path:
    path = lane_dir / "MANIFEST.json"
    path.write_text(json.dumps(items, indent=2, sort_keys=True) + "\n")
    return path


def check_lane_dir(lane_dir: Path, repo: Path = REPO) -> tuple[int, str]:
    """Is the bundle in ``lane_dir`` usable with this checkout?

    Returns:
        ``(0, msg)`` fresh, ``(3, msg)`` stale (payload changed since the build) or built
        unpatched, ``(4, msg)`` missing or incomplete.
    """
    manifest = lane_dir / "MANIFEST.json"
    tarball = lane_dir / "site.tar.xz"
    if not manifest.is_file() or not tarball.is_file():
        return (
            4,
            f"bundle missing: {lane_dir} (build it here: bash tools/gpu/build_bundle.sh {lane_dir.name})",
        )
    meta = json.loads(manifest.read_text())
    want = payload_fingerprint(repo)
    if not meta.get("patched", False):
        return 3, f"bundle {lane_dir} was built with --unpatched (development only)"
    if meta.get("payload_fingerprint") != want:
        return 3, (
            f"bundle STALE: built for payload {meta.get('payload_fingerprint')}, checkout has {want} "
            f"(patches, adapter, stubs or deps.txt changed); rebuild: bash tools/gpu/build_bundle.sh {meta.get('lane')}"
        )
    return 0, (
        f"bundle OK: lane {meta.get('lane')} vllm {meta.get('vllm')} vllm-omni {meta.get('vllm_omni')} "
        f"payload {want} built {meta.get('built_at')}"
    )


def _git_files(repo: Path) -> list[Path]:
    """Tracked plus untracked-not-ignored files: what the device tool sends besides ``carry``."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [repo / p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def carry_report(bundle: Path, repo: Path = REPO) -> tuple[str, bool]:
    """Size table: working tree + each lane (and all lanes together) against the 64 MiB limit.

    Returns:
        ``(text, all_fit)``: ``all_fit`` is False when some single lane does not fit.
    """
    tree = sum(f.stat().st_size for f in _git_files(repo))
    lanes = (
        sorted(p for p in bundle.iterdir() if p.is_dir() and (p / "MANIFEST.json").is_file())
        if bundle.is_dir()
        else []
    )
    rel = os.path.relpath(bundle, repo)
    lines = [f"working tree (tracked + untracked-not-ignored): {tree / MIB:6.2f} MiB"]
    ok = True
    for lane_dir in lanes:
        size = tree_bytes(lane_dir)
        fits = tree + size < CARRY_LIMIT
        ok &= fits
        lines.append(
            f"lane {lane_dir.name:8s} {rel}/{lane_dir.name}: {size / MIB:6.2f} MiB -> one call carries "
            f"{(tree + size) / MIB:6.2f} MiB of 64 {'OK' if fits else 'TOO BIG'}   "
            f'carry: ["{rel}/{lane_dir.name}"]'
        )
    if len(lanes) > 1:
        size = tree_bytes(bundle)
        both = tree + size < CARRY_LIMIT
        verdict = (
            f'OK: carry ["{rel}"] works for any lane'
            if both
            else "TOO BIG together: carry one lane dir per call"
        )
        lines.append(
            f"all lanes {rel}: {size / MIB:6.2f} MiB -> {(tree + size) / MIB:6.2f} MiB of 64 {verdict}"
        )
    return "\n".join(lines), ok


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _fmt_stats(stats: dict) -> str:
    out = [f"  {stats['wheel']}: kept {stats['kept_files']} files, {stats['kept_bytes'] / MIB:.2f} MiB raw"]
    for rule, (n, b) in sorted(stats["dropped"].items(), key=lambda kv: -kv[1][1]):
        out.append(f"    dropped {n:5d} files {b / MIB:9.2f} MiB  {rule}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "pins":
        pins = read_lane_pins(args[0])
        print(f"vllm=={pins['vllm']} vllm-omni=={pins['vllm-omni']}")
    elif cmd == "deps":
        print("\n".join(read_deps(args[0])))
    elif cmd == "extract":
        site = Path(args[0])
        site.mkdir(parents=True, exist_ok=True)
        all_stats = [extract_wheel(w, site) for w in args[1:]]
        for st in all_stats:
            print(_fmt_stats(st))
        (site.parent / "strip-stats.json").write_text(json.dumps(all_stats, indent=1))
    elif cmd == "strip-site":
        removed = strip_site(args[0])
        print(
            "  pruned from installed deps: " + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in removed.items())
        )
    elif cmd == "fingerprint":
        print(payload_fingerprint())
    elif cmd == "pack":
        t0 = time.time()
        size = pack(args[0], args[1])
        print(f"  packed {args[1]}: {size / MIB:.2f} MiB in {time.time() - t0:.0f} s")
    elif cmd == "manifest":
        # manifest LANE_DIR KEY=VALUE...; values "true"/"false" are booleans, "@FILE" reads JSON
        lane_dir = Path(args[0])
        items: dict = {}
        for kv in args[1:]:
            k, sep, v = kv.partition("=")
            if not sep:
                raise SystemExit(f"manifest: expected KEY=VALUE, got {kv!r}")
            if v in ("true", "false"):
                items[k] = v == "true"
            elif v.startswith("@"):
                items[k] = json.loads(Path(v[1:]).read_text())
            else:
                items[k] = v
        items.setdefault("payload_fingerprint", payload_fingerprint())
        items.setdefault("built_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        files = {
            p.name: p.stat().st_size
            for p in sorted(lane_dir.iterdir())
            if p.is_file() and p.name != "MANIFEST.json"
        }
        items["files"] = files
        print(f"  wrote {write_manifest(lane_dir, items)}")
    elif cmd == "check":
        rc, msg = check_lane_dir(Path(args[0]))
        print(msg)
        return rc
    elif cmd == "carry-report":
        text, ok = carry_report(Path(args[0]))
        print(text)
        return 0 if ok else 1
    else:
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
