"""Gemma 3 in the paged engine: our SigLIP tower (`families/siglip_tower.py`) on the
checkpoint's weights, its pooling projector, our decoder with Gemma's layers (see
`decoder_spec`), one image's tokens attending to each other in prefill
(`bidirectional_media`), as `transformers` masks them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmbatch.engine.decoder import DecoderSpec, LayerAttention
from vlmbatch.engine.layers.rotary import RotaryEmbedding
from vlmbatch.engine.vision_language import VisionLanguageModel, pooled
from vlmbatch.families.prompt import IMAGE, MediaItem
from vlmbatch.families.siglip_tower import SiglipTower

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class Gemma3Model(SiglipTower, VisionLanguageModel):
    bidirectional_media = True

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """SigLIP, then the projector: average-pooled to `mm_tokens_per_image`, normed, projected."""
        pixels = self.on_device(items, "pixel_values").to(self.hf.dtype)
        return pooled(self.hf.model.multi_modal_projector(self.vision_hidden(pixels)))

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        """Gemma 3's decoder from its config; what the engine does not do is refused here."""
        cfg = text_config
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma attention logit soft-capping (attn_logit_softcapping) is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not supported")
        if cfg.hidden_activation not in GELU_TANH:
            raise ValueError(f"unsupported Gemma activation {cfg.hidden_activation!r}")
        layers = tuple(LayerAttention(window=cfg.sliding_window if kind == "sliding_attention" else 0, rope=kind)
                       for kind in cfg.layer_types)
        return DecoderSpec(
            qkv_bias=bool(cfg.attention_bias), qk_norm=True, offset_norm=True, sandwich_norms=True, activation="gelu_tanh",
            embed_scale=cfg.hidden_size**0.5, attention_scale=cfg.query_pre_attn_scalar**-0.5, layers=layers,
            final_logit_softcap=cfg.final_logit_softcapping,
        )

    @classmethod
    def rotary_embeddings(cls, hf_rotary: nn.Module, text_config: Any) -> dict[str, RotaryEmbedding]:
        """One per layer type (local base for sliding layers, global base and scaling for
        full ones), recomputed in fp32 by transformers' own rope functions: a bf16 model
        may hold rounded buffers. They are made where transformers' own buffers are (the GPU
        in production): our tables are plain attributes, which `.to()` does not move."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        device = next(hf_rotary.buffers()).device
        out = {}
        for kind in sorted(set(text_config.layer_types)):
            rope_type = hf_rotary.rope_type[kind]
            init = hf_rotary.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, scaling = init(text_config, device, layer_type=kind)
            out[kind] = RotaryEmbedding(inv_freq, float(scaling))
        return out


ENGINE_MODEL = Gemma3Model
