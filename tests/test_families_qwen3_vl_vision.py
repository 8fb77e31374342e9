"""Our Qwen3-VL vision tower gives transformers' features (merged and every DeepStack level) on the same weights."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.kernel_choice import TORCH_KERNELS, choose_kernels
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.families.qwen3_vl.vision import Qwen3VisionTower
from vlmbatch.kernels.reference import dequantize_fp8_ref, quantize_fp8_ref

# Odd aspect ratios (grids larger and smaller than the 4x4 learned position grid, so it is
# interpolated up and down), a 3-step video item (attention within each frame), the
# smallest grid, and a repeated grid. Sizes are in patches, multiples of the 2x2 merge.
GRIDS = torch.tensor([[1, 6, 10], [1, 14, 4], [3, 4, 6], [1, 2, 2], [1, 6, 10]])


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def model(request, tiny_model_dir):
    """The tiny checkpoint's transformers model (fp32, CPU) with every vision weight drawn
    afresh: the checkpoint's biases are zero and its norms the identity, which would hide
    a dropped bias (the Conv3d's) or norm."""
    hf = load_hf_model(str(tiny_model_dir(request.param)), torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in hf.model.visual.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            parameter.copy_(centre + 0.2 * torch.randn(parameter.shape, generator=generator))
    return hf


def _pixels(config, grids, seed=0):
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(grids.prod(-1).sum()), width, generator=torch.Generator().manual_seed(seed))


def _transformers_features(hf, pixels, grids):
    """What `tower_features` handed the decoder before: merged features, then each level."""
    output = hf.model.get_image_features(pixels.to(hf.device), grids.to(hf.device), return_dict=True)
    return torch.cat([torch.cat(output.pooler_output), *[torch.cat(level) for level in output.deepstack_features]], dim=-1)


def _relative_errors(ours, reference, levels):
    """Relative L2 error of each block of columns: the merged features, then each level."""
    return [((a.float() - b).norm() / b.norm()).item() for a, b in zip(ours.chunk(levels, -1), reference.float().chunk(levels, -1))]


@torch.no_grad()
def test_tower_matches_transformers(model):
    visual = model.model.visual
    tower = Qwen3VisionTower.from_hf(visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    levels = 1 + len(visual.config.deepstack_visual_indexes)
    for grids in (GRIDS, GRIDS[:1], GRIDS[2:3], GRIDS[1:3]):  # the batch, one image, the video alone, two sizes
        pixels = _pixels(visual.config, grids)
        expected = _transformers_features(model, pixels, grids)
        ours = tower(pixels, grids)
        assert ours.shape == expected.shape == (int(grids.prod(-1).sum()) // 4, levels * visual.config.out_hidden_size)
        assert max(_relative_errors(ours, expected, levels)) <= 1e-5
    # items do not attend to each other: one alone gives its rows of the batch
    pixels = _pixels(visual.config, GRIDS)
    torch.testing.assert_close(tower(pixels[: 6 * 10], GRIDS[:1]), tower(pixels, GRIDS)[:15], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_layout_is_cached_per_grid_combination(model):
    tower = Qwen3VisionTower.from_hf(model.model.visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    first = tower.layout(GRIDS)
    assert tower.layout(GRIDS.clone()) is first
    assert tower.layout(GRIDS[:2]) is not first
    assert first.frame_lengths == (60, 56, 24, 24, 24, 4, 60)
    assert first.position_taps.shape == first.position_weights.shape == (int(GRIDS.prod(-1).sum()), 4)
    torch.testing.assert_close(first.position_weights.sum(-1), torch.ones(len(first.position_weights)))


TRITON_ROTARY = textwrap.dedent(
    r"""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import dataclasses, torch
    torch.set_num_threads(1)
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS
    from vlmbatch.engine.loading import load_hf_model
    from vlmbatch.families.qwen3_vl.vision import Qwen3VisionTower
    from vlmbatch.kernels import apply_rotary

    hf = load_hf_model(sys.argv[1], torch.float32, torch.device("cpu"))
    kernels = dataclasses.replace(TORCH_KERNELS, rotary=apply_rotary)
    fused = Qwen3VisionTower.from_hf(hf.model.visual, torch.device("cpu"), torch.float32, kernels)
    plain = Qwen3VisionTower.from_hf(hf.model.visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    grids = torch.tensor([[1, 6, 10], [2, 4, 4]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(pixels, grids), plain(pixels, grids), rtol=1e-5, atol=1e-5)
    print("ok")
    """
)


def test_the_fused_rotary_kernel_gives_the_torch_path_under_the_interpreter(tiny_model_dir):
    """The engine's Triton rotary on q/k views of the fused q/k/v output (the GPU path), in
    fp32 under Triton's CPU interpreter (a fresh process: it must be on before the import)."""
    result = subprocess.run([sys.executable, "-c", TRITON_ROTARY, str(tiny_model_dir("qwen3_vl"))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_the_engine_runs_our_tower_and_quantize_vision_converts_its_linear_layers(tiny_model_dir):
    """transformers' tower is dropped once ours holds its weights; `quantize_vision` holds
    the per-channel fp8 round trip of every linear layer of ours but the patch embedding."""
    from vlmbatch.engine.paged import PagedEngine
    from vlmbatch.families.registry import load_adapter

    adapter = load_adapter(str(tiny_model_dir("qwen3_vl")))
    engine = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=2)
    plain = PagedEngine(adapter, EngineConfig(**engine)).model
    assert isinstance(plain.tower, Qwen3VisionTower) and plain.hf.model.visual is None
    assert plain.vision_modules() == [plain.tower]
    tower = PagedEngine(adapter, EngineConfig(**engine, quantization="fp8", quantize_vision=True)).model.tower
    assert torch.equal(tower.patch_embed.weight, plain.tower.patch_embed.weight)
    for name in ("blocks.0.attn.qkv", "blocks.2.mlp.linear_fc2", "merger.linear_fc1", "deepstack_merger_list.1.linear_fc2"):
        w = plain.tower.get_submodule(name).weight
        assert torch.equal(tower.get_submodule(name).weight, dequantize_fp8_ref(*quantize_fp8_ref(w))), name


@pytest.mark.gpu
@torch.no_grad()
def test_bf16_tower_on_cuda_matches_transformers_fp32(model):
    """bf16 on the GPU with the engine's kernels (fused rotary, flash SDPA) against
    transformers fp32: within twice transformers' own bf16 error, or 2e-2."""
    from vlmbatch.engine.attention import resolve_backend

    device = torch.device("cuda")
    pixels = _pixels(model.model.visual.config, GRIDS)
    reference = _transformers_features(copy.deepcopy(model).to(device), pixels, GRIDS)
    theirs = _transformers_features(copy.deepcopy(model).to(device, torch.bfloat16), pixels, GRIDS)
    kernels = choose_kernels(EngineConfig(), device, resolve_backend("auto", device)[0])
    tower = Qwen3VisionTower.from_hf(model.model.visual, device, torch.bfloat16, kernels)
    ours = tower(pixels.to(device), GRIDS)
    levels = 1 + len(model.model.visual.config.deepstack_visual_indexes)
    bounds = [max(2 * e, 2e-2) for e in _relative_errors(theirs, reference, levels)]
    errors = _relative_errors(ours, reference, levels)
    assert all(e <= b for e, b in zip(errors, bounds)), (errors, bounds)
