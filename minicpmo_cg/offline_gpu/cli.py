"""Command line of the offline GPU runner: ``python -m minicpmo_cg.offline_gpu {bundle,check,env,run}``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from minicpmo_cg.lanes import get_lane
from minicpmo_cg.offline_gpu import build, hostenv, payload, runner


def checkout_root() -> Path:
    """The source checkout: the one holding this package, else the working directory."""
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
        "parts", nargs="*", metavar="PART", help=f"{', '.join(runner.PARTS)} (default: {' '.join(runner.DEFAULT_PARTS)})"
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


#: command -> (one-line help, argument setup)
COMMANDS = {
    "bundle": ("build lane bundles (on a machine that reaches PyPI)", _bundle_parser),
    "check": ("is the lane's bundle present and fresh for this checkout? print the run plan", _check_parser),
    "env": (
        'unpack the bundle, print shell exports: eval "$(python3 -m minicpmo_cg.offline_gpu env LANE)"',
        _env_parser,
    ),
    "run": ("run tests / demo / bench against the bundle (on the GPU host)", _run_parser),
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
    parts = list(dict.fromkeys(args.parts)) or list(runner.DEFAULT_PARTS)
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
    return cmd_run(ap, args)
