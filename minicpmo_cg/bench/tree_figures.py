"""Call-site figures of one vllm-omni tree, for comparing the trees of a PR stack side by side.

``python -m minicpmo_cg.bench.tree_figures measure --label L --out DIR`` times the three encoder
call sites of MiniCPM-o 4.5 as the vllm-omni on ``sys.path`` ships them, with that tree's own
defaults, so that one run over the release and over each PR's tree (``offline_gpu stack-run
--figures``) gives every PR its figures against the tree before it: same host, same weights, same
inputs. What each tree runs:

- **the image call** ``get_vision_hidden_states``: 1 slice (32 x 32 patches, a 448 x 448 slice),
  3 slices of 1024 / 1035 / 1035 patches (padded to the largest) and 10 slices of 1024 patches;
- **the stateless audio call** ``get_audio_hidden_states``: 1 s and 5 s (100 and 500 mel frames);
- **one duplex session** through ``get_audio_embedding_streaming``: :data:`DUPLEX_CHUNKS` 1 s chunks
  (102 then 104 mel frames with their context, the session's Whisper KV cache growing by 50
  positions a chunk); per-chunk milliseconds of the session's first chunk, median and worst.

Each call site runs **eager** (``encoder_cuda_graph`` false; a tree without the wiring is always
eager) and, on a tree with the wiring, **graphed** with every ``--hf-overrides`` key at its default:
first :data:`WARMUP_CALLS` untimed calls (the adapters' admission decides what they capture), then
the timed ones; the replays among the timed calls are counted. A duplex session is graphed as a
server runs it: on a tree with start-up capture (``startup_capture.capture_at_startup``, what the
worker calls before serving) the graphs are captured first and the timed session is the first one;
on a tree without it the timed session is the third (the first two capture lazily), and the first
session's chunks are reported as well. Inputs and weights are seeded (:data:`SEED`): every tree
gets the same ones.

Times are CUDA-event milliseconds of one call (:class:`minicpmo_cg.measure.Timer`), in
:data:`BLOCKS` blocks of :data:`BLOCK_CALLS` timed calls per call site (:class:`TreeRun`): median and
p90 of all of them, and each block's median. ``measure`` runs the blocks one after the other;
``measure --serve`` builds the model, says ``ready`` and then runs one block per line it reads
(``eager``, ``graphed``, ``finish``), so that ``stack-run --figures`` can keep every tree's process
alive and take turns: each round runs one block of every tree, in an order that rotates from round to
round, and a drift of the host over the run reaches every tree alike. Outputs (eager and graphed) are
saved beside the JSON (``<label>.pt``) for :func:`compare`, which relates each tree to the one
before it.

Without CUDA (``--allow-cpu``) both passes run on the reduced model (2 + 2 layers) and tiny inputs,
the graphed one through the CPU stand-in for capture (:mod:`minicpmo_cg.bench.cpu_backend`, scripted
clock): a logic check of the whole flow, whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from minicpmo_cg import measure

__all__ = ["CALLS", "TreeRun", "compare", "main", "measure_tree", "pin_threads", "serve", "tree_features"]

SEED = 0
WARMUP_CALLS = 4
#: blocks per pass (eager, then graphed), on CUDA and on a CPU logic check
BLOCKS = {"cuda": 3, "cpu": 2}
#: timed calls per call site in one block
BLOCK_CALLS = {"cuda": 10, "cpu": 1}
#: untimed eager calls per call site before its timed ones (the eager duplex session: sessions)
EAGER_WARMUP = {"cuda": 3, "cpu": 0}
DUPLEX_CHUNKS = {"cuda": 10, "cpu": 3}
#: call name -> (kind, full-size spec, CPU spec): vision specs are patch grids, audio ones mel frames
CALLS: dict[str, tuple[str, Any, Any]] = {
    "image, 1 slice": ("vision", [(32, 32)], [(4, 4)]),
    "image, 3 slices (padded)": ("vision", [(32, 32), (23, 45), (45, 23)], [(4, 4), (3, 5), (5, 3)]),
    "image, 10 slices": ("vision", [(32, 32)] * 10, [(4, 4)] * 10),
    "audio, 1 s": ("audio", 100, 30),
    "audio, 5 s": ("audio", 500, 60),
}
DUPLEX = "duplex session"
_MODELS = "vllm_omni.model_executor.models.minicpmo_4_5"


def _has(module: str) -> bool:
    """Whether ``module`` is a module or regular package (an empty folder, a namespace package, is not)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    return spec is not None and spec.origin is not None


def tree_features() -> dict[str, bool]:
    """What the vllm-omni on ``sys.path`` has, by module: ``graphs`` (the encoder CUDA graph adapter),
    ``startup_capture``, ``sdpa`` (SigLIP's SDPA attention module) and ``fused_layers``."""
    return {
        "sdpa": _has(f"{_MODELS}.siglip_attention"),
        "graphs": _has(f"{_MODELS}.encoder_cuda_graph"),
        "startup_capture": _has(f"{_MODELS}.startup_capture"),
        "fused_layers": _has(f"{_MODELS}.fused_layers"),
    }


def _inputs(kind: str, spec: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(SEED + 1)
    if kind == "vision":
        pixels = [(torch.rand((3, 14, h * w * 14), generator=g) * 2 - 1).to(device, dtype) for h, w in spec]
        return {"pixel_values": pixels, "tgt_sizes": torch.tensor(spec, dtype=torch.int32, device=device)}
    feats = (torch.randn((1, 80, spec), generator=g) * 0.5).to(device, dtype)
    return {"audio_features": feats, "audio_feature_lens": [torch.tensor([spec], dtype=torch.int64)]}


def _duplex_chunks(count: int, device: torch.device) -> list[Any]:
    """A session's chunks as the duplex stage hands them over: float32 log-mel frames on the device
    (the model casts them; the start-up capture captures exactly these forms)."""
    from minicpmo_cg import duplex

    g = torch.Generator().manual_seed(SEED + 2)
    mel = torch.randn((80, count * duplex.CHUNK_FRAMES + duplex.CONTEXT_FRAMES), generator=g) * 0.5
    return duplex.frame_chunks(mel, count, device=device, dtype=torch.float32)


def _output(out: Any) -> torch.Tensor:
    """One tensor of a call's output (the per-item tensors concatenated), on the CPU in float32."""
    if isinstance(out, torch.Tensor):
        return out.detach().float().cpu()
    parts = [t for item in out for t in (item if isinstance(item, (list, tuple)) else [item])]
    return torch.cat([t.detach().float().reshape(-1, t.shape[-1]).cpu() for t in parts])


def _stats_of(model: Any) -> dict[str, dict[str, Any]]:
    from minicpmo_cg import standalone

    adapters = {
        "vision": standalone.vision_graph(model),
        "audio": standalone.audio_graph(model),
        "streaming audio": standalone.streaming_audio_graph(model),
    }
    return {name: a.get_cumulative_stats() for name, a in adapters.items() if a is not None}


def _hits(model: Any) -> int:
    return sum(int(s["graph_hits"]) for s in _stats_of(model).values())


def _timing(times: list[float]) -> dict[str, float]:
    s = measure.summary(times)
    return {"median": round(s["median"], 3), "p90": round(s["p90"], 3), "n": s["n"]}


def _session(model: Any, timer: Any, chunks: list[Any]) -> tuple[list[float], torch.Tensor]:
    from minicpmo_cg.duplex import DuplexSession

    session, times, outs = DuplexSession(), [], []
    for chunk in chunks:
        ms, out = timer.timed(lambda chunk=chunk: session.encode(model, chunk))
        times.append(ms)
        outs.append(out)
    return times, _output(outs)


def _duplex_timing(times: list[float]) -> dict[str, float]:
    return {
        "first_ms": round(times[0], 3),
        "median": round(measure.summary(times)["median"], 3),
        "worst": round(max(times), 3),
        "n": len(times),
    }


def _call_fn(model: Any, data: dict[str, Any]) -> Callable[[], Any]:
    if "pixel_values" in data:
        return lambda: model.get_vision_hidden_states(data)
    return lambda: model.get_audio_hidden_states(data)


class TreeRun:
    """The measurement of the vllm-omni on ``sys.path``, in blocks that a caller may interleave with
    other trees' blocks (``stack-run --figures`` runs every tree's process at once and takes turns).

    Build the model (the constructor), then :meth:`eager_block` and :meth:`graphed_block` as many
    times as wanted (every eager block before the first graphed one: the graphed blocks wire the
    graphs in), then :meth:`result`. A block times :data:`BLOCK_CALLS` calls of every call site; the
    first eager block runs :data:`EAGER_WARMUP` untimed calls (and sessions) first, every later one
    one untimed call, so a block never starts cold; an eager block runs one duplex session too. The
    first graphed block wires the graphs, captures at start-up where the tree can, times the duplex
    session as a server's first (or, without start-up capture, third) and runs
    :data:`WARMUP_CALLS` untimed calls per call site before its timed ones.

    A row's times are those of all its blocks; its ``blocks`` are each block's median (ms), so
    the spread within one process shows beside the difference between trees.

    Raises:
        whatever building the model or a call raises (a capture failure is fatal, as in serving);
        RuntimeError: an eager block after a graphed one.
    """

    def __init__(self, *, cpu: bool = False) -> None:
        from minicpmo_cg import standalone
        from minicpmo_cg.vllm_config import duplex_vllm_config, standalone_vllm_config

        self.cpu = cpu
        self.mode = "cpu" if cpu else "cuda"
        self.features = tree_features()
        device = torch.device("cpu" if cpu else "cuda")
        dtype = torch.float32 if cpu else torch.bfloat16
        self.model = standalone.build_thinker_encoders(
            device=device,
            dtype=dtype,
            reduced=cpu,
            seed=SEED,
            vision_attn="sdpa" if self.features["sdpa"] else "eager",
        )
        self.timer = measure.Timer(device)
        self.backend = self.clock = None
        if cpu and self.features["graphs"]:
            from minicpmo_cg.bench.cpu_backend import CpuGraphBackend, ScriptedClock

            self.clock = ScriptedClock()
            self.backend = CpuGraphBackend(clock=self.clock)
        self.call_args = {name: _inputs(kind, spec[1] if cpu else spec[0], device, dtype)
                          for name, (kind, *spec) in CALLS.items()}  # fmt: skip
        self.chunks = _duplex_chunks(DUPLEX_CHUNKS[self.mode], device)
        self.config = duplex_vllm_config(standalone_vllm_config(), 2)
        self.times: dict[str, dict[str, list[list[float]]]] = {"eager": {}, "graphed": {}}
        self.replayed: dict[str, int] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.duplex: dict[str, Any] = {}
        self.graphed = False
        if self.features["graphs"]:
            with self._context():
                standalone.wire_encoder_graphs(self.model, self.config, enabled=False)

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(_clock_for_adapters(self.clock))
        return stack

    def _time_calls(self, kind: str, warmup: int) -> None:
        for name, data in self.call_args.items():
            fn = _call_fn(self.model, data)
            for _ in range(warmup):
                fn()
            hits0 = _hits(self.model) if self.features["graphs"] else 0
            times, out = self.timer.repeat(fn, BLOCK_CALLS[self.mode])
            if self.features["graphs"]:
                self.replayed[f"{kind}/{name}"] = (
                    self.replayed.get(f"{kind}/{name}", 0) + _hits(self.model) - hits0
                )
            self.times[kind].setdefault(name, []).append(times)
            self.outputs.setdefault(f"{kind}/{name}", _output(out))

    def eager_block(self) -> None:
        """One eager block (``encoder_cuda_graph`` false): every call site, then one duplex session."""
        if self.graphed:
            raise RuntimeError("an eager block after a graphed one: the graphs are wired in")
        first = not self.times["eager"]
        with self._context():
            self._time_calls("eager", EAGER_WARMUP[self.mode] if first else 1)
            if first:
                for _ in range(EAGER_WARMUP[self.mode]):
                    _session(self.model, self.timer, self.chunks)
            times, out = _session(self.model, self.timer, self.chunks)
        self.times["eager"].setdefault(DUPLEX, []).append(times)
        self.outputs.setdefault("eager/" + DUPLEX, out)

    def graphed_block(self) -> None:
        """One block with the graphs wired in at their defaults (nothing on a tree without them)."""
        if not self.features["graphs"]:
            return
        with self._context():
            if not self.graphed:
                self._first_graphed()
                self._time_calls("graphed", WARMUP_CALLS)
            else:
                self._time_calls("graphed", 1)

    def _first_graphed(self) -> None:
        from minicpmo_cg import standalone

        self.graphed = True
        standalone.wire_encoder_graphs(self.model, self.config, enabled=True, backend=self.backend)
        if self.features["startup_capture"]:
            startup = importlib.import_module(f"{_MODELS}.startup_capture")
            t0 = time.perf_counter()
            report = startup.capture_at_startup(self.model, self.config)
            self.duplex["startup"] = {
                "graphs": report.num_graphs,
                "mib": round(report.total_bytes / 2**20, 1),
                "seconds": round(time.perf_counter() - t0, 2),
            }
            lazy = []
        else:
            lazy = [_session(self.model, self.timer, self.chunks)[0] for _ in range(2)]
        hits0 = _hits(self.model)
        times, self.outputs["graphed/" + DUPLEX] = _session(self.model, self.timer, self.chunks)
        self.duplex.update(_duplex_timing(times))
        self.duplex["replayed"] = _hits(self.model) - hits0
        self.duplex["calls"] = len(self.chunks)
        self.duplex["timed_session"] = 3 if lazy else 1
        if lazy:
            self.duplex["first_session"] = _duplex_timing(lazy[0])

    def _rows(self, kind: str) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        for name in CALLS:
            blocks = self.times[kind][name]
            flat = [t for block in blocks for t in block]
            rows[name] = {
                **_timing(flat),
                "blocks": [round(measure.median(b), 3) for b in blocks],
                "replayed": self.replayed.get(f"{kind}/{name}", 0),
                "calls": len(flat),
            }
        return rows

    def result(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(figures, outputs)``: see :func:`measure_tree`.

        Raises:
            RuntimeError: no eager block ran.
        """
        if not self.times["eager"]:
            raise RuntimeError("no eager block ran")
        sessions = self.times["eager"][DUPLEX]
        eager_duplex = _duplex_timing([t for s in sessions for t in s])
        eager_duplex["first_ms"] = round(sessions[0][0], 3)
        eager_duplex["blocks"] = [round(measure.median(s), 3) for s in sessions]
        figures: dict[str, Any] = {
            "features": self.features,
            "build": dataclass_dict(self.model.build_info),
            "eager": {**self._rows("eager"), DUPLEX: eager_duplex},
            "graphed": None,
        }
        if self.graphed:
            figures["graphed"] = {**self._rows("graphed"), DUPLEX: dict(self.duplex)}
            with self._context():
                figures["stats"] = _stats_of(self.model)
        return figures, dict(self.outputs)


def measure_tree(
    *, cpu: bool = False, blocks: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Measure the vllm-omni on ``sys.path`` (see the module docstring) in one go: ``blocks`` eager
    blocks, then as many graphed ones (:class:`TreeRun`; default :data:`BLOCKS`).

    Returns:
        ``(figures, outputs)``: the JSON-ready figures (``features``, ``eager`` / ``graphed`` rows by
        call name, ``duplex``, the adapters' ``stats``, the build) and the outputs by
        ``"<eager|graphed>/<call name>"`` (float32 CPU tensors; a call's first timed output).

    Raises:
        whatever building the model or a call raises (a capture failure is fatal, as in serving).
    """
    run = TreeRun(cpu=cpu)
    count = BLOCKS[run.mode] if blocks is None else blocks
    for _ in range(count):
        run.eager_block()
    for _ in range(count):
        run.graphed_block()
    return run.result()


@contextlib.contextmanager
def _clock_for_adapters(clock: Any):
    """The CPU logic check's scripted clock for the adapters' capture timing (no-op on CUDA)."""
    if clock is None:
        yield
        return
    from minicpmo_cg.bench.cpu_backend import adapter_clock
    from minicpmo_cg.standalone import ADAPTER_MODULE

    with adapter_clock(importlib.import_module(ADAPTER_MODULE), clock):
        yield


def dataclass_dict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
            for k, v in dataclasses.asdict(obj).items()}  # fmt: skip


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """:func:`minicpmo_cg.tolerance.rel_diff` (``max |a - b| / max |a|``, 0.0 for identical tensors),
    None instead of its error when the shapes differ."""
    from minicpmo_cg.tolerance import rel_diff as relative

    try:
        return relative(a, b)
    except RuntimeError:
        return None


def compare(out_dir: Path, labels: list[str]) -> dict[str, Any]:
    """Relate each tree's outputs to the previous label's and its graphed outputs to its eager ones.

    Reads ``<out_dir>/<label>.pt`` (from ``measure``); a label without outputs is skipped.

    Returns:
        ``{label: {"vs_previous": {key: rel or None}, "graphed_vs_eager": {call: rel}, "previous": label}}``,
        rel as :func:`rel_diff` (0.0: bitwise equal).
    """
    loaded = {lb: torch.load(out_dir / f"{lb}.pt") for lb in labels if (out_dir / f"{lb}.pt").is_file()}
    result: dict[str, Any] = {}
    previous = None
    for label in labels:
        if label not in loaded:
            continue
        outs = loaded[label]
        entry: dict[str, Any] = {"previous": previous, "vs_previous": {}, "graphed_vs_eager": {}}
        for key, value in sorted(outs.items()):
            kind, _, call = key.partition("/")
            if kind == "graphed" and f"eager/{call}" in outs:
                entry["graphed_vs_eager"][call] = rel_diff(outs[f"eager/{call}"], value)
            if previous is not None and key in loaded[previous]:
                entry["vs_previous"][key] = rel_diff(loaded[previous][key], value)
        result[label] = entry
        previous = label
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m minicpmo_cg.bench.tree_figures", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure the vllm-omni on sys.path")
    m.add_argument("--label", required=True, help="the tree's name (the JSON and .pt file names)")
    m.add_argument("--out", type=Path, required=True, help="folder for <label>.json and <label>.pt")
    m.add_argument("--allow-cpu", action="store_true", help="without CUDA: eager logic check on tiny inputs")
    m.add_argument(
        "--serve",
        action="store_true",
        help="build, print 'ready', then run one block per line read from stdin (eager, graphed, finish)",
    )
    m.add_argument(
        "--pin-core",
        type=int,
        default=None,
        metavar="N",
        help="once built, run every thread of the process on CPU core N (eager calls are bound by the host)",
    )
    c = sub.add_parser("compare", help="relate the outputs of the labels, in order; writes compare.json")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("labels", nargs="+")
    return p.parse_args(argv)


def pin_threads(core: int) -> bool:
    """Run every thread of this process on CPU ``core``, torch's CPU ops on one thread (as a process
    started on that core alone would; a pool sized for every core would spin on one); False where the
    host cannot (no such core, no ``sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity") or core not in os.sched_getaffinity(0):
        return False
    torch.set_num_threads(1)
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, {core})
    return True


def serve(run: TreeRun, commands: TextIO, replies: TextIO) -> int:
    """Run one block per command line (``eager``, ``graphed``) until ``finish``; reply ``done
    COMMAND SECONDS`` per block. Returns the number of blocks run.

    Raises:
        ValueError: an unknown command; EOFError: the input ended before ``finish``.
    """
    blocks = 0
    print("ready", file=replies, flush=True)
    while True:
        line = commands.readline()
        if not line:
            raise EOFError("the input ended before 'finish'")
        command = line.strip()
        if command == "finish":
            return blocks
        if command not in ("eager", "graphed"):
            raise ValueError(f"unknown command {command!r}: expected eager, graphed or finish")
        t0 = time.perf_counter()
        run.eager_block() if command == "eager" else run.graphed_block()
        blocks += 1
        print(f"done {command} {time.perf_counter() - t0:.2f}", file=replies, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0, or 2 for usage (no CUDA without ``--allow-cpu``)."""
    args = _parse(argv)
    if args.command == "compare":
        doc = compare(args.out, args.labels)
        (args.out / "compare.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out / 'compare.json'}")
        return 0
    cpu = not torch.cuda.is_available()
    if cpu and not args.allow_cpu:
        print("tree_figures: needs a CUDA GPU (or --allow-cpu for a logic check)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    replies = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # the model's prints must not reach the replies
        run = TreeRun(cpu=cpu)
        pinned = args.pin_core is not None and pin_threads(args.pin_core)
        if args.serve:
            serve(run, sys.stdin, replies)
        else:
            for _ in range(BLOCKS[run.mode]):
                run.eager_block()
            for _ in range(BLOCKS[run.mode]):
                run.graphed_block()
        figures, outputs = run.result()
    figures.update(label=args.label, seconds=round(time.perf_counter() - t0, 1), cpu=cpu,
                   device=torch.cuda.get_device_name(0) if not cpu else "cpu", versions=measure.versions(),
                   pinned_core=args.pin_core if pinned else None)  # fmt: skip
    torch.save(outputs, args.out / f"{args.label}.pt")
    (args.out / f"{args.label}.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(f"{args.label}: {figures['seconds']} s, wrote {args.out / (args.label + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
