"""MiniCPM-V 2.5/2.6/4.0 encoder CUDA graph mixin (patch 0006 on legacy, upstream on current).

The tests build tiny MiniCPM-V models: the real classes with a small Idefics2 ViT and
resampler and no language model (the encoder graph never touches it). The graph path
(select -> capture buffers zero-filled and copied like the manager does -> forward) is
compared with the model's eager encoder on CPU; the CUDA test captures real graphs with
the manager and replays them.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

pytestmark = [pytest.mark.core_model, pytest.mark.legacy_lane]

PATCH = 14
QUERY_NUM = 4
EMBED_DIM = 256  # the resampler uses embed_dim // 128 heads
VERSIONS = [(2, 5), (2, 6), (4, 0)]
BUF_PIXEL, BUF_TGT, BUF_MASK = "minicpmv_pixel_values", "minicpmv_tgt_sizes", "minicpmv_patch_attn_mask"


@pytest.fixture(scope="module")
def mcpmv():
    from vllm.model_executor.models import minicpmv

    return minicpmv


@pytest.fixture(autouse=True)
def _cpu_only_host(monkeypatch):
    """vllm 0.30.0's code assumes a CUDA driver in two places the CPU tests reach:
    Resampler2_5.forward asks torch.cuda whether a capture is running (even for CPU
    tensors) and the replay buffers copy tgt_sizes through pinned memory (even from
    CPU to CPU). Without a driver both raise, so answer "not capturing" and skip the
    pinning there; the patched legacy code does neither for CPU tensors."""
    if not torch.cuda.is_available():
        from vllm.utils import torch_utils

        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch_utils, "PIN_MEMORY", False, raising=False)


@contextlib.contextmanager
def _vllm_config(device):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
        yield


def tiny_minicpmv(version, *, image_size=56, max_slice_num=2, device="cpu", seed=0):
    """A MiniCPM-V model of ``version`` with a 2-layer ViT, no LLM, random weights."""
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
    from vllm.config.multimodal import MultiModalConfig
    from vllm.model_executor.models import minicpmv

    cls = {(2, 5): minicpmv.MiniCPMV2_5, (2, 6): minicpmv.MiniCPMV2_6, (4, 0): minicpmv.MiniCPMV4_0}[version]
    vision_config = Idefics2VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=PATCH,
    )
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config = SimpleNamespace(
        vision_config=vision_config,
        query_num=QUERY_NUM,
        max_slice_num=max_slice_num,
        hidden_size=EMBED_DIM,
        drop_vision_last_layer=False,
    )
    model.version = version
    model.multimodal_config = MultiModalConfig()
    model.embed_dim = EMBED_DIM
    with _vllm_config(device):
        model.vpm = model.init_vision_module(model.config, None, prefix="vpm")
        model.vision_dim = model.vpm.embeddings.embed_dim
        model.resampler = model.init_resampler(EMBED_DIM, model.vision_dim, prefix="resampler")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model.to(device).eval()


def to_flat(image: torch.Tensor) -> torch.Tensor:
    """The processor's flat slice: (3, p, n*p) with the n patches side by side, row-major."""
    channels = image.shape[0]
    cols = F.unfold(image[None], PATCH, stride=PATCH)  # (1, C*p*p, n)
    n = cols.shape[-1]
    return cols.reshape(channels, PATCH, PATCH, n).permute(0, 1, 3, 2).reshape(channels, PATCH, n * PATCH)


def make_items(gen, slice_grids):
    """mm_kwargs lists for items whose slices have the given (nb_h, nb_w) grids."""
    pixel_values, tgt_sizes = [], []
    for grids in slice_grids:
        slices = [to_flat(torch.randn(3, h * PATCH, w * PATCH, generator=gen)) for h, w in grids]
        pixel_values.append(slices)
        tgt_sizes.append(torch.tensor(grids, dtype=torch.long))
    return pixel_values, tgt_sizes


def fill_like_manager(capture_values, replay_values):
    """What the manager does before a replay: zero each buffer, copy the batch's rows."""
    for key, buf in capture_values.items():
        src = replay_values.get(key)
        if src is None:
            continue
        buf.zero_()
        buf[: src.shape[0]].copy_(src)
    return capture_values


# ---------------------------------------------------------------------------
# module helpers
# ---------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize("grid", [(2, 3), (3, 2), (1, 4), (4, 4), (1, 1)])
@pytest.mark.parametrize("canvas", [(4, 4), (4, 6), (6, 3)])  # (6, 3): rows wrap
def test_pack_flat_pixels_keeps_patch_order(mcpmv, grid, canvas):
    nb_h, nb_w = grid
    grid_h, grid_w = canvas
    gen = torch.Generator().manual_seed(nb_h * 10 + nb_w)
    image = torch.randn(3, nb_h * PATCH, nb_w * PATCH, generator=gen)
    packed = mcpmv._mcpmv_pack_flat_pixels(
        [to_flat(image)],
        pixel_height=grid_h * PATCH,
        pixel_width=grid_w * PATCH,
        max_num_slices=2,
        device=torch.device("cpu"),
        dtype=torch.float32,
        patch_size=PATCH,
        tgt_sizes=torch.tensor([grid]),
    )
    assert packed.shape == (2, 3 * grid_h * PATCH * grid_w * PATCH)
    canvas_img = packed[0].view(3, grid_h * PATCH, grid_w * PATCH)
    # Patches of the canvas read row-major == the slice's patches in order, then zeros.
    canvas_patches = F.unfold(canvas_img[None], PATCH, stride=PATCH)[0].T
    image_patches = F.unfold(image[None], PATCH, stride=PATCH)[0].T
    n = nb_h * nb_w
    torch.testing.assert_close(canvas_patches[:n], image_patches, rtol=0, atol=0)
    assert not canvas_patches[n:].any()
    assert not packed[1].any()  # unused slice row stays zero
    # What the ViT's patch convolution sees: the same embeddings, in the same order.
    weight = torch.randn(5, 3, PATCH, PATCH, generator=gen)
    via_canvas = F.conv2d(canvas_img[None], weight, stride=PATCH).flatten(2)[0, :, :n]
    via_flat = F.conv2d(to_flat(image)[None], weight, stride=PATCH).flatten(2)[0]
    torch.testing.assert_close(via_canvas, via_flat)


@pytest.mark.cpu
def test_pack_flat_pixels_other_slices_and_capacity(mcpmv):
    gen = torch.Generator().manual_seed(3)
    image = torch.randn(3, 2 * PATCH, 3 * PATCH, generator=gen)  # not in flat layout
    flat = to_flat(torch.randn(3, PATCH, 2 * PATCH, generator=gen))
    packed = mcpmv._mcpmv_pack_flat_pixels(
        [image, flat, flat],
        pixel_height=4 * PATCH,
        pixel_width=4 * PATCH,
        max_num_slices=2,
        device=torch.device("cpu"),
        dtype=torch.float32,
        patch_size=PATCH,
        tgt_sizes=torch.tensor([[2, 3], [1, 2], [1, 2]]),
    )
    assert packed.shape[0] == 2  # the third slice does not fit and is dropped
    canvas = packed[0].view(3, 4 * PATCH, 4 * PATCH)
    torch.testing.assert_close(canvas[:, : 2 * PATCH, : 3 * PATCH], image, rtol=0, atol=0)
    canvas[:, : 2 * PATCH, : 3 * PATCH] = 0
    assert not canvas.any()
    assert packed[1].view(3, 4 * PATCH, 4 * PATCH)[:, :PATCH, : 2 * PATCH].equal(flat)


@pytest.mark.cpu
def test_normalize_tgt_sizes_accepts_every_layout(mcpmv):
    counts = [2, 1, 3]
    per_slice = torch.tensor([[2, 3], [3, 2], [4, 4], [1, 2], [2, 2], [3, 3]])
    groups = list(torch.split(per_slice, counts))
    padded = torch.zeros(3, 3, 2, dtype=torch.long)
    for i, g in enumerate(groups):
        padded[i, : len(g)] = g
    padded[0, 2] = torch.tensor([9, 9])  # padding rows are ignored
    norm = mcpmv._mcpmv_normalize_tgt_sizes
    assert norm(groups, counts).equal(per_slice)  # list of per-item tensors
    assert norm(per_slice, counts).equal(per_slice)  # (total, 2)
    assert norm(padded, counts).equal(per_slice)  # (items, max_slices, 2)
    per_item = torch.tensor([[2, 3], [4, 4], [1, 1]])
    expected = torch.tensor([[2, 3], [2, 3], [4, 4], [1, 1], [1, 1], [1, 1]])
    assert norm(per_item, counts).equal(expected)  # one size per item
    assert norm([], []).shape == (0, 2)


# ---------------------------------------------------------------------------
# the mixin
# ---------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("image_size", "keys"),
    [
        (980, ((32, 32), (32, 64), (64, 32), (70, 70))),
        (896, ((32, 32), (32, 64), (64, 32), (64, 64))),
        (448, ((32, 32),)),
        (56, ((4, 4),)),
    ],
)
def test_capture_axis_is_the_patch_grid_buckets(tp_group, image_size, keys):
    model = tiny_minicpmv((2, 5), image_size=image_size)
    config = model.get_encoder_cudagraph_config()
    assert config.capture_axes == (keys,)
    assert config.modalities == ["image"]
    assert config.buffer_keys == [BUF_PIXEL, BUF_TGT, BUF_MASK]
    assert config.out_hidden_size == EMBED_DIM


@pytest.mark.cpu
@pytest.mark.parametrize("version", [(2, 6), (4, 0)])
def test_video_versions(tp_group, monkeypatch, version):
    model = tiny_minicpmv(version)
    monkeypatch.setattr(model, "get_max_frames_per_video", lambda: 5)
    config = model.get_encoder_cudagraph_config()
    assert config.modalities == ["image", "video"]
    assert config.max_frames_per_video == 5
    assert model.get_input_modality({"video_pixel_values": []}) == "video"
    assert model.get_input_modality({"pixel_values": []}) == "image"


@pytest.mark.cpu
def test_only_2_5_2_6_4_0_use_the_mixin(mcpmv):
    from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph

    for cls in (mcpmv.MiniCPMV2_5, mcpmv.MiniCPMV2_6, mcpmv.MiniCPMV4_0):
        assert issubclass(cls, mcpmv._MiniCPMVEncoderCudaGraphMixin)
        assert SupportsEncoderCudaGraph in cls.__mro__
        assert cls.supports_encoder_cudagraph is True
    for cls in (mcpmv.MiniCPMV2_0, mcpmv.MiniCPMV4_5):
        assert not issubclass(cls, mcpmv._MiniCPMVEncoderCudaGraphMixin)
        assert SupportsEncoderCudaGraph not in cls.__mro__


@pytest.mark.cpu
def test_budget_range_and_item_specs(tp_group):
    from minicpmo_cg.vllm_config import standalone_vllm_config

    model = tiny_minicpmv((2, 6))
    vllm_config = standalone_vllm_config()
    object.__setattr__(vllm_config.model_config, "max_model_len", 1000)
    vllm_config.scheduler_config.max_num_batched_tokens = 512
    assert model.get_encoder_cudagraph_budget_range(vllm_config) == (QUERY_NUM, 512)

    pixel_values, tgt_sizes = make_items(
        torch.Generator().manual_seed(0), [[(2, 3)], [(4, 4), (1, 2), (3, 1)]]
    )
    specs = model.get_encoder_cudagraph_item_specs({"pixel_values": pixel_values, "tgt_sizes": tgt_sizes})
    assert [s.output_tokens for s in specs] == [1 * QUERY_NUM, 3 * QUERY_NUM]
    assert [s.input_size for s in specs] == [6, 16 + 2 + 3]


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("indices", "expected_key"),
    [
        ([0], (32, 32)),
        ([1], (32, 64)),
        ([2], (64, 32)),
        ([0, 1], (32, 64)),
        ([1, 2], (70, 70)),
        ([3], (70, 70)),
    ],
)
def test_select_resolves_the_smallest_covering_patch_grid(tp_group, indices, expected_key):
    from vllm.v1.worker.encoder_cudagraph_defs import ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG

    model = tiny_minicpmv((2, 6), image_size=980)
    grids = [[(3, 5), (20, 30)], [(10, 40)], [(40, 10), (1, 1)], [(66, 66)]]
    mm_kwargs = {
        "pixel_values": [[torch.zeros(3, PATCH, h * w * PATCH) for h, w in item] for item in grids],
        "tgt_sizes": [torch.tensor(item) for item in grids],
    }
    selected = model.select_encoder_cudagraph_items(mm_kwargs, indices)
    assert selected[ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG] == (expected_key,)
    assert selected["minicpmv_encoder_patch_grid"] == expected_key
    num_slices = sum(len(grids[i]) for i in indices)
    h, w = expected_key
    assert selected["minicpmv_encoder_input_flat"].shape == (num_slices, 3 * h * PATCH * w * PATCH)
    assert selected["pixel_values"] == [mm_kwargs["pixel_values"][i] for i in indices]
    got_tgt = torch.cat(list(selected["tgt_sizes"]))
    assert got_tgt.equal(torch.cat([mm_kwargs["tgt_sizes"][i] for i in indices]))

    empty = model.select_encoder_cudagraph_items(mm_kwargs, [])
    assert empty[ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG] == ((32, 32),)
    assert empty["pixel_values"] == []


@pytest.mark.cpu
@pytest.mark.parametrize("key", [(32, 32), (32, 64), (64, 32), (70, 70)])
def test_capture_inputs_per_axis_key(tp_group, key):
    model = tiny_minicpmv((2, 6), image_size=980, max_slice_num=2)
    # budget 40 tokens -> 10 slices, but 3 items x (2 + 1) slices cap it at 9
    capture = model.prepare_encoder_cudagraph_capture_inputs(
        40, 3, 0, torch.device("cpu"), torch.float32, "default", (key,)
    ).values
    h, w = key
    assert set(capture) == {BUF_PIXEL, BUF_TGT, BUF_MASK}
    assert capture[BUF_PIXEL].shape == (9, 3, h * PATCH, w * PATCH)
    assert capture[BUF_PIXEL].dtype == torch.float32 and not capture[BUF_PIXEL].any()
    assert capture[BUF_TGT].dtype == torch.long
    assert capture[BUF_TGT].equal(torch.tensor([key] * 9))
    assert capture[BUF_MASK].dtype == torch.bool and capture[BUF_MASK].shape == (9, h * w)
    assert capture[BUF_MASK].all()
    # Keyword form (the legacy manager's call) is the same.
    by_keyword = model.prepare_encoder_cudagraph_capture_inputs(
        8, 3, 0, torch.device("cpu"), torch.float32, path="default", axis_keys=(key,)
    ).values
    assert by_keyword[BUF_PIXEL].shape == (2, 3, h * PATCH, w * PATCH)  # 8 // 4 = 2 slices
    # Without axis keys: the full grid.
    full = model.prepare_encoder_cudagraph_capture_inputs(8, 3, 0, torch.device("cpu"), torch.float32).values
    assert full[BUF_PIXEL].shape == (2, 3, 70 * PATCH, 70 * PATCH)


@pytest.mark.cpu
def test_video_frames_raise_the_slice_cap(tp_group):
    model = tiny_minicpmv((2, 6), image_size=56, max_slice_num=2)
    image_only = model.prepare_encoder_cudagraph_capture_inputs(400, 2, 0, torch.device("cpu"), torch.float32)
    with_video = model.prepare_encoder_cudagraph_capture_inputs(400, 2, 8, torch.device("cpu"), torch.float32)
    assert image_only.values[BUF_PIXEL].shape[0] == 2 * 3
    assert with_video.values[BUF_PIXEL].shape[0] == 8 * 3


@pytest.mark.cpu
@pytest.mark.parametrize("key", [(32, 32), (32, 64), (70, 70)])
def test_replay_buffers_and_patch_masks(tp_group, key):
    model = tiny_minicpmv((2, 6), image_size=980)
    gen = torch.Generator().manual_seed(1)
    grids = [[(3, 5), (2, 7)], [(1, 4)]]
    pixel_values, tgt_sizes = make_items(gen, grids)
    # A batch packed for ``key`` (select picks (32, 32) for these slices; the buffers of
    # any key are built the same way).
    batch = {
        "pixel_values": pixel_values,
        "tgt_sizes": tgt_sizes,
        "minicpmv_encoder_input_flat": _repack(pixel_values, tgt_sizes, key),
        "minicpmv_encoder_patch_grid": key,
    }
    replay = model.prepare_encoder_cudagraph_replay_buffers(batch, 3, 0).values
    h, w = key
    assert replay[BUF_PIXEL].shape == (3, 3, h * PATCH, w * PATCH)
    assert replay[BUF_PIXEL].reshape(3, -1).equal(batch["minicpmv_encoder_input_flat"])
    assert replay[BUF_TGT].dtype == torch.long and replay[BUF_TGT].tolist() == [[3, 5], [2, 7], [1, 4]]
    mask = replay[BUF_MASK]
    assert mask.shape == (3, h * w)
    for row, n in zip(mask, (15, 14, 4)):
        assert row[:n].all() and not row[n:].any()


def _repack(pixel_values, tgt_sizes, key):
    from vllm.model_executor.models import minicpmv

    slices = [s for item in pixel_values for s in item]
    return minicpmv._mcpmv_pack_flat_pixels(
        slices,
        pixel_height=key[0] * PATCH,
        pixel_width=key[1] * PATCH,
        max_num_slices=len(slices),
        device=torch.device("cpu"),
        dtype=torch.float32,
        patch_size=PATCH,
        tgt_sizes=torch.cat(tgt_sizes),
    )


@pytest.mark.cpu
@pytest.mark.parametrize("version", VERSIONS)
def test_graph_path_matches_eager_encoder(tp_group, version):
    """select -> capture buffers (zero-filled, batch rows copied) -> forward == eager encoder."""
    from vllm.v1.worker.encoder_cudagraph_defs import ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG

    model = tiny_minicpmv(version, image_size=112, max_slice_num=2)  # 8x8 patch grid
    gen = torch.Generator().manual_seed(5)
    grids = [[(2, 3), (8, 8)], [(1, 5)], [(4, 2), (3, 3), (1, 1)]]
    pixel_values, tgt_sizes = make_items(gen, grids)
    mm_kwargs = {"pixel_values": pixel_values, "tgt_sizes": tgt_sizes}
    indices = [2, 0]
    num_slices = 5

    with torch.inference_mode():
        selected = model.select_encoder_cudagraph_items(mm_kwargs, indices)
        (key,) = selected.pop(ENCODER_CUDAGRAPH_AXIS_KEYS_KWARG)
        assert key == (8, 8)
        capture = model.prepare_encoder_cudagraph_capture_inputs(
            32, 3, 0, torch.device("cpu"), torch.float32, "default", (key,)
        ).values
        assert capture[BUF_PIXEL].shape[0] == 8  # 32 // 4 slice rows, 3 padding rows
        warmup = model.encoder_cudagraph_forward(dict(capture))
        assert warmup.shape == (8 * QUERY_NUM, EMBED_DIM)
        replay = model.prepare_encoder_cudagraph_replay_buffers(selected, 3, 0).values
        graph_out = model.encoder_cudagraph_forward(fill_like_manager(capture, replay))
        eager_out = model.encoder_eager_forward(selected)

    assert eager_out.shape == (num_slices * QUERY_NUM, EMBED_DIM)
    torch.testing.assert_close(graph_out[: num_slices * QUERY_NUM], eager_out, rtol=1e-4, atol=1e-4)
    # The eager path saw the same items, in the selected order.
    with torch.inference_mode():
        direct = model.encoder_eager_forward(
            {"pixel_values": [pixel_values[i] for i in indices], "tgt_sizes": [tgt_sizes[i] for i in indices]}
        )
    torch.testing.assert_close(eager_out, direct, rtol=0, atol=0)
    # ... although ``selected`` carried the private keys, which the eager path strips.
    assert {"minicpmv_encoder_input_flat", "minicpmv_encoder_patch_grid"} <= set(selected)


@pytest.mark.cpu
def test_resampler_batched_equals_one_slice_at_a_time(tp_group):
    """The vectorised, capture-safe Resampler2_5: padding keys are masked, positions per slice."""
    model = tiny_minicpmv((2, 6))
    gen = torch.Generator().manual_seed(11)
    sizes = torch.tensor([[2, 3], [4, 4], [1, 1], [3, 5]])
    counts = sizes.prod(-1)
    x = torch.randn(4, int(counts.max()) + 2, model.vision_dim, generator=gen)
    with torch.inference_mode():
        batched = model.resampler(x, sizes)
        for i in range(4):
            alone = model.resampler(x[i : i + 1, : int(counts[i])], sizes[i : i + 1])
            torch.testing.assert_close(batched[i], alone[0], rtol=1e-5, atol=1e-5)
    # Sizes beyond the position cache grow it (eager) instead of failing.
    big = torch.tensor([[80, 1]])
    with torch.inference_mode():
        out = model.resampler(torch.randn(1, 80, model.vision_dim, generator=gen), big)
    assert out.shape == (1, QUERY_NUM, EMBED_DIM) and torch.isfinite(out).all()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "tgt_sizes_on_host", [False, True]
)  # 0.28 keeps them on the device, 0.30 on the host
def test_cuda_manager_captures_and_replays_minicpmv(tp_group, monkeypatch, version, tgt_sizes_on_host):
    """Real capture through the manager; replay == the eager encoder, item by item."""
    # Full fp32 so the canvas and flat layouts differ only by summation order.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    from minicpmo_cg.vllm_config import standalone_vllm_config

    model = tiny_minicpmv(version, image_size=112, max_slice_num=2, device="cuda")
    vllm_config = standalone_vllm_config()
    vllm_config.compilation_config.encoder_cudagraph_token_budgets = [8, 32]
    vllm_config.compilation_config.encoder_cudagraph_max_vision_items_per_batch = 3
    # The frame count needs the checkpoint's processor; the tiny model has none.
    model.get_max_frames_per_video = lambda: 2
    manager = EncoderCudaGraphManager(vllm_config, torch.device("cuda"), torch.float32, model)
    assert manager.get_num_graphs_to_capture() == 2 * 1  # 112 // 14 = 8: one key (8, 8)
    with torch.cuda.stream(torch.cuda.Stream()):
        manager.capture(graph_pool=torch.cuda.graph_pool_handle())
    torch.cuda.synchronize()
    assert set(manager.budget_graphs["default"]) == {(8, ((8, 8),)), (32, ((8, 8),))}

    gen = torch.Generator().manual_seed(2)
    pixel_values, tgt_sizes = make_items(gen, [[(2, 3), (8, 8)], [(1, 5)], [(4, 2), (3, 3), (1, 1)]])
    mm_kwargs = {
        "pixel_values": [[s.cuda() for s in item] for item in pixel_values],
        "tgt_sizes": [t if tgt_sizes_on_host else t.cuda() for t in tgt_sizes],
    }
    with torch.inference_mode():
        outputs = manager.execute(mm_kwargs)
        for i, out in enumerate(outputs):
            eager = model.encoder_eager_forward(
                {"pixel_values": [mm_kwargs["pixel_values"][i]], "tgt_sizes": [mm_kwargs["tgt_sizes"][i]]}
            )
            torch.testing.assert_close(out, eager, rtol=1e-3, atol=1e-3)
    assert manager.graph_hits == 3 and manager.graph_misses == 0
