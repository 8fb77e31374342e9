"""Tiny random-weight Idefics3 checkpoints: a SigLIP-style tower on 32 px tiles (4x4 patches
of 8 px), a pixel-shuffle connector (scale 2: 4 tokens a tile), a Llama decoder, and
images split into up to 3x3 tiles plus the global image (longest edge 96 px).

`smolvlm/tiny.py` builds on these pieces with SmolVLM's processor, video included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint, train_tokenizer

TILE = 32  # the tower's image size = the processor's `max_image_size` (a tile's side)
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2  # tokens of one tile after the pixel shuffle
# The processor's tile tokens: up to 6 x 6 tiles, as the released tokenizers carry them.
ROW_COL_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
MEDIA_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *ROW_COL_TOKENS]

# The hub checkpoint's template ("User:<image>text<end_of_utterance>\nAssistant:") less its
# leading "<|begin_of_text|>", which the tokenizer adds to every prompt here.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

IMAGE_PROCESSOR = dict(
    do_image_splitting=True,
    size={"longest_edge": 3 * TILE},
    max_image_size={"longest_edge": TILE},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def tokenizer(bos: str, eos: str, pad: str, add_bos: bool) -> Any:
    tok = train_tokenizer([pad, bos, eos, *MEDIA_TOKENS], add_bos=bos if add_bos else None)
    tok.bos_token, tok.eos_token, tok.pad_token = bos, eos, pad
    return tok


def config_parts(tok: Any, num_key_value_heads: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(text config, vision config, top-level values) of the tiny configs."""
    text_config = dict(
        model_type="llama",
        vocab_size=padded_vocab(tok),
        **TINY_DECODER,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision_config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         image_size=TILE, patch_size=PATCH)
    top = dict(scale_factor=SCALE_FACTOR, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    return text_config, vision_config, top


def eos_token_ids(config: Any) -> list[int]:
    text = config.get_text_config()
    return [text.eos_token_id]


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    tok = tokenizer("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", add_bos=True)
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessor(**IMAGE_PROCESSOR), tokenizer=tok,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    text_config, vision_config, top = config_parts(tok, num_key_value_heads=2)  # GQA, as Idefics3-8B's Llama 3
    config = Idefics3Config(text_config=text_config, vision_config=vision_config, **top)
    return save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
