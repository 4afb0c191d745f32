# SPDX-License-Identifier: Apache-2.0
"""Two-GPU tests: per-device graphs, pools and capture streams; inputs spanning devices;
the memory floor's device; one worker process per GPU as with tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cuda,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.accelerator.device_count() < 2,
        reason="needs at least two CUDA devices",
    ),
]


def counting(ecg, *args, **options):
    """The adapter with ``admission="count"``: these tests pin capture mechanics on tiny forwards,
    whose graphs the cost rule would (rightly) decline; the cost rule has its own tests."""
    options.setdefault("admission", "count")
    return ecg.EncoderCudaGraph(*args, **options)


def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A capturable body whose weights follow the input's device."""
    w = torch.linspace(-1, 1, x.shape[-1] * x.shape[-1], device=x.device, dtype=x.dtype)
    y = x @ w.view(x.shape[-1], x.shape[-1])
    if mask is not None:
        y = y + mask.to(y.device).sum(-1, keepdim=True)
    return torch.tanh(y)


@torch.inference_mode()
def test_each_device_keeps_its_own_graphs_pools_and_capture_streams(ecg, vllm_config):
    graph = counting(ecg, forward, vllm_config)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    torch.accelerator.set_device_index(0)  # the current device stays 0 throughout
    for _ in range(3):
        for dev in devices:
            x = torch.randn(4, 32, device=dev)
            out = graph(x)
            assert out.device == dev
            torch.testing.assert_close(out, forward(x), rtol=0, atol=0)
    assert len(graph.graphs) == 2
    assert {key[1] for key in graph.graphs} == set(devices)
    assert {dev for dev, _ in graph._capture_pools} == set(devices)
    for (dev, _), pool in graph._capture_pools.items():
        assert pool.stream.device == dev
    pools = {manager.graph_pool for manager in graph.graphs.values()}
    assert len(pools) == 2
    assert {manager.device for manager in graph.graphs.values()} == set(devices)
    assert graph.get_cumulative_stats()["graph_hits"] == 4


@torch.inference_mode()
def test_inputs_spanning_two_devices_run_eagerly_as_ineligible(ecg, vllm_config):
    graph = counting(ecg, forward, vllm_config)
    x = torch.randn(2, 16, device="cuda:0")
    mask = torch.randn(2, 4, device="cuda:1")
    for _ in range(3):
        torch.testing.assert_close(graph(x, mask), forward(x, mask), rtol=0, atol=0)
    stats = graph.get_cumulative_stats()
    assert stats["ineligible_misses"] == 3 and stats["num_graphs"] == 0 and not graph.admission.history


@torch.inference_mode()
def test_memory_floor_reads_the_inputs_device_not_the_current_one(ecg, vllm_config, monkeypatch):
    asked = []

    class ReadingBackend(ecg.CudaGraphBackend):
        def free_bytes(self, device):
            asked.append(device)
            return 1 << 40

    graph = counting(ecg, forward, vllm_config, min_free_bytes=1, backend=ReadingBackend())
    torch.accelerator.set_device_index(0)
    x = torch.randn(2, 16, device="cuda:1")
    graph(x), graph(x)
    assert asked == [torch.device("cuda", 1)]

    seen = []
    platform = ecg.backend.omni_platforms.current_omni_platform  # where the backend reads free memory
    real = platform.get_free_memory
    monkeypatch.setattr(platform, "get_free_memory", lambda device=None: seen.append(device) or real(device))
    default = counting(ecg, forward, vllm_config, min_free_bytes=1)
    default(x), default(x)
    assert [torch.device(d) for d in seen] == [torch.device("cuda", 1)]
    assert len(default.graphs) == 1


WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from minicpmo_cg.vllm_config import standalone_vllm_config
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph import EncoderCudaGraph

    rank = int(sys.argv[1])
    torch.accelerator.set_device_index(rank)
    dev = torch.device("cuda", rank)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank)).to(dev)

    def fwd(x, mask=None):
        return torch.nn.functional.gelu(x @ w)

    graph = EncoderCudaGraph(fwd, standalone_vllm_config(), name=f"rank{rank}", admission="count")
    worst = 0.0
    with torch.inference_mode():
        for _ in range(6):
            x = torch.randn(8, 64, device=dev)
            worst = max(worst, (graph(x) - fwd(x)).abs().max().item())
    stats = graph.get_cumulative_stats()
    print(json.dumps({"rank": rank, "worst": worst, "stats": stats,
                      "devices": sorted({str(k[1]) for k in graph.graphs})}))
    """
)


def test_one_worker_process_per_gpu_captures_and_replays_its_own_graphs(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["devices"] == [f"cuda:{rank}"]
        assert result["worst"] == 0.0
        assert result["stats"]["num_graphs"] == 1
        assert result["stats"]["graph_hits"] == 5 and result["stats"]["warmup_misses"] == 1
