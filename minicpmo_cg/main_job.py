"""``minicpmo-cg-demo``: MiniCPM-o 4.5's input encoders, eager vs. exact-shape CUDA graphs.

Builds the thinker's encoders from vllm-omni's own classes at the checkpoint's dimensions with
random weights (:mod:`minicpmo_cg.standalone`), feeds them real photos and real speech through
MiniCPM-o's own preprocessing (:mod:`minicpmo_cg.inputs`) and runs every input through the
patched call sites ``get_vision_hidden_states`` / ``get_audio_hidden_states`` twice:

1. **eager**: ``encoder_cuda_graph`` false (no adapters); one warm-up call on CUDA, then
   ``--repeats`` timed calls.
2. **graphed** (CUDA only): ``encoder_cuda_graph`` true with ``encoder_cuda_graph_max_graphs``
   :data:`MAX_GRAPHS` (the job feeds more distinct shapes than the default 4 slots) and
   ``encoder_cuda_graph_min_capture_calls`` :data:`MIN_CAPTURE_CALLS`: that many untimed calls
   (the last one captures), then ``--repeats`` timed calls, all of which must be replays.

Timings are per call of the whole call site (vision: embeddings, SigLIP stack, resampler; audio:
mask building, Whisper, projection, pooling, length slicing), in milliseconds: the median over
the timed calls, measured with CUDA events around each call after a ``torch.cuda.synchronize``
on CUDA and with ``time.perf_counter`` on CPU. Everything runs under ``torch.inference_mode``.

Tolerance (exit status 1 when exceeded): ``max|graphed - eager| <= rel_tol * max|eager|`` per
input, with ``rel_tol`` = 2**-6 (1.6 %) for bfloat16 and 1e-4 for float32. A replay runs the
very kernels the eager call runs, on the same shapes and the same weights, so the difference
is expected to be exactly 0. The tolerance only leaves room for a library choosing another
kernel or split-K order while a graph is captured: that changes fp32 accumulation order, each
bf16 output can then move by one bf16 ulp (2**-8 relative to its magnitude, 2**-7 at worst),
and 26 residual layers can compound that a few times; 2**-6 of the output's largest magnitude
is a few such ulps, while any real fault (stale inputs, a wrong mask, another graph's buffers)
moves the output by O(1) of its magnitude. Non-finite outputs, or timed graphed calls that were
not all served by replays, also fail the job.

Without CUDA only the eager pass runs (graphed columns "n/a"); the adapters are then wired once
and called once per encoder to show that the patched call sites route through them and stay
eager (``ineligible_misses``).

Exit status: 0 ok, 1 a check failed, 2 usage or environment error (e.g. model file not patched).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``encoder_cuda_graph_max_graphs`` for the graphed pass: room for every input's shapes
#: (the full input set needs 8 vision + 4 audio keys per encoder at most).
MAX_GRAPHS = 16
#: ``encoder_cuda_graph_min_capture_calls`` for the graphed pass (the adapter's default).
MIN_CAPTURE_CALLS = 2
#: Relative tolerances by dtype name (see the module docstring).
REL_TOL = {"bfloat16": 2.0**-6, "float32": 1e-4}
DEFAULT_REPEATS = {"cuda": 20, "cuda_quick": 5, "cpu": 1}

NEEDS_CUDA_LINE = (
    "NOTE: encoder CUDA graphs need a CUDA device; ran eagerly on {device} only (graphed columns n/a)."
)


class UsageError(Exception):
    """A bad flag or an unusable environment (exit status 2)."""


def _progress(msg: str) -> None:
    print(f"[minicpmo-cg-demo] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="minicpmo-cg-demo",
        description=(
            "Run MiniCPM-o 4.5's vision and audio encoders (random weights at checkpoint size) on "
            "real photos and speech, eagerly and through exact-shape encoder CUDA graphs, and "
            "print timings and eager/graph differences."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced model (2 vision + 2 audio layers, full widths), 2 photos sliced at 224 instead of 448 "
        "+ 2 speech clips, few repeats",
    )
    parser.add_argument(
        "--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="parameter dtype; auto: bfloat16 on CUDA, float32 on CPU (float16 is not offered: "
        "the model keeps FP16 Whisper eager because of its host-side overflow check)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per input and mode (default: 20 on CUDA, 5 with --quick; 1 on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Timing and comparison helpers
# ---------------------------------------------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Any, n: int, device: Any) -> tuple[list[float], Any]:
    """Call ``fn()`` ``n`` times; return per-call milliseconds and the last output.

    CUDA: synchronize, record a start event, call, record an end event; the elapsed event time
    covers the call's GPU work and any host gaps inside it. CPU: ``time.perf_counter``.
    """
    import torch

    times: list[float] = []
    out = None
    for _ in range(n):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def output_shape(out: Any) -> str:
    """``(3, 64, 4096)`` for a tensor, ``(77, 4096)+(90, 4096)`` for a per-audio list."""
    return "+".join(str(tuple(t.shape)) for t in _as_list(out))


def max_abs(out: Any) -> float:
    return max(float(t.detach().float().abs().max()) if t.numel() else 0.0 for t in _as_list(out))


def all_finite(out: Any) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in _as_list(out))


def max_abs_diff(a: Any, b: Any) -> float:
    """``max |a - b|`` over matching tensors (computed in float32)."""
    la, lb = _as_list(a), _as_list(b)
    if len(la) != len(lb) or any(x.shape != y.shape for x, y in zip(la, lb)):
        raise RuntimeError(f"graphed output shape {output_shape(b)} != eager {output_shape(a)}")
    return max(float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(la, lb))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class InputResult:
    """Per-input results (times in milliseconds)."""

    name: str
    modality: str
    source: str
    input_shape: str
    encoder_calls: int
    output_shape: str = ""
    output_max_abs: float = math.nan
    finite: bool = True
    eager_ms: list[float] = field(default_factory=list)
    graphed_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)
    max_abs_diff: float | None = None
    rel_diff: float | None = None
    replays: int | None = None
    expected_replays: int | None = None
    ok: bool = True
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "modality": self.modality,
            "source": self.source,
            "input_shape": self.input_shape,
            "encoder_calls_per_call": self.encoder_calls,
            "output_shape": self.output_shape,
            "output_max_abs": self.output_max_abs,
            "finite": self.finite,
            "eager_ms_median": _median(self.eager_ms),
            "eager_ms": self.eager_ms,
            "graphed_ms_median": _median(self.graphed_ms),
            "graphed_ms": self.graphed_ms,
            "graphed_warmup_ms": self.warmup_ms,
            "max_abs_diff": self.max_abs_diff,
            "rel_diff": self.rel_diff,
            "replays": self.replays,
            "expected_replays": self.expected_replays,
            "ok": self.ok,
            "problems": self.problems,
        }


def _fmt_ms(values: list[float]) -> str:
    m = _median(values)
    if m is None:
        return "n/a"
    return f"{m:.1f}" if m >= 100 else f"{m:.2f}"


def format_table(results: list[InputResult]) -> str:
    """The results table (one row per input)."""
    header = ["input", "modality", "input shape", "output"]
    header += ["eager ms", "graphed ms", "speedup", "max|g-e|", "replays"]
    rows = [header]
    for r in results:
        eager, graphed = _median(r.eager_ms), _median(r.graphed_ms)
        rows.append(
            [
                r.name,
                r.modality,
                r.input_shape,
                r.output_shape,
                _fmt_ms(r.eager_ms),
                _fmt_ms(r.graphed_ms),
                f"{eager / graphed:.2f}x" if eager and graphed else "n/a",
                "n/a" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}",
                "n/a" if r.replays is None else f"{r.replays}/{r.expected_replays}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    numeric = {4, 5, 6, 7, 8}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_stats(name: str, stats: dict[str, Any] | None) -> str:
    if stats is None:
        return f"  {name:<6} n/a (no adapter)"
    parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()]
    return f"  {name:<6} " + " ".join(parts)


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------


def _resolve_device(spec: str) -> Any:
    import torch

    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise UsageError(f"--device {spec}: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available here (torch {torch.__version__})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        raise UsageError(f"--device {spec}: only cpu and cuda are supported")
    return device


def _call_site(model: Any, item: Any, device: Any, dtype: Any) -> Any:
    """``(fn, n_encoder_calls)``: a no-argument call of the input's model call site."""
    data = item.data(device, dtype)
    if item.modality == "image":
        batch = max(1, int(model.config.vision_batch_size))
        return (lambda: model.get_vision_hidden_states(data)), math.ceil(item.num_slices / batch)
    return (lambda: model.get_audio_hidden_states(data)), 1


def _versions() -> dict[str, str]:
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__}
    for dist in ("vllm", "vllm-omni", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """Run the job; return ``(exit status, JSON-able report)``. Prints the table to stdout."""
    _progress("importing torch, vLLM and vllm-omni's MiniCPM-o 4.5 model file ...")
    t_import = time.perf_counter()
    import torch

    from minicpmo_cg import inputs as job_inputs
    from minicpmo_cg import standalone
    from minicpmo_cg.vllm_config import standalone_vllm_config

    device = _resolve_device(args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    dtype = getattr(torch, dtype_name)
    repeats = args.repeats or DEFAULT_REPEATS["cpu" if not cuda else ("cuda_quick" if args.quick else "cuda")]
    eager_warmup = 1 if cuda else 0
    rel_tol = REL_TOL[dtype_name]

    mod = standalone.model_module()
    thinker_cls = mod.MiniCPMO45OmniLLMForConditionalGeneration
    if not callable(getattr(thinker_cls, "_init_encoder_cuda_graphs", None)):
        raise UsageError(f"{standalone.PATCH_HINT} (model file: {mod.__file__})")
    _progress(f"imports done in {time.perf_counter() - t_import:.1f} s")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # Random-weight attention puts subnormal probabilities into the CPU matmuls, which x86
        # handles in microcode; flushing them to zero keeps the CPU run's timings meaningful.
        torch.set_flush_denormal(True)

    _progress("preparing inputs (skimage photos -> MiniCPMVImageProcessor, vllm-omni voices -> mel) ...")
    items = job_inputs.build_inputs(quick=args.quick)
    model = standalone.build_thinker_encoders(
        device=device, dtype=dtype, reduced=args.quick, seed=args.seed, progress=True
    )
    vllm_config = standalone_vllm_config(enforce_eager=False)

    results: list[InputResult] = []
    eager_out: dict[str, Any] = {}
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": dtype_name,
        "quick": bool(args.quick),
        "repeats": repeats,
        "seed": args.seed,
        "versions": _versions(),
        "model": {
            "vision_layers": model.build_info.vision_layers,
            "audio_layers": model.build_info.audio_layers,
            "vision_attn": model.build_info.vision_attn,
            "audio_attn": model.build_info.audio_attn,
            "num_params": model.build_info.num_params,
            "build_s": model.build_info.build_s,
        },
        "cuda_graphs": cuda,
        "options": {
            "encoder_cuda_graph_max_graphs": MAX_GRAPHS,
            "encoder_cuda_graph_min_capture_calls": MIN_CAPTURE_CALLS,
        },
        "tolerance": {"rel_tol": rel_tol, "rule": "max|graphed - eager| <= rel_tol * max|eager|"},
    }

    with torch.inference_mode():
        # -- eager pass: graphs off ------------------------------------------------------------
        standalone.wire_encoder_graphs(model, vllm_config, enabled=False)
        for k, item in enumerate(items, 1):
            fn, n_enc = _call_site(model, item, device, dtype)
            r = InputResult(item.name, item.modality, item.source, item.describe(), n_enc)
            _progress(f"eager   {k}/{len(items)} {item.name} ({r.input_shape}) ...")
            for _ in range(eager_warmup):
                fn()
            r.eager_ms, out = time_calls(fn, repeats, device)
            eager_out[item.name] = out
            r.output_shape = output_shape(out)
            r.output_max_abs = max_abs(out)
            r.finite = all_finite(out)
            if not r.finite:
                r.ok = False
                r.problems.append("eager output is not finite")
            _progress(f"        {item.name}: {_fmt_ms(r.eager_ms)} ms -> {r.output_shape}")
            results.append(r)

        # -- graphed pass (CUDA) or a routing check (CPU) --------------------------------------
        standalone.wire_encoder_graphs(
            model, vllm_config, enabled=True, max_graphs=MAX_GRAPHS, min_capture_calls=MIN_CAPTURE_CALLS
        )
        graphs = {"vision": standalone.vision_graph(model), "audio": standalone.audio_graph(model)}
        for name, adapter in graphs.items():
            if adapter is None:
                raise RuntimeError(
                    f"_init_encoder_cuda_graphs left the {name} adapter unset with encoder_cuda_graph true"
                )
        if cuda:
            for k, (item, r) in enumerate(zip(items, results), 1):
                fn, n_enc = _call_site(model, item, device, dtype)
                adapter = graphs["vision" if item.modality == "image" else "audio"]
                _progress(f"graphed {k}/{len(items)} {item.name}: {MIN_CAPTURE_CALLS} warm-up/capture calls")
                for _ in range(MIN_CAPTURE_CALLS):
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    r.warmup_ms.append((time.perf_counter() - t0) * 1e3)
                hits0 = adapter.get_cumulative_stats()["graph_hits"]
                r.graphed_ms, out = time_calls(fn, repeats, device)
                r.replays = adapter.get_cumulative_stats()["graph_hits"] - hits0
                r.expected_replays = repeats * n_enc
                r.max_abs_diff = max_abs_diff(eager_out[item.name], out)
                r.rel_diff = r.max_abs_diff / r.output_max_abs if r.output_max_abs else r.max_abs_diff
                if not all_finite(out):
                    r.problems.append("graphed output is not finite")
                if r.rel_diff > rel_tol:
                    r.problems.append(
                        f"max|graphed - eager| = {r.max_abs_diff:.3g} exceeds {rel_tol:.3g} x max|eager| "
                        f"({r.output_max_abs:.3g})"
                    )
                if r.replays != r.expected_replays:
                    r.problems.append(
                        f"only {r.replays} of {r.expected_replays} timed encoder calls were graph replays"
                    )
                r.ok = not r.problems
                _progress(
                    f"        {item.name}: {_fmt_ms(r.graphed_ms)} ms, max|g-e| {r.max_abs_diff:.3g}, "
                    f"replays {r.replays}/{r.expected_replays}"
                )
        else:
            # CPU: the patched call sites must route through the adapters, which stay eager.
            check: dict[str, Any] = {}
            for modality in ("image", "audio"):
                # the cheapest input of the modality: fewest slices / mel frames
                item = min(
                    (i for i in items if i.modality == modality),
                    key=lambda i: (i.num_slices * max(i.patches)) if i.modality == "image" else sum(i.frames),
                )
                _progress(f"routing check ({modality}): {item.name} through the wired adapters ...")
                fn, _ = _call_site(model, item, device, dtype)
                diff = max_abs_diff(eager_out[item.name], fn())
                check[modality] = {"input": item.name, "max_abs_diff": diff}
                if diff != 0.0:
                    r = next(x for x in results if x.name == item.name)
                    r.ok = False
                    r.problems.append(f"call through the wired adapter differs from eager by {diff:.3g}")
            report["cpu_routing_check"] = check

    stats = {name: adapter.get_cumulative_stats() for name, adapter in graphs.items()}
    ok = all(r.ok for r in results)
    report.update(
        inputs=[r.to_json() for r in results],
        stats=stats,
        ok=ok,
        problems=[f"{r.name}: {p}" for r in results for p in r.problems],
    )

    # -- print ---------------------------------------------------------------------------------
    b = model.build_info
    print(
        f"MiniCPM-o 4.5 thinker encoders ({'reduced, ' if args.quick else ''}random weights): "
        f"SigLIP {b.vision_layers} layers ({b.vision_attn}) + resampler, Whisper {b.audio_layers} layers "
        f"({b.audio_attn}) + projection; {dtype_name} on {report['device_name']} ({device}); "
        f"median of {repeats} call(s)"
    )
    if not cuda:
        print(NEEDS_CUDA_LINE.format(device=device))
    print(format_table(results))
    print("input shape: slices x max patches per slice / clips x max mel frames (100 per s); * = padded mask")
    print("encoder CUDA graph stats (get_cumulative_stats):")
    print(format_stats("vision", stats["vision"]))
    print(format_stats("audio", stats["audio"]))
    if not cuda:
        check = report["cpu_routing_check"]
        print(
            "CPU routing check: "
            + ", ".join(
                f"{m} {c['input']} via adapter max|d|={c['max_abs_diff']:.3g}" for m, c in check.items()
            )
            + " (CPU tensors are ineligible: the adapters ran the encoders eagerly)"
        )
    else:
        print(f"tolerance: max|graphed - eager| <= {rel_tol:.3g} x max|eager| per input ({dtype_name})")
    if ok:
        print("RESULT: OK")
    else:
        print("RESULT: FAILED")
        for p in report["problems"]:
            print(f"  - {p}")
    return (0 if ok else 1), report


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``minicpmo-cg-demo``; returns the exit status."""
    args = parse_args(argv)
    try:
        status, report = run(args)
    except UsageError as exc:
        print(f"minicpmo-cg-demo: error: {exc}", file=sys.stderr)
        status, report = 2, {"ok": False, "error": str(exc)}
        if args.json is None:
            return status
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        _progress(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
