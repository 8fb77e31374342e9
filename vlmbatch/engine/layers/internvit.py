"""InternViT (InternVL3 / InternVL3.5's `InternVLVisionModel`) as our SigLIP tower with a CLS
token: once each layer's scale (`lambda_1`, `lambda_2`) is folded into the projection before
it, an InternViT layer is SigLIP's pre-LayerNorm block (`engine/layers/siglip.py`), so the
encoder, its one q/k/v matmul read by SDPA as strided views, and the feature-layer rules are
SigLIP's.

What differs is the embeddings (the Conv2d with its bias as one matmul, the CLS token first,
learned positions over CLS + patches) and the weight names (`convert_state_dict`). Folding
the scales changes rounding only: `transformers` rounds the projection, then its product
with the scale; ours rounds once. Measured on the H200 (InternVL3-8B, 64 W1 images, session
11): 1.57 ms an image against `transformers`' 1.69, half the q/k/v GEMM launches; its
layer norms and elementwise kernels are ~22% of the time left.

Towers with q/k norms or RMSNorm (InternViT-6B) or without absolute positions keep `transformers`' (`rebuilds`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmbatch.engine.layers.siglip import SiglipEmbeddings, SiglipVisionTower

# transformers' names (`InternVLVisionModel.state_dict()`) -> ours (SigLIP's), as substrings
_RENAMES = (
    ("encoder.layer.", "encoder.layers."),
    (".attention.projection_layer.", ".self_attn.out_proj."),
    (".attention.", ".self_attn."),
    (".layernorm_before.", ".layer_norm1."),
    (".layernorm_after.", ".layer_norm2."),
    ("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding."),
    ("embeddings.position_embeddings", "embeddings.position_embedding.weight"),
)
# the scale after each projection: lambda_1 after attention's output, lambda_2 after the MLP
_SCALED = {"lambda_1": "self_attn.out_proj", "lambda_2": "mlp.fc2"}


class InternVisionEmbeddings(SiglipEmbeddings):
    """[B, C, H, W] -> [B, 1 + patches, hidden]: the CLS token, then the patches, plus the
    learned position of each (a fixed grid: tiles are always the configured size)."""

    def __init__(self, config: Any, bucketed_positions: bool = False):
        super().__init__(config, bucketed_positions)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.position_embedding = nn.Embedding(1 + self.side**2, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x, rows, cols = self.embed_patches(pixels)
        if (rows, cols) != (self.side, self.side):
            raise ValueError(f"InternViT tower: a {rows}x{cols} patch grid needs position interpolation, which this "
                             f"tower does not do (its grid is {self.side}x{self.side})")
        x = torch.cat([self.cls_token.expand(len(x), 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class InternVisionTower(SiglipVisionTower):
    embeddings_class = InternVisionEmbeddings

    @classmethod
    def final_norm(cls, config: Any) -> nn.Module:
        return nn.Identity() if config.use_mean_pooling else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @classmethod
    def rebuilds(cls, vision: nn.Module) -> bool:
        config = vision.config
        return (type(vision).__name__ == "InternVLVisionModel" and config.norm_type == "layer_norm" and not config.use_qk_norm
                and config.use_absolute_position_embeddings)

    def convert_state_dict(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`transformers`' names as SigLIP's, each layer's scales folded into the weight and
        bias of the projection before them (in float32), then SigLIP's conversion."""
        state: dict[str, torch.Tensor] = {}
        for name, value in hf_state.items():
            for theirs, ours in _RENAMES:
                name = name.replace(theirs, ours)
            state[name] = value
        state["embeddings.position_embedding.weight"] = state["embeddings.position_embedding.weight"][0]  # [1, N+1, D]
        for name in [n for n in state if n.rsplit(".", 1)[-1] in _SCALED]:
            prefix, scale_name = name.rsplit(".", 1)
            scale = state.pop(name).float()
            for kind in ("weight", "bias"):
                target = f"{prefix}.{_SCALED[scale_name]}.{kind}"
                value = state[target]
                state[target] = (value.float() * (scale[:, None] if kind == "weight" else scale)).to(value.dtype)
        state = {"post_" + k if k.startswith("layernorm.") else k: v for k, v in state.items()}  # SigLIP drops it where unbuilt
        return super().convert_state_dict(state)
