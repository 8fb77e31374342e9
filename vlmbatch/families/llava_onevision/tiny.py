"""Tiny random-weight LLaVA-OneVision checkpoints: a SigLIP tower (no CLS, "full" features),
anyres tiling over 1x1..4x4 tiles with `anyres_max_9` downsampling of large grids, videos
pooled 2x2 per frame, and a Qwen2 decoder (q/k/v biases; LLaVA-NeXT's tiny `text_config`) with
OneVision's ChatML prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.families.llava_next.tiny import text_config
from vlmbatch.testing.checkpoints import CHATML_TURN_END, chatml_tokenizer, save_checkpoint

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
TILE, PATCH = 32, 8  # 4x4 patches per tile
# every grid of 1..4 x 1..4 tiles, as the released 1..6 x 1..6 (384 px tiles) scaled down:
# grids above ~9 tiles' worth of features are downsampled (anyres_max_9)
PINPOINTS = [[TILE * rows, TILE * cols] for rows in range(1, 5) for cols in range(1, 5)]

# OneVision's ChatML: "<|im_start|>user <image><video>\n<text><|im_end|>", media first in a turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{%- if message['content'] is string -%}{{ '\\n' + message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ '<image>' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'video' -%}{{ '<video>' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ '\\n' + part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    + CHATML_TURN_END
)


def processor() -> Any:
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    tokenizer = chatml_tokenizer(SPECIAL_TOKENS)
    pixels = dict(size={"height": TILE, "width": TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(image_grid_pinpoints=PINPOINTS, **pixels),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(**pixels),
        num_image_tokens=(TILE // PATCH) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=CHAT_TEMPLATE,
    )


def config(tokenizer: Any) -> Any:
    from transformers import LlavaOnevisionConfig

    vision_config = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=TILE, patch_size=PATCH,
    )
    return LlavaOnevisionConfig(
        vision_config=vision_config,
        text_config=text_config("qwen2", tokenizer, "<|endoftext|>", "<|im_end|>", "<|endoftext|>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    proc = processor()
    cfg = config(proc.tokenizer)
    text = cfg.text_config
    return save_checkpoint(dir, cfg, proc, [text.eos_token_id, text.pad_token_id], seed)
