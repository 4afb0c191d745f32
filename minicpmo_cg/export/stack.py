"""The stack of upstream pull requests, in merge order: the changes that need no graph first."""

from __future__ import annotations

from typing import NamedTuple


class Pr(NamedTuple):
    key: str
    patches: tuple[str, ...]
    owned: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()


M = "vllm_omni/model_executor/models/minicpmo_4_5/"
G = M + "encoder_cuda_graph/"
T = "tests/model_executor/models/minicpmo_4_5/"

STACK = (
    Pr(
        "siglip-attention",
        ("0001", "0002"),
        (M + "siglip_attention.py",),
        (T + "test_vision_attention.py", T + "test_audio_layout.py"),
    ),
    Pr("audio-lengths", ("0003",), (M + "audio_lengths.py",)),
    Pr(
        "encoder-graphs",
        ("0004", "0005"),
        (
            *(G + f"{m}.py" for m in ("__init__", "adapter", "admission", "backend", "factory", "immediate")),
            *(G + f"{m}.py" for m in ("options", "shapes")),
            M + "encoder_graphs.py",
            M + "vision_path.py",
            M + "fused_layers.py",
            M + "ops/__init__.py",
            M + "ops/fused_add_layer_norm.py",
        ),
        (
            *(T + f"test_encoder_cuda_graph_{m}.py" for m in ("admission", "cuda", "failed_capture", "models")),
            *(T + f"test_encoder_cuda_graph_{m}.py" for m in ("multi_gpu", "options", "options_page", "platform")),
            *(T + f"test_encoder_cuda_graph_{m}.py" for m in ("policy", "threads", "wiring")),
            *(T + f"test_{m}.py" for m in ("vision_attention_overrides", "vision_path", "model_wiring")),
            T + "test_vision_graph_cuda.py",
        ),
    ),
    Pr(
        "streaming-audio",
        ("0006",),
        (M + "streaming_audio.py",),
        (T + "test_audio_host_reads.py",),
    ),
    Pr("fused-layers", ("0007",), (), (T + "test_fused_layers.py", T + "test_fused_layers_cuda.py")),
    Pr("startup-capture", ("0008", "0009"), (M + "startup_capture.py",), (T + "test_startup_capture.py",)),
    Pr("duplex-batch", ("0010", "0011", "0012"), (M + "duplex_step.py",), (T + "test_streaming_audio.py",)),
)

#: The vLLM PR the graph PRs need: patches of ``patches/vllm/`` and its test, at vLLM's path below
#: ``tests/vllm_patches/upstream/``.
VLLM = Pr(
    "capture-error-mode",
    ("0007",),
    (),
    ("tests/vllm_patches/upstream/tests/v1/cudagraph/test_encoder_cudagraph_capture_error_mode.py",),
)
