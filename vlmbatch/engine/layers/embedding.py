"""Token embeddings multiplied by a constant (Gemma: sqrt(hidden)), as `transformers` scales them."""

from __future__ import annotations

import torch
from torch import nn


class ScaledEmbedding(nn.Embedding):
    """`Gemma3TextScaledWordEmbedding`: the scale is a buffer cast to the weight's dtype
    before the product, so a bf16 model rounds it as transformers does (sqrt(3840) = 61.97
    becomes 62.0). Media embeddings that replace placeholder rows are not scaled."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale_value = scale
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def place_scale(self, device: torch.device, dtype: torch.dtype) -> None:
        """The scale of an embedding built on "meta" (which holds no value), as built and cast elsewhere."""
        if self.scale.is_meta:
            self.scale = torch.tensor(self.scale_value).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale.to(self.weight.dtype)
