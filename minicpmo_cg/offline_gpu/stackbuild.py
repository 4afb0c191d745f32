"""``stack LANE --export DIR``: per PR of an export, what turns the lane bundle into that PR's tree.

The bundle's ``vllm_omni`` package carries the whole patch series. For a run of one PR's tests
against that PR alone, this writes ``<bundle dir>/stack-LANE/`` (see ``docs/offline_gpu_host.md``):

- ``STACK.json``: per PR of the export (the vllm-omni PRs in merge order, then the vLLM PRs), its
  *overlay* (site-relative path -> sha256 of that file's content at the PR, or null where the PR's
  tree lacks it), its tree's test files (path -> sha256), the test files it runs, the series and
  tree fingerprints (:func:`minicpmo_cg.export.gitseries.series_fingerprint`, and
  :func:`~minicpmo_cg.export.gitseries.tree_fingerprint` of the vLLM PRs it needs, the earlier PRs
  and itself: what the export matches a run against), and the sha256 of every
  file of the release wheel's ``vllm_omni/`` (the host checks each overlaid package against it);
- ``blobs.tar.xz``: every content named there once, as ``blobs/<sha256>``.

``STACK.json`` also holds the release's own overlay (``release``: the wheel's bytes, pristine vLLM),
so that ``stack-run --figures`` measures the first PR against the tree before it too.

The overlay's paths are every ``vllm_omni/`` file that some PR of the stack touches or that the
bundle's site holds with other bytes than the release wheel, so the bundle's ``vllm_omni`` with a
PR's overlay is the release with that PR and the earlier ones applied, file for file. A PR that
needs no vLLM PR, neither itself nor through an earlier PR, also gets the pristine bytes of the
vLLM files the vLLM PRs change. Built on a machine that has the export, the pinned vllm-omni wheel
(downloaded once into the cache) and the lane's installation (for vLLM's pristine files).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from minicpmo_cg.offline_gpu import payload

STACK_FILE = "STACK.json"
BLOBS = "blobs.tar.xz"
#: What a vllm-omni PR's tests run with on the GPU host: vllm-omni's L2 level (``core_model and
#: cuda``), the level the PR text's Test Plan names; the CPU level runs in the export's checks.
OMNI_MARKS = "core_model and cuda"
#: vLLM's tests carry no hardware marks: all of the vLLM PR's tests run.
VLLM_MARKS = ""
#: The name of the release's tree (no PR applied) in ``STACK.json`` and in the figures.
RELEASE = "00-release"


def stack_dir_name(lane: str) -> str:
    return f"stack-{lane}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path, under: str) -> dict[str, bytes]:
    """``under/``'s files below ``root`` (bytecode excepted), by root-relative POSIX path."""
    base = root / under
    if not base.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def site_differences(archive: Path, base: dict[str, bytes], package: str = "vllm_omni") -> list[str]:
    """``package/`` files of the bundle's ``archive`` whose bytes differ from ``base`` or that
    ``base`` lacks (files of ``base`` the archive lacks are the strip rules' and are not listed)."""
    out = []
    with tarfile.open(archive) as tf:
        for member in tf:
            name = member.name
            if not member.isfile() or not name.startswith(f"{package}/") or "__pycache__" in name:
                continue
            data = tf.extractfile(member).read()
            if base.get(name) != data:
                out.append(name)
    return sorted(out)


@dataclass
class StackBuild:
    """What :func:`build_stack` wrote: the folder, its sizes and one line per PR."""

    out: Path
    bytes_total: int
    blobs: int
    lines: list[str]


def _apply(tree: Path, patches: list[Path], identity) -> None:
    """``git am`` ``patches`` onto ``tree`` as the export's checks do; raise on any problem."""
    from minicpmo_cg.export.verify import _am

    problems = _am(tree, patches, identity)
    if problems:
        raise RuntimeError(f"{tree}: {'; '.join(problems)}")


def build_stack(export: Path, repo: Path, bundle_dir: Path, site_packages: Path | None = None) -> StackBuild:
    """Write ``<bundle_dir>/stack-LANE/`` for the export in ``export`` (made from the checkout ``repo``).

    Raises:
        RuntimeError: the export is not for the wheel the cache holds, the lane's bundle is missing,
            or a PR's series does not apply.
    """
    from minicpmo_cg.export import conventions as conv
    from minicpmo_cg.export import fetch
    from minicpmo_cg.export.changeset import read_change_set
    from minicpmo_cg.export.gitseries import Identity, series_fingerprint, tree_fingerprint
    from minicpmo_cg.export.verify import _init_base
    from minicpmo_cg.export.vllm_base import pristine_files

    identity = Identity("Stack Overlay <stack-overlay@example.invalid>")
    manifest = json.loads((export / "export.json").read_text(encoding="utf-8"))
    lane = manifest["lane"]
    lane_dir = bundle_dir / lane
    status = payload.bundle_status(lane_dir, repo)
    if status.code == payload.MISSING:
        raise RuntimeError(status.message)
    wheel = fetch.wheel("vllm-omni", manifest["vllm_omni"])
    if _sha(wheel.read_bytes()) != manifest["base"]["sha256"]:
        raise RuntimeError(f"{wheel} is not the wheel the export in {export} was made against")
    blobs: dict[str, bytes] = {}

    def keep(data: bytes) -> str:
        digest = _sha(data)
        blobs[digest] = data
        return digest

    lines = []
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-stack-") as tmp:
        tree = fetch.extract_package(wheel, "vllm_omni", Path(tmp) / "vllm-omni")
        base = _files(tree, "vllm_omni")
        touched = {f for pr in manifest["prs"] for f in pr["files"] if f.startswith("vllm_omni/")}
        paths = sorted(touched | set(site_differences(lane_dir / payload.ARCHIVE, base)))
        _init_base(tree, identity)
        cs = read_change_set(repo, lane)
        vllm_files = sorted({f for pr in manifest["vllm_prs"] for f in pr["files"] if f.startswith("vllm/")})
        pristine = pristine_files(cs, vllm_files, site_packages) if vllm_files else {}
        # the release itself (no PR applied, vLLM pristine): the tree the first PR's figures compare with
        release = {rel: keep(base[rel]) if rel in base else None for rel in paths}
        release.update({rel: keep(data) for rel, data in pristine.items()})
        vllm_of = {pr["folder"]: set(pr["vllm"]) for pr in manifest["prs"]}
        # each series' fingerprint, read once: an entry's own and its tree's are made of them
        fingerprint_of = {
            pr["folder"]: series_fingerprint([export / s for s in pr["series"]])
            for pr in [*manifest["prs"], *manifest["vllm_prs"]]
        }
        entries = []
        for pr in manifest["prs"]:
            series = [export / s for s in pr["series"]]
            _apply(tree, series, identity)
            overlay = {}
            for rel in paths:
                path = tree / rel
                overlay[rel] = keep(path.read_bytes()) if path.is_file() else None
            needs_vllm = sorted(set().union(*(vllm_of[d] for d in [*pr["depends"], pr["folder"]])))
            if not needs_vllm:
                overlay.update({rel: keep(data) for rel, data in pristine.items()})
            tests = {rel: keep(data) for rel, data in _files(tree, "tests").items()}
            entries.append(
                {
                    "folder": pr["folder"],
                    "title": pr["title"],
                    "kind": "vllm-omni",
                    "depends": pr["depends"],
                    "vllm_prs": needs_vllm,
                    "series_fingerprint": fingerprint_of[pr["folder"]],
                    # the tree the tests run on: the vLLM PRs it needs, the earlier PRs and this one
                    "tree_fingerprint": tree_fingerprint(
                        [fingerprint_of[f] for f in [*needs_vllm, *pr["depends"], pr["folder"]]]
                    ),
                    "overlay": overlay,
                    "tests": tests,
                    "run": [t for t in pr["tests"] if PurePosixPath(t).name.startswith("test_")],
                    "marks": OMNI_MARKS,
                }
            )
            lines.append(
                f"  {pr['folder']}: {sum(v is not None for v in overlay.values())} package files, "
                f"{sum(v is None for v in overlay.values())} absent, {len(tests)} test files, "
                f"vLLM {'with ' + ', '.join(needs_vllm) if needs_vllm else 'pristine'}"
            )
        for pr in manifest["vllm_prs"]:
            vtree = Path(tmp) / pr["folder"]
            rels = sorted({f for f in pr["files"] if f.startswith("vllm/")})
            for rel, data in pristine_files(cs, rels, site_packages).items():
                (vtree / rel).parent.mkdir(parents=True, exist_ok=True)
                (vtree / rel).write_bytes(data)
            _init_base(vtree, identity)
            series = [export / s for s in pr["series"]]
            _apply(vtree, series, identity)
            tests = {rel: keep(data) for rel, data in _files(vtree, "tests").items()}
            entries.append(
                {
                    "folder": pr["folder"],
                    "title": pr["title"],
                    "kind": "vllm",
                    "depends": [],
                    "vllm_prs": [pr["folder"]],
                    "series_fingerprint": fingerprint_of[pr["folder"]],
                    "tree_fingerprint": tree_fingerprint([fingerprint_of[pr["folder"]]]),
                    "overlay": {},
                    "tests": tests,
                    "run": [t for t in pr["tests"] if PurePosixPath(t).name.startswith("test_")],
                    "marks": VLLM_MARKS,
                }
            )
            lines.append(f"  {pr['folder']}: vLLM as in the bundle, {len(tests)} test files")
    out = bundle_dir / stack_dir_name(lane)
    out.mkdir(parents=True, exist_ok=True)
    _pack_blobs(blobs, out / BLOBS)
    doc = {
        "lane": lane,
        "vllm": manifest["vllm"],
        "vllm_omni": manifest["vllm_omni"],
        "export": str(export.resolve()),
        "base_wheel_sha256": manifest["base"]["sha256"],
        "base_files": {rel: _sha(data) for rel, data in base.items()},
        "overlay_paths": paths,
        "markers": list(conv.UPSTREAM_MARKERS),
        "bundle": {
            "archive_sha256": status.manifest.get("archive_sha256"),
            "payload_fingerprint": status.manifest.get("payload_fingerprint"),
        },
        "blobs_sha256": payload.file_sha256(out / BLOBS),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": payload.git_head(repo),
        #: the overlay that turns the bundle's packages into the release's (``stack-run --figures``)
        "release": {
            "folder": RELEASE,
            "title": f"the vllm-omni {manifest['vllm_omni']} release",
            "overlay": release,
        },
        "prs": entries,
    }
    (out / STACK_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if status.code:
        lines.append(f"  note: {status.message}")
    return StackBuild(out, total, len(blobs), lines)


def _pack_blobs(blobs: dict[str, bytes], archive: Path) -> None:
    """``blobs/<sha256>`` members in digest order (the same contents always pack to the same bytes)."""
    tmp = archive.with_name(archive.name + ".part")
    with tarfile.open(tmp, "w:xz", preset=9) as tf:
        for digest in sorted(blobs):
            info = tarfile.TarInfo(f"blobs/{digest}")
            info.size = len(blobs[digest])
            info.mtime = payload.ARCHIVE_MTIME
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(blobs[digest]))
    tmp.replace(archive)
