"""Tiny random-weight LLaVA-NeXT checkpoints: a CLIP tower (CLS dropped), the MLP projector,
anyres tiling over grid pinpoints of 1x2..3x1 tiles with `image_newline`, and a Mistral
decoder with the `[INST] ... [/INST]` prompts of llava-v1.6-mistral.

`llava_onevision/tiny.py` builds on the tokenizer piece (same special tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint, train_tokenizer

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
TILE = 56  # the tower's input side: 4x4 patches of 14 px per tile
PINPOINTS = [[56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]  # llava-v1.6's five shapes, scaled down

# llava-v1.6-mistral: "[INST] <image>\n<text> [/INST]"; a turn's images first, then its text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '[INST] ' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ '<image>\\n' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}{{ ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ ' ' + (message['content'] if message['content'] is string else message['content'][0]['text']) + '</s>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def llama_tokenizer() -> Any:
    """The BPE with LLaMA's specials: `<s>` prepended, `</s>` ends, `<image>` the placeholder."""
    tokenizer = train_tokenizer(SPECIAL_TOKENS, add_bos="<s>")
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    tokenizer.unk_token, tokenizer.pad_token = "<unk>", "<pad>"
    return tokenizer


def processor() -> Any:
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=llama_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
        chat_template=CHAT_TEMPLATE,
    )


def config(tokenizer: Any) -> Any:
    from transformers import LlavaNextConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision_config = dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=TILE, patch_size=14, projection_dim=32,
    )
    text_config = dict(
        model_type="mistral",
        vocab_size=padded_vocab(tokenizer),
        **TINY_DECODER,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=None,  # as llava-v1.6-mistral-7b (Mistral 7B v0.2)
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    return LlavaNextConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=ids["<image>"],
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    proc = processor()
    cfg = config(proc.tokenizer)
    return save_checkpoint(dir, cfg, proc, cfg.text_config.eos_token_id, seed)
