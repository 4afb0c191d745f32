#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Select this build's CI levels and turn the level files into a plain Buildkite pipeline.

The level files (``.buildkite/cuda/test-*.yml``) are Buildkite YAML plus two keys in
vllm-omni's style that Buildkite does not know, handled here:

- ``mirror_hardwares: [key, ...]``: replaced by the ``agents:`` of each key in
  ``common/ci_mirror_hardwares.yml``; with several keys the step is mirrored, one copy per
  key (key and label suffixed), and ``depends_on`` references are rewritten to all copies.
- ``source_file_dependencies: [group, ...]``: on pull-request builds a step is dropped when no
  changed file lies under a path of its groups (``common/ci_source_file_dependencies.yml``);
  a step that depends on a dropped step is dropped too. Other builds run every step.

One value is filled in: a matrix dimension ``lane: lanes/*.txt`` becomes the lane names (the
file names of ``lanes/*.txt``, sorted), and a matrix adjustment that names no lane is repeated
for every lane, so the level files never list the lanes themselves.

Levels (cumulative): L2 ``test-ready`` (pull request labelled ``ready``; without the label
only its CPU steps), L3 ``test-merge`` (builds of the default branch), L4 ``test-nightly``
(scheduled builds). ``MINICPMO_CG_CI_LEVEL=L2|L3|L4`` forces a level.

Usage::

    upload_pipeline.py [--upload] [--level L2|L3|L4] [--changed-files FILE ...]

prints the pipeline YAML (or pipes it to ``buildkite-agent pipeline upload`` with ``--upload``).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

BUILDKITE = Path(__file__).resolve().parents[1]
REPO = BUILDKITE.parent
LEVEL_FILES = {"L2": "cuda/test-ready.yml", "L3": "cuda/test-merge.yml", "L4": "cuda/test-nightly.yml"}
LEVEL_ORDER = ("L2", "L3", "L4")
HARDWARE_FILE = "common/ci_mirror_hardwares.yml"
DEPENDENCY_FILE = "common/ci_source_file_dependencies.yml"
#: the value of a ``lane`` matrix dimension that stands for every lane
LANES_GLOB = "lanes/*.txt"
READY_LABEL = "ready"


class PipelineError(Exception):
    """A level file refers to an unknown hardware or dependency group, or is malformed."""


def load_yaml(relpath: str) -> Any:
    with open(BUILDKITE / relpath, encoding="utf-8") as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------------------
# Build context
# ---------------------------------------------------------------------------


def select_levels(env: Mapping[str, str]) -> tuple[list[str], bool]:
    """The level files to upload for this build and whether only CPU steps run.

    Returns:
        (levels in upload order, cpu_only)
    """
    forced = env.get("MINICPMO_CG_CI_LEVEL", "").strip().upper()
    if forced:
        if forced not in LEVEL_ORDER:
            raise PipelineError(f"MINICPMO_CG_CI_LEVEL={forced!r} is not one of {', '.join(LEVEL_ORDER)}")
        return list(LEVEL_ORDER[: LEVEL_ORDER.index(forced) + 1]), False
    if env.get("BUILDKITE_SOURCE") == "schedule":
        return list(LEVEL_ORDER), False
    pull_request = env.get("BUILDKITE_PULL_REQUEST", "false")
    if pull_request not in ("", "false"):
        labels = {label.strip() for label in env.get("BUILDKITE_PULL_REQUEST_LABELS", "").split(",")}
        return ["L2"], READY_LABEL not in labels
    default_branch = env.get("BUILDKITE_PIPELINE_DEFAULT_BRANCH", "main")
    if env.get("BUILDKITE_BRANCH") == default_branch:
        return ["L2", "L3"], False
    return ["L2"], False


def changed_files(env: Mapping[str, str]) -> list[str] | None:
    """Files a pull request changes against its base branch; None = not a PR or unknown (run all)."""
    if env.get("BUILDKITE_PULL_REQUEST", "false") in ("", "false"):
        return None
    base = env.get("BUILDKITE_PULL_REQUEST_BASE_BRANCH") or env.get(
        "BUILDKITE_PIPELINE_DEFAULT_BRANCH", "main"
    )

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    try:
        subprocess.run(
            ["git", "fetch", "--quiet", "origin", base], cwd=REPO, capture_output=True, check=False
        )
        merge_base = git("merge-base", "HEAD", f"origin/{base}").strip()
        return [line for line in git("diff", "--name-only", merge_base, "HEAD").splitlines() if line]
    except (OSError, subprocess.CalledProcessError) as exc:
        print(
            f"upload_pipeline: cannot diff against origin/{base} ({exc}); running every step", file=sys.stderr
        )
        return None


# ---------------------------------------------------------------------------
# Transformation
# ---------------------------------------------------------------------------


def lane_names() -> list[str]:
    """The lanes, by the file names of ``lanes/*.txt`` (sorted: ``current`` before ``legacy``)."""
    return sorted(p.stem for p in REPO.glob(LANES_GLOB))


def resolve_lanes(step: Mapping[str, Any], lanes: Sequence[str]) -> dict[str, Any]:
    """``step`` with a ``lane: lanes/*.txt`` matrix dimension replaced by ``lanes``.

    An adjustment without a ``lane`` applies to every lane: it is repeated once per lane (Buildkite
    needs every dimension in an adjustment). Other steps are returned unchanged (as a copy).

    Raises:
        PipelineError: the step needs the lanes but there are none.
    """
    step = copy.deepcopy(dict(step))
    matrix = step.get("matrix")
    if not isinstance(matrix, dict) or matrix.get("setup", {}).get("lane") != LANES_GLOB:
        return step
    if not lanes:
        raise PipelineError(f"step {step.get('key')!r}: no lanes in {LANES_GLOB}")
    matrix["setup"]["lane"] = list(lanes)
    if "adjustments" in matrix:
        adjustments = []
        for adj in matrix["adjustments"]:
            if "lane" in adj["with"]:
                adjustments.append(adj)
            else:
                adjustments += [{**adj, "with": {"lane": lane, **adj["with"]}} for lane in lanes]
        matrix["adjustments"] = adjustments
    return step


def _depends_on(step: Mapping[str, Any]) -> list[str]:
    deps = step.get("depends_on") or []
    if isinstance(deps, (str, dict)):
        deps = [deps]
    return [d if isinstance(d, str) else d["step"] for d in deps]


def _rewrite_depends_on(step: dict[str, Any], copies: Mapping[str, list[str]]) -> None:
    deps = step.get("depends_on")
    if deps is None:
        return
    entries = deps if isinstance(deps, list) else [deps]
    out: list[Any] = []
    for entry in entries:
        key = entry if isinstance(entry, str) else entry["step"]
        for new_key in copies.get(key, [key]):
            out.append(new_key if isinstance(entry, str) else {**entry, "step": new_key})
    step["depends_on"] = out


def step_paths(step: Mapping[str, Any], groups: Mapping[str, Sequence[str]]) -> list[str] | None:
    """Path prefixes a step depends on; None when it declares none (always runs)."""
    names = step.get("source_file_dependencies")
    if names is None:
        return None
    unknown = [n for n in names if n not in groups]
    if unknown:
        raise PipelineError(
            f"step {step.get('key')!r}: unknown source_file_dependencies {unknown} ({DEPENDENCY_FILE})"
        )
    return [path for n in names for path in groups[n]]


def touches(paths: Sequence[str], changed: Sequence[str]) -> bool:
    return any(f == p or (p.endswith("/") and f.startswith(p)) for f in changed for p in paths)


def _drop_reason(
    step: Mapping[str, Any],
    hardware: Mapping[str, Mapping[str, Any]],
    groups: Mapping[str, Sequence[str]],
    changed: Sequence[str] | None,
    cpu_only: bool,
) -> str | None:
    """Why this build does not run ``step`` (None: it runs); raises on unknown names."""
    key = step.get("key")
    if not key:
        raise PipelineError(f"step without a key: {step.get('label')!r}")
    hws = step.get("mirror_hardwares") or []
    unknown = [h for h in hws if h not in hardware]
    if unknown:
        raise PipelineError(f"step {key!r}: unknown mirror_hardwares {unknown} ({HARDWARE_FILE})")
    paths = step_paths(step, groups)
    if cpu_only and any(hardware[h].get("gpus", 0) for h in hws):
        return "needs a GPU (add the `ready` label to run GPU steps)"
    if changed is not None and paths is not None and not touches(paths, changed):
        return "no change under its source_file_dependencies"
    return None


def _mirror(kept: list[dict[str, Any]], hardware: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Resolve ``mirror_hardwares`` into ``agents`` (one copy per hardware when there are several)."""
    copies: dict[str, list[str]] = {}
    out: list[dict[str, Any]] = []
    for step in kept:
        hws = step.pop("mirror_hardwares", None) or []
        step.pop("source_file_dependencies", None)
        if len(hws) <= 1:
            if hws:
                step["agents"] = {**hardware[hws[0]]["agents"], **(step.get("agents") or {})}
            out.append(step)
            continue
        copies[step["key"]] = []
        for hw in hws:
            mirrored = copy.deepcopy(step)
            mirrored["key"] = f"{step['key']}-{hw.replace('_', '-')}"
            mirrored["label"] = f"{step.get('label', step['key'])} · {hw}"
            mirrored["agents"] = {**hardware[hw]["agents"], **(step.get("agents") or {})}
            copies[step["key"]].append(mirrored["key"])
            out.append(mirrored)
    for step in out:
        _rewrite_depends_on(step, copies)
    return out


def build_steps(
    level_docs: Sequence[Mapping[str, Any]],
    hardware: Mapping[str, Mapping[str, Any]],
    groups: Mapping[str, Sequence[str]],
    changed: Sequence[str] | None,
    cpu_only: bool = False,
    lanes: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Plain Buildkite steps from the level documents, and the messages about dropped steps.

    ``lanes`` defaults to :func:`lane_names`.
    """
    lanes = lane_names() if lanes is None else lanes
    steps = [resolve_lanes(s, lanes) for doc in level_docs for s in (doc or {}).get("steps", [])]
    dropped: dict[str, str] = {}
    kept: list[dict[str, Any]] = []
    for step in steps:
        reason = _drop_reason(step, hardware, groups, changed, cpu_only)
        if reason is None:
            kept.append(step)
        else:
            dropped[step["key"]] = reason
    # a step whose dependency was dropped cannot run either (repeat until stable)
    while True:
        newly = [s for s in kept if any(d in dropped for d in _depends_on(s))]
        if not newly:
            break
        for s in newly:
            dropped[s["key"]] = "depends on a dropped step"
        kept = [s for s in kept if s["key"] not in dropped]
    messages = [f"skipped {key}: {why}" for key, why in dropped.items()]
    return _mirror(kept, hardware), messages


def build_pipeline(
    env: Mapping[str, str], changed: Sequence[str] | None = None, level: str | None = None
) -> dict:
    if level:
        env = {**env, "MINICPMO_CG_CI_LEVEL": level}
    levels, cpu_only = select_levels(env)
    docs = [load_yaml(LEVEL_FILES[lv]) for lv in levels]
    steps, messages = build_steps(
        docs, load_yaml(HARDWARE_FILE), load_yaml(DEPENDENCY_FILE), changed, cpu_only
    )
    for message in messages:
        print(f"upload_pipeline: {message}", file=sys.stderr)
    print(
        f"upload_pipeline: levels {', '.join(levels)}{' (CPU steps only)' if cpu_only else ''}: "
        f"{len(steps)} step(s)",
        file=sys.stderr,
    )
    return {"steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--upload", action="store_true", help="pipe the result to `buildkite-agent pipeline upload`"
    )
    parser.add_argument("--level", choices=LEVEL_ORDER, help="force a level (default: from the build's env)")
    parser.add_argument(
        "--changed-files", nargs="*", help="pretend these files changed (default: git diff on PRs)"
    )
    args = parser.parse_args(argv)
    env = dict(os.environ)
    changed = args.changed_files if args.changed_files is not None else changed_files(env)
    try:
        pipeline = build_pipeline(env, changed, args.level)
    except PipelineError as exc:
        print(f"upload_pipeline: {exc}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(pipeline, sort_keys=False, allow_unicode=True, width=1000)
    if not args.upload:
        sys.stdout.write(text)
        return 0
    if not pipeline["steps"]:
        print("upload_pipeline: nothing to upload", file=sys.stderr)
        return 0
    return subprocess.run(
        ["buildkite-agent", "pipeline", "upload"], input=text, text=True, check=False
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
