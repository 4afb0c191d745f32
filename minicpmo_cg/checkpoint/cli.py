"""``minicpmo-cg-checkpoint``: build a MiniCPM-o 4.5 checkpoint folder, or check one."""

from __future__ import annotations

import argparse
import sys

from minicpmo_cg.checkpoint import layout

#: exit status for a bad folder or bad arguments (argparse's own errors use it too)
EXIT_BAD = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minicpmo-cg-checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write a checkpoint folder with random weights")
    build.add_argument("out", help="folder to create (must not exist or be empty)")
    build.add_argument("--size", choices=layout.SIZES, default="reduced")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--device", default="cpu", help="where weights are drawn: cpu or cuda[:N]")
    check = sub.add_parser("check", help="validate a checkpoint folder")
    check.add_argument("dir")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; a problem is one line on stderr and exit status 2, never a traceback."""
    args = _parser().parse_args(argv)
    from minicpmo_cg.checkpoint.check import CheckError, check

    try:
        if args.command == "build":
            from minicpmo_cg.checkpoint.build import build

            folder = build(args.out, args.size, seed=args.seed, device=args.device, progress=True)
            print(check(folder))
        else:
            print(check(args.dir))
    except CheckError as exc:
        print(f"minicpmo-cg-checkpoint {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD
    except Exception as exc:  # a command-line tool: one line, never a traceback
        print(f"minicpmo-cg-checkpoint {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_BAD
    return 0


if __name__ == "__main__":
    sys.exit(main())
