"""Command line of the offline GPU runner: ``python -m minicpmo_cg.offline_gpu {bundle,check,env,run}``.

Also installed as ``minicpmo-cg-offline-gpu``. On the GPU host the project is not installed:
run it from the checkout's root with the host's ``python3``. See ``docs/offline_gpu_host.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from minicpmo_cg.lanes import get_lane
from minicpmo_cg.offline_gpu import build, hostenv, payload, runner, stackrun


def checkout_root() -> Path:
    """The source checkout: the one holding this package, else the working directory.

    Everything the runner does needs a checkout (patches, adapter, tests); on the GPU host it
    runs from one without being installed.
    """
    here = Path(__file__).resolve().parents[2]
    return here if (here / "patches").is_dir() and (here / "tests").is_dir() else Path.cwd().resolve()


REPO = checkout_root()
PROG = "python -m minicpmo_cg.offline_gpu"
EXIT_USAGE = 2
DESCRIPTION = (
    "Run this project's CUDA tests, demo and benchmark on an offline GPU host (no vLLM, no network)."
)


def _lane(name: str):
    try:
        return get_lane(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _part_timeout(text: str) -> tuple[str, int]:
    part, sep, seconds = text.partition("=")
    if not sep or part not in runner.PARTS or not seconds.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected PART=SECONDS with PART in {', '.join(runner.PARTS)}, got {text!r}"
        )
    return part, int(seconds)


def _add_bundle_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle-dir",
        type=Path,
        default=REPO / ".gpubundle",
        help="bundles, one folder per lane (default: %(default)s)",
    )


def _add_lane(p: argparse.ArgumentParser) -> None:
    p.add_argument("lane", type=_lane, help="lane name (a lanes/<lane>.txt)")


def _add_seconds(p: argparse.ArgumentParser, flag: str, default: int, what: str) -> None:
    p.add_argument(flag, type=int, default=default, metavar="S", help=f"{what} (default: %(default)s)")


def _add_site(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--site", type=Path, help="where the bundle is unpacked (default: <tmp>/minicpmo-cg-site-LANE)"
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    _add_lane(p)
    p.add_argument(
        "parts", nargs="*", metavar="PART", help=f"{', '.join(runner.PARTS)} (default: all, in this order)"
    )
    p.add_argument("--quick", action="store_true", help="pass --quick to the demo and the benchmark")
    _add_seconds(p, "--budget", runner.DEFAULT_BUDGET_S, "seconds for the whole run")
    p.add_argument("--out", type=Path, help="output folder (default: out/gpu-LANE in the checkout)")
    p.add_argument(
        "--markers",
        default=runner.DEFAULT_MARKERS,
        help="pytest marker expression of the tests part (default: %(default)r)",
    )
    for part in runner.PARTS:
        p.add_argument(
            f"--{part}-args",
            default="",
            metavar="ARGS",
            help=f"extra arguments of the {part} part (one shell-quoted string)",
        )
    p.add_argument(
        "--timeout",
        type=_part_timeout,
        action="append",
        default=[],
        metavar="PART=S",
        help="time limit of one part",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter of the parts (default: this one)")
    _add_bundle_dir(p)
    _add_site(p)


def _bundle_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("lanes", nargs="+", type=_lane, metavar="LANE")
    p.add_argument(
        "--out", type=Path, default=REPO / ".gpubundle", help="bundle directory (default: %(default)s)"
    )
    p.add_argument(
        "--cache", type=Path, default=build.default_cache(), help="download cache (default: %(default)s)"
    )
    p.add_argument("--unpatched", action="store_true", help="skip the patch series (development only)")
    verify = p.add_mutually_exclusive_group()
    verify.add_argument(
        "--verify",
        dest="verify",
        action="store_const",
        const="yes",
        default="auto",
        help="import check; create the host-like environment if missing (default: check if it exists)",
    )
    verify.add_argument(
        "--no-verify", dest="verify", action="store_const", const="no", help="no import check"
    )
    p.add_argument(
        "--host-python", help="Python 3.12 to create the host-like environment with (default: python3.12)"
    )


def _check_parser(p: argparse.ArgumentParser) -> None:
    _add_run_options(p)
    p.add_argument("--max-mib", type=float, help="also fail when all bundles together are larger than this")


def _env_parser(p: argparse.ArgumentParser) -> None:
    _add_lane(p)
    _add_bundle_dir(p)
    _add_site(p)


def _run_parser(p: argparse.ArgumentParser) -> None:
    _add_run_options(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing, write nothing")


def _stack_parser(p: argparse.ArgumentParser) -> None:
    _add_lane(p)
    p.add_argument(
        "--export",
        type=Path,
        required=True,
        metavar="DIR",
        help="the export (`minicpmo-cg-patch export --out DIR`) whose PRs get overlays",
    )
    p.add_argument(
        "--site-packages", type=Path, metavar="DIR", help="the lane's site-packages (vLLM's pristine files)"
    )
    _add_bundle_dir(p)


def _stack_run_parser(p: argparse.ArgumentParser) -> None:
    _add_lane(p)
    p.add_argument(
        "prs",
        nargs="*",
        metavar="PR",
        help="PR folders, numbers (01) or keys (siglip-attention); default: all",
    )
    p.add_argument("--out", type=Path, help="output folder (default: out/gpu-stack-LANE in the checkout)")
    _add_seconds(p, "--budget", stackrun.DEFAULT_BUDGET_S, "seconds for the whole run")
    _add_seconds(p, "--timeout", stackrun.DEFAULT_PR_TIMEOUT_S, "time limit of one PR's own tests")
    _add_seconds(
        p,
        "--earlier-timeout",
        stackrun.DEFAULT_EARLIER_TIMEOUT_S,
        "time limit of one tree's run of the earlier PRs' tests",
    )
    p.add_argument(
        "--own-only",
        action="store_true",
        help="run each PR's own tests only, not also the earlier PRs' tests on its tree",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=stackrun.DEFAULT_JOBS,
        metavar="N",
        help=f"pytest processes at once, all on the one GPU (default: {stackrun.DEFAULT_JOBS})",
    )
    p.add_argument(
        "--markers", help="pytest -m expression for every PR (default: each PR's own, see STACK.json)"
    )
    p.add_argument(
        "--pytest-args", default="", metavar="ARGS", help="extra pytest arguments (one shell-quoted string)"
    )
    p.add_argument("--python", default=sys.executable, help="interpreter of the tests (default: this one)")
    p.add_argument(
        "--figures",
        action="store_true",
        help="then measure the call-site figures of the release's and each PR's tree (minicpmo_cg.bench.tree_figures)",
    )
    p.add_argument("--no-tests", action="store_true", help="run no tests (with --figures: the figures alone)")
    p.add_argument(
        "--figures-cpu",
        action="store_true",
        help="the figures' logic check without CUDA (numbers mean nothing)",
    )
    _add_seconds(
        p, "--figures-timeout", stackrun.DEFAULT_FIGURES_TIMEOUT_S, "time limit of one tree's figures"
    )
    p.add_argument(
        "--installed-site",
        type=Path,
        metavar="DIR",
        help="a ready, patched site-packages to use instead of unpacking the bundle (checks on a CPU machine)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing, write nothing")
    _add_bundle_dir(p)
    _add_site(p)


#: command -> (one-line help, argument setup)
COMMANDS = {
    "bundle": ("build lane bundles (on a machine that reaches PyPI)", _bundle_parser),
    "check": ("is the lane's bundle present and fresh for this checkout? print the run plan", _check_parser),
    "env": (
        'unpack the bundle, print shell exports: eval "$(python3 -m minicpmo_cg.offline_gpu env LANE)"',
        _env_parser,
    ),
    "run": ("run tests / demo / bench against the bundle (on the GPU host)", _run_parser),
    "stack": (
        "write per-PR overlays of an export next to the lane's bundle (networked machine)",
        _stack_parser,
    ),
    "stack-run": (
        "run each exported PR's tests and the earlier PRs' tests from its own tree against the bundle (GPU host)",
        _stack_run_parser,
    ),  # fmt: skip
}


def usage() -> str:
    lines = [f"usage: {PROG} {{{','.join(COMMANDS)}}} ...", "", DESCRIPTION, ""]
    lines += [f"  {name:9s} {text}" for name, (text, _) in COMMANDS.items()]
    return "\n".join([*lines, "", f"{PROG} COMMAND --help: the command's options"])


def command_parser(name: str) -> argparse.ArgumentParser:
    text, setup = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=text)
    setup(parser)
    return parser


def make_plan(ap: argparse.ArgumentParser, args: argparse.Namespace) -> runner.RunPlan:
    unknown = [p for p in args.parts if p not in runner.PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r} (parts: {', '.join(runner.PARTS)})")
    if args.budget <= 0:
        ap.error("--budget must be a positive number of seconds")
    parts = list(dict.fromkeys(args.parts)) or list(runner.PARTS)
    extra = {part: shlex.split(getattr(args, f"{part}_args")) for part in runner.PARTS}
    return runner.RunPlan(
        lane=args.lane.name,
        parts=parts,
        python=args.python,
        out=(args.out or REPO / "out" / f"gpu-{args.lane.name}").resolve(),
        budget_s=args.budget,
        quick=args.quick,
        markers=args.markers,
        extra={part: argv for part, argv in extra.items() if argv},
        timeouts=dict(args.timeout),
    )


def _site(args: argparse.Namespace) -> Path:
    return (args.site or hostenv.default_site(args.lane.name)).resolve()


def cmd_check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    plan = make_plan(ap, args)
    status = payload.bundle_status(args.bundle_dir / plan.lane, REPO)
    print(runner.describe(plan, _site(args), hostenv.environment(_site(args), REPO), status.message))
    sizes, small_enough = payload.size_report(args.bundle_dir, args.max_mib)
    print(f"# bundles in {args.bundle_dir}:\n{sizes}")
    code = status.code or (0 if small_enough else 1)
    print(
        "check: OK"
        if code == 0
        else f"check: FAILED ({status.message if status.code else 'bundles too big'})"
    )
    return code


def cmd_env(args: argparse.Namespace) -> int:
    site = _site(args)
    installed = hostenv.install(args.bundle_dir / args.lane.name, site, REPO)
    print(installed.message, file=sys.stderr)
    if installed.code:
        return installed.code
    print(hostenv.shell_exports(hostenv.environment(site, REPO)))
    return 0


def cmd_run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    plan = make_plan(ap, args)
    lane_dir = args.bundle_dir / plan.lane
    if args.dry_run:
        status = payload.bundle_status(lane_dir, REPO)
        print(runner.describe(plan, _site(args), hostenv.environment(_site(args), REPO), status.message))
        return 0
    return runner.execute(plan, lane_dir, _site(args), REPO)


def cmd_stack(args: argparse.Namespace) -> int:
    from minicpmo_cg.offline_gpu import stackbuild

    try:
        built = stackbuild.build_stack(args.export.resolve(), REPO, args.bundle_dir, args.site_packages)
    except (RuntimeError, OSError) as exc:
        print(f"stack: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"stack: {built.out} ({built.bytes_total / payload.MIB:.2f} MiB, {built.blobs} distinct files)")
    print("\n".join(built.lines))
    return 0


def cmd_stack_run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    folder = stackrun.stack_dir(args.bundle_dir, args.lane.name)
    if not (folder / stackrun.STACK_FILE).is_file():
        print(
            f"no overlays in {folder} (build them: {PROG} stack {args.lane.name} --export DIR)",
            file=sys.stderr,
        )
        return payload.MISSING
    stack = stackrun.read_stack(folder)
    try:
        prs = stackrun.select(stack, args.prs)
    except ValueError as exc:
        ap.error(str(exc))
    if args.budget <= 0 or args.timeout <= 0 or args.earlier_timeout <= 0:
        ap.error("--budget, --timeout and --earlier-timeout must be positive numbers of seconds")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be at least 1 (pytest processes at once)")
    plan = stackrun.StackPlan(
        lane=args.lane.name,
        prs=prs,
        python=args.python,
        out=(args.out or REPO / "out" / f"gpu-stack-{args.lane.name}").resolve(),
        budget_s=args.budget,
        pr_timeout_s=args.timeout,
        markers=args.markers,
        extra=shlex.split(args.pytest_args),
        tests=not args.no_tests,
        figures=args.figures,
        figures_timeout_s=args.figures_timeout,
        figures_cpu=args.figures_cpu,
        earlier=not args.own_only,
        earlier_timeout_s=args.earlier_timeout,
        jobs=args.jobs,
    )
    if not plan.tests and not plan.figures:
        ap.error("--no-tests without --figures runs nothing")
    site = args.installed_site.resolve() if args.installed_site else _site(args)
    if args.dry_run:
        print(stackrun.describe(plan, stack, site))
        return 0
    lane_dir = args.bundle_dir / plan.lane
    return stackrun.execute(plan, folder, lane_dir, site, REPO, installed_site=bool(args.installed_site))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] not in COMMANDS:
        print(f"{usage()}\n\n{PROG}: unknown command {argv[0]!r}", file=sys.stderr)
        return EXIT_USAGE
    ap = command_parser(argv[0])
    args = ap.parse_intermixed_args(argv[1:])
    if argv[0] == "bundle":
        opts = build.BuildOptions(
            repo=REPO,
            out=args.out.resolve(),
            cache=args.cache,
            patched=not args.unpatched,
            verify=args.verify,
            host_python=args.host_python,
        )
        return build.build(args.lanes, opts)
    if argv[0] == "check":
        return cmd_check(ap, args)
    if argv[0] == "env":
        return cmd_env(args)
    if argv[0] == "stack":
        return cmd_stack(args)
    if argv[0] == "stack-run":
        return cmd_stack_run(ap, args)
    return cmd_run(ap, args)
