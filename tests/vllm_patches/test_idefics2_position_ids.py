"""Idefics2 ViT without host synchronisation (patch 0005 on legacy, upstream on current).

``Idefics2VisionEmbeddings.get_position_ids`` must equal a plain per-item loop, for
``(B, 1, L)`` masks with ``tgt_sizes`` (MiniCPM-V), ``(B, H, W)`` grid masks without
(Idefics2/3) and 2-D masks, padded or not, and must never read device values on the
host. On CPU the latter is shown by construction: the function runs on the ``meta``
device, where any ``.item()``/``.tolist()``/``.cpu()``/``bool()`` of a tensor raises,
and the whole ViT forward runs under a dispatch mode that fails on host reads
(``aten._local_scalar_dense``). The CUDA test runs them under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

pytestmark = [pytest.mark.core_model, pytest.mark.legacy_lane]

PATCH = 14


def _vision_config(image_size=56, hidden=32, layers=2):
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig

    return Idefics2VisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=PATCH,
    )


@contextlib.contextmanager
def _vllm_config():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
        yield


def _embeddings(image_size, device="cpu"):
    from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionEmbeddings

    with _vllm_config(), torch.device(device):
        return Idefics2VisionEmbeddings(_vision_config(image_size))


def reference_position_ids(mask: torch.Tensor, tgt_sizes: torch.Tensor | None, per_side: int) -> torch.Tensor:
    """One item at a time: the item's nb_h x nb_w grid, bucketised, written to its valid patches."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    flat = mask.reshape(mask.shape[0], -1)
    out = torch.zeros(flat.shape, dtype=torch.long)
    for item in range(mask.shape[0]):
        if tgt_sizes is not None:
            nb_h, nb_w = (int(v) for v in tgt_sizes[item])
        elif mask.dim() == 3:
            nb_h, nb_w = int(mask[item, :, 0].sum()), int(mask[item, 0, :].sum())
        else:
            nb_h, nb_w = 1, int(flat[item].sum())
        if nb_h == 0 or nb_w == 0:
            continue
        rows = torch.bucketize(torch.arange(nb_h) / nb_h, boundaries, right=True)
        cols = torch.bucketize(torch.arange(nb_w) / nb_w, boundaries, right=True)
        out[item, flat[item]] = (rows[:, None] * per_side + cols[None, :]).flatten()
    return out


def _random_prefix_batch(gen, num_items, max_side, padded):
    """(B, 1, L) prefix masks and their tgt_sizes, as MiniCPM-V builds them."""
    sizes = torch.randint(1, max_side + 1, (num_items, 2), generator=gen)
    if not padded:
        sizes[:] = sizes[0]
    counts = sizes.prod(-1)
    length = int(counts.max()) + (3 if padded else 0)
    mask = torch.arange(length)[None, :] < counts[:, None]
    return mask[:, None, :], sizes


def _random_grid_batch(gen, num_items, max_side, padded):
    """(B, H, W) masks whose valid patches are a top-left rectangle (Idefics2/3)."""
    sizes = torch.randint(1, max_side + 1, (num_items, 2), generator=gen)
    if not padded:
        sizes[:] = sizes[0]
    grid_h, grid_w = (int(v) for v in sizes.amax(0))
    if padded:
        grid_h, grid_w = grid_h + 1, grid_w + 2
    rows = torch.arange(grid_h)[None, :, None] < sizes[:, 0, None, None]
    cols = torch.arange(grid_w)[None, None, :] < sizes[:, 1, None, None]
    return rows & cols, sizes


@pytest.mark.cpu
@pytest.mark.parametrize("image_size", [56, 448, 980])  # 4, 32 and 70 patches per side
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_position_ids_match_per_item_reference(image_size, padded, seed):
    emb = _embeddings(image_size)
    per_side = image_size // PATCH
    gen = torch.Generator().manual_seed(seed)
    max_side = min(per_side + 6, 80)

    mask, sizes = _random_prefix_batch(gen, 5, max_side, padded)
    got = emb.get_position_ids(mask, sizes)
    assert got.dtype == torch.long and got.shape == (5, mask.shape[-1])
    torch.testing.assert_close(got, reference_position_ids(mask, sizes, per_side), rtol=0, atol=0)
    # int32 sizes (as some processors emit) give the same ids.
    torch.testing.assert_close(emb.get_position_ids(mask, sizes.to(torch.int32)), got, rtol=0, atol=0)

    grid_mask, grid_sizes = _random_grid_batch(gen, 4, max_side, padded)
    got = emb.get_position_ids(grid_mask)
    torch.testing.assert_close(got, reference_position_ids(grid_mask, None, per_side), rtol=0, atol=0)
    # ... and the same with the sizes given explicitly.
    torch.testing.assert_close(emb.get_position_ids(grid_mask, grid_sizes), got, rtol=0, atol=0)

    # (B, 1, L) masks without sizes: one row of all valid patches.
    got = emb.get_position_ids(mask)
    torch.testing.assert_close(got, reference_position_ids(mask, None, per_side), rtol=0, atol=0)
    flat = mask[:, 0, :]
    torch.testing.assert_close(emb.get_position_ids(flat), got, rtol=0, atol=0)


@pytest.mark.cpu
def test_fully_padded_rows_get_zero_ids():
    emb = _embeddings(56)
    mask = torch.zeros(3, 1, 16, dtype=torch.bool)
    mask[0, 0, :6] = True
    sizes = torch.tensor([[2, 3], [0, 0], [0, 0]])
    got = emb.get_position_ids(mask, sizes)
    assert torch.equal(got[1:], torch.zeros(2, 16, dtype=torch.long))
    assert torch.equal(got[0, :6], reference_position_ids(mask, sizes, 4)[0, :6])
    assert torch.equal(got[0, 6:], torch.zeros(10, dtype=torch.long))


@pytest.mark.cpu
def test_embeddings_forward_uses_given_position_ids():
    emb = _embeddings(56)
    with torch.no_grad():
        emb.position_embedding.weight.copy_(torch.arange(16, dtype=torch.float32)[:, None].expand(16, 32))
        emb.patch_embedding.weight.zero_()
        if emb.patch_embedding.bias is not None:
            emb.patch_embedding.bias.zero_()
    pixels = torch.randn(2, 3, PATCH, PATCH * 6)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    sizes = torch.tensor([[2, 3], [3, 2]])
    computed = emb(pixels, mask, sizes)
    ids = emb.get_position_ids(mask, sizes)
    torch.testing.assert_close(computed[..., 0], ids.float())
    forced = torch.full((2, 6), 5, dtype=torch.long)
    torch.testing.assert_close(emb(pixels, mask, sizes, position_ids=forced)[..., 0], forced.float())


@pytest.mark.cpu
def test_position_ids_never_read_values_on_the_host():
    """On ``meta`` tensors every host read raises, so success proves there is none."""
    emb = _embeddings(980, device="meta")
    mask = torch.ones(4, 1, 1024, dtype=torch.bool, device="meta")
    sizes = torch.ones(4, 2, dtype=torch.long, device="meta")
    assert emb.get_position_ids(mask, sizes).device.type == "meta"
    assert emb.get_position_ids(torch.ones(4, 32, 33, dtype=torch.bool, device="meta")).shape == (4, 32 * 33)
    assert emb.get_position_ids(mask[:, 0, :]).shape == (4, 1024)
    pixels = torch.zeros(4, 3, PATCH, PATCH * 1024, device="meta")
    assert emb(pixels, mask, sizes).shape == (4, 1024, emb.embed_dim)


class HostReadDetector(TorchDispatchMode):
    """Records ops that copy a device value to the host (``.item()``, ``bool(t)``...)."""

    HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")

    def __init__(self):
        super().__init__()
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.HOST_READS):
            self.host_reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.cpu
def test_host_read_detector_sees_item_and_bool():
    with HostReadDetector() as detector:
        x = torch.ones(3)
        bool(torch.any(x > 0))
        x.sum().item()
    assert len(detector.host_reads) == 2


@pytest.mark.cpu
@pytest.mark.parametrize("padded", [False, True])
def test_vision_transformer_forward_has_no_host_reads(tp_group, padded):
    from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer

    with _vllm_config():
        vpm = Idefics2VisionTransformer(_vision_config(), apply_encoder_attention_mask=True).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # vLLM layers start uninitialised
        for param in vpm.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    pixels = torch.randn(2, 3, PATCH, PATCH * 6)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    sizes = torch.tensor([[2, 3], [2, 3]])
    if padded:
        mask[1, 0, 4:] = False
        sizes[1] = torch.tensor([2, 2])
    with torch.inference_mode(), HostReadDetector() as detector:
        out = vpm(pixels, patch_attention_mask=mask, tgt_sizes=sizes)
    assert detector.host_reads == []
    assert out.shape == (2, 6, 32)
    if padded:
        # The padded patches are masked in attention: the valid patches of item 1 see
        # only each other, so dropping the padding entirely gives the same outputs.
        with torch.inference_mode():
            alone = vpm(
                pixels[1:, :, :, : 4 * PATCH], patch_attention_mask=mask[1:, :, :4], tgt_sizes=sizes[1:]
            )
        torch.testing.assert_close(out[1, :4], alone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("sizes_on_host", [False, True])
def test_cuda_position_ids_without_sync(sizes_on_host):
    emb = _embeddings(980, device="cuda")
    gen = torch.Generator().manual_seed(7)
    mask, sizes = _random_prefix_batch(gen, 6, 76, padded=True)
    expected = reference_position_ids(mask, sizes, 70)
    mask = mask.cuda()
    sizes = sizes if sizes_on_host else sizes.cuda()
    pixels = torch.randn(6, 3, PATCH, PATCH * mask.shape[-1], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = emb.get_position_ids(mask, sizes)
        embedded = emb(pixels, mask, sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(ids.cpu(), expected, rtol=0, atol=0)
    assert embedded.shape == (6, mask.shape[-1], emb.embed_dim)
