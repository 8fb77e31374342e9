"""Tiny random-weight SmolVLM / SmolVLM2 checkpoints: Idefics3's tiny tower, connector and
decoder (`idefics3/tiny.py`) with SmolVLM's processor, chat template and video processor
(frames squared to one tile each, written into the prompt with their timestamps)."""

from __future__ import annotations

from pathlib import Path

from vlmbatch.families.idefics3.tiny import IMAGE_PROCESSOR, IMAGE_SEQ_LEN, TILE, config_parts, eos_token_ids, tokenizer
from vlmbatch.testing.checkpoints import save_checkpoint

VIDEO_PROCESSOR = dict(size={"longest_edge": 3 * TILE}, max_image_size={"longest_edge": TILE},
                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], num_frames=8, fps=1)


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    tok = tokenizer("<|im_start|>", "<|im_end|>", "<|endoftext|>", add_bos=False)  # the template writes it
    proc = SmolVLMProcessor(image_processor=SmolVLMImageProcessor(**IMAGE_PROCESSOR), tokenizer=tok,
                            video_processor=SmolVLMVideoProcessor(**VIDEO_PROCESSOR), image_seq_len=IMAGE_SEQ_LEN,
                            chat_template=DEFAULT_CHAT_TEMPLATE)
    text_config, vision_config, top = config_parts(tok, num_key_value_heads=4)  # no GQA, as SmolVLM2-2.2B's SmolLM2
    config = SmolVLMConfig(text_config=text_config, vision_config=vision_config, **top)
    return save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
