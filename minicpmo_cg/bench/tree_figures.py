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

Times are CUDA-event milliseconds of one call (:class:`minicpmo_cg.measure.Timer`), median and p90
of :data:`TIMED_CALLS` calls after :data:`EAGER_WARMUP` untimed eager ones. Outputs (eager and graphed) are saved beside the JSON
(``<label>.pt``) for :func:`compare`, which relates each tree to the one before it.

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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minicpmo_cg import measure

__all__ = ["CALLS", "compare", "main", "measure_tree", "tree_features"]

SEED = 0
WARMUP_CALLS = 4
#: timed calls per call site, on CUDA and on a CPU logic check
TIMED_CALLS = {"cuda": 30, "cpu": 2}
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


def _call_pass(model: Any, timer: Any, call_args: dict[str, dict], warmup: int, timed: int) -> dict[str, Any]:
    rows, outs = {}, {}
    for name, data in call_args.items():
        fn: Callable[[], Any] = (
            (lambda d=data: model.get_vision_hidden_states(d))
            if "pixel_values" in data
            else (lambda d=data: model.get_audio_hidden_states(d))
        )
        for _ in range(warmup):
            fn()
        hits0 = _hits(model)
        times, out = timer.repeat(fn, timed)
        rows[name] = {**_timing(times), "replayed": _hits(model) - hits0, "calls": timed}
        outs[name] = _output(out)
    return {"rows": rows, "outputs": outs}


def measure_tree(*, cpu: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Measure the vllm-omni on ``sys.path`` (see the module docstring).

    Returns:
        ``(figures, outputs)``: the JSON-ready figures (``features``, ``eager`` / ``graphed`` rows by
        call name, ``duplex``, the adapters' ``stats``, the build) and the outputs by
        ``"<eager|graphed>/<call name>"`` (float32 CPU tensors).

    Raises:
        whatever building the model or a call raises (a capture failure is fatal, as in serving).
    """
    from minicpmo_cg import standalone
    from minicpmo_cg.vllm_config import duplex_vllm_config, standalone_vllm_config

    features = tree_features()
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    model = standalone.build_thinker_encoders(
        device=device,
        dtype=dtype,
        reduced=cpu,
        seed=SEED,
        vision_attn="sdpa" if features["sdpa"] else "eager",
    )
    timer = measure.Timer(device)
    mode = "cpu" if cpu else "cuda"
    backend = clock = None
    if cpu and features["graphs"]:
        from minicpmo_cg.bench.cpu_backend import CpuGraphBackend, ScriptedClock

        clock = ScriptedClock()
        backend = CpuGraphBackend(clock=clock)
    call_args = {name: _inputs(kind, spec[1] if cpu else spec[0], device, dtype)
                 for name, (kind, *spec) in CALLS.items()}  # fmt: skip
    chunks = _duplex_chunks(DUPLEX_CHUNKS[mode], device)
    config = duplex_vllm_config(standalone_vllm_config(), 2)
    figures: dict[str, Any] = {"features": features, "build": dataclass_dict(model.build_info)}
    outputs: dict[str, torch.Tensor] = {}
    warmup = EAGER_WARMUP[mode]
    with torch.inference_mode(), _clock_for_adapters(clock):
        if features["graphs"]:
            standalone.wire_encoder_graphs(model, config, enabled=False)
        eager = _call_pass(model, timer, call_args, warmup, TIMED_CALLS[mode])
        for _ in range(warmup):
            _session(model, timer, chunks)
        times, outputs["eager/" + DUPLEX] = _session(model, timer, chunks)
        figures["eager"] = {**eager["rows"], DUPLEX: _duplex_timing(times)}
        outputs.update({f"eager/{k}": v for k, v in eager["outputs"].items()})
        if not features["graphs"]:
            figures["graphed"] = None
            return figures, outputs
        standalone.wire_encoder_graphs(model, config, enabled=True, backend=backend)
        duplex_rows: dict[str, Any] = {}
        if features["startup_capture"]:
            startup = importlib.import_module(f"{_MODELS}.startup_capture")
            t0 = time.perf_counter()
            report = startup.capture_at_startup(model, config)
            duplex_rows["startup"] = {
                "graphs": report.num_graphs,
                "mib": round(report.total_bytes / 2**20, 1),
                "seconds": round(time.perf_counter() - t0, 2),
            }
            lazy = []
        else:
            lazy = [_session(model, timer, chunks)[0] for _ in range(2)]
        hits0 = _hits(model)
        times, outputs["graphed/" + DUPLEX] = _session(model, timer, chunks)
        duplex_rows.update(_duplex_timing(times))
        duplex_rows["replayed"] = _hits(model) - hits0
        duplex_rows["calls"] = len(chunks)
        duplex_rows["timed_session"] = 3 if lazy else 1
        if lazy:
            duplex_rows["first_session"] = _duplex_timing(lazy[0])
        graphed = _call_pass(model, timer, call_args, WARMUP_CALLS, TIMED_CALLS[mode])
        figures["graphed"] = {**graphed["rows"], DUPLEX: duplex_rows}
        outputs.update({f"graphed/{k}": v for k, v in graphed["outputs"].items()})
        figures["stats"] = _stats_of(model)
    return figures, outputs


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
    c = sub.add_parser("compare", help="relate the outputs of the labels, in order; writes compare.json")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("labels", nargs="+")
    return p.parse_args(argv)


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
    with contextlib.redirect_stdout(sys.stderr):
        figures, outputs = measure_tree(cpu=cpu)
    figures.update(label=args.label, seconds=round(time.perf_counter() - t0, 1), cpu=cpu,
                   device=torch.cuda.get_device_name(0) if not cpu else "cpu", versions=measure.versions())  # fmt: skip
    torch.save(outputs, args.out / f"{args.label}.pt")
    (args.out / f"{args.label}.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(f"{args.label}: {figures['seconds']} s, wrote {args.out / (args.label + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
