"""The demo (``minicpmo-cg-demo``, ``python -m minicpmo_cg.demo``, ``tools/demo.sh``): MiniCPM-o 4.5's
input encoders, eager vs. exact-shape CUDA graphs, on real photos and real speech.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minicpmo_cg.measure import (
    Timer,
    all_finite,
    graph_rel_tol,
    max_abs,
    max_abs_diff,
    median,
    output_shape,
    versions,
)

PROG = "minicpmo-cg-demo"
#: How a user of this repository installs the patch set the demo needs.
APPLY_HINT = "run `minicpmo-cg-patch apply` first"
#: ``encoder_cuda_graph_max_graphs`` for the graphed pass: room for every input's shapes
#: (the full input set needs 8 vision + 4 audio keys per encoder at most).
MAX_GRAPHS = 16
#: ``encoder_cuda_graph_min_capture_calls`` for the graphed pass (the adapter's default).
MIN_CAPTURE_CALLS = 2
#: Chunks of the duplex row's session by device type: on CUDA a whole cache cycle and its reset
#: (before chunk 29, at 1500 positions), so the graphed session replays all 30 graphs; on CPU
#: (eager only) a few.
DUPLEX_CHUNKS = {"cuda": 32, "cpu": 4}
#: The adapter that serves each input modality.
ADAPTER_OF = {"image": "vision", "audio": "audio", "duplex": "streaming audio"}
#: SigLIP's attention in the demo: the model's default (``vision_attn_implementation``).
VISION_ATTN = "sdpa"
#: Timed calls per input and mode by (device type, size).
DEFAULT_REPEATS = {("cuda", "full"): 20, ("cuda", "reduced"): 5, ("cpu", "full"): 1, ("cpu", "reduced"): 1}
#: Adapter options of the graphed pass. It times replays of every input's shapes, so admission is
#: ``"count"``: each shape is captured at its MIN_CAPTURE_CALLS-th call. The default ``"cost"`` rule
#: would decline GPU-bound batches (e.g. ``retina``'s 10 slices), whose timed calls would run eagerly.
GRAPHED_OPTIONS = {"max_graphs": MAX_GRAPHS, "min_capture_calls": MIN_CAPTURE_CALLS, "admission": "count"}

NEEDS_CUDA_LINE = (
    "NOTE: encoder CUDA graphs need a CUDA device; ran eagerly on {device} only (graphed columns n/a)."
)
REDUCED_WITHOUT_CUDA_LINE = (
    "NOTE: no CUDA device, so the reduced size ran (2+2 layers, 224-pixel slices, 4 inputs); "
    "--full runs the checkpoint size (about 11 min on a 2-core CPU)."
)


class UsageError(Exception):
    """A bad flag or an unusable environment (exit status 2)."""


def _progress(msg: str) -> None:
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run MiniCPM-o 4.5's vision and audio encoders (random weights) on real photos and "
            "speech, eagerly and through exact-shape encoder CUDA graphs, and print timings and "
            "eager/graph differences (table on stdout, logs on stderr)."
        ),
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="reduced size: 2 vision + 2 audio layers (full widths), 2 photos sliced at 224 instead of 448 "
        "+ 2 speech clips, few repeats (the default without CUDA)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="checkpoint size (26 + 24 layers, 7 photo inputs + 4 speech inputs) also without CUDA "
        "(the default on CUDA; about 11 min on a 2-core CPU)",
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
        help="timed calls per input and mode (default: 20 on CUDA, 5 at the reduced size; 1 on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def resolve_size(*, quick: bool, full: bool, cuda: bool) -> str:
    """``"reduced"`` or ``"full"``: the flag given, else full on CUDA and reduced elsewhere."""
    if quick:
        return "reduced"
    if full:
        return "full"
    return "full" if cuda else "reduced"


def patch_problems(plan: Any) -> list[str]:
    """What keeps the installation described by a patch tool plan from being patched (empty: patched)."""
    from minicpmo_cg import resources
    from minicpmo_cg.patchtool.views import CONFLICT, NOT_APPLICABLE, PENDING

    problems = [f"{r.patch.name}: {r.state}" for r in plan.reports if r.state in (PENDING, CONFLICT)]
    adapter = resources.ADAPTER_RELPATH.as_posix()
    for owned in plan.owned:
        if owned.state not in ("installed", NOT_APPLICABLE):
            what = "adapter copy" if owned.rel == adapter else f"owned file {owned.rel}"
            problems.append(f"{what}: {owned.state}")
    return problems


def check_patched() -> None:
    """Ask the patch tool (which imports neither torch nor vLLM) whether the patch set is applied.

    Raises:
        UsageError: a patch is pending or in conflict, or the adapter copy is missing or outdated.
            When the tool cannot tell (e.g. no GNU ``patch`` on this machine) it says so on stderr
            and the model file is checked after the import instead.
    """
    from minicpmo_cg import patchtool

    try:
        install = patchtool.discover_installation()
        plan = patchtool.build_plan(install)
    except patchtool.ToolError as exc:
        _progress(f"cannot read the patch state ({exc}); checking the model file after the import instead")
        return
    problems = patch_problems(plan)
    if problems:
        raise UsageError(
            f"the encoder CUDA graph patch set is not applied to {install.site} ({'; '.join(problems)}); "
            f"{APPLY_HINT}"
        )


@dataclass
class InputResult:
    """Per-input results (times in milliseconds)."""

    name: str
    modality: str
    source: str
    input_shape: str
    encoder_calls: int
    attention: str = ""
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
            "attention": self.attention,
            "encoder_calls_per_call": self.encoder_calls,
            "output_shape": self.output_shape,
            "output_max_abs": self.output_max_abs,
            "finite": self.finite,
            "eager_ms_median": median(self.eager_ms),
            "eager_ms": self.eager_ms,
            "graphed_ms_median": median(self.graphed_ms),
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
    m = median(values)
    if m is None:
        return "n/a"
    return f"{m:.1f}" if m >= 100 else f"{m:.2f}"


def _table_row(r: InputResult) -> list[str]:
    eager, graphed = median(r.eager_ms), median(r.graphed_ms)
    return [
        r.name,
        r.modality,
        r.attention,
        r.input_shape,
        r.output_shape,
        _fmt_ms(r.eager_ms),
        _fmt_ms(r.graphed_ms),
        f"{eager / graphed:.2f}x" if eager and graphed else "n/a",
        "n/a" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}",
        "n/a" if r.replays is None else f"{r.replays}/{r.expected_replays}",
    ]


def format_table(results: list[InputResult]) -> str:
    """The results table (one row per input)."""
    header = ["input", "modality", "attention", "input shape", "output"]
    header += ["eager ms", "graphed ms", "speedup", "max|g-e|", "replays"]
    rows = [header] + [_table_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    numeric = {5, 6, 7, 8, 9}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_stats(name: str, stats: dict[str, Any] | None) -> str:
    if stats is None:
        return f"  {name:<15} n/a (no adapter)"
    parts = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()]
    return f"  {name:<15} " + " ".join(parts)


def format_report(report: dict[str, Any], results: list[InputResult]) -> str:
    """What the demo prints on stdout: header, notes, table, stats, checks and the verdict."""
    m, cuda = report["model"], report["cuda_graphs"]
    reduced = "reduced, " if report["size"] == "reduced" else ""
    lines = [
        (
            f"MiniCPM-o 4.5 thinker encoders ({reduced}random weights): "
            f"SigLIP {m['vision_layers']} layers ({m['vision_attn']}) + resampler, "
            f"Whisper {m['audio_layers']} "
            f"layers ({m['audio_attn']}) + projection; {report['dtype']} on {report['device_name']} "
            f"({report['device']}); median of {report['repeats']} call(s)"
        )
    ]
    if not cuda:
        lines.append(NEEDS_CUDA_LINE.format(device=report["device"]))
        if report["size_defaulted"] and report["size"] == "reduced":
            lines.append(REDUCED_WITHOUT_CUDA_LINE)
    lines.append(format_table(results))
    lines.append(
        "input shape: slices x max patches per slice / clips x max mel frames (100 per s); * = padded mask"
    )
    lines.append(
        "duplex: chunks x mel frames of one session through get_audio_embedding_streaming (KV cache kept; "
        "it resets every 29 chunks, at the 1500-position limit); ms per chunk"
    )
    lines.append("encoder CUDA graph stats (get_cumulative_stats):")
    lines += [format_stats(name, report["stats"][name]) for name in ("vision", "audio", "streaming audio")]
    if not cuda:
        checks = ", ".join(
            f"{mod} {c['input']} via adapter max|d|={c['max_abs_diff']:.3g}"
            for mod, c in report["cpu_routing_check"].items()
        )
        lines.append(
            f"CPU routing check: {checks} (CPU tensors are ineligible: the adapters ran the encoders eagerly)"
        )
    else:
        rel_tol = report["tolerance"]["rel_tol"]
        lines.append(
            f"tolerance: max|graphed - eager| <= {rel_tol:.3g} x max|eager| per input ({report['dtype']})"
        )
    lines.append("RESULT: OK" if report["ok"] else "RESULT: FAILED")
    lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)


@dataclass
class Demo:
    """Everything one run uses: device, dtype, size, the model, its inputs and the timer."""

    device: Any
    dtype_name: str
    dtype: Any
    size: str
    size_defaulted: bool
    repeats: int
    seed: int
    model: Any = None
    items: list[Any] = field(default_factory=list)
    vllm_config: Any = None
    timer: Any = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


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


def configure(args: argparse.Namespace) -> Demo:
    """Resolve device, dtype, size and repeats (imports torch, not vLLM)."""
    import torch

    device = _resolve_device(args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    size = resolve_size(quick=args.quick, full=args.full, cuda=cuda)
    repeats = args.repeats or DEFAULT_REPEATS[("cuda" if cuda else "cpu", size)]
    demo = Demo(
        device,
        dtype_name,
        getattr(torch, dtype_name),
        size,
        not (args.quick or args.full),
        repeats,
        args.seed,
    )
    if not cuda and demo.size_defaulted:
        _progress(REDUCED_WITHOUT_CUDA_LINE.removeprefix("NOTE: "))
    return demo


def build(demo: Demo) -> None:
    """Import vLLM and the model file, then build the inputs, the encoders and a ``VllmConfig``."""
    import torch

    _progress("importing torch, vLLM and vllm-omni's MiniCPM-o 4.5 model file ...")
    t_import = time.perf_counter()
    from minicpmo_cg import duplex, inputs, standalone
    from minicpmo_cg.vllm_config import standalone_vllm_config

    mod = standalone.model_module()
    if not callable(
        getattr(mod.MiniCPMO45OmniLLMForConditionalGeneration, "_init_encoder_cuda_graphs", None)
    ):
        raise UsageError(f"{standalone.WIRING_MISSING} (model file: {mod.__file__}); {APPLY_HINT}")
    _progress(f"imports done in {time.perf_counter() - t_import:.1f} s")
    if demo.cuda:
        torch.cuda.set_device(demo.device)
    else:
        # Random-weight attention puts subnormal probabilities into the CPU matmuls, which x86
        # handles in microcode; flushing them to zero keeps the CPU run's timings meaningful.
        torch.set_flush_denormal(True)
    reduced = demo.size == "reduced"
    _progress("preparing inputs (skimage photos -> MiniCPMVImageProcessor, vllm-omni voices -> mel) ...")
    demo.items = inputs.build_inputs(quick=reduced)
    demo.items.append(duplex.duplex_input(DUPLEX_CHUNKS[demo.device.type]))
    demo.model = standalone.build_thinker_encoders(
        device=demo.device,
        dtype=demo.dtype,
        reduced=reduced,
        seed=demo.seed,
        vision_attn=VISION_ATTN,
        progress=True,
    )
    demo.vllm_config = standalone_vllm_config(enforce_eager=False)
    demo.timer = Timer(demo.device)


def _call_site(demo: Demo, item: Any) -> tuple[Any, int]:
    """``(fn, n_encoder_calls)``: a no-argument call of the input's model call site and the adapter
    calls (graph replays when graphed) it makes: one per call for images too, since the image graph
    holds every ``vision_batch_size`` chunk of SigLIP and the resampler (vllm-omni patch 0005).
    """
    model = demo.model
    data = item.data(demo.device, demo.dtype)
    if item.modality == "image":
        return (lambda: model.get_vision_hidden_states(data)), 1
    return (lambda: model.get_audio_hidden_states(data)), 1


def _attention(demo: Demo, item: Any) -> str:
    """The attention implementation of the encoder that serves ``item``."""
    info = demo.model.build_info
    return info.vision_attn if item.modality == "image" else info.audio_attn


def _duplex_session(demo: Demo, item: Any) -> tuple[list[float], list[Any]]:
    """One new duplex session over the item's chunks: per-chunk milliseconds and embeddings."""
    from minicpmo_cg.duplex import DuplexSession

    session = DuplexSession()
    times, outs = [], []
    for chunk in item.on(demo.device):
        ms, out = demo.timer.timed(lambda chunk=chunk: session.encode(demo.model, chunk))
        times.append(ms)
        outs.append(out)
    session.close()
    return times, outs


def _eager_input(demo: Demo, item: Any) -> tuple[InputResult, Any]:
    """One input eagerly: a warm-up call on CUDA, then ``repeats`` timed calls (duplex: one session)."""
    if item.modality == "duplex":
        r = InputResult(item.name, item.modality, item.source, item.describe(), 1, _attention(demo, item))
        if demo.cuda:
            _duplex_session(demo, item)  # warm-up
        r.eager_ms, out = _duplex_session(demo, item)
        r.output_shape = f"{len(out)} x {tuple(out[0].shape)}"
        return r, out
    fn, n_enc = _call_site(demo, item)
    r = InputResult(item.name, item.modality, item.source, item.describe(), n_enc, _attention(demo, item))
    if demo.cuda:
        fn()  # warm-up
    r.eager_ms, out = demo.timer.repeat(fn, demo.repeats)
    r.output_shape = output_shape(out)
    return r, out


def eager_pass(demo: Demo) -> tuple[list[InputResult], dict[str, Any]]:
    """Every input with graphs off; returns the results and the eager outputs by input name."""
    from minicpmo_cg import standalone

    standalone.wire_encoder_graphs(demo.model, demo.vllm_config, enabled=False)
    results: list[InputResult] = []
    outputs: dict[str, Any] = {}
    for k, item in enumerate(demo.items, 1):
        _progress(f"eager   {k}/{len(demo.items)} {item.name} ({item.describe()}) ...")
        r, out = _eager_input(demo, item)
        outputs[item.name] = out
        r.output_max_abs, r.finite = max_abs(out), all_finite(out)
        if not r.finite:
            r.ok = False
            r.problems.append("eager output is not finite")
        _progress(f"        {item.name}: {_fmt_ms(r.eager_ms)} ms -> {r.output_shape}")
        results.append(r)
    return results, outputs


def wire_graphs(demo: Demo) -> dict[str, Any]:
    """Wire the adapters with graphs on; returns them by name (``vision``, ``audio``, ``streaming audio``)."""
    from minicpmo_cg import standalone

    standalone.wire_encoder_graphs(
        demo.model,
        demo.vllm_config,
        enabled=True,
        **GRAPHED_OPTIONS,
    )
    graphs = {
        "vision": standalone.vision_graph(demo.model),
        "audio": standalone.audio_graph(demo.model),
        "streaming audio": standalone.streaming_audio_graph(demo.model),
    }
    for name, adapter in graphs.items():
        if adapter is None:
            raise RuntimeError(
                f"_init_encoder_cuda_graphs left the {name} adapter unset with encoder_cuda_graph true"
            )
    return graphs


def _graphed_input(demo: Demo, item: Any, r: InputResult, eager_out: Any, adapter: Any) -> None:
    """Warm up and capture one input's shapes, time the replays and compare with eager."""
    if item.modality == "duplex":  # whole sessions: every key of the cache cycle is captured in the last
        session = functools.partial(_duplex_session, demo, item)
        r.warmup_ms = [demo.timer.wall_ms(session) for _ in range(MIN_CAPTURE_CALLS)]
        hits0 = adapter.get_cumulative_stats()["graph_hits"]
        r.graphed_ms, out = session()
        r.expected_replays = len(item.chunks)
    else:
        fn, n_enc = _call_site(demo, item)
        r.warmup_ms = [demo.timer.wall_ms(fn) for _ in range(MIN_CAPTURE_CALLS)]
        hits0 = adapter.get_cumulative_stats()["graph_hits"]
        r.graphed_ms, out = demo.timer.repeat(fn, demo.repeats)
        r.expected_replays = demo.repeats * n_enc
    r.replays = adapter.get_cumulative_stats()["graph_hits"] - hits0
    r.max_abs_diff = max_abs_diff(eager_out, out)
    r.rel_diff = r.max_abs_diff / r.output_max_abs if r.output_max_abs else r.max_abs_diff
    rel_tol = graph_rel_tol(demo.dtype_name)
    if not all_finite(out):
        r.problems.append("graphed output is not finite")
    if r.rel_diff > rel_tol:
        r.problems.append(
            f"max|graphed - eager| = {r.max_abs_diff:.3g} exceeds {rel_tol:.3g} x max|eager| "
            f"({r.output_max_abs:.3g})"
        )
    if r.replays != r.expected_replays:
        r.problems.append(f"only {r.replays} of {r.expected_replays} timed encoder calls were graph replays")
    r.ok = not r.problems


def graphed_pass(demo: Demo, results: list[InputResult], eager_out: dict[str, Any], graphs: dict) -> None:
    """CUDA: every input through the graphs (results updated in place)."""
    for k, (item, r) in enumerate(zip(demo.items, results), 1):
        _progress(f"graphed {k}/{len(demo.items)} {item.name}: {MIN_CAPTURE_CALLS} warm-up/capture calls")
        adapter = graphs[ADAPTER_OF[item.modality]]
        _graphed_input(demo, item, r, eager_out[item.name], adapter)
        _progress(
            f"        {item.name}: {_fmt_ms(r.graphed_ms)} ms, max|g-e| {r.max_abs_diff:.3g}, "
            f"replays {r.replays}/{r.expected_replays}"
        )


def _cheapest(items: list[Any], modality: str) -> Any:
    """The input of ``modality`` with the fewest slices x patches / mel frames."""
    costs = {"image": lambda i: i.num_slices * max(i.patches), "audio": lambda i: sum(i.frames)}
    return min((i for i in items if i.modality == modality), key=costs.get(modality, lambda i: len(i.chunks)))


def cpu_routing_check(demo: Demo, results: list[InputResult], eager_out: dict[str, Any]) -> dict[str, Any]:
    """CPU: the patched call sites route through the wired adapters, which stay eager and exact."""
    check: dict[str, Any] = {}
    for modality in ("image", "audio", "duplex"):
        item = _cheapest(demo.items, modality)
        _progress(f"routing check ({modality}): {item.name} through the wired adapters ...")
        out = _duplex_session(demo, item)[1] if modality == "duplex" else _call_site(demo, item)[0]()
        diff = max_abs_diff(eager_out[item.name], out)
        check[modality] = {"input": item.name, "max_abs_diff": diff}
        if diff != 0.0:
            r = next(x for x in results if x.name == item.name)
            r.ok = False
            r.problems.append(f"call through the wired adapter differs from eager by {diff:.3g}")
    return check


def _report_header(demo: Demo) -> dict[str, Any]:
    import torch

    b = demo.model.build_info
    return {
        "device": str(demo.device),
        "device_name": torch.cuda.get_device_name(demo.device) if demo.cuda else "cpu",
        "dtype": demo.dtype_name,
        "size": demo.size,
        "size_defaulted": demo.size_defaulted,
        "quick": demo.size == "reduced",
        "repeats": demo.repeats,
        "seed": demo.seed,
        "versions": versions(),
        "model": {
            "vision_layers": b.vision_layers,
            "audio_layers": b.audio_layers,
            "vision_attn": b.vision_attn,
            "audio_attn": b.audio_attn,
            "num_params": b.num_params,
            "build_s": b.build_s,
        },
        "cuda_graphs": demo.cuda,
        "options": {
            "encoder_cuda_graph_max_graphs": MAX_GRAPHS,
            "encoder_cuda_graph_min_capture_calls": MIN_CAPTURE_CALLS,
        },
        "tolerance": {
            "rel_tol": graph_rel_tol(demo.dtype_name),
            "rule": "max|graphed - eager| <= rel_tol * max|eager|",
        },
    }


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[InputResult]]:
    """Run the demo; return ``(exit status, JSON-able report, per-input results)``."""
    import torch

    demo = configure(args)
    build(demo)
    report = _report_header(demo)
    with torch.inference_mode():
        results, eager_out = eager_pass(demo)
        graphs = wire_graphs(demo)
        if demo.cuda:
            graphed_pass(demo, results, eager_out, graphs)
        else:
            report["cpu_routing_check"] = cpu_routing_check(demo, results, eager_out)
    ok = all(r.ok for r in results)
    report.update(
        inputs=[r.to_json() for r in results],
        stats={name: adapter.get_cumulative_stats() for name, adapter in graphs.items()},
        ok=ok,
        problems=[f"{r.name}: {p}" for r in results for p in r.problems],
    )
    return (0 if ok else 1), report, results


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``minicpmo-cg-demo``; returns the exit status."""
    args = parse_args(argv)
    # vLLM logs to stdout unless told otherwise; the demo's stdout is the results table.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        check_patched()
        with contextlib.redirect_stdout(sys.stderr):
            status, report, results = run(args)
        print(format_report(report, results), flush=True)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        status, report = 2, {"ok": False, "error": str(exc)}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        _progress(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
