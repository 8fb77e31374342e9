"""Our Qwen2.5-VL vision tower gives transformers' features on the same weights."""

import pytest
import torch

from vlmbatch.engine.kernel_choice import TORCH_KERNELS
from vlmbatch.families.qwen2_5_vl.vision import MLP_ALIGNMENT, QwenVisionTower
from vlmbatch.engine.loading import load_hf_model

# Windows of several lengths (8x8 and 4x6 patches with 2x2-merged windows), a 2-frame video
# item (full attention per frame), and a repeated grid.
GRIDS = torch.tensor([[1, 8, 8], [1, 4, 6], [2, 4, 4], [1, 8, 8]])


def _features(visual, pixels, grids):
    output = visual(pixels, grid_thw=grids)
    return getattr(output, "pooler_output", output)


def _pixels(visual, grids, seed=0):
    config = visual.config
    generator = torch.Generator().manual_seed(seed)
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(grids.prod(-1).sum()), width, generator=generator)


@pytest.fixture(scope="module")
def visual(tiny_qwen):
    return load_hf_model(str(tiny_qwen), torch.float32, torch.device("cpu")).model.visual


@torch.no_grad()
def test_tower_matches_transformers(visual):
    tower = QwenVisionTower.from_hf(visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    pixels = _pixels(visual, GRIDS)
    expected = _features(visual, pixels, GRIDS)
    torch.testing.assert_close(tower(pixels, GRIDS), expected, rtol=1e-5, atol=1e-5)
    # one item alone gives its rows of the batch: items do not attend to each other
    alone = tower(pixels[: 8 * 8], GRIDS[:1])
    torch.testing.assert_close(alone, expected[:16], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_layout_is_cached_per_grid_combination(visual):
    tower = QwenVisionTower.from_hf(visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    first = tower.layout(GRIDS)
    assert tower.layout(GRIDS.clone()) is first
    assert tower.layout(GRIDS[:2]) is not first
    assert first.frame_lengths == (64, 24, 16, 16, 64)
    assert sorted(first.window_lengths) == sorted([16] * 4 + [16, 8] + [16] * 2 + [16] * 4)


@torch.no_grad()
def test_unaligned_mlp_is_padded_without_changing_features(tiny_qwen):
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = AutoConfig.from_pretrained(str(tiny_qwen)).vision_config
    config.intermediate_size = 60  # like Qwen2.5-VL's 3420: not a multiple of the alignment
    torch.manual_seed(1)
    visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()
    for parameter in visual.parameters():  # fresh random weights everywhere, biases included
        parameter.data.normal_(0, 0.2)
    tower = QwenVisionTower.from_hf(visual, torch.device("cpu"), torch.float32, TORCH_KERNELS)
    assert tower.blocks[0].mlp.down_proj.in_features == MLP_ALIGNMENT
    pixels = _pixels(visual, GRIDS, seed=2)
    torch.testing.assert_close(tower(pixels, GRIDS), _features(visual, pixels, GRIDS), rtol=1e-5, atol=1e-5)
