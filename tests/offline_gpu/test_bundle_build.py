"""CPU checks of ``bundle``: a whole build from local stand-in wheels (no network), the wheel
cache lookup, the command line, and the host-like import check's own logic."""

from __future__ import annotations

import importlib
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

from minicpmo_cg.lanes import get_lane
from minicpmo_cg.offline_gpu import build, cli, importcheck, payload, wheels

pytestmark = pytest.mark.core_model


def _wheel(folder: Path, filename: str, members: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / filename, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return folder / filename


@pytest.mark.cpu
def test_cached_wheel_matches_normalised_names_and_exact_versions(tmp_path: Path) -> None:
    whl = _wheel(tmp_path, "vllm_omni-0.30.0-py3-none-any.whl", {})
    _wheel(tmp_path, "partial_json_parser-0.2.1.1.post7-py3-none-any.whl", {})
    assert wheels.cached_wheel(tmp_path, "vllm-omni==0.30.0") == whl
    assert wheels.cached_wheel(tmp_path, "vllm-omni==0.30") is None
    assert wheels.cached_wheel(tmp_path, "vllm==0.30.0") is None
    assert wheels.cached_wheel(tmp_path, "partial-json-parser==0.2.1.1.post7") is not None
    flags = wheels.target_flags()
    assert flags[flags.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in flags


@pytest.mark.cpu
def test_build_from_cached_wheels_strips_adds_stubs_packs_and_records(tmp_path: Path, monkeypatch) -> None:
    lane = get_lane("current")
    cache = tmp_path / "cache"
    _wheel(
        cache / "upstream",
        f"vllm-{lane.vllm}-cp38-abi3-manylinux_2_28_x86_64.whl",
        {
            "vllm/__init__.py": b"",
            "vllm/_C.abi3.so": b"\x7fELF",
            f"vllm-{lane.vllm}.dist-info/METADATA": b"x",
        },
    )
    _wheel(cache / "upstream", f"vllm_omni-{lane.vllm_omni}-py3-none-any.whl", {"vllm_omni/__init__.py": b""})
    monkeypatch.setattr(payload, "read_deps", lambda lane_name: [])  # nothing to download
    opts = build.BuildOptions(repo=cli.REPO, out=tmp_path / "out", cache=cache, patched=False, verify="no")
    assert build.build([lane], opts) == 0
    lane_dir = tmp_path / "out" / "current"
    meta = payload.read_manifest(lane_dir)
    assert (meta["lane"], meta["vllm"], meta["patched"], meta["import_check"]) == (
        "current",
        lane.vllm,
        False,
        "skipped",
    )
    assert meta["payload_fingerprint"] == payload.payload_fingerprint(cli.REPO)
    assert meta["archive_sha256"] == payload.file_sha256(lane_dir / payload.ARCHIVE)
    assert meta["strip"][0]["dropped"]["native extension (not carried)"][0] == 1
    with tarfile.open(lane_dir / payload.ARCHIVE) as tf:
        names = set(tf.getnames())
    assert {"vllm/__init__.py", "vllm_omni/__init__.py", "vllm/_C_stable_libtorch.py"} <= names
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.py" in names and "vllm/_C.abi3.so" not in names
    assert payload.bundle_status(lane_dir, cli.REPO).code == payload.STALE  # unpatched: development only
    assert sorted(p.name for p in lane_dir.iterdir()) == [payload.MANIFEST, payload.ARCHIVE]


@pytest.mark.cpu
def test_build_reports_a_failed_lane_and_keeps_the_old_bundle(
    tmp_path: Path, make_bundle, monkeypatch
) -> None:
    old = make_bundle(tmp_path / "out")
    before = (old / payload.MANIFEST).read_text()

    def no_network(specs, folder):
        raise RuntimeError("pip download failed (exit 1): no network")

    monkeypatch.setattr(wheels, "fetch", no_network)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the failed lane's work directory is kept
    opts = build.BuildOptions(repo=cli.REPO, out=tmp_path / "out", cache=tmp_path / "cache", verify="no")
    assert build.build([get_lane("current")], opts) == 1
    assert (old / payload.MANIFEST).read_text() == before
    assert len(list(tmp_path.glob("offline-gpu-current-*"))) == 1  # kept for a look, as the message says


@pytest.mark.cpu
@pytest.mark.parametrize(
    "argv", [["bundle"], ["bundle", "nolane"], ["bundle", "current", "--bogus"], ["frob"], []]
)
def test_bundle_command_line_errors(argv: list[str], capsys) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.cpu
def test_import_check_optional_modules_and_exit_status(tmp_path: Path, monkeypatch, capsys) -> None:
    assert importcheck.main(["json", "?no_such_module_xyz"]) == 0
    assert "skip  no_such_module_xyz" in capsys.readouterr().out
    assert importcheck.main(["json", "no_such_module_xyz"]) == 1
    assert "FAIL  no_such_module_xyz" in capsys.readouterr().out
    # an optional module that is present but misses one of its own imports is a failure
    (tmp_path / "broken_module_xyz.py").write_text("import another_missing_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importcheck.try_import("?broken_module_xyz") is False
    assert "another_missing_module_xyz" in capsys.readouterr().out


@pytest.mark.cpu
def test_fake_nvml_serves_both_names_only_while_installed(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    finder = importcheck._FakeNvmlFinder()
    sys.meta_path.insert(0, finder)
    try:
        fake = importlib.import_module("pynvml")
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("pynvml", None)
    assert fake is finder.module
    assert fake.nvmlDeviceGetCudaComputeCapability(fake.nvmlDeviceGetHandleByIndex(0)) == (9, 0)
    assert fake.nvmlDeviceGetCount() == 1
    assert finder.find_spec("vllm.third_party.pynvml") is not None and finder.find_spec("numpy") is None
