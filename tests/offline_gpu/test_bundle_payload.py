"""CPU checks of a lane bundle on disk: lanes, dependency pins, payload fingerprint, archive,
freshness, sizes, and the stubs that stand in for vLLM's native modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from minicpmo_cg.lanes import get_lane, lane_for_versions
from minicpmo_cg.offline_gpu import payload, strip
from minicpmo_cg.offline_gpu.cli import REPO
from minicpmo_cg.resources import ADAPTER_PACKAGE_RELPATH, ADAPTER_RELPATH

pytestmark = pytest.mark.core_model

STUBS = sorted(payload.STUBS_DIR.rglob("*.py"))


@pytest.mark.cpu
def test_lane_pins_come_from_the_lane_files() -> None:
    current, legacy = get_lane("current"), get_lane("legacy")
    assert (current.vllm, current.vllm_omni) == ("0.30.0", "0.30.0")
    assert (legacy.vllm, legacy.vllm_omni) == ("0.28.0", "0.28.0")
    assert current.requirement("vllm-omni") == "vllm-omni==0.30.0"
    assert lane_for_versions("0.28.0", "0.28.0") == legacy and lane_for_versions("0.28.0", "0.30.0") is None
    with pytest.raises(ValueError, match="unknown lane 'nope'.*current"):
        get_lane("nope")


@pytest.mark.cpu
def test_deps_are_exact_pins_and_lane_filtered(tmp_path: Path) -> None:
    deps = payload.read_deps("current")
    assert deps and all("==" in d for d in deps)
    assert {"pydantic", "pyzmq", "xgrammar"} <= {d.split("==")[0] for d in deps}
    f = tmp_path / "deps.txt"
    f.write_text("a==1  # both\nb==2 lanes=legacy  # legacy only\n\n# comment\n")
    assert payload.read_deps("current", f) == ["a==1"]
    assert payload.read_deps("legacy", f) == ["a==1", "b==2"]
    f.write_text("c>=1\n")
    with pytest.raises(ValueError, match="pin"):
        payload.read_deps("current", f)
    f.write_text("c==1 only=legacy\n")
    with pytest.raises(ValueError, match="unknown option"):
        payload.read_deps("current", f)


def _fake_checkout(root: Path) -> tuple[Path, Path]:
    files = {
        "repo/patches/vllm-omni/series": "0001.patch\n",
        "repo/patches/vllm-omni/0001.patch": "diff\n",
        "repo/patches/README.md": "prose\n",
        f"repo/{ADAPTER_RELPATH}": "ADAPTER = 1\n",
        f"repo/{ADAPTER_PACKAGE_RELPATH}/backend.py": "BACKEND = 1\n",
        "pkg/stubs/vllm/_C_stable_libtorch.py": "STUB = True\n",
        "pkg/deps.txt": "a==1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "repo", root / "pkg"


@pytest.mark.cpu
def test_fingerprint_follows_patches_adapter_stubs_deps_not_prose(tmp_path: Path) -> None:
    repo, pkg = _fake_checkout(tmp_path)
    base = payload.payload_fingerprint(repo, pkg)
    (repo / "patches/README.md").write_text("other prose\n")
    assert payload.payload_fingerprint(repo, pkg) == base
    for path in (
        repo / "patches/vllm-omni/0001.patch",
        repo / ADAPTER_RELPATH,
        repo / ADAPTER_PACKAGE_RELPATH / "backend.py",  # every module of the adapter package counts
        pkg / "stubs/vllm/_C_stable_libtorch.py",
        pkg / "deps.txt",
    ):
        old = path.read_text()
        path.write_text(old + "# changed\n")
        assert payload.payload_fingerprint(repo, pkg) != base, path
        path.write_text(old)
    assert payload.payload_fingerprint(repo, pkg) == base
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "repo", moved / "repo")
    shutil.copytree(tmp_path / "pkg", moved / "pkg")
    assert payload.payload_fingerprint(moved / "repo", moved / "pkg") == base  # location-independent


@pytest.mark.cpu
def test_pack_is_normalised_and_unpacks_to_the_same_tree(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("V = 2\n")
    (site / "pkg" / "data.bin").write_bytes(os.urandom(1000))
    out = tmp_path / "site.tar.xz"
    assert payload.pack(site, out, preset=1) == out.stat().st_size
    assert not out.with_name("site.tar.xz.part").exists()
    with tarfile.open(out) as tf:
        infos = {i.name: i for i in tf.getmembers()}
    assert set(infos) == {"pkg/__init__.py", "pkg/data.bin"}
    assert all(i.uid == 0 and i.mtime == payload.ARCHIVE_MTIME for i in infos.values())
    again = tmp_path / "again.tar.xz"
    payload.pack(site, again, preset=1)
    assert again.read_bytes() == out.read_bytes()  # same site, same bytes
    dest = tmp_path / "dest"
    dest.mkdir()
    payload.unpack(out, dest)
    assert (dest / "pkg" / "data.bin").read_bytes() == (site / "pkg" / "data.bin").read_bytes()


@pytest.mark.cpu
def test_bundle_status_states(tmp_path: Path, make_bundle) -> None:
    assert payload.bundle_status(tmp_path / "none" / "current", REPO).code == payload.MISSING
    assert payload.bundle_status(make_bundle(tmp_path / "a"), REPO).code == payload.FRESH
    status = payload.bundle_status(make_bundle(tmp_path / "b", fingerprint="0" * 16), REPO)
    assert status.code == payload.STALE and "STALE" in status.message
    assert "python -m minicpmo_cg.offline_gpu bundle current" in status.message
    status = payload.bundle_status(make_bundle(tmp_path / "c", patched=False), REPO)
    assert status.code == payload.STALE and "unpatched" in status.message
    (tmp_path / "a" / "current" / payload.ARCHIVE).unlink()
    assert payload.bundle_status(tmp_path / "a" / "current", REPO).code == payload.MISSING


@pytest.mark.cpu
def test_size_report_flags_bundles_over_a_given_limit(tmp_path: Path, make_bundle) -> None:
    bundle_dir = tmp_path / "bundles"
    make_bundle(bundle_dir, lane="current")
    text, ok = payload.size_report(bundle_dir, max_mib=1)
    assert ok and "current" in text and "OK" in text
    big = make_bundle(bundle_dir, lane="legacy")
    with open(big / payload.ARCHIVE, "r+b") as fh:  # sparse: 2 MiB without writing them
        fh.truncate(2 * payload.MIB)
    text, ok = payload.size_report(bundle_dir, max_mib=1)
    assert not ok and "TOO BIG" in text and "legacy" in text
    assert payload.size_report(bundle_dir)[1]  # no limit given: nothing to fail


@pytest.mark.cpu
def test_stubs_stand_in_for_stripped_native_modules() -> None:
    rels = {p.relative_to(payload.STUBS_DIR).as_posix() for p in STUBS}
    assert rels == {"vllm/_C_stable_libtorch.py", "vllm/vllm_flash_attn/_vllm_fa2_C.py", "av/__init__.py"}
    # FlashAttention is dropped; vLLM's kernels are carried, the stub is their fallback
    assert strip.classify("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")[0] is False
    assert strip.classify("vllm/_C_stable_libtorch.abi3.so")[0] is True


@pytest.mark.cpu
@pytest.mark.parametrize("stub", STUBS, ids=lambda p: p.name)
def test_stub_headers_explain_why_and_why_safe(stub: Path) -> None:
    text = stub.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert text.startswith("# STUB (offline GPU bundle")
    for needle in ("Why it exists", "What it does", "Why that is safe"):
        assert needle in header, f"{stub.name}: header lacks {needle!r}"
    assert "STUB = True" in text


STUB_CHECK = textwrap.dedent(
    """
    import stub_under_test as s
    assert s.STUB is True
    if hasattr(s, "QUERIES"):
        import torch
        # the import-time queries of w8a8_utils (fp8: vllm 0.28; block fp8: 0.28 and 0.30)
        assert set(s.QUERIES) == {"cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8"}
        for name in s.QUERIES:
            assert getattr(torch.ops._C, name)(90) is False
        try:
            torch.ops._C.cutlass_group_gemm_supported
        except AttributeError:
            pass
        else:
            raise AssertionError("the stub must register nothing but the import-time queries")
    print("ok")
    """
)


@pytest.mark.cpu
@pytest.mark.parametrize("stub", STUBS, ids=lambda p: p.name)
def test_stub_imports_in_isolation(stub: Path, tmp_path: Path) -> None:
    # A fresh interpreter (the _C stub registers torch ops; keep them out of this process), the
    # stub copied into a temporary directory and imported under a neutral name.
    shutil.copy(stub, tmp_path / "stub_under_test.py")
    r = subprocess.run(
        [sys.executable, "-c", STUB_CHECK],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        check=False,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
