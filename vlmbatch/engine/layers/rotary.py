"""Rotary position embeddings for flat token batches: 1-D RoPE and the Qwen-VL M-RoPEs.

The inverse frequencies and scaling come from the checkpoint's own `transformers`
rotary module, so every rope type it supports is reproduced exactly. M-RoPE gives each
token three positions (temporal, height, width) and takes each frequency's angle from
one of them: Qwen2-VL splits the frequencies into three contiguous sections
(`mrope_section`), Qwen3-VL interleaves them (frequency i from height when i % 3 == 1 and
i < 3 * section[1], from width when i % 3 == 2 and i < 3 * section[2], else temporal).
The result is laid out like 1-D RoPE, so one `apply_rotary` serves all of them.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0, mrope_section: list[int] | None = None,
                 interleaved: bool = False):
        super().__init__()
        # A plain attribute, not a buffer: `.to(bfloat16)` on the decoder must not round it.
        self.inv_freq = inv_freq.float().clone()
        self.attention_scaling = attention_scaling
        self.mrope_section = list(mrope_section) if mrope_section else None
        self.interleaved = interleaved

    @classmethod
    def from_hf(cls, hf_rotary: nn.Module, text_config, mrope: bool, interleaved: bool = False) -> "RotaryEmbedding":
        """From the model's `transformers` rotary module; the M-RoPE section sits on the
        module in recent versions and in the config's rope parameters in older ones."""
        section = None
        if mrope:
            rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
            section = getattr(hf_rotary, "mrope_section", None) or rope.get("mrope_section")
            if section is None:
                raise ValueError("an M-RoPE model without mrope_section in its rotary module or config")
        inv_freq, scaling = hf_rotary.inv_freq, getattr(hf_rotary, "attention_scaling", 1.0)
        if getattr(hf_rotary, "rope_type", None) == "default" and hasattr(hf_rotary, "compute_default_rope_parameters"):
            # Recomputed in fp32 where this transformers version allows: a model loaded in
            # bf16 may hold a rounded copy.
            try:
                fresh, scaling = hf_rotary.compute_default_rope_parameters(text_config)
                inv_freq = fresh.to(hf_rotary.inv_freq.device)
            except (TypeError, KeyError, AttributeError):
                pass
        return cls(inv_freq, float(scaling), section, interleaved)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, head_dim] for positions [num_tokens] (or [3, num_tokens])."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., num_tokens, head_dim / 2]
        if self.mrope_section is not None:
            if positions.dim() == 1:
                freqs = freqs.unsqueeze(0).expand(3, -1, -1)
            freqs = self._interleave(freqs) if self.interleaved else self._sections(freqs)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


    def _sections(self, freqs: torch.Tensor) -> torch.Tensor:
        bands = freqs.split(self.mrope_section, dim=-1)
        return torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)

    def _interleave(self, freqs: torch.Tensor) -> torch.Tensor:
        out = freqs[0].clone()
        for axis in (1, 2):
            band = slice(axis, 3 * self.mrope_section[axis], 3)
            out[..., band] = freqs[axis][..., band]
        return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N, heads, dim] and k [N, kv_heads, dim] (rotate-half layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)
