"""Differential check: the patched legacy lane computes what vllm 0.30.0 computes natively.

``differential_outputs()`` evaluates the changed code on inputs drawn from fixed seeds:
Idefics2 position ids, packed MiniCPM-V canvases, normalised tgt_sizes, the MiniCPM-V
patch-grid keys and replay buffers, the resampler's output, and the graph-key sets and
axis keys the manager captures/replays with. Each lane saves them to
``$MINICPMO_CG_DIFF_DIR/<lane>.pt``; when the other lane's file is there, the two must be
exactly equal. CI runs the current lane first, then the legacy lane, with the same dir.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import test_capture_axes as cap
import test_idefics2_position_ids as idef
import test_minicpmv_encoder_cudagraph as mini
import torch
from test_minicpmv_encoder_cudagraph import _cpu_only_host  # noqa: F401  (autouse fixture)

pytestmark = [pytest.mark.core_model, pytest.mark.legacy_lane]

DIFF_DIR_ENV = "MINICPMO_CG_DIFF_DIR"
FORMAT = 1


def _position_ids() -> dict[str, torch.Tensor]:
    out = {}
    for image_size in (56, 448, 980):
        emb = idef._embeddings(image_size)
        per_side = image_size // idef.PATCH
        gen = torch.Generator().manual_seed(1000 + image_size)
        for padded in (False, True):
            tag = f"pos/{image_size}/{'padded' if padded else 'full'}"
            mask, sizes = idef._random_prefix_batch(gen, 6, per_side + 6, padded)
            out[f"{tag}/prefix+tgt"] = emb.get_position_ids(mask, sizes)
            out[f"{tag}/prefix"] = emb.get_position_ids(mask)
            out[f"{tag}/2d"] = emb.get_position_ids(mask[:, 0, :])
            grid, _ = idef._random_grid_batch(gen, 5, per_side + 6, padded)
            out[f"{tag}/grid"] = emb.get_position_ids(grid)
    return out


def _packing_and_tgt_sizes() -> dict[str, Any]:
    from vllm.model_executor.models import minicpmv

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(2024)
    grids = [[(2, 3), (4, 4)], [(1, 6)], [(3, 2), (2, 2), (1, 1)]]
    pixel_values, tgt_sizes = mini.make_items(gen, grids)
    slices = [s for item in pixel_values for s in item]
    for key in ((4, 4), (4, 6), (6, 3), (8, 8)):
        out[f"pack/{key}"] = minicpmv._mcpmv_pack_flat_pixels(
            slices,
            pixel_height=key[0] * mini.PATCH,
            pixel_width=key[1] * mini.PATCH,
            max_num_slices=len(slices) + 1,
            device=torch.device("cpu"),
            dtype=torch.float32,
            patch_size=mini.PATCH,
            tgt_sizes=torch.cat(tgt_sizes),
        )
    counts = [len(g) for g in grids]
    padded = torch.zeros(len(grids), max(counts), 2, dtype=torch.long)
    for i, t in enumerate(tgt_sizes):
        padded[i, : len(t)] = t
    norm = minicpmv._mcpmv_normalize_tgt_sizes
    out["tgt/list"] = norm(tgt_sizes, counts)
    out["tgt/flat"] = norm(torch.cat(tgt_sizes), counts)
    out["tgt/padded"] = norm(padded, counts)
    out["tgt/per_item"] = norm(torch.tensor([[2, 3], [1, 6], [3, 2]]), counts)
    return out


def _minicpmv_model_outputs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for image_size in (56, 448, 896, 980):
        model = mini.tiny_minicpmv((2, 5), image_size=image_size)
        out[f"keys/{image_size}"] = [list(k) for k in model.get_encoder_cudagraph_config().capture_axes[0]]

    from vllm.v1.worker.encoder_cudagraph_defs import ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG

    model = mini.tiny_minicpmv((2, 6), image_size=112, seed=3)
    gen = torch.Generator().manual_seed(77)
    pixel_values, tgt_sizes = mini.make_items(gen, [[(2, 3), (8, 8)], [(1, 5)], [(4, 2), (3, 3), (1, 1)]])
    mm_kwargs = {"pixel_values": pixel_values, "tgt_sizes": tgt_sizes}
    with torch.inference_mode():
        for indices in ([0], [1], [2, 0], [1, 2]):
            selected = model.select_encoder_cudagraph_items(mm_kwargs, indices)
            out[f"select/{indices}/axis_keys"] = [
                list(k) for k in selected.pop(ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG)
            ]
            out[f"select/{indices}/flat"] = selected["minicpmv_encoder_input_flat"]
            replay = model.prepare_encoder_cudagraph_replay_buffers(selected, 3, 0).values
            for name, value in sorted(replay.items()):
                out[f"replay/{indices}/{name}"] = value
        capture = model.prepare_encoder_cudagraph_capture_inputs(
            32, 3, 0, torch.device("cpu"), torch.float32, "default", ((8, 8),)
        ).values
        for name, value in sorted(capture.items()):
            out[f"capture/{name}"] = value
        sizes = torch.tensor([[2, 3], [4, 4], [1, 1], [3, 5]])
        x = torch.randn(4, 18, model.vision_dim, generator=gen)
        out["resampler"] = model.resampler(x, sizes)
    return out


def _manager_graph_keys(monkeypatch) -> dict[str, Any]:
    import vllm.v1.worker.encoder_cudagraph as ec

    monkeypatch.setattr(torch.cuda, "CUDAGraph", cap._EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", cap._emulated_capture)
    monkeypatch.setattr(ec, "current_stream", lambda: None, raising=False)
    out: dict[str, Any] = {}
    for name, axes in (("none", ()), ("one", (("a", "b"),)), ("two", cap.TWO_AXES)):
        model = cap.FakeAxisModel(
            capture_axes=axes, resolve=cap._resolve_two_axes if axes == cap.TWO_AXES else None
        )
        manager = cap._make_manager(model)
        manager.capture(graph_pool=object())
        out[f"graphs/{name}/count"] = manager.get_num_graphs_to_capture()
        out[f"graphs/{name}/keys"] = sorted(repr(k) for k in manager.budget_graphs["default"])
        out[f"graphs/{name}/capture_order"] = [(b, repr(tuple(k or ()))) for b, _, k in model.capture_calls]
    return out


def differential_outputs(monkeypatch) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    outputs.update(_position_ids())
    outputs.update(_packing_and_tgt_sizes())
    outputs.update(_minicpmv_model_outputs())
    outputs.update(_manager_graph_keys(monkeypatch))
    return outputs


def _assert_same(mine: dict[str, Any], theirs: dict[str, Any], other: str) -> None:
    assert sorted(mine) == sorted(theirs), f"output names differ from the {other} lane's"
    mismatched = []
    for name in sorted(mine):
        a, b = mine[name], theirs[name]
        if isinstance(a, torch.Tensor):
            same = (
                isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            )
        else:
            same = a == b
        if not same:
            mismatched.append(name)
    assert not mismatched, f"differs from the {other} lane: {mismatched}"


@pytest.mark.cpu
def test_differential_outputs_are_deterministic(tp_group, monkeypatch):
    first = differential_outputs(monkeypatch)
    second = differential_outputs(monkeypatch)
    _assert_same(first, second, "same")
    assert len(first) > 60


@pytest.mark.cpu
def test_patched_legacy_equals_native_current(tp_group, monkeypatch, lane):
    import vllm

    outputs = differential_outputs(monkeypatch)
    diff_dir = os.environ.get(DIFF_DIR_ENV)
    if not diff_dir:
        pytest.skip(f"{DIFF_DIR_ENV} is unset: no directory to exchange outputs between the lanes")
    directory = Path(diff_dir)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "vllm": vllm.__version__, "outputs": outputs}, directory / f"{lane}.pt")

    other = "current" if lane == "legacy" else "legacy"
    other_file = directory / f"{other}.pt"
    if not other_file.exists():
        pytest.skip(
            f"{other_file} is missing: run this test on the {other} lane with the same "
            f"{DIFF_DIR_ENV} to compare (saved this lane's outputs to {directory / f'{lane}.pt'})"
        )
    saved = torch.load(other_file, weights_only=False)
    assert saved["format"] == FORMAT, f"{other_file} was written by another version of this test"
    _assert_same(outputs, saved["outputs"], f"{other} (vllm {saved['vllm']})")
