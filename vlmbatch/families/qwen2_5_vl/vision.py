"""Qwen2.5-VL's vision tower, rebuilt for batches of images on the engine's kernels.

`transformers`' module is correct but slow where the engine needs it fast (measured on
the H200 at ~6.5 ms per 448x448 image, against ~2 ms of matmul work): it applies the
vision rotary embedding in ~20 float32 passes over q and k, runs windowed attention as a
loop over windows, and rebuilds rotary tables and window indices with Python loops on
every call. This tower holds the same weights and does the same arithmetic with: rotary
in one fused kernel (float32 inside, rounded once, as `transformers` rounds), attention
over windows of equal length as one batched SDPA call on a view (no gather), q/k/v and
gate/up each one matmul with gate/up zero-padded to an aligned width (cuBLAS falls back
to slow kernels at Qwen's 3420), fused add+RMSNorm, and each batch's layout (rotary
tables, window order) computed once per combination of image grids and cached.

The result equals `transformers`' tower up to float rounding (tests compare features in
fp32 on the CPU and the bf16 engine against transformers on the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.gated_mlp import GatedMLP
from vlmbatch.engine.layers.norm import RMSNorm
from vlmbatch.engine.layers.vision import Grids, LayoutCache, QwenTower, VisionAttention, merge_block_positions, rotary_tables

# Gated-MLP widths are padded to a multiple of this many elements (Qwen2.5-VL's 3420 rows
# are not 16-byte aligned; 64 is also a multiple of cuBLAS's tile sizes).
MLP_ALIGNMENT = 64


@functools.lru_cache(maxsize=256)
def _grid_layout(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """One image's (or video's) layout: patch positions [t*h*w, 2] (row, column; patches in
    merge-block order as the processor emits them), the window order of its merged tokens,
    and the windows' lengths in patches. `window` is the window side in merged tokens."""
    positions = merge_block_positions(h, w, merge).repeat(t, 1)
    mh, mw = h // merge, w // merge
    pad_h, pad_w = -mh % window, -mw % window
    index = F.pad(torch.arange(t * mh * mw).view(t, mh, mw), (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (mh + pad_h) // window, (mw + pad_w) // window
    windows = index.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(-1, window * window)
    order = windows[windows >= 0]
    lengths = tuple(n * merge * merge for n in (windows >= 0).sum(-1).tolist() if n)
    return positions, order, lengths


@dataclass
class BatchLayout:
    """Everything a forward pass needs that depends only on the batch's grids."""

    cos: torch.Tensor  # [patches, head_dim] float32, in window order
    sin: torch.Tensor
    window_order: torch.Tensor  # merged-token index of each window-ordered merged token
    restore_order: torch.Tensor  # its inverse: back to the processor's order
    window_lengths: tuple[int, ...]  # windowed layers attend within these (patches)
    frame_lengths: tuple[int, ...]  # full-attention layers attend within each frame


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, intermediate: int, kernels: KernelSet):
        super().__init__()
        self.norm1 = RMSNorm(dim, 1e-6, kernels.rms_norm)
        self.attn = VisionAttention(dim, num_heads, kernels.rotary)
        self.norm2 = RMSNorm(dim, 1e-6, kernels.rms_norm)
        self.mlp = GatedMLP(nn.Linear(dim, 2 * intermediate), nn.Linear(intermediate, dim), kernels)

    def emit_fp8_inputs(self) -> None:
        """With the tower in FP8 (`quantize_vision`): the norms and the activation write their
        projections' inputs quantized, as the decoder's layers do (`DecoderLayer.emit_fp8_inputs`)."""
        self.norm1.emit_fp8_for(self.attn.qkv)
        self.norm2.emit_fp8_for(self.mlp.gate_up_proj)
        self.mlp.emit_fp8_for_down()

    def forward(self, x, residual, cos, sin, lengths):
        """Takes and returns (output, residual) so each add is fused into the next norm."""
        h, residual = self.norm1(x, residual)
        h = self.attn(h, cos, sin, lengths)
        h, residual = self.norm2(h, residual)
        return self.mlp(h), residual


class QwenVisionTower(QwenTower):
    """Patch embedding, windowed/full-attention blocks and the 2x2 patch merger."""

    def __init__(self, config: Any, kernels: KernelSet):
        super().__init__()
        dim, self.merge = config.hidden_size, config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_attention_layers = frozenset(config.fullatt_block_indexes)
        self.head_dim = dim // config.num_heads
        intermediate = -(-config.intermediate_size // MLP_ALIGNMENT) * MLP_ALIGNMENT
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = nn.Linear(patch, dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, config.num_heads, intermediate, kernels) for _ in range(config.depth))
        self.merger_norm = RMSNorm(dim, 1e-6, kernels.rms_norm)
        self.merger_fc1 = nn.Linear(dim * self.merge**2, dim * self.merge**2)
        self.merger_fc2 = nn.Linear(dim * self.merge**2, config.out_hidden_size)
        self.inv_freq = torch.empty(0)  # a plain attribute: `.to(bfloat16)` must not round it
        self.layout = LayoutCache(self._layout)

    @torch.no_grad()
    def load_from_hf(self, visual: nn.Module) -> None:
        """Copy `transformers`' weights: the Conv3d patch embedding as the equivalent matmul,
        q/k/v as one, gate/up fused and zero-padded (silu(0) * 0 = 0 adds nothing)."""
        self.patch_embed.weight.copy_(visual.patch_embed.proj.weight.reshape(self.patch_embed.weight.shape))
        self.inv_freq = visual.rotary_pos_emb.inv_freq.detach().float().to(self.patch_embed.weight.device)
        for ours, theirs in zip(self.blocks, visual.blocks):
            ours.norm1.weight.copy_(theirs.norm1.weight)
            ours.norm2.weight.copy_(theirs.norm2.weight)
            ours.attn.qkv.load_state_dict(theirs.attn.qkv.state_dict())
            ours.attn.proj.load_state_dict(theirs.attn.proj.state_dict())
            m, size = theirs.mlp, theirs.mlp.gate_proj.out_features
            width = ours.mlp.down_proj.in_features
            for param in (ours.mlp.gate_up_proj.weight, ours.mlp.gate_up_proj.bias, ours.mlp.down_proj.weight):
                param.zero_()
            for half, linear in enumerate((m.gate_proj, m.up_proj)):
                ours.mlp.gate_up_proj.weight[half * width : half * width + size] = linear.weight
                ours.mlp.gate_up_proj.bias[half * width : half * width + size] = linear.bias
            ours.mlp.down_proj.weight[:, :size] = m.down_proj.weight
            ours.mlp.down_proj.bias.copy_(m.down_proj.bias)
        self.merger_norm.weight.copy_(visual.merger.ln_q.weight)
        self.merger_fc1.load_state_dict(visual.merger.mlp[0].state_dict())
        self.merger_fc2.load_state_dict(visual.merger.mlp[2].state_dict())

    def _layout(self, grids: Grids) -> BatchLayout:
        """The batch layout of `grids`, cached by `self.layout`: batch jobs repeat the same
        few combinations of image sizes."""
        positions, orders, window_lengths, frame_lengths, offset = [], [], [], [], 0
        for t, h, w in grids:
            item_positions, order, lengths = _grid_layout(t, h, w, self.merge, self.window)
            positions.append(item_positions)
            orders.append(order + offset)
            window_lengths += lengths
            frame_lengths += [h * w] * t
            offset += t * h * w // self.merge**2
        device = self.patch_embed.weight.device
        window_order = torch.cat(orders)
        unit = self.merge**2
        ordered = torch.cat(positions).view(-1, unit, 2)[window_order].view(-1, 2).to(device)
        cos, sin = rotary_tables(ordered, self.inv_freq)
        return BatchLayout(cos, sin, window_order.to(device), torch.argsort(window_order).to(device),
                           tuple(window_lengths), tuple(frame_lengths))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Processor `pixel_values` [patches, C*T*P*P] of items with `grids` -> merged
        embeddings [patches / merge², out_hidden], in the processor's token order."""
        layout = self.layout(grids)
        unit = self.merge**2
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        x = x.view(-1, unit, x.shape[-1])[layout.window_order].view(-1, x.shape[-1])
        residual = None
        for index, block in enumerate(self.blocks):
            lengths = layout.frame_lengths if index in self.full_attention_layers else layout.window_lengths
            x, residual = block(x, residual, layout.cos, layout.sin, lengths)
        x = self.merger_norm(x, residual)[0].view(-1, unit * x.shape[-1])
        x = self.merger_fc2(F.gelu(self.merger_fc1(x)))
        return x[layout.restore_order]
