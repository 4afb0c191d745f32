"""CPU checks of the offline GPU runner (tools/gpu/): strip rules, manifest/freshness, stubs, run.sh.

Nothing here needs the network, a built bundle or a GPU; run.sh is exercised in --dry-run /
--preflight mode and, for the real code path, with a tiny hand-made bundle and a fake Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tools" / "gpu"
RUN_SH = GPU / "run.sh"
BUILD_SH = GPU / "build_bundle.sh"


def _load_bundle_lib():
    spec = importlib.util.spec_from_file_location("gpu_bundle_lib", GPU / "bundle_lib.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bl = _load_bundle_lib()


def run_sh(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        ["bash", str(RUN_SH), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


# ---------------------------------------------------------------------------------------------
# strip rules
# ---------------------------------------------------------------------------------------------

ELF = b"\x7fELF\x02\x01\x01\x00"


@pytest.mark.parametrize(
    ("name", "head", "keep"),
    [
        ("vllm/config/model.py", b"", True),
        ("vllm/_C_stable_libtorch.abi3.so", b"", False),
        ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"", False),
        ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", b"", False),
        ("foo/libbar.so.1.2", b"", False),
        ("vllm/vllm-rs", ELF, False),  # 55 MB executable without an extension
        ("vllm/utils/numa_wrapper.sh", b"", True),
        ("vllm/third_party/x/include/cutlass.hpp", b"", False),
        ("vllm/third_party/fmha_sm100/csrc/fmha_sm100_plan.cu", b"", False),
        ("vllm/entrypoints/serve/instrumentator/static/swagger-ui-bundle.js", b"", False),
        ("vllm/distributed/kv_transfer/disagg_prefill_workflow.jpg", b"", False),
        ("vllm/distributed/kv_transfer/README.md", b"", False),
        ("vllm/model_executor/layers/fused_moe/configs/README", b"", False),
        # runtime data must stay: kernel tuning configs, chat templates, type marker
        ("vllm/model_executor/layers/fused_moe/configs/E=8,N=14336,device_name=NVIDIA_H200.json", b"", True),
        ("vllm/transformers_utils/chat_templates/template_basic.jinja", b"", True),
        ("vllm/py.typed", b"", True),
        # vllm-omni media are model assets / real inputs of the main job
        ("vllm_omni/model_executor/models/step_audio2/assets/default_female.wav", b"RIFF", True),
        ("vllm_omni/model_executor/models/covo_audio/speaker_prompt/prompt_latent.npy", b"", True),
        ("vllm_omni/some/figure.png", b"", True),
        # dist-info: version metadata kept (importlib.metadata, patch tool lane check), RECORD dropped
        ("vllm-0.30.0.dist-info/METADATA", b"", True),
        ("vllm-0.30.0.dist-info/entry_points.txt", b"", True),
        ("vllm-0.30.0.dist-info/licenses/LICENSE", b"", True),
        ("vllm-0.30.0.dist-info/RECORD", b"", False),
        ("vllm/__pycache__/envs.cpython-312.pyc", b"", False),
        ("vllm/config/", b"", False),
    ],
)
def test_classify(name: str, head: bytes, keep: bool) -> None:
    kept, rule = bl.classify(name, head)
    assert kept is keep, rule
    assert (rule == "keep") is keep


def test_extract_wheel_applies_rules_and_counts(tmp_path: Path) -> None:
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    members = {
        "demo/__init__.py": b"X = 1\n",
        "demo/_native.abi3.so": ELF + b"\0" * 100,
        "demo/tool": ELF + b"\0" * 10,
        "demo/script": b"#!/bin/sh\necho hi\n",
        "demo/include/a.h": b"int a;",
        "demo/data/config.json": b"{}",
        "demo-1.0.dist-info/METADATA": b"Name: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/RECORD": b"",
    }
    with zipfile.ZipFile(whl, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    site = tmp_path / "site"
    stats = bl.extract_wheel(whl, site)
    kept = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert kept == ["demo-1.0.dist-info/METADATA", "demo/__init__.py", "demo/data/config.json", "demo/script"]
    assert stats["kept_files"] == 4
    assert stats["dropped"]["native executable"][0] == 1
    assert stats["dropped"]["native extension (built for another torch)"][0] == 1


def test_extract_wheel_refuses_paths_outside_the_site(tmp_path: Path) -> None:
    whl = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("../escape.py", b"")
    with pytest.raises(ValueError, match="escapes"):
        bl.extract_wheel(whl, tmp_path / "site")


def test_strip_site_keeps_test_packages_of_deps(tmp_path: Path) -> None:
    # xgrammar imports its own `testing` subpackage at import time: it must survive.
    site = tmp_path / "site"
    for rel in (
        "xgrammar/testing.py",
        "xgrammar/tvm_ffi_binding/testing/__init__.py",
        "pkg/tests/__init__.py",
        "pkg/__pycache__/m.cpython-312.pyc",
        "pkg/include/x.h",
        "pkg-1.0.dist-info/RECORD",
        "pkg-1.0.dist-info/METADATA",
        "bin/pkg-cli",
        "vllm/__pycache__/keep.pyc",
    ):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x")
    bl.strip_site(site)
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert "xgrammar/tvm_ffi_binding/testing/__init__.py" in left and "pkg/tests/__init__.py" in left
    assert "pkg-1.0.dist-info/METADATA" in left
    for gone in (
        "pkg/__pycache__/m.cpython-312.pyc",
        "pkg/include/x.h",
        "pkg-1.0.dist-info/RECORD",
        "bin/pkg-cli",
    ):
        assert gone not in left
    assert "vllm/__pycache__/keep.pyc" in left  # upstream trees are classify()'s business only


# ---------------------------------------------------------------------------------------------
# pins, deps, fingerprint, pack, freshness, sizes
# ---------------------------------------------------------------------------------------------


def test_lane_pins_match_lane_files() -> None:
    assert bl.read_lane_pins("current") == {"vllm": "0.30.0", "vllm-omni": "0.30.0"}
    assert bl.read_lane_pins("legacy") == {"vllm": "0.28.0", "vllm-omni": "0.28.0"}
    with pytest.raises(SystemExit):
        bl.read_lane_pins("nope")


def test_deps_are_exact_pins_and_lane_filtered(tmp_path: Path) -> None:
    deps = bl.read_deps("current")
    assert deps and all("==" in d for d in deps)
    assert {"pydantic", "pyzmq", "xgrammar"} <= {d.split("==")[0] for d in deps}
    f = tmp_path / "deps.txt"
    f.write_text("a==1  # both\nb==2 lanes=legacy  # legacy only\n\n# comment\n")
    assert bl.read_deps("current", f) == ["a==1"]
    assert bl.read_deps("legacy", f) == ["a==1", "b==2"]
    f.write_text("c>=1\n")
    with pytest.raises(ValueError, match="pin"):
        bl.read_deps("current", f)


def _fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for rel, text in {
        "patches/vllm-omni/series": "0001.patch\n",
        "patches/vllm-omni/0001.patch": "diff\n",
        "patches/README.md": "prose\n",
        "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph.py": "ADAPTER = 1\n",
        "tools/gpu/stubs/vllm/_C_stable_libtorch.py": "STUB = True\n",
        "tools/gpu/deps.txt": "a==1\n",
    }.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


def test_fingerprint_follows_patches_adapter_stubs_deps_not_prose(tmp_path: Path, monkeypatch) -> None:
    repo = _fake_repo(tmp_path)
    monkeypatch.setattr(bl, "HERE", repo / "tools" / "gpu")
    base = bl.payload_fingerprint(repo)
    (repo / "patches/README.md").write_text("other prose\n")
    assert bl.payload_fingerprint(repo) == base
    for rel in (
        "patches/vllm-omni/0001.patch",
        "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph.py",
        "tools/gpu/stubs/vllm/_C_stable_libtorch.py",
        "tools/gpu/deps.txt",
    ):
        old = (repo / rel).read_text()
        (repo / rel).write_text(old + "# changed\n")
        assert bl.payload_fingerprint(repo) != base, rel
        (repo / rel).write_text(old)
    assert bl.payload_fingerprint(repo) == base


def test_pack_round_trip_is_normalised(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("V = 2\n")
    (site / "pkg" / "data.bin").write_bytes(os.urandom(1000))
    out = tmp_path / "site.tar.xz"
    assert bl.pack(site, out, preset=1) == out.stat().st_size
    with tarfile.open(out) as tf:
        infos = {i.name: i for i in tf.getmembers()}
        assert set(infos) == {"pkg/__init__.py", "pkg/data.bin"}
        assert all(i.uid == 0 and i.mtime == 1_700_000_000 for i in infos.values())
        assert tf.extractfile("pkg/__init__.py").read() == b"V = 2\n"


def _lane_dir(root: Path, *, fingerprint: str, patched: bool = True, lane: str = "current") -> Path:
    d = root / lane
    d.mkdir(parents=True, exist_ok=True)
    (d / "site.tar.xz").write_bytes(b"")
    (d / "MANIFEST.json").write_text(
        json.dumps(
            {
                "lane": lane,
                "patched": patched,
                "payload_fingerprint": fingerprint,
                "vllm": "0.30.0",
                "vllm_omni": "0.30.0",
            }
        )
    )
    return d


def test_check_lane_dir_states(tmp_path: Path) -> None:
    now = bl.payload_fingerprint()
    assert bl.check_lane_dir(tmp_path / "missing")[0] == 4
    assert bl.check_lane_dir(_lane_dir(tmp_path / "a", fingerprint=now))[0] == 0
    rc, msg = bl.check_lane_dir(_lane_dir(tmp_path / "b", fingerprint="0" * 16))
    assert rc == 3 and "STALE" in msg and "build_bundle.sh current" in msg
    assert bl.check_lane_dir(_lane_dir(tmp_path / "c", fingerprint=now, patched=False))[0] == 3


def test_carry_report_flags_oversized_lanes(tmp_path: Path) -> None:
    bundle = tmp_path / ".gpubundle"
    small = _lane_dir(bundle, fingerprint="x", lane="current")
    (small / "site.tar.xz").write_bytes(b"\0" * 1024)
    text, ok = bl.carry_report(bundle)
    assert ok and "lane current" in text
    big = _lane_dir(bundle, fingerprint="x", lane="legacy")
    with open(big / "site.tar.xz", "wb") as fh:  # sparse file: 65 MiB without writing them
        fh.truncate(65 * bl.MIB)
    text, ok = bl.carry_report(bundle)
    assert not ok and "TOO BIG" in text


def test_bundle_lib_cli_usage_errors() -> None:
    assert bl.main([]) == 2
    assert bl.main(["frobnicate"]) == 2


def test_build_bundle_help_and_bad_option() -> None:
    r = subprocess.run(
        ["bash", str(BUILD_SH), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    assert r.returncode == 0 and "LANE" in r.stdout
    r = subprocess.run(
        ["bash", str(BUILD_SH), "--bogus"], capture_output=True, text=True, timeout=30, check=False
    )
    assert r.returncode == 2


# ---------------------------------------------------------------------------------------------
# stubs
# ---------------------------------------------------------------------------------------------

STUBS = sorted((GPU / "stubs").rglob("*.py"))


def test_stubs_exist_and_stand_in_for_stripped_native_modules() -> None:
    rels = {str(p.relative_to(GPU / "stubs")) for p in STUBS}
    assert rels == {"vllm/_C_stable_libtorch.py", "vllm/vllm_flash_attn/_vllm_fa2_C.py"}
    for rel in rels:  # the real module is a native extension that the strip drops
        assert bl.classify(rel[: -len(".py")] + ".abi3.so")[0] is False


@pytest.mark.parametrize("stub", STUBS, ids=lambda p: p.name)
def test_stub_headers_explain_why_and_why_safe(stub: Path) -> None:
    text = stub.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert text.startswith("# STUB (offline GPU bundle")
    for needle in ("Why it exists", "What it does", "Why that is safe"):
        assert needle in header, f"{stub.name}: header lacks {needle!r}"
    assert "STUB = True" in text


@pytest.mark.parametrize("stub", STUBS, ids=lambda p: p.name)
def test_stub_imports_in_isolation(stub: Path, tmp_path: Path) -> None:
    # A fresh interpreter (the _C stub registers a torch op; keep that out of this process), the
    # stub copied into a temp dir and imported under a neutral name.
    shutil.copy(stub, tmp_path / "stub_under_test.py")
    code = textwrap.dedent(
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
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        check=False,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# run.sh
# ---------------------------------------------------------------------------------------------


def test_run_sh_dry_run_prints_each_part(tmp_path: Path) -> None:
    r = run_sh(
        "current", "tests", "--dry-run", env={"OUT": str(tmp_path / "out"), "GPU_BUNDLE_DIR": str(tmp_path)}
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "bundle missing" in out
    assert "tar -xJf" in out and "/tmp/site-current" in out
    assert "export PYTHONPATH=/tmp/site-current:" in out
    parts = [line for line in out.splitlines() if line.startswith("[")]
    assert len(parts) == 1 and parts[0].startswith("[tests] timeout -k 10 240 ")
    assert '-m pytest tests -m "cuda or multi_gpu or core_model"' in parts[0]
    assert f"--junitxml={tmp_path}/out/junit-current.xml" in parts[0]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_run_sh_default_parts_quick_and_budget(tmp_path: Path) -> None:
    r = run_sh(
        "legacy",
        "--quick",
        "--budget",
        "100",
        "--dry-run",
        env={"OUT": "/o", "GPU_BUNDLE_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    parts = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert [p.split("]")[0][1:] for p in parts] == ["tests", "demo", "bench"]
    assert all(" timeout -k 10 100 " in p for p in parts)  # every cap clipped to the budget
    assert "--quick" not in parts[0]
    assert "-m minicpmo_cg.main_job --quick --json /o/demo-legacy.json" in parts[1]
    assert "benchmarks/encoder_cuda_graph_bench.py --quick --json /o/bench-legacy.json" in parts[2]
    files = r.stdout.split("# files in $OUT:")[1].split()
    assert len(files) <= 8 and "run-legacy.log" in files  # the device tool returns at most 8 files


def test_run_sh_keeps_given_order_and_drops_repeats(tmp_path: Path) -> None:
    r = run_sh("current", "bench", "tests", "bench", "--dry-run", env={"GPU_BUNDLE_DIR": str(tmp_path)})
    parts = [line.split("]")[0][1:] for line in r.stdout.splitlines() if line.startswith("[")]
    assert parts == ["bench", "tests"]


@pytest.mark.parametrize(
    "args",
    [(), ("nolane",), ("current", "lint"), ("current", "--budget", "x"), ("current", "--frob")],
)
def test_run_sh_rejects_bad_arguments(args: tuple[str, ...]) -> None:
    r = run_sh(*args, "--dry-run")
    assert r.returncode == 2


def test_run_sh_preflight_needs_a_fresh_bundle(tmp_path: Path) -> None:
    assert run_sh("current", "--preflight", env={"GPU_BUNDLE_DIR": str(tmp_path)}).returncode == 4
    _lane_dir(tmp_path, fingerprint="stale")
    r = run_sh("current", "--preflight", env={"GPU_BUNDLE_DIR": str(tmp_path)})
    assert r.returncode == 3 and "STALE" in r.stdout
    _lane_dir(tmp_path, fingerprint=bl.payload_fingerprint())
    r = run_sh("current", "--preflight", env={"GPU_BUNDLE_DIR": str(tmp_path)})
    assert r.returncode == 0 and "preflight: OK" in r.stdout


FAKE_PY = """#!/usr/bin/env bash
# Stands in for the host's python3 in test_run_sh_real_path: tools run for real, parts are faked.
case "$1" in
  *tools/gpu/bundle_lib.py) exec python3 "$@" ;;
  -) cat > /dev/null; echo "python 3.12 (fake)"; exit 0 ;;
esac
if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "3 passed"; exit 0; fi
if [ "$1" = -m ] && [ "$2" = minicpmo_cg.main_job ]; then echo "demo broke"; exit 1; fi
if [ "$1" = -m ] && [ "$2" = minicpmo_cg.patchtool ]; then exit 0; fi
case "$1" in *encoder_cuda_graph_bench.py) echo "noise"; echo "=== RESULTS: fake"; echo "row 1"; exit 0 ;; esac
echo "unexpected: $*" >&2; exit 9
"""


def _real_bundle(root: Path) -> None:
    site = root / "stage"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("")
    lane = root / "current"
    lane.mkdir(parents=True)
    bl.pack(site, lane / "site.tar.xz", preset=1)
    (lane / "MANIFEST.json").write_text(
        json.dumps({"lane": "current", "patched": True, "payload_fingerprint": bl.payload_fingerprint()})
    )


def test_run_sh_real_path_isolates_failures_and_summarises(tmp_path: Path) -> None:
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    _real_bundle(tmp_path / "bundle")
    out, site = tmp_path / "out", tmp_path / "site"
    env = {
        "PY": str(fake),
        "OUT": str(out),
        "GPU_BUNDLE_DIR": str(tmp_path / "bundle"),
        "GPU_SITE": str(site),
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
    }
    r = run_sh("current", "tests", "demo", "bench", env=env)
    assert r.returncode == 1, r.stdout + r.stderr  # demo failed, the others still ran
    assert (site / "fakepkg" / "__init__.py").is_file()
    summary = r.stdout.split("SUMMARY current")[1]
    assert "tests  ok" in summary and "demo   FAILED (1)" in summary and "bench  ok" in summary
    assert (
        "=== RESULTS: fake" in r.stdout and "row 1" in r.stdout
    )  # the bench table is printed from its marker
    written = sorted(p.name for p in out.iterdir())
    assert written == ["bench-current.log", "demo-current.log", "run-current.log", "tests-current.log"]
    assert "demo broke" in (out / "demo-current.log").read_text()
    assert "SUMMARY current" in (out / "run-current.log").read_text()


def test_run_sh_budget_exhausted_skips_parts(tmp_path: Path) -> None:
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    _real_bundle(tmp_path / "bundle")
    env = {
        "PY": str(fake),
        "OUT": str(tmp_path / "out"),
        "GPU_BUNDLE_DIR": str(tmp_path / "bundle"),
        "GPU_SITE": str(tmp_path / "site"),
    }
    r = run_sh("current", "tests", "--budget", "5", env=env)
    assert r.returncode == 1 and "[tests] SKIPPED" in r.stdout and "FAILED (skipped)" in r.stdout


def test_run_sh_without_bundle_fails_fast(tmp_path: Path) -> None:
    r = run_sh("current", env={"OUT": str(tmp_path / "out"), "GPU_BUNDLE_DIR": str(tmp_path / "none")})
    assert r.returncode == 4 and "FATAL: no bundle" in r.stdout
