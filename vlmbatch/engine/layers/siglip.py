"""A SigLIP vision encoder of ours, for the families whose tower is `transformers`'
`SiglipVisionModel` (Gemma 3, LLaVA-OneVision) or Idefics3's copy of it run on full tiles
(Idefics3, SmolVLM: `Idefics3VisionTransformer` without a patch mask).

The same weights and arithmetic as `transformers`': the Conv2d patch embedding (stride =
kernel) as one matmul, learned positions (a fixed grid, or Idefics3's bucketed position ids
of a full tile), pre-LayerNorm blocks with GELU-tanh MLPs, the post-layernorm. What differs
is the layout: q, k and v are one matmul whose output [B, L, 3, H, D] reaches SDPA as
strided [B, H, L, D] views (no copies), and SDPA's output is read back as [B, L, H*D]
(`transpose(1, 2).reshape`, a view where the backend returns it heads-inner, as the flash
and cuDNN kernels do). Measured on the H200 (SigLIP-so400m at 896 px), `transformers`'
`.contiguous()` copies around attention are ~24% of its CUDA time and its three q/k/v
matmuls a third of the GEMM launches.

Weights load with a strict `load_state_dict` under `transformers`' names; the one
conversion (`convert_state_dict`): `q_proj`, `k_proj`, `v_proj` are concatenated into
`qkv` (rows in q, k, v order), the Conv2d weight is flattened to the matmul's [D, C*P*P],
and what is not built is dropped by name: the layers after the deepest one a family reads,
the post-layernorm where it reads an inner layer's hidden states, and the pooling `head`
(no family here uses it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# `transformers`' towers of this arithmetic; the second two place patches by bucketed
# position ids (NaViT-style, for tiles smaller than the grid), the first by a fixed grid.
BUCKETED_TOWERS = ("Idefics3VisionTransformer", "SmolVLMVisionTransformer")
TOWERS = ("SiglipVisionModel", *BUCKETED_TOWERS)


@functools.lru_cache(maxsize=64)
def bucketed_position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Idefics3's position ids [rows*cols] of a tile whose every patch is real, by its own
    float32 arithmetic (`torch.bucketize` of fractional coordinates into `side` buckets)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    buckets = []
    for size in (rows, cols):
        coords = torch.arange(size, dtype=torch.float32)[None] * (1.0 / torch.tensor([size]))[:, None]
        buckets.append(torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)[0])
    return (buckets[0][:, None] * side + buckets[1][None, :]).flatten()


def square_size(size: int | Sequence[int]) -> int:
    """A config's image or patch size as one number (InternViT's are [height, width] pairs of one value)."""
    return size if isinstance(size, int) else size[0]


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any, bucketed_positions: bool):
        super().__init__()
        self.patch = square_size(config.patch_size)
        self.side = square_size(config.image_size) // self.patch
        self.bucketed = bucketed_positions
        self.patch_embedding = nn.Linear(config.num_channels * self.patch**2, config.hidden_size)  # the Conv2d has a bias
        self.position_embedding = nn.Embedding(self.side**2, config.hidden_size)
        self._positions: dict[tuple[int, int], torch.Tensor] = {}

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        key = (rows, cols)
        if key not in self._positions:
            if self.bucketed:
                ids = bucketed_position_ids(rows, cols, self.side)
            elif rows * cols == self.side**2:
                ids = torch.arange(rows * cols)  # `transformers` without `interpolate_pos_encoding`
            else:
                raise ValueError(f"SigLIP tower: a {rows}x{cols} patch grid needs position interpolation, which "
                                 f"this tower does not do (its grid is {self.side}x{self.side})")
            self._positions[key] = ids.to(self.position_embedding.weight.device)
        return self._positions[key]

    def embed_patches(self, pixels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """[B, C, H, W] -> [B, (H/P)*(W/P), hidden] and the patch grid: patches row by row, as
        the Conv2d's output flattened."""
        b, c, h, w = pixels.shape
        p = self.patch
        rows, cols = h // p, w // p
        patches = pixels[:, :, : rows * p, : cols * p].reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5)
        return self.patch_embedding(patches.reshape(b, rows * cols, c * p * p).to(self.patch_embedding.weight.dtype)), rows, cols

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x, rows, cols = self.embed_patches(pixels)
        return x + self.position_embedding(self.position_ids(rows, cols))


class SiglipAttention(nn.Module):
    """Full attention over one image's patches; q/k/v one matmul, no copies around SDPA."""

    def __init__(self, dim: int, num_heads: int, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        # [B, L, 3, H, D] -> three strided [B, H, L, D] views (last dim contiguous, as SDPA needs)
        q, k, v = self.qkv(x).view(b, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, length, dim))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        from transformers.activations import ACT2FN

        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(dim, config.num_attention_heads, bias=getattr(config, "attention_bias", True))
        self.layer_norm2 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(layers))


def transformers_hidden(vision: nn.Module, pixels: torch.Tensor, feature_layers: Sequence[int] | None) -> torch.Tensor:
    """What `transformers`' tower `vision` gives for the same `feature_layers` (see
    `SiglipVisionTower`): the reference of the tests and the bench, and the engine's path
    where ours is not built."""
    if feature_layers is None:
        return vision(pixel_values=pixels).last_hidden_state
    states = vision(pixels, output_hidden_states=True, return_dict=True).hidden_states
    picked = [states[i] for i in feature_layers]
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


class SiglipVisionTower(nn.Module):
    """`tower(pixels [B, C, H, W])` -> [B, patches, hidden]: the post-layernormed last layer
    (`last_hidden_state`, `feature_layers` None), or the hidden states at `feature_layers`
    (indices into `transformers`' `hidden_states`: 0 is the embeddings, i the i-th layer's
    output, negatives from the end; several are concatenated on the last dim), for which
    only the layers up to the deepest are built and there is no post-layernorm."""

    embeddings_class = SiglipEmbeddings

    def __init__(self, config: Any, feature_layers: Sequence[int] | None = None, bucketed_positions: bool = False):
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = None if feature_layers is None else tuple(i % (total + 1) for i in feature_layers)
        layers = total if self.feature_layers is None else max(self.feature_layers)
        self.embeddings = self.embeddings_class(config, bucketed_positions)
        self.encoder = SiglipEncoder(config, layers)
        self.post_layernorm = self.final_norm(config) if self.feature_layers is None else None

    @classmethod
    def final_norm(cls, config: Any) -> nn.Module:
        """What `last_hidden_state` passes through after the last layer."""
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @classmethod
    def rebuilds(cls, vision: nn.Module) -> bool:
        """Whether `transformers`' tower `vision` is one this class rebuilds exactly."""
        return type(vision).__name__ in TOWERS

    @classmethod
    def from_hf(cls, vision: nn.Module, device: torch.device, dtype: torch.dtype,
                feature_layers: int | Sequence[int] | None = None) -> "SiglipVisionTower":
        """Ours from `transformers`' `SiglipVisionModel` (or `Idefics3VisionTransformer`,
        whose full tiles take the bucketed position ids), with its weights."""
        if isinstance(feature_layers, int):
            feature_layers = (feature_layers,)
        config = vision.config
        bucketed = type(vision).__name__ in BUCKETED_TOWERS
        with torch.device(device):
            tower = cls(config, feature_layers, bucketed).to(dtype)
        tower.load_state_dict(tower.convert_state_dict(vision.state_dict()))
        return tower.eval().requires_grad_(False)

    def convert_state_dict(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`transformers`' state dict (`SiglipVisionModel`'s `vision_model.` prefix removed) in
        our names: q/k/v fused, the Conv2d flattened, unbuilt parts dropped (see the module doc)."""
        state = {k.removeprefix("vision_model."): v for k, v in hf_state.items()}
        built = len(self.encoder.layers)
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if name.startswith("head.") or (self.post_layernorm is None and name.startswith("post_layernorm.")):
                continue
            if name.startswith("encoder.layers.") and int(name.split(".")[2]) >= built:
                continue
            if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
                continue  # fused with q_proj below
            if ".self_attn.q_proj." in name:
                prefix, kind = name.split(".self_attn.q_proj.")
                parts = [state[f"{prefix}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
                out[f"{prefix}.self_attn.qkv.{kind}"] = torch.cat(parts)
                continue
            if name == "embeddings.patch_embedding.weight":
                value = value.reshape(value.shape[0], -1)
            out[name] = value
        return out

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        if self.feature_layers is None:
            for layer in self.encoder.layers:
                x = layer(x)
            return self.post_layernorm(x)
        states = {0: x}  # only the states a family reads are kept
        for index, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if index in self.feature_layers:
                states[index] = x
        picked = [states[i] for i in self.feature_layers]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
