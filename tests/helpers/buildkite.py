# SPDX-License-Identifier: Apache-2.0
"""Reading the Buildkite pipelines under ``.buildkite/`` as Buildkite would: the level files with
their lanes filled in by the uploader, matrices expanded into jobs, and what each job runs
(lane, level, mode, marker expression)."""

from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
BK = REPO / ".buildkite"
SERVE_SMOKE = "tests/helpers/serve_smoke.py"
MODES = ("eager", "graphed")
LEVELS = ("cpu-unit", "cuda-unit", "e2e")

# Buildkite command-step attributes (https://buildkite.com/docs/pipelines/configure/step-types/command-step)
# plus the two vllm-omni-style keys that upload_pipeline.py consumes.
COMMAND_STEP_ATTRIBUTES = {
    "label",
    "key",
    "command",
    "commands",
    "agents",
    "env",
    "timeout_in_minutes",
    "matrix",
    "depends_on",
    "artifact_paths",
    "retry",
    "soft_fail",
    "skip",
    "if",
    "plugins",
    "priority",
    "parallelism",
    "concurrency",
    "concurrency_group",
    "allow_dependency_failure",
    "branches",
    "cancel_on_build_failing",
    "notify",
    "signature",
}
CUSTOM_ATTRIBUTES = {"mirror_hardwares", "source_file_dependencies"}
KEY_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
PLACEHOLDER_RE = re.compile(r"\{\{\s*matrix\.([A-Za-z0-9_]+)\s*\}\}")
# repo-relative paths a command may name (outputs under out/ are written, not read)
PATH_RE = re.compile(
    r"^(?:\./)?((?:tools|tests|\.buildkite|patches|lanes|vllm_omni|minicpmo_cg|docs)/[\w./-]*)$"
)
LANE_SCRIPTS = ("tools/test.sh", ".buildkite/scripts/lane_exec.sh", "tools/demo.sh")


def _load_script(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


uploader = _load_script("minicpmo_cg_bk_upload_pipeline", BK / "scripts" / "upload_pipeline.py")
#: the lanes, as the uploader fills them into the level files (the names of lanes/*.txt)
LANES = tuple(uploader.lane_names())


# ---------------------------------------------------------------------------
# Loading and matrix expansion
# ---------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for pattern in ("*.yml", "*.yaml") for p in BK.rglob(pattern))


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def raw_level_steps() -> list[tuple[str, dict]]:
    """(level id, step) of every level file as written, in upload order."""
    return [(lv, s) for lv in uploader.LEVEL_ORDER for s in load(BK / uploader.LEVEL_FILES[lv])["steps"]]


def level_steps() -> list[tuple[str, dict]]:
    """(level id, step) of every level file with the lanes filled in, in upload order."""
    return [(lv, uploader.resolve_lanes(s, LANES)) for lv, s in raw_level_steps()]


def all_steps() -> list[dict]:
    return load(BK / "pipeline.yml")["steps"] + [s for _, s in level_steps()]


HARDWARE = load(BK / uploader.HARDWARE_FILE)
GROUPS = load(BK / uploader.DEPENDENCY_FILE)


@dataclass
class Job:
    step_key: str
    label: str
    command: str
    values: dict[str, str]
    hardware: list[str]
    skip: Any = None  # None: runs; else the adjustment's skip value

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command.replace(";", " ; "))


def _interpolate(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], text)


def expand(step: dict) -> list[Job]:
    """The jobs Buildkite makes of a step: its matrix product, adjusted (skip / added combinations)."""
    command = step.get("command") or "\n".join(step.get("commands", []))
    hardware = list(step.get("mirror_hardwares") or [])
    matrix = step.get("matrix")
    if matrix is None:
        return [Job(step["key"], step["label"], command, {}, hardware)]
    setup = matrix["setup"]
    dims = list(setup)
    combos = [dict(zip(dims, vals)) for vals in itertools.product(*(setup[d] for d in dims))]
    skips: dict[tuple, Any] = {}
    for adj in matrix.get("adjustments", []):
        combo = {k: str(v) for k, v in adj["with"].items()}
        if combo not in combos:
            combos.append(combo)
        if "skip" in adj:
            skips[tuple(sorted(combo.items()))] = adj["skip"]
    return [
        Job(
            step["key"],
            _interpolate(step["label"], c),
            _interpolate(command, c),
            c,
            hardware,
            skips.get(tuple(sorted(c.items()))),
        )
        for c in combos
    ]


def all_jobs() -> list[Job]:
    return [job for _, step in level_steps() for job in expand(step)]


def marker_expr(job: Job) -> str | None:
    argv = job.argv
    return argv[argv.index("-m") + 1] if "-m" in argv else None


def expr_words(expr: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)) - {"and", "or", "not"}


def lane_of(job: Job) -> str | None:
    argv = job.argv
    for script in LANE_SCRIPTS:
        if script in argv:
            return argv[argv.index(script) + 1]
    return None


def level_of(job: Job) -> str | None:
    argv = job.argv
    if SERVE_SMOKE in argv and "run" in argv:
        return "e2e"
    expr = marker_expr(job)
    if expr is None:
        return None
    words = expr_words(expr)
    if "multi_gpu" in words:
        return "multi-gpu"
    return "cuda-unit" if "cuda" in words else "cpu-unit" if "cpu" in words else None


def mode_of(job: Job) -> str | None:
    argv = job.argv
    if "--mode" in argv:
        return argv[argv.index("--mode") + 1]
    return job.values.get("mode")


def marker_expressions() -> list[str]:
    return sorted({e for job in all_jobs() if (e := marker_expr(job)) is not None})
