"""Qwen2-VL in the paged engine: the checkpoint's own vision tower, M-RoPE positions.

`QwenVL` holds what the Qwen-VL families share (placeholders, encoding through the tower,
`transformers`' own position rules, and the hookup of a tower of ours where a family has
one: Qwen2.5-VL, Qwen3-VL); Qwen2-VL keeps `transformers`' tower with its windows attended
in one call per length (`segment_attention.use_packed_attention`).
"""

from __future__ import annotations

import inspect
from functools import cached_property
from itertools import groupby
from typing import Any

import torch

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.engine.layers.segment_attention import use_packed_attention
from vlmbatch.engine.vision_language import VisionLanguageModel, pooled
from vlmbatch.families.prompt import IMAGE, VIDEO, MediaItem, collate

_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_PIXELS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


class QwenVL(VisionLanguageModel):
    """Dynamic-resolution ViT with 2x2 merge in front of a Qwen2 decoder with M-RoPE."""

    mrope = True
    # Our tower (`from_hf(visual, device, dtype, kernels)`, called as `tower(pixels, grids)`)
    # in place of `transformers`' one, whose weights it takes over; None keeps theirs.
    tower_class: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tower = None
        if self.tower_class is not None:
            weight = self.decoder.embed_tokens.weight
            self.tower = self.tower_class.from_hf(self.hf.model.visual, weight.device, weight.dtype, self.kernels)
            self.hf.model.visual = None  # ours holds the weights now

    def vision_modules(self) -> list[torch.nn.Module]:
        return [self.tower] if self.tower is not None else super().vision_modules()

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)  # Qwen2's q/k/v projections always have biases

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id, VIDEO: self.config.video_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        pixels_key, grid_key = _PIXELS[kind]
        pixels = self.on_device(items, pixels_key)
        grids = torch.cat([i.tensors[grid_key] for i in items])
        return self.tower_features(kind, pixels, grids)

    def tower_features(self, kind: str, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        if self.tower is not None:
            return self.tower(pixels, grids)
        encode = self.hf.model.get_image_features if kind == IMAGE else self.hf.model.get_video_features
        return pooled(encode(pixels, grids.to(self.device)))

    def prompt_positions(self, token_ids: list[int], media: list[MediaItem]) -> tuple[torch.Tensor, int]:
        """Exactly `transformers`' `get_rope_index` (whose signature changed across versions),
        memoised on what it depends on: where the media and vision-start tokens sit, and the
        grids. Batch workloads repeat one layout, and the HF function is a Python loop."""
        grids = {key: value for key, value in collate([_grids_only(m) for m in media]).items() if key in _GRID_KEYS}
        key = self._layout_key(token_ids, grids)
        cached = self._rope_cache.get(key)
        if cached is None:
            cached = self._rope_cache[key] = self._hf_rope_index(token_ids, grids)
            if len(self._rope_cache) > 1024:
                self._rope_cache.pop(next(iter(self._rope_cache)))
        return cached

    @cached_property
    def _rope_cache(self) -> dict[tuple, tuple[torch.Tensor, int]]:
        return {}

    def _layout_key(self, token_ids: list[int], grids: dict[str, torch.Tensor]) -> tuple:
        special = {self.config.image_token_id, self.config.video_token_id, self.config.vision_start_token_id}
        runs = tuple((token, len(list(group))) for token, group in groupby(t if t in special else -1 for t in token_ids))
        return runs, tuple(tuple(grids[k].reshape(-1).tolist()) if k in grids else None for k in _GRID_KEYS)

    def _hf_rope_index(self, token_ids: list[int], grids: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        get_rope_index = self.hf.model.get_rope_index
        accepted = inspect.signature(get_rope_index).parameters
        input_ids = torch.tensor([token_ids])
        kwargs: dict[str, Any] = {k: grids.get(k) for k in _GRID_KEYS if k in accepted}
        if "mm_token_type_ids" in accepted:
            types = torch.zeros_like(input_ids)
            types[input_ids == self.config.image_token_id] = 1
            types[input_ids == self.config.video_token_id] = 2
            kwargs["mm_token_type_ids"] = types
        positions, delta = get_rope_index(input_ids, **kwargs)
        return positions[:, 0], int(delta.reshape(-1)[0])


def _grids_only(item: MediaItem) -> MediaItem:
    """The item without its pixels (positions need only the grids; an encoded image has no pixels yet)."""
    return MediaItem(item.kind, {k: v for k, v in item.tensors.items() if k in _GRID_KEYS}, item.num_tokens, item.content_hash)


class Qwen2VLModel(QwenVL):
    """Qwen2-VL keeps `transformers`' tower; `packed_vision_attention` False means it kept
    its per-window loop (benchmarks report it: it costs ~4x)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.packed_vision_attention = use_packed_attention(self.hf.model.visual)


ENGINE_MODEL = Qwen2VLModel
