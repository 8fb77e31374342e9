"""What our Qwen-VL vision towers share (Qwen2.5-VL's and Qwen3-VL's): patch positions in
the processor's order, their 2-D rotary tables, attention with fused q/k/v and rotary
within segments, and the cache of per-batch layouts.

Both towers rotate half of each head by a patch's row and half by its column with the
same frequencies, and both see patches in merge-block order; computing that once per
combination of image grids (batch jobs repeat a few) keeps Python loops and small host
tensors out of every forward pass.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.fp8_linear import Fp8Activation
from vlmbatch.engine.layers.segment_attention import attend_segments

Grids = tuple[tuple[int, int, int], ...]  # (t, h, w) in patches, per item
Layout = TypeVar("Layout")


@functools.lru_cache(maxsize=256)
def merge_block_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """(row, column) [h*w, 2] of one frame's patches in the order the processor emits them:
    merge x merge blocks row by row, each block's patches row by row."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    return torch.stack([p.reshape(blocks).transpose(1, 2).flatten() for p in (rows, cols)], dim=-1)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches, head_dim] float32 of (row, column) `positions`: the row's angles on
    the first quarter of each half of a head, the column's on the second, as `transformers`
    lays them out."""
    freqs = (positions.unsqueeze(-1).float() * inv_freq).flatten(1)  # [patches, (row, col) x head_dim / 4]
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


class VisionAttention(nn.Module):
    """q/k/v as one matmul, rotary through the engine's kernel, attention within segments."""

    def __init__(self, dim: int, num_heads: int, rotary: Callable):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary

    def forward(self, x: torch.Tensor | Fp8Activation, cos: torch.Tensor, sin: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.rotary(q, k, cos, sin)
        q, k = q.to(v.dtype), k.to(v.dtype)  # the torch path computes in float32 (cos is float32)
        return self.proj(attend_segments(q, k, v, lengths, self.scale).reshape(-1, self.num_heads * self.head_dim))


class QwenTower(nn.Module):
    """What the Qwen-VL towers share beyond their layers: built from `transformers`' visual
    module (`cls(config, kernels)` on the device, then the subclass's `load_from_hf`)."""

    @classmethod
    def from_hf(cls, visual: nn.Module, device: torch.device, dtype: torch.dtype, kernels: KernelSet) -> "QwenTower":
        with torch.device(device):
            tower = cls(visual.config, kernels).to(dtype)
        tower.load_from_hf(visual)
        return tower.eval().requires_grad_(False)


class LayoutCache(Generic[Layout]):
    """The layouts of the last `size` combinations of grids, built by `build` on a miss."""

    def __init__(self, build: Callable[[Grids], Layout], size: int = 8):
        self.build = build
        self.size = size
        self._layouts: OrderedDict[Hashable, Layout] = OrderedDict()

    def __call__(self, grids: torch.Tensor) -> Layout:
        """The layout of `grids` [items, 3] (t, h, w in patches)."""
        key = tuple(map(tuple, grids.tolist()))
        cached = self._layouts.get(key)
        if cached is not None:
            self._layouts.move_to_end(key)
            return cached
        layout = self._layouts[key] = self.build(key)
        if len(self._layouts) > self.size:
            self._layouts.popitem(last=False)
        return layout
