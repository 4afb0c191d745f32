# SPDX-License-Identifier: Apache-2.0
"""The Buildkite pipelines under ``.buildkite/`` are well formed and run what they claim.

Checked without Buildkite: every YAML parses; steps are keyed (unique), labelled and time
bounded and use only known attributes; matrices are consistent (placeholders, adjustments,
skip reasons); the level files take their lanes from ``lanes/*.txt``; every repo path a command
names exists; every ``-m`` expression uses only the markers registered in pyproject.toml and
selects at least one collected test; the matrices cover lane (every ``lanes/*.txt``) × mode
(eager, graphed) × level (CPU unit, CUDA unit, e2e); the e2e comparison reads what the serve
jobs write; and the uploader that turns the level files into plain Buildkite YAML selects
levels, fills in the lanes, filters and resolves hardware correctly.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import serve_smoke as smoke
from helpers.buildkite import (
    BK,
    COMMAND_STEP_ATTRIBUTES,
    CUSTOM_ATTRIBUTES,
    GROUPS,
    HARDWARE,
    KEY_RE,
    LANES,
    LEVELS,
    MODES,
    PATH_RE,
    PLACEHOLDER_RE,
    REPO,
    SERVE_SMOKE,
    Job,
    all_jobs,
    all_steps,
    expr_words,
    lane_of,
    level_of,
    level_steps,
    load,
    marker_expressions,
    mode_of,
    raw_level_steps,
    uploader,
    yaml_files,
)

pytestmark = [pytest.mark.core_model]


# ---------------------------------------------------------------------------
# Syntax and structure
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_the_tree_has_the_entry_point_and_the_level_files() -> None:
    names = {str(p.relative_to(BK)) for p in yaml_files()}
    assert {
        "pipeline.yml",
        *uploader.LEVEL_FILES.values(),
        uploader.HARDWARE_FILE,
        uploader.DEPENDENCY_FILE,
    } <= names


@pytest.mark.cpu
@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(BK)))
def test_every_yaml_parses_to_a_mapping(path: Path) -> None:
    doc = load(path)
    assert isinstance(doc, dict) and doc, f"{path} is empty or not a mapping"


@pytest.mark.cpu
def test_steps_are_keyed_unique_labelled_time_bounded_and_known() -> None:
    keys = []
    for step in all_steps():
        key = step.get("key")
        assert isinstance(key, str) and KEY_RE.match(key), (
            f"step {step.get('label')!r}: bad or missing key {key!r}"
        )
        keys.append(key)
        assert step.get("label"), f"{key}: no label"
        assert step.get("command") or step.get("commands"), f"{key}: no command"
        timeout = step.get("timeout_in_minutes")
        assert isinstance(timeout, int) and 1 <= timeout <= 120, f"{key}: timeout_in_minutes={timeout!r}"
        unknown = set(step) - COMMAND_STEP_ATTRIBUTES - CUSTOM_ATTRIBUTES
        assert not unknown, f"{key}: unknown step attributes {unknown}"
        # `buildkite-agent pipeline upload` interpolates $VAR at upload time; runtime variables need $$
        command = step.get("command") or "\n".join(step.get("commands", []))
        assert "$" not in command.replace("$$", ""), f"{key}: unescaped $ in {command!r}"
    assert len(keys) == len(set(keys)), f"duplicate step keys: {sorted(k for k in keys if keys.count(k) > 1)}"


@pytest.mark.cpu
def test_the_entry_point_only_uploads() -> None:
    (step,) = load(BK / "pipeline.yml")["steps"]
    assert step["command"] == "bash .buildkite/scripts/bootstrap.sh"
    assert step["agents"] == HARDWARE["cpu"]["agents"]  # the bootstrap runs where CPU steps run
    assert "upload_pipeline.py" in (BK / "scripts" / "bootstrap.sh").read_text()


@pytest.mark.cpu
def test_matrices_are_consistent() -> None:
    for _, step in level_steps():
        key = step["key"]
        text = step["label"] + (step.get("command") or "")
        used = set(PLACEHOLDER_RE.findall(text))
        matrix = step.get("matrix")
        if matrix is None:
            assert not used, f"{key}: {{{{matrix.*}}}} without a matrix"
            continue
        setup = matrix["setup"]
        assert isinstance(setup, dict) and setup, f"{key}: matrix.setup must name its dimensions"
        assert used <= set(setup), f"{key}: placeholders {used - set(setup)} are no matrix dimension"
        label_dims = set(PLACEHOLDER_RE.findall(step["label"]))
        assert label_dims == set(setup), (
            f"{key}: the label must show every dimension (jobs look alike otherwise)"
        )
        for dim, values in setup.items():
            assert len(values) == len(set(values)), f"{key}: duplicate values in {dim}"
        for adj in matrix.get("adjustments", []):
            assert set(adj["with"]) == set(setup), f"{key}: adjustment {adj['with']} must set every dimension"
            if "skip" in adj:
                assert all(adj["with"][d] in setup[d] for d in setup), (
                    f"{key}: skips a combination it never had"
                )
                assert isinstance(adj["skip"], str) and adj["skip"].strip(), f"{key}: a skip needs its reason"


@pytest.mark.cpu
def test_level_files_take_their_lanes_from_the_lanes_folder() -> None:
    assert LANES and LANES == tuple(sorted(p.stem for p in (REPO / "lanes").glob("*.txt")))
    with_lanes = 0
    for _, step in raw_level_steps():
        matrix = step.get("matrix") or {}
        if "lane" in matrix.get("setup", {}):
            assert matrix["setup"]["lane"] == uploader.LANES_GLOB, f"{step['key']}: lists its lanes"
            with_lanes += 1
        for adj in matrix.get("adjustments", []):
            assert "lane" not in adj["with"], f"{step['key']}: an adjustment names a lane"
        command = step.get("command") or "\n".join(step.get("commands", []))
        words = set(command.replace(";", " ").split())
        assert not words & set(LANES), f"{step['key']}: names a lane in its command"
    assert with_lanes >= 5


@pytest.mark.cpu
def test_resolve_lanes_fills_in_every_lane_and_repeats_lane_free_adjustments() -> None:
    step = {
        "key": "k",
        "matrix": {
            "setup": {"lane": uploader.LANES_GLOB, "mode": ["graphed", "eager"]},
            "adjustments": [{"with": {"mode": "eager"}, "skip": "why"}, {"with": {"lane": "b", "mode": "x"}}],
        },
    }
    original = copy.deepcopy(step)
    resolved = uploader.resolve_lanes(step, ["a", "b", "c"])
    assert step == original  # not modified in place
    assert resolved["matrix"]["setup"] == {"lane": ["a", "b", "c"], "mode": ["graphed", "eager"]}
    assert resolved["matrix"]["adjustments"] == [
        {"with": {"lane": "a", "mode": "eager"}, "skip": "why"},
        {"with": {"lane": "b", "mode": "eager"}, "skip": "why"},
        {"with": {"lane": "c", "mode": "eager"}, "skip": "why"},
        {"with": {"lane": "b", "mode": "x"}},
    ]
    plain = {"key": "p", "matrix": {"setup": {"mode": ["a"]}}}
    assert uploader.resolve_lanes(plain, ["a"]) == plain
    with pytest.raises(uploader.PipelineError, match="no lanes"):
        uploader.resolve_lanes(step, [])


@pytest.mark.cpu
def test_depends_on_targets_exist_at_the_same_or_a_lower_level() -> None:
    seen: set[str] = set()
    for level in uploader.LEVEL_ORDER:
        steps = [s for lv, s in level_steps() if lv == level]
        keys = seen | {s["key"] for s in steps}
        for step in steps:
            for dep in uploader._depends_on(step):
                assert dep in keys, f"{step['key']} depends on {dep!r}, which level {level} does not upload"
        seen = keys


@pytest.mark.cpu
def test_hardware_and_source_dependency_groups_resolve_to_existing_things() -> None:
    for _, step in level_steps():
        hws = step.get("mirror_hardwares")
        assert hws, f"{step['key']}: no mirror_hardwares (where would it run?)"
        assert set(hws) <= set(HARDWARE), f"{step['key']}: unknown hardware {set(hws) - set(HARDWARE)}"
        assert set(step.get("source_file_dependencies", [])) <= set(GROUPS), step["key"]
    for name, hw in HARDWARE.items():
        assert isinstance(hw.get("gpus"), int) and hw["agents"].get("queue"), name
    used = {g for _, s in level_steps() for g in s.get("source_file_dependencies", [])}
    assert used == set(GROUPS), f"unused source_file_dependencies groups: {set(GROUPS) - used}"
    for group, paths in GROUPS.items():
        for path in paths:
            target = REPO / path
            ok = target.is_dir() if path.endswith("/") else target.is_file()
            assert ok, f"source_file_dependencies group {group!r}: {path} does not exist"


# ---------------------------------------------------------------------------
# What the commands reference
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_every_path_a_command_names_exists() -> None:
    checked = 0
    for job in all_jobs():
        argv = job.argv
        outputs = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--workdir")}
        for token in argv:
            m = PATH_RE.match(token)
            if not m or token in outputs or any(c in token for c in "*?$"):
                continue
            assert (REPO / m.group(1)).exists(), f"{job.step_key} ({job.label}): {token} does not exist"
            checked += 1
    assert checked >= len(all_jobs()), "path extraction found fewer paths than jobs; is PATH_RE stale?"


@pytest.mark.cpu
def test_lane_arguments_are_pinned_lanes() -> None:
    lanes = {p.stem for p in (REPO / "lanes").glob("*.txt")}
    assert set(LANES) <= lanes
    for job in all_jobs():
        lane = lane_of(job)
        if lane == "all":  # tools/test.sh only: every lane in one job
            assert job.argv[job.argv.index("all") - 1] == "tools/test.sh", job.step_key
        elif lane is not None:
            assert lane in lanes, f"{job.step_key}: lane {lane!r} has no lanes/{lane}.txt"
            if "lane" in job.values:
                assert lane == job.values["lane"], (
                    f"{job.label}: runs lane {lane} in the {job.values['lane']} cell"
                )


_COLLECT_DRIVER = """
import json, sys
import pytest

class Count:
    items = None
    markers = None
    def pytest_configure(self, config):
        self.markers = [line.split(":")[0].strip() for line in config.getini("markers")]
    def pytest_collection_finish(self, session):
        self.items = len(session.items)

out = {"counts": {}}
for expr in json.loads(sys.argv[1]):
    counter = Count()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", expr, "tests"]
    rc = pytest.main(args, plugins=[counter])
    out["counts"][expr] = {"rc": int(rc), "items": counter.items}
    out["markers"] = counter.markers
print("MARKER-COUNTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def collected() -> dict[str, Any]:
    """pytest's registered markers, and per expression its exit code and the number of tests ``-m``
    selects, from ``pytest --collect-only`` in one subprocess (the repo's own pytest configuration)."""
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT_DRIVER, json.dumps(marker_expressions())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MARKER-COUNTS ")]
    assert lines, (
        f"collection driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("MARKER-COUNTS ") :])


@pytest.mark.cpu
def test_marker_expressions_use_only_registered_markers(collected: dict[str, Any]) -> None:
    exprs = marker_expressions()
    assert {"core_model and cpu", "core_model and cuda"} <= set(exprs)
    registered = set(collected["markers"])
    assert {"core_model", "cpu", "cuda"} <= registered
    for expr in exprs:
        assert expr_words(expr) <= registered, f"-m {expr!r}: unregistered {expr_words(expr) - registered}"


@pytest.mark.cpu
@pytest.mark.parametrize("expr", marker_expressions())
def test_marker_expression_selects_collected_tests(expr: str, collected: dict[str, Any]) -> None:
    result = collected["counts"][expr]
    assert result["rc"] == 0, f"pytest --collect-only -m {expr!r} exited {result['rc']} (collection errors?)"
    assert result["items"] and result["items"] > 0, f"-m {expr!r} selects no test"


_MARK_CASES = """
import pytest

def test_unmarked():
    pass

@pytest.mark.cpu
def test_cpu():
    pass

@pytest.mark.cpu
@pytest.mark.cuda
def test_both():
    pass
"""


@pytest.mark.cpu
def test_root_conftest_rejects_tests_without_exactly_one_hardware_mark(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cpu: c\n    cuda: g\n")
    (tmp_path / "test_marks.py").write_text(_MARK_CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    error = out[out.index("every test needs exactly one of the marks cpu, cuda") :]
    assert "test_marks.py::test_unmarked (none)" in error and "test_marks.py::test_both (cpu, cuda)" in error
    assert "test_cpu" not in error


# ---------------------------------------------------------------------------
# Coverage and the e2e contract
# ---------------------------------------------------------------------------


@pytest.mark.cpu
def test_matrix_covers_every_lane_mode_and_level() -> None:
    cells: dict[tuple[str, str, str], list[Job]] = {}
    for job in all_jobs():
        level = level_of(job)
        if level in LEVELS:
            cells.setdefault((level, lane_of(job), mode_of(job)), []).append(job)
    for level, lane, mode in itertools.product(LEVELS, LANES, MODES):
        jobs = cells.get((level, lane, mode))
        assert jobs, f"no job for level {level}, lane {lane}, mode {mode}"
        running = [j for j in jobs if j.skip is None]
        if level == "e2e" or mode == "graphed":
            assert running, f"{level}/{lane}/{mode} is declared but every job of it is skipped"
        else:
            assert running or all(isinstance(j.skip, str) and j.skip for j in jobs), (level, lane, mode)
    for job in all_jobs():
        if level_of(job) == "e2e" and "mode" in job.values:
            assert mode_of(job) == job.values["mode"], f"{job.label}: serves --mode {mode_of(job)}"


@pytest.mark.cpu
def test_the_lane_differential_runs_both_lanes_in_one_job() -> None:
    # tests/vllm_patches/test_lane_differential.py compares the lanes through $MINICPMO_CG_DIFF_DIR,
    # which tools/test.sh shares only between the lanes of one invocation
    jobs = [j for j in all_jobs() if "test_lane_differential" in j.command and j.skip is None]
    assert jobs, "no CI job runs the lane differential"
    assert all(lane_of(j) == "all" for j in jobs)
    assert (REPO / "tests/vllm_patches/test_lane_differential.py").is_file()


@pytest.mark.cpu
def test_levels_run_on_matching_hardware() -> None:
    for job in all_jobs():
        level = level_of(job)
        gpus = [HARDWARE[h]["gpus"] for h in job.hardware]
        if level == "cpu-unit":
            assert gpus == [0], f"{job.step_key}: CPU unit tests belong on the cpu hardware"
        elif level in ("cuda-unit", "e2e"):
            assert gpus and min(gpus) >= 1, f"{job.step_key}: {level} needs a GPU agent"
        elif level == "multi-gpu":
            assert gpus and min(gpus) >= 2, f"{job.step_key}: multi_gpu tests need two GPUs"


@pytest.mark.cpu
def test_e2e_modes_are_the_documented_flags() -> None:
    assert smoke.MODE_ARGS["graphed"] == []
    flags = smoke.MODE_ARGS["eager"]
    assert flags[0] == "--hf-overrides" and json.loads(flags[1]) == {"encoder_cuda_graph": False}
    assert smoke.MODE_ARGS["enforce-eager"] == ["--enforce-eager"]
    served = {mode_of(j) for j in all_jobs() if level_of(j) == "e2e"}
    assert served <= set(smoke.MODE_ARGS), served


@pytest.mark.cpu
def test_e2e_compare_reads_what_the_serve_jobs_write() -> None:
    outputs: dict[tuple[str, str], str] = {}
    serve_keys = set()
    for job in all_jobs():
        if level_of(job) == "e2e" and job.skip is None:
            argv = job.argv
            outputs[(lane_of(job), mode_of(job))] = argv[argv.index("--out") + 1]
            serve_keys.add(job.step_key)
    compares = [j for j in all_jobs() if SERVE_SMOKE in j.argv and "compare" in j.argv]
    compared_lanes = set()
    for job in compares:
        argv = job.argv
        i = argv.index("compare")
        reference, candidate = argv[i + 1], argv[i + 2]
        lane = job.values["lane"]
        assert (reference, candidate) == (outputs[(lane, "eager")], outputs[(lane, "graphed")]), job.label
        assert f"out/e2e/{lane}-*.json" in job.command, f"{job.label}: does not download the recordings"
        compared_lanes.add(lane)
        step = next(s for _, s in level_steps() if s["key"] == job.step_key)
        assert set(uploader._depends_on(step)) & serve_keys, (
            f"{job.step_key} does not wait for the serve jobs"
        )
    assert compared_lanes == set(LANES)
    artifacts = [s.get("artifact_paths", []) for _, s in level_steps() if s["key"] in serve_keys]
    assert all("out/e2e/*.json" in a for a in artifacts), "serve jobs must upload their recordings"


@pytest.mark.cpu
def test_lane_exec_rejects_unknown_lanes_before_doing_anything() -> None:
    script = BK / "scripts" / "lane_exec.sh"
    for path in (BK / "scripts").glob("*.sh"):
        subprocess.run(["bash", "-n", str(path)], check=True)
    proc = subprocess.run(
        ["bash", str(script), "nightly", "true"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and "usage" in proc.stderr


# ---------------------------------------------------------------------------
# The uploader
# ---------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize(
    "env, levels, cpu_only",
    [
        (
            {"BUILDKITE_PULL_REQUEST": "17", "BUILDKITE_PULL_REQUEST_LABELS": "ready,documentation"},
            ["L2"],
            False,
        ),
        ({"BUILDKITE_PULL_REQUEST": "17", "BUILDKITE_PULL_REQUEST_LABELS": "documentation"}, ["L2"], True),
        ({"BUILDKITE_PULL_REQUEST": "false", "BUILDKITE_BRANCH": "main"}, ["L2", "L3"], False),
        (
            {
                "BUILDKITE_PULL_REQUEST": "false",
                "BUILDKITE_BRANCH": "trunk",
                "BUILDKITE_PIPELINE_DEFAULT_BRANCH": "trunk",
            },
            ["L2", "L3"],
            False,
        ),
        ({"BUILDKITE_PULL_REQUEST": "false", "BUILDKITE_BRANCH": "feature"}, ["L2"], False),
        ({"BUILDKITE_SOURCE": "schedule", "BUILDKITE_BRANCH": "main"}, ["L2", "L3", "L4"], False),
        ({"BUILDKITE_PULL_REQUEST": "17", "MINICPMO_CG_CI_LEVEL": "l3"}, ["L2", "L3"], False),
    ],
)
def test_level_selection(env: dict, levels: list[str], cpu_only: bool) -> None:
    assert uploader.select_levels(env) == (levels, cpu_only)


@pytest.mark.cpu
def test_unknown_forced_level_is_an_error() -> None:
    with pytest.raises(uploader.PipelineError):
        uploader.select_levels({"MINICPMO_CG_CI_LEVEL": "L9"})


@pytest.mark.cpu
@pytest.mark.parametrize("level", uploader.LEVEL_ORDER)
def test_uploaded_pipeline_is_plain_buildkite(level: str) -> None:
    pipeline = uploader.build_pipeline({}, None, level)
    expected = [
        s["key"]
        for lv, s in level_steps()
        if uploader.LEVEL_ORDER.index(lv) <= uploader.LEVEL_ORDER.index(level)
    ]
    steps = pipeline["steps"]
    assert [s["key"] for s in steps] == expected
    keys = {s["key"] for s in steps}
    for step in steps:
        assert not set(step) & CUSTOM_ATTRIBUTES, (
            f"{step['key']} still carries {set(step) & CUSTOM_ATTRIBUTES}"
        )
        assert step["agents"]["queue"], step["key"]
        assert set(uploader._depends_on(step)) <= keys
        if "lane" in step.get("matrix", {}).get("setup", {}):
            assert step["matrix"]["setup"]["lane"] == list(LANES), step["key"]
    # round trip through the YAML the agent receives
    assert yaml.safe_load(yaml.safe_dump(pipeline, allow_unicode=True)) == pipeline


@pytest.mark.cpu
def test_pull_request_filter_keeps_only_affected_steps_and_their_dependents() -> None:
    def keys(changed):
        return [s["key"] for s in uploader.build_pipeline({}, changed, "L3")["steps"]]

    assert keys(["README.md"]) == []
    assert keys([SERVE_SMOKE]) == ["e2e-thinker-engine", "e2e-serve", "e2e-compare"]
    assert "e2e-thinker-engine" in keys(["minicpmo_cg/thinker_engine.py"])
    assert keys(["tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py"]) == [
        "e2e-thinker-engine",
        "e2e-serve",
        "e2e-compare",
    ]
    assert keys(["vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/adapter.py"]) == [
        "cpu-unit",
        "cuda-unit",
        "e2e-thinker-engine",
        "e2e-serve",
        "e2e-compare",
    ]
    assert keys(["lanes/legacy.txt"]) == [
        "cpu-unit",
        "lane-differential",
        "cuda-unit",
        "e2e-thinker-engine",
        "e2e-serve",
        "e2e-compare",
    ]
    assert keys(["patches/vllm/series"]) == [
        "cpu-unit",
        "lane-differential",
        "cuda-unit",
        "e2e-thinker-engine",
        "e2e-serve",
        "e2e-compare",
    ]
    # "tests/e2e" is a directory prefix, not a string prefix
    assert keys(["tests/e2e_old/notes.txt"]) == []


@pytest.mark.cpu
def test_unlabelled_pull_request_gets_cpu_steps_only() -> None:
    env = {"BUILDKITE_PULL_REQUEST": "3", "BUILDKITE_PULL_REQUEST_LABELS": ""}
    steps = uploader.build_pipeline(
        env, ["vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/adapter.py"]
    )["steps"]
    assert [s["key"] for s in steps] == ["cpu-unit"]
    assert steps[0]["agents"] == HARDWARE["cpu"]["agents"]
    steps = uploader.build_pipeline(env, ["patches/vllm/series"])["steps"]
    assert [s["key"] for s in steps] == ["cpu-unit", "lane-differential"]


@pytest.mark.cpu
def test_mirroring_dropping_and_unknown_names() -> None:
    hardware = {
        "cpu": {"gpus": 0, "agents": {"queue": "c"}},
        "a_1": {"gpus": 1, "agents": {"queue": "a"}},
        "b_1": {"gpus": 1, "agents": {"queue": "b"}},
    }
    groups = {"x": ["x/"], "y": ["y.py"]}
    doc = {
        "steps": [
            {
                "key": "build",
                "label": "build",
                "command": "true",
                "mirror_hardwares": ["a_1", "b_1"],
                "source_file_dependencies": ["x"],
            },
            {
                "key": "check",
                "label": "check",
                "command": "true",
                "mirror_hardwares": ["cpu"],
                "depends_on": [{"step": "build", "allow_failure": True}],
                "source_file_dependencies": ["x", "y"],
            },
            {"key": "always", "label": "always", "command": "true", "mirror_hardwares": ["cpu"]},
        ]
    }
    steps, _ = uploader.build_steps([doc], hardware, groups, None)
    assert [s["key"] for s in steps] == ["build-a-1", "build-b-1", "check", "always"]
    assert [s["agents"]["queue"] for s in steps] == ["a", "b", "c", "c"]
    assert steps[2]["depends_on"] == [
        {"step": "build-a-1", "allow_failure": True},
        {"step": "build-b-1", "allow_failure": True},
    ]
    # only y.py changed: build is dropped, so check (which needs it) is dropped as well
    steps, messages = uploader.build_steps([doc], hardware, groups, ["y.py"])
    assert [s["key"] for s in steps] == ["always"]
    assert any("check: depends on a dropped step" in m for m in messages)
    with pytest.raises(uploader.PipelineError, match="mirror_hardwares"):
        uploader.build_steps(
            [{"steps": [{**doc["steps"][2], "mirror_hardwares": ["tpu_8"]}]}], hardware, groups, None
        )
    with pytest.raises(uploader.PipelineError, match="source_file_dependencies"):
        uploader.build_steps(
            [{"steps": [{**doc["steps"][2], "source_file_dependencies": ["z"]}]}], hardware, groups, []
        )
