"""One attention call per length for Qwen-VL vision towers, instead of one per window.

`transformers` runs the Qwen2-VL / Qwen2.5-VL vision attention with SDPA as a Python loop
over every window and image (a 448x448 image has 16 windows in 28 of 32 layers), so a
batch of 50 images costs ~25,000 small kernel launches per forward. Its varlen branch,
taken for attention implementations whose name contains "flash", hands over all windows
at once with `cu_seqlens`; this implementation, registered under such a name, groups
the windows by length and runs one batched SDPA per group (same math, any device).
Qwen2-VL's `transformers` tower uses it; our Qwen2.5-VL and Qwen3-VL towers call `attend_segments`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

NAME = "flash_packed_sdpa"  # "flash" selects transformers' varlen (cu_seqlens) code path


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float | None,
                    is_causal: bool = False) -> torch.Tensor:
    """Attention within consecutive sequences of `lengths`: q/k/v [total, heads, dim] ->
    [total, heads, dim]. Equal lengths (a tower's windows, one image size) are one SDPA
    call on a view; otherwise one call per distinct length over gathered rows."""
    if len(set(lengths)) == 1:
        count, length = len(lengths), lengths[0]
        batch = [t.view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]  # [n, heads, length, dim]
        return F.scaled_dot_product_attention(*batch, scale=scale, is_causal=is_causal).transpose(1, 2).reshape(q.shape)
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    start = 0
    for length in lengths:
        if length:
            starts_by_length[length].append(start)
        start += length
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        rows = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).to(q.device)  # [n, length]
        batch = [t[rows].transpose(1, 2) for t in (q, k, v)]  # [n, heads, length, dim]
        attended = F.scaled_dot_product_attention(*batch, scale=scale, is_causal=is_causal)
        out[rows] = attended.transpose(1, 2)
    return out


def packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                is_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """q/k/v [1, heads, total, dim] with sequences at `cu_seq_lens_q` -> [1, total, heads, dim]."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, heads, dim]
    lengths = cu_seq_lens_q.diff().tolist()
    return attend_segments(q, k, v, lengths, scaling, is_causal).unsqueeze(0), None


@torch.no_grad()
def use_packed_attention(vision_tower: nn.Module) -> bool:
    """Switch a Qwen-VL vision tower to `packed_sdpa` if, on a small probe image, it gives
    the features the tower's own attention gives; otherwise (another transformers version
    taking other paths) leave the tower as it was. Returns whether it switched."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    config = vision_tower.config
    before = config._attn_implementation
    parameter = next(vision_tower.parameters())
    patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
    grid = torch.tensor([[1, 16, 12]], device=parameter.device)  # windows of two lengths
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(int(grid.prod()), patch, generator=generator).to(parameter.device, parameter.dtype)
    try:
        expected = vision_tower(probe, grid_thw=grid)
        AttentionInterface.register(NAME, packed_sdpa)
        config._attn_implementation = NAME
        packed = vision_tower(probe, grid_thw=grid)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError):
        config._attn_implementation = before
        return False
    # Relative L2 error: bf16 kernels differ in rounding (a few 1e-3 per layer, growing
    # over 32 layers), while a wrong code path (windows ignored) is off by ~0.7.
    tolerance = 1e-3 if parameter.dtype == torch.float32 else 5e-2
    same = all(_relative_error(a, b) <= tolerance for a, b in zip(_tensors(expected), _tensors(packed)))
    if not same:
        config._attn_implementation = before
    return same


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.float()
    return ((ours.float() - reference).norm() / reference.norm().clamp(min=1e-12)).item()


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a vision tower's output (a tensor or a ModelOutput, by version)."""
    if isinstance(output, torch.Tensor):
        return [output]
    return [v for v in output.values() if isinstance(v, torch.Tensor)]
