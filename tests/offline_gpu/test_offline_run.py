"""CPU checks of ``check``, ``run`` and ``env``: the plan, part budgeting, a real run against a
hand-made bundle with a stand-in host Python, stale and missing bundles, and the shell exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minicpmo_cg.offline_gpu import cli, hostenv, payload, runner

pytestmark = pytest.mark.core_model


def offline_gpu(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse errors
        return exc.code


def plan_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[")]


@pytest.mark.cpu
def test_dry_run_prints_each_part_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert (
        offline_gpu(
            ["run", "current", "tests", "--dry-run", "--out", str(out), "--bundle-dir", str(tmp_path)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "bundle missing" in text
    assert "site.tar.xz into" in text and "minicpmo-cg-site-current" in text
    assert f"export PYTHONPATH={hostenv.default_site('current').resolve()}:{cli.REPO}" in text
    for flag in (
        "NCCL_NVLS_ENABLE=0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
        "NVSHMEM_DISABLE_NVLS=1",
        "HF_HUB_OFFLINE=1",
    ):
        assert f"export {flag}" in text
    (part,) = plan_lines(text)
    assert part.startswith("[tests] time limit 240 s: ")
    assert "-m pytest tests -m 'cuda or multi_gpu or core_model'" in part and "--ignore=tests/patches" in part
    assert f"--junitxml={out}/junit-current.xml" in part
    assert not out.exists()


@pytest.mark.cpu
def test_default_parts_quick_budget_and_extra_args(tmp_path: Path, capsys) -> None:
    argv = [
        "run",
        "legacy",
        "--quick",
        "--budget",
        "100",
        "--dry-run",
        "--out",
        "/o",
        "--bundle-dir",
        str(tmp_path),
    ]
    assert offline_gpu([*argv, "--bench-args", "--only vision,audio", "--timeout", "demo=60"]) == 0
    parts = plan_lines(capsys.readouterr().out)
    assert [p.split("]")[0][1:] for p in parts] == ["tests", "demo", "bench"]
    assert [p.split(" s: ")[0].rsplit(" ", 1)[1] for p in parts] == ["100", "60", "100"]
    assert "--quick" not in parts[0]
    assert "-m minicpmo_cg.demo --json /o/demo-legacy.json --quick >" in parts[1]
    assert "-m minicpmo_cg.bench --json /o/bench-legacy.json --quick --only vision,audio >" in parts[2]


@pytest.mark.cpu
def test_test_paths_in_the_tests_args_replace_the_whole_suite(tmp_path: Path, capsys) -> None:
    base = ["run", "current", "tests", "--dry-run", "--out", "/o", "--bundle-dir", str(tmp_path)]
    node = "tests/model_executor/test_x.py::test_y"
    assert offline_gpu([*base, "--tests-args", f"{node} -x"]) == 0
    (line,) = plan_lines(capsys.readouterr().out)
    assert "-m pytest -m " in line and f"--ignore=tests/patches --ignore=tests/e2e {node} -x >" in line
    assert offline_gpu([*base, "--tests-args", "-k capture"]) == 0  # no path: the whole suite
    (line,) = plan_lines(capsys.readouterr().out)
    assert "-m pytest tests -m " in line and "--ignore=tests/patches --ignore=tests/e2e -k capture >" in line


@pytest.mark.cpu
def test_parts_keep_the_given_order_once_each(tmp_path: Path, capsys) -> None:
    assert (
        offline_gpu(["run", "current", "bench", "tests", "bench", "--dry-run", "--bundle-dir", str(tmp_path)])
        == 0
    )
    text = capsys.readouterr().out
    assert [p.split("]")[0][1:] for p in plan_lines(text)] == ["bench", "tests"]
    files = text.split("# files in ")[1].split(": ", 1)[1].split()
    assert files == [
        "run-current.log", "run-current.json", "bench-current.log", "bench-current.json",
        "tests-current.log", "junit-current.xml",
    ]  # fmt: skip


@pytest.mark.cpu
@pytest.mark.parametrize(
    "args",
    [(), ("nolane",), ("current", "lint"), ("current", "--budget", "x"), ("current", "--budget", "0"),
     ("current", "--frob"), ("current", "--timeout", "lint=3"), ("current", "--timeout", "tests")],
)  # fmt: skip
def test_run_rejects_bad_arguments(args: tuple[str, ...], capsys) -> None:
    assert offline_gpu(["run", *args, "--dry-run"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.cpu
def test_part_time_limit_clips_to_the_budget_and_skips_when_too_little_is_left() -> None:
    plan = runner.RunPlan(lane="current", parts=["tests"], python="py", out=Path("/o"), timeouts={"demo": 5})
    assert runner.part_time_limit(plan, "tests", 1000) == 240
    assert runner.part_time_limit(plan, "tests", 100.7) == 100
    assert runner.part_time_limit(plan, "tests", runner.MIN_PART_S - 1) is None
    assert runner.part_time_limit(plan, "demo", 6) == 5  # a part shorter than the minimum still runs
    assert runner.part_time_limit(plan, "demo", 4) is None


@pytest.mark.cpu
def test_check_needs_a_present_fresh_bundle(tmp_path: Path, make_bundle, capsys) -> None:
    check = ["check", "current", "--bundle-dir", str(tmp_path)]
    assert offline_gpu(check) == payload.MISSING
    make_bundle(tmp_path, fingerprint="stale")
    assert offline_gpu(check) == payload.STALE
    assert "STALE" in capsys.readouterr().out
    make_bundle(tmp_path)
    assert offline_gpu(check) == 0
    text = capsys.readouterr().out
    assert "check: OK" in text and "[tests]" in text and "together" in text
    assert offline_gpu([*check, "--max-mib", "0.000001"]) == 1
    assert "bundles too big" in capsys.readouterr().out


def _run(tmp_path: Path, fake_python: Path, *args: str) -> tuple[int, Path, Path]:
    out, site = tmp_path / "out", tmp_path / "site"
    argv = ["run", "current", *args, "--python", str(fake_python), "--out", str(out), "--site", str(site)]
    return offline_gpu([*argv, "--bundle-dir", str(tmp_path / "bundles")]), out, site


@pytest.mark.cpu
def test_real_run_isolates_failures_and_summarises(tmp_path: Path, make_bundle, fake_python, capsys) -> None:
    make_bundle(tmp_path / "bundles")
    code, out, site = _run(tmp_path, fake_python, "tests", "demo", "bench")
    text = capsys.readouterr().out
    assert code == 1, text  # the demo failed, the others still ran
    assert (site / "fakepkg" / "__init__.py").is_file() and (site / hostenv.STAMP).is_file()
    summary = text.split("SUMMARY current")[1]
    assert "tests  ok" in summary and "demo   FAILED (exit 1)" in summary and "bench  ok" in summary
    assert "=== RESULTS: fake\nrow 1" in text and "noise" not in text  # the bench table from its marker
    assert "fake -m minicpmo_cg.offline_gpu.probe" in text and "fake -m minicpmo_cg.patchtool status" in text
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(["bench-current.json", "bench-current.log", "demo-current.log", "run-current.json",
                              "run-current.log", "tests-current.log"])  # fmt: skip
    assert "demo broke" in (out / "demo-current.log").read_text()
    assert "SUMMARY current" in (out / "run-current.log").read_text()
    doc = json.loads((out / "run-current.json").read_text())
    assert doc["ok"] is False and doc["manifest"]["lane"] == "current"
    assert [(p["name"], p["status"], p["returncode"]) for p in doc["parts"]] == [
        ("tests", "ok", 0), ("demo", "failed", 1), ("bench", "ok", 0),
    ]  # fmt: skip


@pytest.mark.cpu
def test_budget_exhausted_skips_parts(tmp_path: Path, make_bundle, fake_python, capsys) -> None:
    make_bundle(tmp_path / "bundles")
    code, out, _ = _run(tmp_path, fake_python, "tests", "--budget", "5")
    text = capsys.readouterr().out
    assert code == 1 and "[tests] SKIPPED" in text and "SKIPPED" in text.split("SUMMARY")[1]
    assert not (out / "tests-current.log").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.cpu
def test_a_part_over_its_time_limit_is_killed_with_its_children(
    tmp_path: Path, make_bundle, fake_python, capsys
):
    make_bundle(tmp_path / "bundles")
    code, out, _ = _run(
        tmp_path, fake_python, "bench", "tests", "--bench-args=--hang", "--timeout", "bench=2"
    )
    text = capsys.readouterr().out
    # the hanging part would print its results after 120 s: "timeout" says the runner killed it
    assert code == 1 and "[bench] timeout" in text and "TIMEOUT" in text.split("SUMMARY")[1]
    assert "tests  ok" in text.split("SUMMARY")[1]  # the next part still ran
    grandchild = int((out / "grandchild.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.cpu
def test_run_without_a_bundle_fails_fast(tmp_path: Path, fake_python, capsys) -> None:
    code, out, _ = _run(tmp_path, fake_python)
    text = capsys.readouterr().out
    assert code == payload.MISSING and "FATAL: bundle missing" in text and "parts not run" in text
    assert json.loads((out / "run-current.json").read_text())["install_failed"] is True
    assert not fake_python.with_suffix(".calls").exists()  # nothing else was started


@pytest.mark.cpu
def test_a_stale_bundle_is_repatched_from_the_checkout(
    tmp_path: Path, make_bundle, fake_python, capsys
) -> None:
    make_bundle(tmp_path / "bundles", fingerprint="stale")
    code, _, site = _run(tmp_path, fake_python, "tests")
    text = capsys.readouterr().out
    assert code == 0 and "bundle STALE" in text and "WARNING: re-patched" in text
    calls = fake_python.with_suffix(".calls").read_text().splitlines()
    assert calls[:2] == [
        f"-m minicpmo_cg.patchtool {step} --site-packages {site}" for step in ("revert", "apply")
    ]
    assert (site / "vllm" / "_C_stable_libtorch.py").read_text() == (
        payload.STUBS_DIR / "vllm/_C_stable_libtorch.py"
    ).read_text()


@pytest.mark.cpu
def test_a_stale_bundle_with_other_dependencies_needs_a_rebuild(
    tmp_path: Path, make_bundle, fake_python, capsys
):
    make_bundle(tmp_path / "bundles", fingerprint="stale", deps=["pydantic==1.0"])
    code, out, _ = _run(tmp_path, fake_python, "tests")
    text = capsys.readouterr().out
    assert code == payload.STALE and "deps.txt changed" in text and "rebuild" in text
    assert not (out / "tests-current.log").exists()


@pytest.mark.cpu
def test_a_damaged_archive_is_refused(tmp_path: Path, make_bundle, fake_python, capsys) -> None:
    lane_dir = make_bundle(tmp_path / "bundles")
    with open(lane_dir / payload.ARCHIVE, "ab") as fh:
        fh.write(b"garbage")
    code, _, _ = _run(tmp_path, fake_python, "tests")
    assert code == payload.MISSING and "checksum" in capsys.readouterr().out


def _env_in_bash(tmp_path: Path, then: str) -> subprocess.CompletedProcess:
    env_cmd = f"{sys.executable} -m minicpmo_cg.offline_gpu env current --bundle-dir {tmp_path} --site {tmp_path}/site"
    script = f'set -e; eval "$({env_cmd})"; {then}'
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", "-c", script], cwd=cli.REPO, env=environ, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.cpu
def test_env_unpacks_once_and_exports_a_usable_environment(tmp_path: Path, make_bundle) -> None:
    make_bundle(tmp_path)
    then = f"{sys.executable} -c \"import fakepkg, os; print(fakepkg.WHERE, os.environ['NCCL_NVLS_ENABLE'])\""
    first = _env_in_bash(tmp_path, then)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["bundle", "0"] and "install: unpacked" in first.stderr
    second = _env_in_bash(tmp_path, 'echo "$PYTHONPATH"')
    assert second.returncode == 0 and "install: reusing" in second.stderr
    assert second.stdout.strip() == f"{(tmp_path / 'site').resolve()}:{cli.REPO}"


@pytest.mark.cpu
def test_env_without_a_bundle_prints_no_exports(tmp_path: Path, capsys) -> None:
    assert offline_gpu(["env", "current", "--bundle-dir", str(tmp_path), "--site", str(tmp_path / "s")]) == 4
    captured = capsys.readouterr()
    assert captured.out == "" and "FATAL: bundle missing" in captured.err
