# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's thinker stage through vLLM's engine, in one process, and what it answered."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: ``--hf-overrides`` per mode. Graphed admits by count, so the second sighting of a shape
#: captures and the third replays, whatever the measured saving.
MODES: dict[str, dict[str, Any]] = {
    "eager": {"encoder_cuda_graph": False},
    "graphed": {"encoder_cuda_graph_admission": "count"},
    "default": {},  # what a user gets: graphs on, cost admission (also vllm-omni as released)
}
#: no torch.compile (fast start-up); full decode graphs, so vLLM profiles graph memory as it serves
COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
REPEATS = 3
MAX_TOKENS = 8
TOP_LOGPROBS = 5
QUESTION = "<|im_start|>user\n{media}\n{text}<|im_end|>\n<|im_start|>assistant\n"
IMAGE, AUDIO = "(<image>./</image>)", "(<audio>./</audio>)"


def prompts() -> dict[str, dict[str, Any]]:
    """The fixed requests, by name: vLLM prompt dicts with ``multi_modal_data``."""
    from minicpmo_cg.inputs import load_photo, load_wav_16k, voice_files

    photo = load_photo("astronaut")
    wav = load_wav_16k(voice_files()[0])
    speech = [wav[: 16000]] + [(wav.tolist() * (1 + 480000 // len(wav)))[:480000]]
    image_1 = photo.resize((448, 448))
    image_10 = photo.resize((1344, 1344))  # 3 x 3 slices and the overview
    import numpy as np

    audio_1, audio_30 = (np.asarray(a, dtype=np.float32) for a in speech)

    def ask(text: str, image: Any = None, audio: Any = None) -> dict[str, Any]:
        media = "".join([IMAGE] * (image is not None) + [AUDIO] * (audio is not None))
        data = {"image": image} if image is not None else {}
        if audio is not None:
            data["audio"] = (audio, 16000)
        return {"prompt": QUESTION.format(media=media, text=text), "multi_modal_data": data}

    return {
        "image_1_slice": ask("Describe the image.", image=image_1),
        "image_10_slices": ask("Describe the image.", image=image_10),
        "audio_1s": ask("Transcribe the audio.", audio=audio_1),
        "audio_30s": ask("Transcribe the audio.", audio=audio_30),
        "image_and_audio": ask("Describe the image, then transcribe the audio.", image=image_1, audio=audio_1),
    }


def engine_args(model: str, mode: str, *, session_mode: str, startup_capture: bool, compilation: dict) -> Any:
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    overrides = dict(MODES[mode])
    if not startup_capture:
        overrides["encoder_cuda_graph_startup_capture"] = False
    return OmniEngineArgs(
        model=model,
        trust_remote_code=True,
        model_stage="llm",
        model_arch="MiniCPMO45OmniForConditionalGeneration",
        worker_type="ar",
        session_mode=session_mode,
        attention_backend="TRITON_ATTN",
        compilation_config=compilation,
        hf_overrides=overrides,
        max_model_len=4096,
        max_num_seqs=32,
        gpu_memory_utilization=float(os.environ.get("MINICPMO_CG_E2E_GPU_UTIL", "0.5")),
        enable_prefix_caching=False,  # every repeat runs the encoders again
        limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0},
        seed=0,
    )


def _model_stats(worker: Any) -> dict[str, Any]:
    """Each adapter's ``get_cumulative_stats()`` (runs in the worker)."""
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    thinker = getattr(model, "thinker", model)
    vpm = getattr(thinker, "vpm", None)
    adapters = {
        "vision": getattr(vpm, "_encoder_graph", None),
        "audio": getattr(thinker, "_audio_encoder_graph", None),
        "streaming audio": getattr(getattr(thinker, "_streaming_audio", None), "graph", None),
    }
    return {name: a.get_cumulative_stats() for name, a in adapters.items() if a is not None}


def answer(engine: Any, requests: dict[str, dict[str, Any]]) -> dict[str, list[dict]]:
    """Each request, :data:`REPEATS` times, greedily: token ids, text, first-token logprobs,
    expanded prompt length and seconds to the first token, per request name."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, seed=0)
    answers: dict[str, list[dict]] = {}
    for repeat in range(REPEATS):
        for name, prompt in requests.items():
            t = time.perf_counter()
            engine.add_request(f"{name}-{repeat}", prompt, params)
            first_token_s = None
            final = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if first_token_s is None and out.outputs and out.outputs[0].token_ids:
                        first_token_s = time.perf_counter() - t
                    if out.finished:
                        final = out
            completion = final.outputs[0]
            first = completion.logprobs[0] if completion.logprobs else {}
            answers.setdefault(name, []).append(
                {
                    "token_ids": list(completion.token_ids),
                    "text": completion.text,
                    "first_logprobs": {str(t): lp.logprob for t, lp in first.items()},
                    "prompt_tokens": len(final.prompt_token_ids or []),
                    "ttft_s": first_token_s,
                }
            )
    return answers


def _variant(prompt: dict[str, Any], i: int) -> dict[str, Any]:
    """``prompt`` with its media changed in one value: the same shapes, another multimodal hash
    (vLLM's encoder cache would otherwise encode identical concurrent inputs once)."""
    import numpy as np

    data = dict(prompt["multi_modal_data"])
    if "image" in data:
        image = data["image"].copy()
        image.putpixel((i % image.width, 0), (i % 256, 0, 0))
        data["image"] = image
    if "audio" in data:
        audio, rate = data["audio"]
        audio = np.array(audio, copy=True)
        audio[0] += 1e-4 * (i + 1)
        data["audio"] = (audio, rate)
    return {"prompt": prompt["prompt"], "multi_modal_data": data}


def _first_tokens(engine: Any, prompts: list[Any], tag: str) -> tuple[list[float], int]:
    """Submit ``prompts`` at once and step until all finish."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start, first, length = time.perf_counter(), {}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = (time.perf_counter() - start) * 1e3
                length = len(out.prompt_token_ids or [])
    return sorted(first.values()), length


def bench(engine: Any, requests: dict[str, dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    """Time to first token per prompt and concurrency, beside a text prompt of the same length (no
    encoder call): their difference estimates the encoders' share. Two warm-up rounds come first, so
    a graphed engine has captured what its admission takes."""
    import statistics

    rows, serial = [], 0
    for name, prompt in requests.items():
        for _ in range(2):
            serial += 1
            _, length = _first_tokens(engine, [_variant(prompt, 1000 + serial)], f"warm-{serial}")
        for n in levels:
            serial += 1
            media, _ = _first_tokens(engine, [_variant(prompt, 100 * serial + i) for i in range(n)], f"mm-{serial}")
            text, _ = _first_tokens(engine, [{"prompt_token_ids": [1] * length}] * n, f"text-{serial}")
            row = {
                "prompt": name,
                "concurrency": n,
                "prompt_tokens": length,
                "ttft_ms_median": statistics.median(media),
                "ttft_ms_max": media[-1],
                "text_ttft_ms_median": statistics.median(text),
            }
            rows.append(row)
            print(f"bench {name} x{n}: {row['ttft_ms_median']:.1f} ms (text {row['text_ttft_ms_median']:.1f})", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=sorted(MODES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--session-mode", choices=("turn", "duplex"), default="turn")
    ap.add_argument("--no-startup-capture", action="store_true")
    ap.add_argument("--compilation", default=json.dumps(COMPILATION), help="vLLM's compilation config, JSON")
    ap.add_argument("--only", nargs="*", default=[], help="prompt names (default: all)")
    ap.add_argument("--bench", type=int, nargs="*", help="time to first token at these concurrencies instead")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm.v1.engine.llm_engine import LLMEngine

    record = {
        "mode": args.mode,
        "session_mode": args.session_mode,
        "startup_capture": not args.no_startup_capture,
        "compilation": json.loads(args.compilation),
    }
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        engine_args(
            args.model,
            args.mode,
            session_mode=args.session_mode,
            startup_capture=not args.no_startup_capture,
            compilation=record["compilation"],
        )
    )
    record |= {"startup_s": time.perf_counter() - t0, "num_gpu_blocks": engine.vllm_config.cache_config.num_gpu_blocks}
    requests = {k: v for k, v in prompts().items() if not args.only or k in args.only}
    if args.bench:
        record["rows"] = bench(engine, requests, args.bench)
    else:
        record["answers"] = answer(engine, requests)
    record["stats"] = engine.collective_rpc(_model_stats)[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"thinker_engine: {args.mode} ({args.session_mode}) wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
