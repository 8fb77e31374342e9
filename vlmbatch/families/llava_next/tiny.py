"""Tiny random-weight LLaVA-NeXT checkpoints: LLaVA-1.5's tiny CLIP tower (CLS dropped) and
tokenizer, the MLP projector, anyres tiling over grid pinpoints of 1x2..3x1 tiles with
`image_newline`, and a Mistral decoder with the `[INST] ... [/INST]` prompts of
llava-v1.6-mistral.

`llava_onevision/tiny.py` builds on `text_config` (a Qwen2 decoder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.families.llava.tiny import CLIP_PIXELS, CLIP_PROCESSOR, clip_vision_config, llama_tokenizer
from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint

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


def text_config(model_type: str, tokenizer: Any, bos: str, eos: str, pad: str, **extra: Any) -> dict[str, Any]:
    """The tiny decoder of `model_type` with GQA (2 KV heads) and RoPE theta 1e6, as in both
    released 7B language models (Mistral 7B v0.2, Qwen2-7B), its ids from `tokenizer`."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(model_type=model_type, vocab_size=padded_vocab(tokenizer), **TINY_DECODER, num_key_value_heads=2,
                max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                bos_token_id=ids(bos), eos_token_id=ids(eos), pad_token_id=ids(pad), tie_word_embeddings=False, **extra)


def processor() -> Any:
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS, **CLIP_PIXELS
    )
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=llama_tokenizer(), chat_template=CHAT_TEMPLATE,
                              **CLIP_PROCESSOR)


def config(tokenizer: Any) -> Any:
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        vision_config=clip_vision_config(TILE),
        # sliding_window None, as llava-v1.6-mistral-7b's Mistral 7B v0.2
        text_config=text_config("mistral", tokenizer, "<s>", "</s>", "<pad>", sliding_window=None),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
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
