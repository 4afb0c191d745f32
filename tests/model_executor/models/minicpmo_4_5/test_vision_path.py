# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the image path without host reads (one vision graph per image call).

- SigLIP position ids on the device: the table against the model's host mapping for every grid
  side and every patch grid the image slicer emits; resampler positions against its 2-D cache.
- ``get_vision_hidden_states`` reads no tensor value on the host (:class:`helpers.host_reads.HostReads`
  watches ``item``/``tolist``/``__bool__``/... and the operators that copy values out).
- With eager attention its output is bitwise that of the model file before the change, where the
  patch tool can rebuild that file from the installed one.
- SigLIP's hidden states are contiguous in every encoder layer: no layer copies its input
  before a LayerNorm (operators counted per layer with ``torch.profiler``), and the layout does
  not change a bit of the output with either attention.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers.host_reads import HostReads
from helpers.tiny_encoders import copies_per_region, tiny_siglip_config
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

llm = pytest.importorskip("vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm")

if getattr(llm, "vision_path", None) is None:
    pytest.fail(f"{llm.__file__} lacks the image path without host reads (vision_path)", pytrace=False)
vision_path = llm.vision_path
siglip_attention = llm.siglip_attention

PATCH = 14
SIDE = 70  # image_size 980 / patch 14: the checkpoint's position-bucket grid

#: Slice grids (h, w): a real photo's single slice (chelsea through MiniCPM-o's slicer), then the
#: layouts of real multi-slice calls at a quarter of the sides (CPU time), and thin grids whose
#: sides exceed the 70x70 position grid or round differently on a device formula.
GRID_SETS = {
    "one_slice": [(26, 39)],
    "three_padded": [(8, 8), (6, 11), (6, 11)],
    "ten_padded": [(7, 8)] * 5 + [(8, 8), (6, 11), (6, 11), (6, 10), (7, 9)],
    "ten_full": [(8, 8)] * 10,
    "thin_sides": [(1, 100), (100, 1), (25, 4), (49, 2), (55, 1), (50, 2)],
}
#: (grid set, vision_batch_size): chunking (3 or 2 slices per SigLIP call) where there are chunks.
EAGER_CASES = [
    ("one_slice", 16),
    ("three_padded", 16),
    ("ten_padded", 16),
    ("ten_padded", 3),
    ("ten_full", 3),
    ("thin_sides", 2),
]


@pytest.fixture
def single_thread():
    """The host mapping's bucketize goes parallel above 200 elements; on a busy host that is slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def siglip_config(mod, attn: str, **sizes):
    return tiny_siglip_config(mod, attn, side=SIDE, patch=PATCH, **sizes)


def vision_model(mod, attn: str = "eager", *, dtype=torch.float32, vision_batch_size=16, seed=0):
    """A bare thinker holding what get_vision_hidden_states reads: vpm, resampler, config."""
    torch.manual_seed(seed)
    model = object.__new__(mod.MiniCPMO45OmniLLMForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = SimpleNamespace(vision_batch_size=vision_batch_size)
    model.vpm = mod.SiglipVisionTransformer(siglip_config(mod, attn))
    model.resampler = mod.Resampler(num_queries=8, embed_dim=128, num_heads=2, kv_dim=64, adaptive=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.resampler.parameters():  # the query starts at zero: make attention matter
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.eval().to(dtype)


def vision_data(grids, *, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    pixels = [torch.randn(3, PATCH, h * w * PATCH, generator=generator).to(dtype) for h, w in grids]
    return {"pixel_values": pixels, "tgt_sizes": torch.tensor(grids, dtype=torch.int32)}


def padded_valid(lengths, n):
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The unpatched model module, rebuilt by the patch tool from the installed (patched) file."""
    from helpers.pristine import pristine_model_module

    yield from pristine_model_module(tmp_path_factory.mktemp("pristine-minicpmo"), "vision", "vision_path")




# ---------------------------------------------------------------------------
# Position ids and resampler positions on the device
# ---------------------------------------------------------------------------


def slicer_grids(processor, width: int, height: int, max_slice_nums: int) -> list[tuple[int, int]]:
    """(h, w) patch grids MiniCPMVImageProcessor.slice_image gives an image, without the pixels."""
    scale, patch = processor.scale_resolution, processor.patch_size
    grid = processor.get_sliced_grid((width, height), max_slice_nums)
    if grid is None:
        sizes = [processor.find_best_resize((width, height), scale, patch, allow_upscale=True)]
    else:
        refine = processor.get_refine_size((width, height), grid, scale, patch, allow_upscale=True)
        source = processor.find_best_resize((width, height), scale, patch)
        sizes = [source, (refine[0] // grid[0], refine[1] // grid[1])]
    return [(h // patch, w // patch) for w, h in sizes]


@pytest.fixture(scope="module")
def processor():
    return llm.MiniCPMVImageProcessor(max_slice_nums=9, scale_resolution=448, patch_size=PATCH)


@pytest.fixture(scope="module")
def all_slicer_grids(processor):
    """Every grid the slicer gives images of 8..4100 px a side (step 12) and very thin images."""
    sizes = [(w, h) for w in range(8, 4100, 12) for h in range(8, 4100, 12)]
    sizes += [(w, h) for h in range(1, 64) for w in range(1000, 30001, 250)]
    sizes += [(h, w) for w, h in sizes]
    return sorted({g for n in (1, 2, 9) for w, h in sizes for g in slicer_grids(processor, w, h, n)})


def test_slicer_geometry_matches_the_processor(processor):
    from PIL import Image

    generator = torch.Generator().manual_seed(5)
    for width, height in torch.randint(14, 1400, (8, 2), generator=generator).tolist() + [[9000, 12]]:
        for max_slice_nums in (1, 2, 9):
            out = processor.preprocess([Image.new("RGB", (width, height))], max_slice_nums=max_slice_nums)
            got = {tuple(int(v) for v in row) for row in out["tgt_sizes"][0]}
            assert got == set(slicer_grids(processor, width, height, max_slice_nums)), (width, height)


def host_position_ids(embeddings, grids, n):
    """The model's own host mapping for slices packed as get_vision_hidden_states packs them."""
    mask = padded_valid([h * w for h, w in grids], n)
    return embeddings._create_position_ids(mask, torch.tensor(grids), device=torch.device("cpu"))


def test_bucket_table_matches_the_host_mapping_for_every_side(single_thread, all_slicer_grids):
    embeddings = llm.SiglipVisionEmbeddings(siglip_config(llm, "eager"))
    max_side = max(max(g) for g in all_slicer_grids)
    assert max_side > 5000  # thin images give one-patch-high grids of thousands of patches
    for start in reversed(range(1, max_side + 1, 256)):  # largest first: the table is built once
        sides = range(start, min(start + 256, max_side + 1))
        for grids in ([(s, 1) for s in sides], [(1, s) for s in sides]):
            n = max(sides)
            got = vision_path.position_ids_from_tgt_sizes(embeddings, torch.tensor(grids), n)
            assert torch.equal(got, host_position_ids(embeddings, grids, n)), (start, grids[0])


def test_position_ids_match_the_host_mapping_for_every_slicer_grid(single_thread, all_slicer_grids):
    embeddings = llm.SiglipVisionEmbeddings(siglip_config(llm, "eager"))
    grids = sorted(all_slicer_grids, key=lambda g: g[0] * g[1])
    assert len(grids) > 3000
    for start in range(0, len(grids), 64):
        batch = grids[start : start + 64]
        n = max(h * w for h, w in batch)
        want = host_position_ids(embeddings, batch, n)
        for tgt_sizes in (torch.tensor(batch, dtype=torch.int32), torch.tensor(batch, dtype=torch.int64)):
            got = vision_path.position_ids_from_tgt_sizes(embeddings, tgt_sizes, n)
            assert got.dtype == torch.int64 and torch.equal(got, want), batch[0]


def test_position_ids_where_a_division_formula_rounds_differently():
    # fraction = k / side (vLLM's on-device Idefics2 ids) lands in another bucket than the host's
    # arange(0, 1 - 1e-6, 1 / side) for some rows of these sides; the table follows the host.
    embeddings = llm.SiglipVisionEmbeddings(siglip_config(llm, "eager"))
    boundaries = torch.arange(1 / SIDE, 1.0, 1 / SIDE)
    for side in (25, 49, 50, 55):
        grids = [(side, 1), (1, side), (side, 7)]
        n = 7 * side
        want = host_position_ids(embeddings, grids, n)
        assert torch.equal(vision_path.position_ids_from_tgt_sizes(embeddings, torch.tensor(grids), n), want)
        divided = torch.bucketize(torch.arange(side) / side, boundaries, right=True)
        assert not torch.equal(divided, want[0, :side] // SIDE), side


def test_bucket_table_grows_and_keeps_the_replaced_table():
    embeddings = llm.SiglipVisionEmbeddings(siglip_config(llm, "eager"))
    cpu = torch.device("cpu")
    small = vision_path.position_bucket_table(embeddings, 100, cpu)
    assert small.dtype == torch.int16 and small.numel() == 256 * 257 // 2
    assert vision_path.position_bucket_table(embeddings, 256, cpu) is small  # no rebuild within the rows held
    large = vision_path.position_bucket_table(embeddings, 300, cpu)
    assert large.numel() == 512 * 513 // 2 and torch.equal(large[: small.numel()], small)
    assert any(t is small for t in embeddings._bucket_tables._replaced)  # graphs may still read it


@pytest.mark.parametrize("embed_dim, cache", [(4096, (70, 70)), (256, (90, 130))])
def test_resampler_rows_rebuild_the_2d_sincos_cache_bitwise(embed_dim, cache):
    resampler = llm.Resampler(num_queries=4, embed_dim=embed_dim, num_heads=2, kv_dim=64, adaptive=True)
    want = torch.from_numpy(llm.get_2d_sincos_pos_embed(embed_dim, cache)).float()
    rows = vision_path.pos_embed_rows(resampler, max(cache))
    assert rows.shape == (max(cache) + 1, embed_dim // 2) and float(rows[-1].abs().max()) == 0.0
    r, c = torch.meshgrid(torch.arange(cache[0]), torch.arange(cache[1]), indexing="ij")
    assert torch.equal(torch.cat((rows[c], rows[r]), dim=-1), want)


# ---------------------------------------------------------------------------
# get_vision_hidden_states: unchanged eager numerics, no host reads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, vision_batch_size", EAGER_CASES, ids=[f"{n}-vbs{b}" for n, b in EAGER_CASES])
def test_eager_output_is_bitwise_the_unpatched_output(pristine, name, vision_batch_size, dtype):
    grids = GRID_SETS[name]
    before = vision_model(pristine, dtype=dtype, vision_batch_size=vision_batch_size)
    after = vision_model(llm, dtype=dtype, vision_batch_size=vision_batch_size)
    after.load_state_dict(before.state_dict())
    data = vision_data(grids, dtype=dtype)
    with torch.no_grad():
        want = before.get_vision_hidden_states(data)
        got = after.get_vision_hidden_states(data)
        # the other layouts the call site accepts: one stacked tensor, tgt_sizes as int64
        if len({h * w for h, w in grids}) == 1:
            stacked = {
                "pixel_values": torch.stack(data["pixel_values"]),
                "tgt_sizes": data["tgt_sizes"].long(),
            }
            assert torch.equal(after.get_vision_hidden_states(stacked), want)
    assert got.shape == (len(grids), 8, 128) and got.dtype == dtype
    assert torch.equal(got, want)




@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "grids", [GRID_SETS["one_slice"], GRID_SETS["ten_padded"]], ids=["one", "ten_padded"]
)
def test_call_path_reads_no_tensor_value_on_the_host(grids, attn):
    data = vision_data(grids)
    with torch.no_grad(), HostReads() as watch:
        vision_model(llm, attn, vision_batch_size=4).get_vision_hidden_states(data)  # builds the tables
    assert watch.reads == []


def test_the_watch_sees_the_reads_the_former_call_path_made():
    """The watch is not blind: the host reads of ``tgt_sizes`` that the former call path made (its
    ``max()`` bound and its per-slice lengths) each show up as a read."""
    tgt_sizes = torch.tensor(GRID_SETS["three_padded"], dtype=torch.int32)
    with HostReads() as watch:
        int(tgt_sizes.prod(dim=1).max().item())
        tgt_sizes.tolist()
        torch.zeros(int(tgt_sizes[0, 0]), 4)
    assert len(watch.reads) >= 3, watch.reads


@pytest.mark.parametrize(
    "grids", [GRID_SETS["one_slice"], GRID_SETS["ten_padded"]], ids=["one", "ten_padded"]
)
def test_the_watch_sees_the_host_reads_of_the_former_call_path(pristine, grids):
    with torch.no_grad(), HostReads() as watch:
        vision_model(pristine, vision_batch_size=4).get_vision_hidden_states(vision_data(grids))
    assert {"item", "tolist", "__bool__"} <= watch.names()  # what the former call site read




def test_tables_built_in_inference_mode_serve_no_grad_calls():
    """The engine calls under inference_mode, vllm-omni's duplex stage under no_grad."""
    model = vision_model(llm)
    data = vision_data(GRID_SETS["three_padded"])
    with torch.inference_mode():
        first = model.get_vision_hidden_states(data)
    tables = [*model.vpm.embeddings._bucket_tables._tables.values()]
    tables += [*model.resampler._pos_embed_tables._tables.values()]
    assert len(tables) == 2 and not any(table.is_inference() for _, table in tables)
    with torch.no_grad():
        second = model.get_vision_hidden_states(data)
    assert torch.equal(first, second) and first.is_inference() and not second.is_inference()


def test_training_mode_keeps_the_image_call_off_the_graph():
    """As the audio paths: a model in training runs the call eagerly, even under no_grad."""
    model = vision_model(llm)
    data = vision_data(GRID_SETS["three_padded"])
    with torch.no_grad():
        want = model.get_vision_hidden_states(data)

    def forbidden(*inputs):
        raise AssertionError("a model in training reached the vision graph")

    model.vpm._encoder_graph = forbidden
    model.train()
    with torch.no_grad():
        got = model.get_vision_hidden_states(data)
    assert torch.equal(got, want)  # no dropout in these modules: training changes no value here
    model.eval()
    with torch.no_grad(), pytest.raises(AssertionError, match="reached the vision graph"):
        model.get_vision_hidden_states(data)


def test_resampler_accepts_more_patches_than_any_slice_has():
    model = vision_model(llm)
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(6))
    tgt_sizes = torch.tensor([[4, 5], [3, 3]])
    with torch.no_grad():
        wide = model.resampler(x, tgt_sizes)
        narrow = model.resampler(x[:, :20], tgt_sizes)
    torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-5)  # padding keys are masked out
    assert math.isfinite(float(wide.abs().max()))


# ---------------------------------------------------------------------------
# SigLIP's layout: contiguous hidden states, no per-layer copies
# ---------------------------------------------------------------------------

LAYOUT_GRIDS = {"one": GRID_SETS["one_slice"], "three_padded": GRID_SETS["three_padded"]}


def encoder_inputs(model, data) -> list[tuple[str, torch.Tensor]]:
    """(module, hidden states) entering each SigLIP encoder layer and the post layernorm."""
    seen = []
    modules = [*model.vpm.encoder.layers, model.vpm.post_layernorm]
    names = [f"layer{i}" for i in range(len(modules) - 1)] + ["post_layernorm"]
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, name=name: seen.append((name, args[0])))
        for name, module in zip(names, modules)
    ]
    try:
        with torch.no_grad():
            model.get_vision_hidden_states(data)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("grids", LAYOUT_GRIDS.values(), ids=LAYOUT_GRIDS.keys())
def test_encoder_hidden_states_are_contiguous_in_every_layer(attn, grids):
    """A transposed layout (the conv output's) would make every residual add strided."""
    seen = encoder_inputs(
        vision_model(llm, attn, dtype=torch.bfloat16), vision_data(grids, dtype=torch.bfloat16)
    )
    assert len(seen) == 3
    assert [(name, tuple(h.stride())) for name, h in seen if not h.is_contiguous()] == []


def hidden_state_copies(model, data) -> dict[str, int]:
    """Copies of a ``(B, N, hidden)`` tensor (``aten::clone``: ``.contiguous()`` of a strided
    tensor, as LayerNorm makes of its input) under each SigLIP encoder layer and the post
    layernorm during one call, counted with ``torch.profiler``."""
    modules = {f"layer{i}": layer for i, layer in enumerate(model.vpm.encoder.layers)}
    modules["post_layernorm"] = model.vpm.post_layernorm
    open_ranges: dict[str, record_function] = {}

    def enter(name):
        open_ranges[name] = record_function(f"region:{name}")
        open_ranges[name].__enter__()

    hooks = []
    for name, module in modules.items():
        hooks.append(module.register_forward_pre_hook(lambda _m, _a, name=name: enter(name)))
        hooks.append(
            module.register_forward_hook(
                lambda _m, _a, _o, name=name: open_ranges.pop(name).__exit__(None, None, None)
            )
        )
    try:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model.get_vision_hidden_states(data)
    finally:
        for hook in hooks:
            hook.remove()
    return copies_per_region(prof, modules, model.vpm.config.hidden_size)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("grids", LAYOUT_GRIDS.values(), ids=LAYOUT_GRIDS.keys())
def test_encoder_layers_copy_no_hidden_states(attn, grids):
    """Before, each layer copied its transposed hidden states in front of both LayerNorms, and
    the post layernorm once more: 2 * layers + 1 copies per call (53 at the checkpoint's 26
    layers), each a strided kernel on the GPU, as were both residual adds of every layer."""
    model = vision_model(llm, attn, dtype=torch.bfloat16)
    counts = hidden_state_copies(model, vision_data(grids, dtype=torch.bfloat16))
    assert counts == {"layer0": 0, "layer1": 0, "post_layernorm": 0}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("grids", LAYOUT_GRIDS.values(), ids=LAYOUT_GRIDS.keys())
def test_layout_changes_no_bit_of_the_encoder_output(attn, grids):
    """The contiguous sum gives the bits of the former transposed one, with both attentions."""
    model = vision_model(llm, attn, dtype=torch.bfloat16)
    data = vision_data(grids, dtype=torch.bfloat16)
    vpm = model.vpm
    pixels, padded = vision_path.pad_vision_slices(data["pixel_values"])
    tgt_sizes = data["tgt_sizes"]
    num_patches = pixels.shape[-1] // PATCH
    valid = padded_valid([h * w for h, w in grids], num_patches) if padded else None
    with torch.no_grad():
        got = vision_path.encode_packed_slices(vpm, pixels, tgt_sizes, valid)
        embeddings = vpm.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        position_ids = vision_path.position_ids_from_tgt_sizes(vpm.embeddings, tgt_sizes, num_patches)
        transposed = embeddings + vpm.embeddings.position_embedding(position_ids)  # the former sum
        mask = (
            None if valid is None else siglip_attention.encoder_attention_mask(valid, transposed.dtype, False)
        )
        want = vpm._encode_last_hidden_state(transposed, mask)
    assert not transposed.is_contiguous()  # the layout vllm-omni 0.30.0 ran the encoder in
    assert torch.equal(got, want)
