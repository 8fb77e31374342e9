"""Tiny random-weight Qwen3-VL checkpoints: patch 16, 2x2 merge, a learned position grid
smaller than most images (so it is interpolated), DeepStack into both decoder layers,
interleaved M-RoPE, Qwen3 q/k norms, and the processor's timestamped video prompts.

`qwen3_vl_moe/tiny.py` builds on these pieces with a mixture-of-experts decoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.families.qwen2_vl.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, media_token_config
from vlmbatch.testing.checkpoints import TINY_DECODER, padded_vocab, save_checkpoint, token_id_fields, train_tokenizer

# Few pixels so an image costs 4..64 tokens after the 2x2 merge of 16 px patches.
_SIZE = {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}


def processor() -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokenizer = train_tokenizer(SPECIAL_TOKENS, add_bos=None)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    patches = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=_SIZE, **patches),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(size=_SIZE, **patches),
        chat_template=CHAT_TEMPLATE,
    )


def config_parts(tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(text config, vision config, top-level token ids) of the tiny Qwen3-VL configs."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=padded_vocab(tokenizer),
        **TINY_DECODER,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        # head_dim 16: 8 frequency bands, interleaved t/h/w as in the released models
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        **token_id_fields(ids, "<|endoftext|>", "<|im_end|>", "<|endoftext|>"),
        tie_word_embeddings=False,
    )
    vision_config = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=64,
        num_position_embeddings=16,  # a 4x4 learned grid: interpolated to every image's grid
        deepstack_visual_indexes=[0, 1],  # features after blocks 0 and 1 go into decoder layers 0 and 1
    )
    return text_config, vision_config, media_token_config(ids)


def eos_token_ids(config: Any) -> list[int]:
    text = config.get_text_config()
    return [text.eos_token_id, text.pad_token_id]  # <|im_end|> and <|endoftext|>


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLConfig

    proc = processor()
    text_config, vision_config, common = config_parts(proc.tokenizer)
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, **common)
    return save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
