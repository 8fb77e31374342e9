"""Vision-language front ends: a vision tower + our decoder.

Qwen2.5-VL's tower is our own (`qwen_vision.py`: the same weights and arithmetic on the
engine's kernels, several times faster than `transformers`' module on the GPU); the other
families keep the checkpoint's own `transformers` vision modules. The engine batches the
tower across the requests of a prefill step and caches its outputs by media content hash,
so a repeated image is encoded once. Each family says how to split a request's processor
tensors into media items, how to run its tower, and how to place prompt tokens (M-RoPE
for Qwen).
"""

from __future__ import annotations

import functools
import inspect
from functools import cached_property
from itertools import groupby
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlmbatch.engine.layers.rotary import RotaryEmbedding
from vlmbatch.engine.models.decoder import Decoder
from vlmbatch.engine.models.packed_attention import use_packed_attention
from vlmbatch.media.gpu_batch import materialize_pending
from vlmbatch.engine.models.qwen_vision import QwenVisionTower


@dataclass
class MediaItem:
    """One image or video of a request: its own processor tensors and token count."""

    kind: str  # "image" | "video"
    inputs: dict[str, torch.Tensor]
    num_tokens: int
    content_hash: str


def _pooled(features: Any) -> torch.Tensor:
    """Image features as one [tokens, hidden] tensor, whatever the transformers version returns."""
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def _on_device(items: list[MediaItem], key: str, device: torch.device) -> torch.Tensor:
    """The items' `key` tensors concatenated on `device`: each is copied as it is (no
    host-side concatenation of a batch's pixels, which stalls the GPU for a large copy)."""
    return torch.cat([item.inputs[key].to(device, non_blocking=True) for item in items])


class VisionLanguageModel(ABC):
    """Our decoder plus the family's vision tower and prompt-position rules."""

    mrope = False

    def __init__(self, hf_model: nn.Module, decoder: Decoder, encoder_cache_size: int = 256):
        self.hf = hf_model
        self.decoder = decoder
        self.config = hf_model.config
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_size = encoder_cache_size
        self.num_encoded_items = 0  # stats: media items that went through the tower
        self.num_encoder_cache_hits = 0

    @property
    @abstractmethod
    def placeholder_token_ids(self) -> dict[str, int]:
        """kind -> the token id the processor repeats once per media token."""

    @abstractmethod
    def split_media(self, mm_inputs: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """A request's media items, images first then videos, each in prompt order."""

    @abstractmethod
    def _encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """Embeddings [sum of num_tokens, hidden] of items of one kind, in order."""

    def prompt_positions(self, token_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, int]:
        """M-RoPE positions [3, len] of a prompt and the rope delta; (None, 0) for 1-D RoPE."""
        return None, 0

    def use_kernels(self, kernels: Any | None) -> None:
        """Fused norm kernels (`vlmbatch.kernels`) in the decoder and for the vision tower's
        RMSNorms, or plain torch (None). The tower's own RMSNorm is five kernels with fp32
        round trips, measured at ~15% of its time on the H200; the fused one does the
        same arithmetic (fp32 statistics, normalised value rounded before the weight)."""
        self.decoder.use_kernels(kernels)
        for module in self.hf.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                if kernels is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = functools.partial(kernels.rms_norm, weight=module.weight, eps=module.variance_epsilon)

    @torch.no_grad()
    def encode(self, requests: list[list[MediaItem]]) -> list[torch.Tensor]:
        """Media embeddings of each request ([media tokens, hidden], items concatenated in
        order), running the tower once per kind over all items not in the encoder cache."""
        requests = materialize_pending(requests, self.encoder_cache, self.decoder.embed_tokens.weight.device)  # GPU JPEGs
        todo: dict[str, list[MediaItem]] = {}
        for items in requests:
            for item in items:
                if item.content_hash in self.encoder_cache:
                    self.encoder_cache.move_to_end(item.content_hash)
                    self.num_encoder_cache_hits += 1
                elif all(item.content_hash != other.content_hash for other in todo.get(item.kind, [])):
                    todo.setdefault(item.kind, []).append(item)
        fresh: dict[str, torch.Tensor] = {}
        for kind, items in todo.items():
            embeds = self._encode_batch(kind, items).to(self.decoder.embed_tokens.weight.dtype)
            for item, rows in zip(items, embeds.split([i.num_tokens for i in items])):
                fresh[item.content_hash] = rows
            self.num_encoded_items += len(items)
        out = []
        for items in requests:
            out.append(torch.cat([fresh.get(i.content_hash, self.encoder_cache.get(i.content_hash)) for i in items]))
        for content_hash, rows in fresh.items():
            self.encoder_cache[content_hash] = rows
        while len(self.encoder_cache) > self.encoder_cache_size:
            self.encoder_cache.popitem(last=False)
        return out


class QwenVL(VisionLanguageModel):
    """Qwen2-VL and Qwen2.5-VL: dynamic-resolution ViT with 2x2 merge, M-RoPE decoder."""

    mrope = True

    def __init__(self, hf_model: nn.Module, decoder: Decoder, encoder_cache_size: int = 256):
        super().__init__(hf_model, decoder, encoder_cache_size)
        visual = hf_model.model.visual
        self.tower: QwenVisionTower | None = None
        self.packed_vision_attention = False
        if self.config.model_type == "qwen2_5_vl":
            weight = decoder.embed_tokens.weight
            self.tower = QwenVisionTower.from_hf(visual, weight.device, weight.dtype)
            hf_model.model.visual = None  # ours holds the weights now
        else:
            # Qwen2-VL keeps transformers' tower; False: it keeps its per-window loop
            # (benchmarks report it: it costs ~4x)
            self.packed_vision_attention = use_packed_attention(visual)

    def use_kernels(self, kernels: Any | None) -> None:
        super().use_kernels(kernels)
        if self.tower is not None:
            self.tower.use_kernels(kernels)

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {"image": self.config.image_token_id, "video": self.config.video_token_id}

    def split_media(self, mm_inputs, hashes):
        merge = self.config.vision_config.spatial_merge_size ** 2
        items = []
        for kind, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
            grids = mm_inputs.get(grid_key)
            if grids is None:
                continue
            rows = grids.prod(-1).tolist()
            seconds = mm_inputs.get("second_per_grid_ts")
            for i, (grid, pixels) in enumerate(zip(grids, mm_inputs[pixels_key].split(rows))):
                inputs = {pixels_key: pixels, grid_key: grid.unsqueeze(0)}
                if kind == "video" and seconds is not None:
                    inputs["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[i : i + 1]
                items.append(MediaItem(kind, inputs, int(grid.prod()) // merge, hashes[len(items)]))
        return items

    def _encode_batch(self, kind, items):
        pixels_key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
        device = self.decoder.embed_tokens.weight.device
        pixels = _on_device(items, pixels_key, device)
        if self.tower is not None:
            return self.tower(pixels, torch.cat([i.inputs[grid_key] for i in items]))
        grids = torch.cat([i.inputs[grid_key] for i in items]).to(device)
        encode = self.hf.model.get_image_features if kind == "image" else self.hf.model.get_video_features
        return _pooled(encode(pixels, grids))

    def prompt_positions(self, token_ids, mm_inputs):
        """Exactly `transformers`' `get_rope_index` (whose signature changed across versions),
        memoised on what it depends on: where the media and vision-start tokens sit, and the
        grids. Batch workloads repeat one layout, and the HF function is a Python loop."""
        key = self._layout_key(token_ids, mm_inputs)
        cached = self._rope_cache.get(key)
        if cached is None:
            cached = self._rope_cache[key] = self._hf_rope_index(token_ids, mm_inputs)
            if len(self._rope_cache) > 1024:
                self._rope_cache.pop(next(iter(self._rope_cache)))
        return cached

    @cached_property
    def _rope_cache(self) -> dict[tuple, tuple[torch.Tensor, int]]:
        return {}

    def _layout_key(self, token_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> tuple:
        special = {self.config.image_token_id, self.config.video_token_id, self.config.vision_start_token_id}
        runs = tuple((token, len(list(group))) for token, group in groupby(t if t in special else -1 for t in token_ids))
        grids = tuple(
            tuple(mm_inputs[k].reshape(-1).tolist()) if k in mm_inputs else None
            for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        )
        return runs, grids

    def _hf_rope_index(self, token_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        get_rope_index = self.hf.model.get_rope_index
        accepted = inspect.signature(get_rope_index).parameters
        input_ids = torch.tensor([token_ids])
        kwargs = {k: mm_inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in accepted}
        if "mm_token_type_ids" in accepted:
            types = torch.zeros_like(input_ids)
            types[input_ids == self.config.image_token_id] = 1
            types[input_ids == self.config.video_token_id] = 2
            kwargs["mm_token_type_ids"] = types
        positions, delta = get_rope_index(input_ids, **kwargs)
        return positions[:, 0], int(delta.reshape(-1)[0])


class Llava(VisionLanguageModel):
    """LLaVA-1.5: CLIP tower + MLP projector, Llama decoder with 1-D RoPE."""

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {"image": self.config.image_token_id}

    def split_media(self, mm_inputs, hashes):
        pixels = mm_inputs.get("pixel_values")
        if pixels is None:
            return []
        tokens = int(self.config.image_seq_length)
        return [MediaItem("image", {"pixel_values": p.unsqueeze(0)}, tokens, h) for p, h in zip(pixels, hashes)]

    def _encode_batch(self, kind, items):
        device = self.decoder.embed_tokens.weight.device
        pixels = _on_device(items, "pixel_values", device).to(self.hf.dtype)
        return _pooled(self.hf.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        ))


FAMILIES: dict[str, type[VisionLanguageModel]] = {"qwen2_5_vl": QwenVL, "qwen2_vl": QwenVL, "llava": Llava}


def build_model(hf_model: nn.Module, device: torch.device, dtype: torch.dtype) -> VisionLanguageModel:
    """Our decoder with the weights of `hf_model`'s language model, which is then dropped
    (only the vision tower and the position rules are kept from `transformers`)."""
    family = FAMILIES.get(hf_model.config.model_type)
    if family is None:
        raise ValueError(f"the paged engine does not support model type {hf_model.config.model_type!r}")
    language_model = hf_model.model.language_model
    text_config = hf_model.config.get_text_config()
    rotary = RotaryEmbedding.from_hf(language_model.rotary_emb, text_config, mrope=family.mrope)
    bias = family.mrope or bool(getattr(text_config, "attention_bias", False))
    with torch.device(device):
        decoder = Decoder(text_config, rotary, bias).to(dtype)
    decoder.load_from_hf(language_model, hf_model.lm_head)
    decoder.eval().requires_grad_(False)
    hf_model.model.language_model = None
    hf_model.lm_head = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return family(hf_model, decoder)
