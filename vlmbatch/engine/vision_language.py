"""What every family's engine model shares: a vision tower in front of our decoder.

A family subclasses `VisionLanguageModel` in its own folder (`vlmbatch/families/<name>/`)
to say how its tower encodes a batch of media items, which token ids are its media
placeholders, and how prompt tokens are placed (M-RoPE for Qwen). The engine batches the
tower across the requests of a prefill step and caches its outputs by content hash, so a
repeated image is encoded once; encoded JPEGs are decoded on the GPU just before (only
those the tower will actually run on).

The cache holds at most `encoder_cache_size` items and `encoder_cache_bytes` of GPU memory
(the oldest go first): one 16-frame 720p clip of Qwen3-VL-8B is 5,760 tokens of
4 x 4096 features (with its DeepStack levels), 189 MB in bf16, so a count alone would let
256 distinct clips hold 48 GB the KV cache was sized on. With `encoder_cache_size` 0
nothing is reused: every request's items go through the tower for it alone, even two equal
items in one step (benchmarks that repeat media but must not share its encoding).
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from vlmbatch.engine.decoder import Decoder, DecoderSpec
from vlmbatch.engine.dummy_weights import materialize
from vlmbatch.engine.fp8_loading import quantize_vision_modules
from vlmbatch.engine.gpu_images import EncodedImageDecoder
from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.rotary import RotaryEmbedding
from vlmbatch.engine.media_staging import MediaStager
from vlmbatch.engine.weight_loading import CheckpointTensors, ModuleTensors, WeightLoader
from vlmbatch.families.prompt import MediaItem
from vlmbatch.quantization import Fp8Scheme

log = logging.getLogger(__name__)


def pooled(features: Any) -> torch.Tensor:
    """Image features as one [tokens, hidden] tensor, whatever the transformers version returns."""
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


class VisionLanguageModel(ABC):
    """Our decoder plus the family's vision tower and prompt-position rules."""

    mrope = False  # positions are [3, tokens] (M-RoPE), not [tokens]
    mrope_interleaved = False  # Qwen3-VL's layout of the M-RoPE frequencies (`RotaryEmbedding`)
    deepstack_levels = 0  # vision feature levels added after the first decoder layers (Qwen3-VL)
    bidirectional_media = False  # a media item's tokens attend to each other in prefill (Gemma 3)
    language_model_attr = "language_model"  # where `hf_model.model` holds its text model (Idefics3: text_model)

    def __init__(self, hf_model: nn.Module, decoder: Decoder, kernels: KernelSet, image_decoder: EncodedImageDecoder,
                 encoder_cache_size: int = 256, encoder_cache_bytes: int = 2 << 30):
        self.hf = hf_model
        self.decoder = decoder
        self.config = hf_model.config
        self.kernels = kernels
        self.image_decoder = image_decoder
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_size = encoder_cache_size  # items; 0: no reuse at all (module docstring)
        self.encoder_cache_bytes = encoder_cache_bytes
        self.num_encoded_items = 0  # stats: media items that went through the tower
        self.num_encoder_cache_hits = 0
        self.media = MediaStager(decoder.embed_tokens.weight.device)  # every pixel upload; staged ahead when the engine asks
        if kernels.rms_norm is not None:
            self._fuse_tower_norms(kernels.rms_norm)

    @classmethod
    def build(cls, hf_model: nn.Module, device: torch.device, dtype: torch.dtype, kernels: KernelSet,
              image_decoder: EncodedImageDecoder, fp8: Fp8Scheme | None = None, checkpoint: CheckpointTensors | None = None,
              dummy: bool = False) -> VisionLanguageModel:  # fmt: skip
        """Our decoder, built on "meta" and loaded tensor by tensor (`weight_loading.py`): from
        `checkpoint` (a pre-quantized FP8 checkpoint's files, whose language model
        transformers never built), else from `hf_model`'s language model. transformers' text
        model is then dropped (only the vision tower and the position rules are kept from it).
        `fp8`: the decoder's projections in FP8 (`fp8_loading.py`), and with `quantize_vision`
        the tower's too. `dummy`: random weights (`dummy_weights.py`: each tensor made on
        `device` in its final dtype), for `load_format="dummy"`."""
        language_model = getattr(hf_model.model, cls.language_model_attr)
        text_config = hf_model.config.get_text_config()
        rotary = cls.rotary_embeddings(language_model.rotary_emb, text_config)
        with torch.device("meta"):
            decoder = Decoder(text_config, rotary, cls.decoder_spec(text_config), kernels).to(dtype)
        if dummy:
            materialize(decoder, device, dtype, fp8, kernels)
        else:
            source = checkpoint if checkpoint is not None else ModuleTensors(language_model, hf_model.lm_head)
            weights = WeightLoader(source, device, dtype, kernels, fp8)
            decoder.load_weights(weights, tied=bool(getattr(hf_model.config, "tie_word_embeddings", False)))  # as transformers ties
            weights.finish(decoder)
            if checkpoint is not None:
                log.info("decoder streamed from %d checkpoint file(s): %.1f MiB read, at most %.1f MiB of it held on the host at once",
                         len(checkpoint.files), checkpoint.read_bytes / 2**20, checkpoint.peak_host_bytes / 2**20)
            if fp8 is not None:
                log.info("fp8: %d decoder projections / expert sets in FP8", weights.num_fp8)
        decoder.emit_fp8_inputs()
        decoder.eval().requires_grad_(False)
        setattr(hf_model.model, cls.language_model_attr, None)
        hf_model.lm_head = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = cls(hf_model, decoder, kernels, image_decoder)
        if fp8 is not None and fp8.quantize_vision:
            log.info("fp8: %d vision linear layers converted", quantize_vision_modules(model.vision_modules(), kernels, dtype))
        return model

    def vision_modules(self) -> list[nn.Module]:
        """The modules that run the media (the tower and projector): what `quantize_vision`
        converts. A family with its own tower overrides this to name it."""
        return [self.hf]

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)))

    @classmethod
    def rotary_embeddings(cls, hf_rotary: nn.Module, text_config: Any) -> RotaryEmbedding | dict[str, RotaryEmbedding]:
        """The decoder's rotary embedding(s), by the names `DecoderSpec.layers` uses."""
        return RotaryEmbedding.from_hf(hf_rotary, text_config, mrope=cls.mrope, interleaved=cls.mrope_interleaved)

    def _fuse_tower_norms(self, rms_norm: Any) -> None:
        """The checkpoint's own RMSNorms (in `transformers` towers) through the fused kernel:
        theirs is five kernels with fp32 round trips, measured at ~15% of Qwen2.5-VL's tower
        time on the H200; the fused one does the same arithmetic (fp32 statistics,
        normalised value rounded before the weight)."""
        for module in self.hf.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                module.forward = functools.partial(rms_norm, weight=module.weight, eps=module.variance_epsilon)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    @abstractmethod
    def placeholder_token_ids(self) -> dict[str, int]:
        """kind -> the token id the processor repeats once per media token."""

    @abstractmethod
    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """Embeddings [sum of num_tokens, hidden * (1 + deepstack_levels)] of decoded items of
        one kind, in order: the input embeddings, then each DeepStack level, side by side."""

    def on_device(self, items: list[MediaItem], key: str) -> torch.Tensor:
        """The items' `key` tensors concatenated on the device, each copied as it is (no
        host-side concatenation of a batch's pixels, which stalls the GPU for a large copy)
        unless it was staged ahead (`media_staging.py`)."""
        return self.media.take(items, key)

    def stage(self, items: list[MediaItem]) -> None:
        """Upload the pixels of `items`, those the next step will likely encode, while the
        GPU runs this one. With reuse on, `encode` runs the first item of each content and
        none the encoder cache holds: only those are staged."""
        if self.encoder_cache_size > 0:
            firsts = {}
            for item in items:
                if item.content_hash not in self.encoder_cache:
                    firsts.setdefault(item.content_hash, item)
            items = list(firsts.values())
        self.media.stage(items)

    def prompt_positions(self, token_ids: list[int], media: list[MediaItem]) -> tuple[torch.Tensor | None, int]:
        """M-RoPE positions [3, len] of a prompt and the rope delta; (None, 0) for 1-D RoPE."""
        return None, 0

    @torch.no_grad()
    def encode(self, requests: list[list[MediaItem]]) -> list[torch.Tensor]:
        """Media embeddings of each request ([media tokens, hidden], items concatenated in
        order), running the tower once per kind over all items not in the encoder cache
        (equal items of one step once, unless `encoder_cache_size` is 0)."""
        reuse = self.encoder_cache_size > 0
        keys = [[item.content_hash if reuse else (r, i) for i, item in enumerate(items)] for r, items in enumerate(requests)]
        todo: dict[str, dict[Any, MediaItem]] = {}
        for items, item_keys in zip(requests, keys):
            for item, key in zip(items, item_keys):
                if reuse and key in self.encoder_cache:
                    self.encoder_cache.move_to_end(key)
                    self.num_encoder_cache_hits += 1
                else:
                    todo.setdefault(item.kind, {}).setdefault(key, item)
        fresh: dict[Any, torch.Tensor] = {}
        for kind, by_key in todo.items():
            items = self._decoded(list(by_key.values()))
            embeds = self.encode_batch(kind, items).to(self.decoder.embed_tokens.weight.dtype)
            for key, item, rows in zip(by_key, items, embeds.split([i.num_tokens for i in items])):
                fresh[key] = rows
            self.num_encoded_items += len(items)
        out = [torch.cat([fresh[key] if key in fresh else self.encoder_cache[key] for key in item_keys]) for item_keys in keys]
        if reuse:
            self._keep(fresh)
        return out

    def _keep(self, fresh: dict[str, torch.Tensor]) -> None:
        """Cache `fresh`, then evict the oldest entries past the item count or the bytes."""
        self.encoder_cache.update(fresh)
        held = sum(rows.nbytes for rows in self.encoder_cache.values())
        while self.encoder_cache and (len(self.encoder_cache) > self.encoder_cache_size or held > self.encoder_cache_bytes):
            held -= self.encoder_cache.popitem(last=False)[1].nbytes

    def _decoded(self, items: list[MediaItem]) -> list[MediaItem]:
        """`items` with the encoded JPEGs among them decoded on the GPU, in one batch."""
        encoded = [item for item in items if item.encoded is not None]
        if not encoded:
            return items
        decoded = dict(zip((id(item) for item in encoded), self.image_decoder.decode(encoded)))
        return [decoded.get(id(item), item) for item in items]
