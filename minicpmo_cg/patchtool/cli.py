"""The command line of ``minicpmo-cg-patch`` (commands and exit codes: patches/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool import commands, fsops, index
from minicpmo_cg.patchtool.errors import EXIT_CODES_HELP, EXIT_CONFLICT, EXIT_OK, PROG, ToolError
from minicpmo_cg.patchtool.gnupatch import PatchToolMissingError, ScratchDirError
from minicpmo_cg.patchtool.install import discover_installation
from minicpmo_cg.patchtool.plan import build_plan
from minicpmo_cg.patchtool.report import WIDTH, render_json, render_text
from minicpmo_cg.patchtool.series import PatchFormatError, load_all_series
from minicpmo_cg.patchtool.state import LockTimeoutError, locked

__all__ = ["main", "run"]

COMMANDS = {
    "apply": "apply every pending patch and install the owned files (all-or-nothing, idempotent, crash-safe)",
    "check": "dry run of apply: exit 0 when it would succeed, 1 on conflict",
    "status": "show every patch's state, the owned files, versions and lane (--verbose: details)",
    "revert": "restore every file apply changed, byte-identical (all-or-nothing, crash-safe)",
    "base": "write the starting file of a new or refreshed patch (the file with the earlier patches applied)",
    "index": "print, write (--write) or check (--check) patches/INDEX.md from the patch headers",
}


#: seconds a command waits for another command's lock on the installation before it gives up (the
#: variable the lane scripts honour for the venv's lock too); unset: it waits until the lock is free
LOCK_TIMEOUT_ENV = "MINICPMO_CG_LOCK_TIMEOUT"


class UsageError(ToolError):
    """A command line argparse refuses; its message is argparse's, with the usage line."""


class _Parser(argparse.ArgumentParser):
    """argparse, raising :class:`UsageError` instead of printing and exiting, so that ``--json``
    can answer a usage error with its JSON object too."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")


def _common(verbose: bool = True) -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--site-packages",
        type=Path,
        metavar="DIR",
        help="site-packages directory to patch (default: where this Python imports vllm and vllm_omni from)",
    )
    common.add_argument(
        "--patches-dir",
        type=Path,
        metavar="DIR",
        help="patch series root holding vllm/ and vllm-omni/ (default: the one shipped with minicpmo_cg)",
    )
    common.add_argument(
        "--owned-dir",
        type=Path,
        metavar="DIR",
        help="directory whose vllm_omni/ tree is installed (default: the one shipped with minicpmo_cg)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    if verbose:
        common.add_argument(
            "-v", "--verbose", action="store_true", help="full names, every detail, each file's state"
        )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} {{apply,check,status,revert,base,index}} [--site-packages DIR] [--json] ...",
        description="Install the MiniCPM-o 4.5 encoder CUDA graph patch set into vllm-omni / vLLM.",
        epilog=EXIT_CODES_HELP,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{apply,check,status,revert,base,index}"
    )
    for name in ("apply", "check", "status", "revert"):
        sub.add_parser(
            name, parents=[_common()], help=COMMANDS[name], description=COMMANDS[name], epilog=EXIT_CODES_HELP
        )
    base = sub.add_parser("base", parents=[_common()], help=COMMANDS["base"], description=COMMANDS["base"])
    base.add_argument(
        "files", nargs="*", metavar="FILE", help="site-relative path(s), e.g. vllm_omni/.../x.py"
    )
    base.add_argument(
        "--before", metavar="PATCH", help="stop before this patch (refreshing or inserting one)"
    )
    base.add_argument(
        "--out", type=Path, default=Path("patch-base"), metavar="DIR", help="writes DIR/a/FILE and DIR/b/FILE"
    )
    idx = sub.add_parser("index", help=COMMANDS["index"], description=COMMANDS["index"])
    idx.add_argument(
        "--patches-dir", type=Path, metavar="DIR", help="patch series root (default: the shipped one)"
    )
    mode = idx.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write DIR/INDEX.md")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 when DIR/INDEX.md is not what --write writes"
    )
    return parser


def _run_index(args: argparse.Namespace) -> tuple[int, str, str]:
    patches_dir = args.patches_dir or resources.patches_dir()
    try:
        text = index.render_index(load_all_series(patches_dir))
    except PatchFormatError as exc:
        raise ToolError(f"{PROG}: bad patch series: {exc}") from None
    path = index.index_path(patches_dir)
    if args.write:
        if os.path.lexists(path) and not path.is_file():
            raise ToolError(f"{PROG}: index --write: {path} is not a regular file; remove it and re-run")
        path.write_text(text, encoding="utf-8")
        return EXIT_OK, f"index: wrote {path}\n", ""
    if args.check:
        try:
            current = fsops.read_regular(path).decode("utf-8")
        except FileNotFoundError:
            current = None
        except UnicodeDecodeError as exc:
            raise ToolError(f"{PROG}: {path} is not UTF-8 text ({exc}); run `{PROG} index --write`") from None
        except fsops.NotRegularFileError as exc:
            raise ToolError(f"{PROG}: {exc}; remove it and run `{PROG} index --write`") from None
        if current != text:
            return EXIT_CONFLICT, "", f"{PROG}: {path} is out of date; run `{PROG} index --write`\n"
        return EXIT_OK, f"index: {path} is up to date\n", ""
    return EXIT_OK, text, ""


def _lock_timeout() -> float | None:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not timeout >= 0:  # NaN too
        raise ToolError(f"{PROG}: {LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds (0 or more)")
    return timeout


def _waiting(site: Path, timeout: float | None):
    def say(holder: str) -> None:
        until = (
            f"giving up after {timeout:g} s ({LOCK_TIMEOUT_ENV})"
            if timeout is not None
            else f"{LOCK_TIMEOUT_ENV}=S gives up after S seconds"
        )
        _emit(
            f"{PROG}: waiting for the lock held by {holder} on {site} (another {PROG} command on this "
            f"installation; a stopped one holds it until it goes on or is killed); {until}\n",
            "stderr",
        )

    return say


def _execute(args: argparse.Namespace) -> tuple[commands.Outcome, object]:
    command = args.command
    install = discover_installation(args.site_packages)
    timeout = _lock_timeout()
    exclusive = command in ("apply", "revert")
    with locked(install.site, exclusive=exclusive, timeout=timeout, on_wait=_waiting(install.site, timeout)):
        plan = build_plan(install, args.patches_dir, args.owned_dir)
        if command == "status":
            outcome = commands.Outcome("ok", EXIT_OK)
        elif command == "check":
            outcome = commands.cmd_check(plan)
        elif command == "apply":
            outcome = commands.cmd_apply(plan)
        elif command == "revert":
            outcome = commands.cmd_revert(plan)
        else:
            outcome = commands.cmd_base(plan, args.files, args.before, args.out)
        if command in ("apply", "revert") and outcome.result not in ("conflict", "unchanged"):
            try:
                plan = build_plan(install, args.patches_dir, args.owned_dir)
            except (ToolError, OSError, PatchToolMissingError) as exc:  # the command itself is done
                outcome.warnings.append(f"cannot describe the result: {exc}")
    return outcome, plan


def _report(args: argparse.Namespace, outcome: commands.Outcome, plan) -> tuple[str, str]:
    command = args.command
    if args.json:
        out = json.dumps(render_json(command, plan, outcome), indent=2) + "\n"
    elif command == "base":
        wrapped = textwrap.fill(outcome.message, WIDTH, break_on_hyphens=False, break_long_words=False)
        out = "".join(f"wrote: {path}\n" for path in outcome.changed) + wrapped + "\n"
    else:
        out = render_text(command, plan, outcome, args.verbose)
    err = ""
    if outcome.exit_code and outcome.message:
        err = f"{PROG}: {outcome.message}\n"
        conflicts = plan.revert_conflicts() if command == "revert" else plan.apply_conflicts()
        err += "".join(f"  conflict: {c}\n" for c in conflicts if outcome.exit_code == EXIT_CONFLICT)
        err += "".join(f"  {line}\n" for line in outcome.states)
    return out, err


def _emit(text: str, stream_name: str) -> None:
    """Write to stdout/stderr; an output that cannot be written never changes the exit code."""
    stream = getattr(sys, stream_name)
    if not text or stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError) as exc:
        try:  # later flushes (at exit) go nowhere instead of failing again
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass
        if stream_name == "stdout":
            _emit(
                f"{PROG}: could not write the report to stdout ({exc}); the exit code tells the result\n",
                "stderr",
            )


def _io_error(command: str, exc: OSError) -> ToolError:
    """An I/O error no step handled (reading the site, the series, a scratch directory) as exit 2."""
    detail = str(exc)
    if exc.strerror and exc.filename and not isinstance(exc, ScratchDirError):
        detail = f"{exc.strerror}: {exc.filename}"
    unchanged = "; nothing was changed" if command not in ("index", "base") else ""
    return ToolError(f"{PROG}: {command}: I/O error: {detail}{unchanged}")


def _json_error(command: str | None, exc: ToolError) -> str:
    return json.dumps({"command": command, "ok": False, "exit_code": exc.exit_code, "error": str(exc)}) + "\n"


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code instead of exiting (tests call this).

    Raises:
        SystemExit: a usage error (code 2) or ``--help`` (0), as argparse exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:  # exits as argparse does (SystemExit 2), with the JSON object first
        _emit(f"{exc}\n", "stderr")
        if "--json" in argv:  # still one JSON object on stdout, as every --json run prints
            command = next((a for a in argv if a in COMMANDS), None)
            _emit(_json_error(command, exc), "stdout")
        raise SystemExit(exc.exit_code) from None
    try:
        try:
            if args.command == "index":
                code, out, err = _run_index(args)
                _emit(out, "stdout")
                _emit(err, "stderr")
                return code
            outcome, plan = _execute(args)
        except OSError as exc:
            raise _io_error(args.command, exc) from None
        except PatchToolMissingError as exc:
            raise ToolError(f"{PROG}: {exc}") from None
        except LockTimeoutError as exc:
            raise ToolError(
                f"{PROG}: {args.command}: {exc} ({LOCK_TIMEOUT_ENV}); nothing was changed"
            ) from None
    except ToolError as exc:
        _emit(f"{exc}\n", "stderr")
        if getattr(args, "json", False):
            _emit(_json_error(args.command, exc), "stdout")
        return exc.exit_code
    out, err = _report(args, outcome, plan)
    _emit(out, "stdout")
    _emit(err, "stderr")
    return outcome.exit_code


def _ensure_standard_fds() -> None:
    """Open /dev/null on a closed fd 0, 1 or 2, so no file the tool opens can land there."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``minicpmo-cg-patch``)."""
    _ensure_standard_fds()
    sys.exit(run(argv))
