"""Qwen3-VL's vision tower (dense and MoE checkpoints share it), rebuilt for batches of images.

`transformers`' module is correct but slow where the engine needs it fast (measured on the
H200: 3.3 ms per 448x448 image on Qwen3-VL-8B, of which the matmuls are ~0.9): its SDPA
runs as a Python loop over images in every layer, rotary is ~10 float32 passes over q and
k, and the learned position grid is resampled to each image's grid on every call. This
tower holds the same weights and does the same arithmetic with: the Conv3d patch
embedding as one matmul, the position-grid interpolation's taps and weights computed once
per grid (a gather and a weighted sum on the device per batch), rotary tables once per
combination of grids and applied in one fused kernel, and attention within each frame as
one batched SDPA call per distinct frame length.

The output is what `Qwen3VLModel.tower_features` hands the decoder: the merged features
and then each DeepStack level, side by side [patches / merge², out_hidden * (1 + levels)];
it equals `transformers`' up to float rounding (tests compare every level in fp32 on the
CPU and bf16 against transformers fp32 on the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.vision import Grids, LayoutCache, QwenTower, VisionAttention, merge_block_positions, rotary_tables


@functools.lru_cache(maxsize=256)
def _interpolation(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps [h*w, 4] into the flattened `side` x `side` learned position grid and their
    bilinear weights [h*w, 4] (float32) for one frame's patches in merge-block order: the
    grid resampled to h x w with corners aligned, as `transformers` does it."""
    positions = merge_block_positions(h, w, merge)
    taps, weights = [], []
    for axis, size in enumerate((h, w)):
        source = positions[:, axis].float() * (side - 1) / max(size - 1, 1)
        floor = source.floor()
        offsets = torch.arange(2)
        taps.append((floor.long()[:, None] + offsets).clamp(max=side - 1))
        weights.append((1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
    index = (taps[0][:, :, None] * side + taps[1][:, None, :]).flatten(1)
    return index, (weights[0][:, :, None] * weights[1][:, None, :]).flatten(1)


@dataclass
class BatchLayout:
    """Everything a forward pass needs that depends only on the batch's grids."""

    cos: torch.Tensor  # [patches, head_dim] float32
    sin: torch.Tensor
    position_taps: torch.Tensor  # [patches, 4] rows of the learned position grid
    position_weights: torch.Tensor  # [patches, 4] float32
    frame_lengths: tuple[int, ...]  # attention is full within each frame


class VisionMLP(nn.Module):
    def __init__(self, dim: int, intermediate: int, act: nn.Module):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm attention and MLP (names as in `transformers`, so its state dict loads)."""

    def __init__(self, config: Any, kernels: KernelSet):
        super().__init__()
        from transformers.activations import ACT2FN

        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads, kernels.rotary)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = VisionMLP(dim, config.intermediate_size, ACT2FN[config.hidden_act])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one token: LayerNorm before the shuffle (the final merger) or
    after it (DeepStack's), then a GELU MLP."""

    def __init__(self, dim: int, merge: int, out: int, postshuffle_norm: bool):
        super().__init__()
        self.width = dim * merge**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle_norm else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(QwenTower):
    """Patch embedding plus the interpolated learned positions, full-attention blocks, the
    2x2 merger and one DeepStack merger per `deepstack_visual_indexes` block."""

    def __init__(self, config: Any, kernels: KernelSet):
        super().__init__()
        dim, self.merge = config.hidden_size, config.spatial_merge_size
        self.grid_side = int(config.num_position_embeddings**0.5)
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = nn.Linear(patch, dim)  # the Conv3d has a bias
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.blocks = nn.ModuleList(VisionBlock(config, kernels) for _ in range(config.depth))
        self.merger = PatchMerger(dim, self.merge, config.out_hidden_size, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(dim, self.merge, config.out_hidden_size, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )
        # block -> its merger; the levels come out in block order, as `transformers` emits them
        self.deepstack = {block: level for level, block in enumerate(config.deepstack_visual_indexes)}
        self.inv_freq = torch.empty(0)  # a plain attribute: `.to(bfloat16)` must not round it
        self.layout = LayoutCache(self._layout)

    @torch.no_grad()
    def load_from_hf(self, visual: nn.Module) -> None:
        """Copy `transformers`' weights (the same names but the Conv3d, reshaped to the
        equivalent matmul); strict, so a renamed or extra weight fails here."""
        state = dict(visual.state_dict())
        state["patch_embed.weight"] = state.pop("patch_embed.proj.weight").reshape(self.patch_embed.weight.shape)
        state["patch_embed.bias"] = state.pop("patch_embed.proj.bias")
        self.load_state_dict(state)
        self.inv_freq = visual.rotary_pos_emb.inv_freq.detach().float().to(self.patch_embed.weight.device)

    def _layout(self, grids: Grids) -> BatchLayout:
        """The batch layout of `grids`, cached by `self.layout`: batch jobs repeat the same
        few combinations of image sizes. A video's frames repeat its first frame's positions."""
        positions, taps, weights, lengths = [], [], [], []
        for t, h, w in grids:
            positions.append(merge_block_positions(h, w, self.merge).repeat(t, 1))
            frame_taps, frame_weights = _interpolation(h, w, self.merge, self.grid_side)
            taps.append(frame_taps.repeat(t, 1))
            weights.append(frame_weights.repeat(t, 1))
            lengths += [h * w] * t
        device = self.patch_embed.weight.device
        cos, sin = rotary_tables(torch.cat(positions).to(device), self.inv_freq)
        return BatchLayout(cos, sin, torch.cat(taps).to(device), torch.cat(weights).to(device), tuple(lengths))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Processor `pixel_values` [patches, C*T*P*P] of items with `grids` -> the merged
        embeddings and each DeepStack level, concatenated on the last dim."""
        layout = self.layout(grids)
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        positions = (self.pos_embed(layout.position_taps) * layout.position_weights.unsqueeze(-1)).sum(1)
        x = x + positions.to(x.dtype)
        levels = []
        for index, block in enumerate(self.blocks):
            x = block(x, layout.cos, layout.sin, layout.frame_lengths)
            if index in self.deepstack:
                levels.append(self.deepstack_merger_list[self.deepstack[index]](x))
        return torch.cat([self.merger(x), *levels], dim=-1)
