"""Tiny random-weight InternVL3 / InternVL3.5 checkpoints: an InternViT tower (56 px tiles of
14 px patches, CLS token, layer scale), the pixel-shuffle MLP projector, and a Qwen2
(InternVL3) or Qwen3 (InternVL3.5) decoder; the processor's aspect-ratio tiling with a
thumbnail tile (up to 6 tiles + 1 here), `Frame{i}:`-prefixed video frames.

Each 56x56 tile is 4x4 patches, 2x2 after the pixel shuffle: 4 image tokens a tile, so an
image costs 4 to 28 tokens and the tile count (hence the token count) follows its aspect ratio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.testing.checkpoints import CHATML_TURN_END, TINY_DECODER, chatml_tokenizer, padded_vocab, save_checkpoint, token_id_fields

LANGUAGE_MODELS = ("qwen2", "qwen3")  # InternVL3, InternVL3.5
# Named tokens the InternVL processor reads from its tokenizer (`tokenizer.context_image_token` ...).
MEDIA_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *MEDIA_TOKENS.values()]
TILE, PATCH, MAX_TILES = 56, 14, 6
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2  # after the 0.5 pixel shuffle

# InternVL-hf's chat template: ChatML, each image as <IMG_CONTEXT> and each video as <video>
# on its own line before the text of the turn (the processor expands both).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<IMG_CONTEXT>\\n' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<video>\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    + CHATML_TURN_END
)


def processor() -> Any:
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    tokenizer = chatml_tokenizer(SPECIAL_TOKENS)
    tokenizer._set_model_specific_special_tokens(MEDIA_TOKENS)  # saved as tokenizer_config.json "extra_special_tokens"
    pixels = dict(size={"height": TILE, "width": TILE}, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(crop_to_patches=True, min_patches=1, max_patches=MAX_TILES, **pixels),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(**pixels),
        image_seq_length=TOKENS_PER_TILE,
        chat_template=CHAT_TEMPLATE,
    )


def config(tokenizer: Any, language_model: str = "qwen2") -> Any:
    from transformers import InternVLConfig

    if language_model not in LANGUAGE_MODELS:
        raise ValueError(f"language_model must be one of {LANGUAGE_MODELS}, got {language_model!r}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(
        model_type=language_model,
        vocab_size=padded_vocab(tokenizer),
        **TINY_DECODER,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **token_id_fields(ids, "<|endoftext|>", "<|im_end|>", "<|endoftext|>"),
        tie_word_embeddings=False,
    )
    if language_model == "qwen3":
        text_config["head_dim"] = 16
    vision_config = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE, patch_size=PATCH,
        attention_bias=True, norm_type="layer_norm", use_qk_norm=False, use_mean_pooling=True, layer_scale_init_value=0.1,
    )
    return InternVLConfig(
        vision_config=vision_config, text_config=text_config, image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5, projector_hidden_act="gelu",
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )


def make_tiny_checkpoint(dir: str | Path, seed: int = 0, language_model: str = "qwen2") -> Path:
    """InternVL3 (`language_model` qwen2, what `make-tiny-model --arch internvl` writes) or InternVL3.5 (qwen3)."""
    proc = processor()
    cfg = config(proc.tokenizer, language_model)
    text = cfg.text_config
    return save_checkpoint(dir, cfg, proc, [text.eos_token_id, text.pad_token_id], seed)
