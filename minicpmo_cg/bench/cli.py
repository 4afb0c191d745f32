"""``minicpmo-cg-bench`` / ``python -m minicpmo_cg.bench``: arguments, setup, the scenario loop."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import minicpmo_cg.bench
from minicpmo_cg.bench import (
    duplex,
    duplex_concurrency,
    offline,
    per_shape,
    streaming,
    vision_path,
)
from minicpmo_cg.bench.context import PROFILES, ROTATE, TARGETS, Ctx, log
from minicpmo_cg.bench.cpu_backend import CpuGraphBackend, ScriptedClock, adapter_clock
from minicpmo_cg.bench.report import format_report
from minicpmo_cg.measure import Timer, versions

PROG = "minicpmo-cg-bench"
#: scenario name -> run(ctx), in report order
SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    "vision": per_shape.run_vision,
    "audio": per_shape.run_audio,
    "vision_path": vision_path.run,
    "streaming": streaming.run,
    "duplex": duplex.run,
    "duplex_concurrency": duplex_concurrency.run,
    "offline": offline.run,
}
SECTIONS = tuple(SCENARIOS)


class UsageError(Exception):
    """A bad flag or an unusable environment (exit status 2)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=(minicpmo_cg.bench.__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter streaming session")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SECTION[,SECTION]",
        help=f"run only these sections ({', '.join(SECTIONS)}); repeatable",
    )
    ap.add_argument("--json", metavar="PATH", help="write all numbers as JSON (rewritten after each section)")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA: logic dry run on tiny shapes (numbers are meaningless)",
    )
    ap.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when available; cpu forces the --allow-cpu dry run even on a GPU host",
    )
    ap.add_argument("--reduced", action="store_true", help="2 vision + 2 audio layers (full widths)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    only = [s.strip() for item in args.only for s in item.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in only] if only else list(SECTIONS)
    return args


def resolve_mode(args: argparse.Namespace) -> str:
    """``full``, ``quick`` or ``cpu``.

    Raises:
        UsageError: ``--device cuda`` without CUDA, or no CUDA and no ``--allow-cpu``.
    """
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise UsageError("--device cuda but torch sees no CUDA device")
    if not cuda and not args.allow_cpu:
        raise UsageError(
            "needs a CUDA GPU (CUDA graphs are what it measures). "
            "For a logic dry run on tiny shapes here: --allow-cpu --quick."
        )
    return "cpu" if not cuda else ("quick" if args.quick else "full")


def make_context(args: argparse.Namespace, mode: str) -> Ctx:
    """Import the patched adapter, build the encoders and the context.

    Raises:
        UsageError: the patched vllm-omni or the adapter cannot be imported, or the model file is
            not patched.
    """
    cuda = mode != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        import vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph as adapter_mod
        from minicpmo_cg import standalone
        from minicpmo_cg.vllm_config import standalone_vllm_config
    except ImportError as exc:
        raise UsageError(f"cannot import the patched vllm-omni / minicpmo_cg: {exc}") from exc
    reduced = args.reduced or mode == "cpu"
    log(f"building encoders ({'reduced' if reduced else 'full'}, {dtype}, {device}) ...")
    # Every encoder runs its fused layers, whatever the option's default: the sections compare them
    # with the unfused layers by the modules' flags (bench.kernels.fused_layers).
    build_args = {
        "device": device,
        "dtype": dtype,
        "reduced": reduced,
        "seed": args.seed,
        "progress": True,
        "fused_layers": "all",
    }
    model = standalone.build_thinker_encoders(**build_args)
    if not standalone.has_graph_wiring(model):
        raise UsageError(f"{standalone.WIRING_MISSING}; run `minicpmo-cg-patch apply` first")
    return Ctx(
        device=device,
        dtype=dtype,
        profile=PROFILES[mode],
        timer=Timer(device),
        model=model,
        vllm_config=standalone_vllm_config(),
        adapter_mod=adapter_mod,
        rng=torch.Generator().manual_seed(args.seed),
        # a CPU run scripts time: its decisions must not depend on how loaded the host is
        backend=CpuGraphBackend(clock=ScriptedClock()) if device.type != "cuda" else None,
        build_args=build_args,
    )


def _meta(ctx: Ctx, sections: list[str]) -> dict[str, Any]:
    info = ctx.model.build_info
    return {
        "mode": ctx.mode,
        "sections": sections,
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "device_name": torch.cuda.get_device_name(0) if not ctx.cpu else (platform.processor() or "cpu"),
        "python": platform.python_version(),
        **{dist.replace("-", "_"): version for dist, version in versions().items()},
        "model": f"{info.vision_layers}+{info.audio_layers} layers, vision attn {info.vision_attn}, "
        f"audio attn {info.audio_attn}, {info.num_params / 1e6:.0f} M params",
        "rotate": ROTATE,
        "profile": ctx.profile.__dict__,
    }


def run_scenarios(
    ctx: Ctx,
    sections: list[str],
    res: dict[str, Any],
    after_section: Callable[[dict[str, Any]], None] | None = None,
) -> bool:
    """Run each selected scenario into ``res``; a failing one is reported and the others still run."""
    complete = True
    clock = ctx.backend.clock if ctx.cpu else None
    with torch.inference_mode(), adapter_clock(ctx.adapter_mod, clock):
        for section in sections:
            t0 = time.perf_counter()
            log(f"section {section} ...")
            try:
                res[section] = SCENARIOS[section](ctx)
            except Exception as exc:  # noqa: BLE001 - report, keep the other sections
                complete = False
                traceback.print_exc()
                ctx.problems.append(f"section {section} failed: {type(exc).__name__}: {exc}")
            log(f"section {section}: {time.perf_counter() - t0:.1f} s")
            if after_section is not None:
                after_section(res)
    return complete


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 done, 1 a check or section failed, 2 usage)."""
    args = parse_args(argv)
    # vLLM logs to stdout unless told otherwise; the benchmark's stdout is its report.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    t_start = time.perf_counter()
    try:
        mode = resolve_mode(args)
        with contextlib.redirect_stdout(sys.stderr):
            ctx = make_context(args, mode)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"meta": _meta(ctx, args.sections), "targets": TARGETS}

    def write_json(res: dict[str, Any]) -> None:
        res["problems"] = ctx.problems
        res["meta"]["elapsed_s"] = time.perf_counter() - t_start
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")

    with contextlib.redirect_stdout(sys.stderr):
        complete = run_scenarios(ctx, args.sections, res, after_section=write_json)
    write_json(res)
    print(format_report(res), flush=True)
    if args.json:
        log(f"wrote {args.json}")
    return 1 if not complete or ctx.problems else 0
