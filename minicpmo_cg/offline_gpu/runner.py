"""``run``: the CUDA tests, the demo and the benchmark of one lane against its bundle, on the GPU host."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minicpmo_cg.offline_gpu import hostenv

#: Markers of the tests part: the CUDA tests, the two-GPU tests and the CPU tests of the model.
DEFAULT_MARKERS = "cuda or multi_gpu or core_model"
DEFAULT_BUDGET_S = 540
#: A part is skipped when less than this is left of the budget (and its limit is larger).
MIN_PART_S = 20
KILL_GRACE_S = 10
TAIL_LINES = 25
#: The benchmark prints its results table after this marker; the run log shows all of it.
RESULTS_MARKER = "=== RESULTS"


@dataclass(frozen=True)
class PartSpec:
    """One part: its default time limit and its command after the interpreter."""

    timeout_s: int
    argv: str
    quick: bool

    def words(self) -> list[str]:
        return shlex.split(self.argv)


#: The parts, in their default order. ``tests/patches`` is left out: it tests the patch tool on a
#: pip-installed vLLM, while a bundle is patched already and sits on PYTHONPATH (CPU CI runs it).
PARTS: dict[str, PartSpec] = {
    "tests": PartSpec(
        240,
        "-m pytest tests -m {markers} -p no:cacheprovider -q -rs --junitxml={out}/junit-{lane}.xml"
        " --ignore=tests/patches --ignore=tests/e2e",
        quick=False,
    ),
    "demo": PartSpec(150, "-m minicpmo_cg.demo --json {out}/demo-{lane}.json", quick=True),
    "bench": PartSpec(300, "-m minicpmo_cg.bench --json {out}/bench-{lane}.json", quick=True),
    # vLLM's engine on a checkpoint the tests build (reduced size; MINICPMO_CG_E2E_CHECKPOINT names another)
    "e2e": PartSpec(
        540,
        "-m pytest tests/e2e/offline_inference -m cuda -p no:cacheprovider -q -rs --junitxml={out}/junit-e2e-{lane}.xml",
        quick=False,
    ),
}
#: what ``run`` does without a part named
DEFAULT_PARTS = ("tests", "demo", "bench")


def _names_tests(word: str) -> bool:
    """Whether an argument of the tests part names test files: ``tests`` or a path under it
    (a node id such as ``tests/x/test_y.py::test_z`` too)."""
    return word == "tests" or word.startswith("tests/")


@dataclass
class RunPlan:
    """What ``run`` does for one lane (also what ``check`` and ``run --dry-run`` print)."""

    lane: str
    parts: list[str]
    python: str
    out: Path
    budget_s: int = DEFAULT_BUDGET_S
    quick: bool = False
    markers: str = DEFAULT_MARKERS
    extra: dict[str, list[str]] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)

    def command(self, part: str) -> list[str]:
        spec = PARTS[part]
        fill = {"out": str(self.out), "lane": self.lane, "markers": self.markers}
        argv = [self.python, *(word.format(**fill) for word in spec.words())]
        extra = self.extra.get(part, [])
        if part == "tests" and any(_names_tests(word) for word in extra):
            argv.remove("tests")  # the given test paths replace the whole suite
        return argv + (["--quick"] if self.quick and spec.quick else []) + extra

    def timeout(self, part: str) -> int:
        return self.timeouts.get(part, PARTS[part].timeout_s)

    def files(self) -> list[str]:
        """Names of the files a full run writes into :attr:`out`."""
        names = [f"run-{self.lane}.log", f"run-{self.lane}.json"]
        for part in self.parts:
            results = [w.split("{out}/", 1)[1] for w in PARTS[part].words() if "{out}/" in w]
            names += [f"{part}-{self.lane}.log", *(name.format(lane=self.lane) for name in results)]
        return names


def part_time_limit(plan: RunPlan, part: str, left_s: float) -> int | None:
    """Seconds ``part`` may run with ``left_s`` left of the budget; None = skip it (too little left)."""
    limit = plan.timeout(part)
    if left_s < min(MIN_PART_S, limit):
        return None
    return int(min(limit, left_s))


def describe(plan: RunPlan, site: Path, env: dict[str, str], bundle_line: str) -> str:
    """The plan as text: install step, exports, one command line per part, the files written."""
    lines = [
        f"# offline GPU run: lane {plan.lane}, parts {' '.join(plan.parts)}, budget {plan.budget_s} s",
        f"# {bundle_line}",
        f"install: unpack the lane's site.tar.xz into {site}",
        *(f"export {key}={shlex.quote(value)}" for key, value in env.items()),
    ]
    for part in plan.parts:
        limit = min(plan.timeout(part), plan.budget_s)
        lines.append(
            f"[{part}] time limit {limit} s: {shlex.join(plan.command(part))} > {plan.out}/{part}-{plan.lane}.log"
        )
    lines.append(f"# files in {plan.out}: {' '.join(plan.files())}")
    return "\n".join(lines)


@dataclass
class PartResult:
    """Outcome of one part: ``status`` is ok / failed / timeout / skipped."""

    name: str
    status: str
    returncode: int | None
    seconds: float
    time_limit_s: int | None
    command: list[str]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_limited(
    argv: list[str], log: Path, env: dict[str, str], cwd: Path, limit_s: int
) -> tuple[int | None, bool]:
    """Run ``argv`` as a new process group with output to ``log``; kill the group after ``limit_s``."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def log_excerpt(log: Path, lines: int = TAIL_LINES) -> str:
    """The benchmark's whole results table when the log has one, else the last ``lines`` lines."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for i, line in enumerate(text):
        if line.startswith(RESULTS_MARKER):
            return "\n".join(text[i:])
    return "\n".join(text[-lines:])


def summary_table(plan: RunPlan, results: list[PartResult], total_s: float) -> str:
    rows = [f"SUMMARY {plan.lane} (total {total_s:.0f} s of budget {plan.budget_s} s):"]
    rows.append(f"  {'part':6s} {'status':18s} {'seconds':>7s}  log")
    for r in results:
        status = (
            "ok"
            if r.ok
            else f"{r.status.upper()}" + (f" (exit {r.returncode})" if r.status == "failed" else "")
        )
        rows.append(f"  {r.name:6s} {status:18s} {r.seconds:7.0f}  {plan.out}/{r.name}-{plan.lane}.log")
    return "\n".join(rows)


def write_summary_json(plan: RunPlan, results: list[PartResult], facts: dict) -> Path:
    path = plan.out / f"run-{plan.lane}.json"
    doc = {
        "lane": plan.lane,
        "ok": all(r.ok for r in results),
        "budget_s": plan.budget_s,
        "quick": plan.quick,
        "parts": [asdict(r) for r in results],
        **facts,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


class Console:
    """Prints to stdout and appends the same text to the run log."""

    def __init__(self, log: Path) -> None:
        self._log = open(log, "a")  # noqa: SIM115 - closed by close()

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self._log.write(text + "\n")
        self._log.flush()

    def close(self) -> None:
        self._log.close()


def _capture(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: int) -> str:
    """Output of a short informational command (or why it did not run)."""
    try:
        proc = subprocess.run(
            argv, check=False, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
        )
    except FileNotFoundError:
        return f"{argv[0]}: not found"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    return (proc.stdout + proc.stderr).rstrip("\n")


def report_host(say: Console, plan: RunPlan, env: dict[str, str], site: Path, repo: Path) -> None:
    """Device (nvidia-smi queries), versions and vLLM platform (:mod:`.probe`), patch status."""
    say("--- device")
    query = (
        "index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw"
    )
    smi = _capture(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], env, repo, 60)
    say("  " + smi.replace("\n", "\n  "))
    say("--- software")
    probe = _capture([plan.python, "-m", "minicpmo_cg.offline_gpu.probe"], env, repo, 180)
    noise = ("INFO ", "WARNING ", "DEBUG ")
    say("\n".join(f"  {line}" for line in probe.splitlines() if not line.startswith(noise)))
    say("--- patch status")
    status = _capture(
        [plan.python, "-m", "minicpmo_cg.patchtool", "status", "--site-packages", str(site)], env, repo, 60
    )
    say("\n".join(f"  {line}" for line in status.splitlines()[:20]))


def run_parts(
    say: Console, plan: RunPlan, env: dict[str, str], repo: Path, started: float
) -> list[PartResult]:
    """Run every part of the plan in order within the budget counted from ``started``."""
    results = []
    for part in plan.parts:
        argv, log = plan.command(part), plan.out / f"{part}-{plan.lane}.log"
        left = plan.budget_s - (time.monotonic() - started)
        limit = part_time_limit(plan, part, left)
        say("=" * 100)
        say(f"[{part}] {shlex.join(argv)}   (time limit {limit} s, log {log})")
        if limit is None:
            say(f"[{part}] SKIPPED: only {left:.0f} s of the {plan.budget_s} s budget left")
            results.append(PartResult(part, "skipped", None, 0.0, None, argv))
            continue
        t0 = time.monotonic()
        rc, timed_out = run_limited(argv, log, env, repo, limit)
        status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        results.append(PartResult(part, status, rc, round(time.monotonic() - t0, 1), limit, argv))
        say(log_excerpt(log))
        say(f"[{part}] {status} (exit {rc}) in {results[-1].seconds:.0f} s")
    return results


def execute(plan: RunPlan, lane_dir: Path, site: Path, repo: Path) -> int:
    """Install the bundle, report the host, run the parts, write the summary."""
    started = time.monotonic()
    plan.out.mkdir(parents=True, exist_ok=True)
    say = Console(plan.out / f"run-{plan.lane}.log")
    try:
        say("=" * 100)
        say(
            f"offline GPU run, lane {plan.lane}: parts {' '.join(plan.parts)} | budget {plan.budget_s} s | out {plan.out}"
        )
        installed = hostenv.install(lane_dir, site, repo, plan.python)
        say(installed.message)
        manifest = {k: v for k, v in installed.status.manifest.items() if k != "strip"}
        facts = {"bundle": installed.status.message, "manifest": manifest, "site": str(site)}
        if installed.code:
            say(f"SUMMARY {plan.lane}: install FAILED; parts not run: {' '.join(plan.parts)}")
            write_summary_json(plan, [], {**facts, "install_failed": True})
            return installed.code
        env = {**os.environ, **hostenv.environment(site, repo)}
        report_host(say, plan, env, site, repo)
        results = run_parts(say, plan, env, repo, started)
        say("=" * 100)
        say(summary_table(plan, results, time.monotonic() - started))
        write_summary_json(plan, results, facts)
        say(f"  files: {' '.join(sorted(p.name for p in plan.out.iterdir()))}")
        return 0 if all(r.ok for r in results) else 1
    finally:
        say.close()
