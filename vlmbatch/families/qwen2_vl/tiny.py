"""Tiny random-weight Qwen2-VL checkpoints: GQA, M-RoPE, 2x2 patch merge, the Qwen ChatML template.

`qwen2_5_vl/tiny.py` builds on these pieces (same tokenizer, processor sizes and prompt
format; Qwen2.5-VL's windowed vision tower).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.testing.checkpoints import CHATML_TURN_END, TINY_DECODER, padded_vocab, save_checkpoint, token_id_fields, train_tokenizer

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# ChatML with Qwen's vision markers; a system turn is added when the caller gives none,
# as in the released Qwen2-VL / Qwen2.5-VL templates.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    + CHATML_TURN_END
)

def processor(processor_cls: Any) -> Any:
    """A Qwen processor (`processor_cls`: Qwen2VLProcessor, Qwen2_5_VLProcessor) with the tiny tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = train_tokenizer(SPECIAL_TOKENS, add_bos=None)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    # Few pixels so an image costs 4..64 tokens after the 2x2 merge.
    size = {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}
    return processor_cls(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size),
        chat_template=CHAT_TEMPLATE,
    )


def config_parts(tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(text config, the top-level token ids) shared by the Qwen-VL tiny configs."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=padded_vocab(tokenizer),
        **TINY_DECODER,
        num_key_value_heads=2,  # GQA, as in the released models
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        **token_id_fields(ids, "<|endoftext|>", "<|im_end|>", "<|endoftext|>"),
        tie_word_embeddings=False,
    )
    return text_config, media_token_config(ids)


def media_token_config(ids: dict[str, int]) -> dict[str, Any]:
    """The top-level config keys naming the media tokens, shared by the Qwen-VL families."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def eos_token_ids(config: Any) -> list[int]:
    text = config.get_text_config()
    return [text.eos_token_id, text.pad_token_id]  # <|im_end|> and <|endoftext|>


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLProcessor

    proc = processor(Qwen2VLProcessor)
    text_config, common = config_parts(proc.tokenizer)
    vision_config = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2)
    config = Qwen2VLConfig(text_config=text_config, vision_config=vision_config, **common)
    return save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
