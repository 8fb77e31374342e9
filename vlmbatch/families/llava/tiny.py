"""Tiny random-weight LLaVA-1.5 checkpoints: a CLIP tower, the MLP projector and a Llama decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint, token_id_fields, train_tokenizer

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

# LLaVA-1.5: "USER: <image>\n<text> ASSISTANT:"; images first within a turn, then text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'].upper() + ': ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] + ' ' }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ '<image>\\n' }}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] + ' ' }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '</s>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)


# OpenAI CLIP's pixel statistics, and the processor values of a CLIP tower whose CLS token
# the "default" strategy drops (LLaVA-1.5 and LLaVA-NeXT alike).
CLIP_PIXELS = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
CLIP_PROCESSOR = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)


def llama_tokenizer() -> Any:
    """The BPE with LLaMA's specials: `<s>` prepended, `</s>` ends, `<image>` the placeholder."""
    tokenizer = train_tokenizer(SPECIAL_TOKENS, add_bos="<s>")
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    tokenizer.unk_token, tokenizer.pad_token = "<unk>", "<pad>"
    return tokenizer


def clip_vision_config(image_size: int) -> dict[str, Any]:
    """A tiny CLIP tower of 14 px patches."""
    return dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=image_size, patch_size=14, projection_dim=32)


def processor() -> Any:
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, do_center_crop=True, **CLIP_PIXELS
    )
    return LlavaProcessor(image_processor=image_processor, tokenizer=llama_tokenizer(), chat_template=CHAT_TEMPLATE,
                          **CLIP_PROCESSOR)


def config(tokenizer: Any) -> Any:
    from transformers import LlavaConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision_config = clip_vision_config(56)
    text_config = dict(
        model_type="llama",
        vocab_size=padded_vocab(tokenizer),
        **TINY_DECODER,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        **token_id_fields(ids, "<s>", "</s>", "<pad>"),
    )
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=ids["<image>"],
        image_seq_length=16,  # (56 / 14) ** 2 patches, CLS dropped
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    proc = processor()
    cfg = config(proc.tokenizer)
    return save_checkpoint(dir, cfg, proc, cfg.text_config.eos_token_id, seed)
