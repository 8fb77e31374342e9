"""Tiny random-weight Qwen2.5-VL checkpoints: Qwen2-VL's tokenizer and prompt format, with a
windowed vision tower (block 0 windowed, block 1 full attention; images over 56 px span
several windows)."""

from __future__ import annotations

from pathlib import Path

from vlmbatch.families.qwen2_vl.tiny import config_parts, eos_token_ids, processor
from vlmbatch.testing.checkpoints import save_checkpoint


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    proc = processor(Qwen2_5_VLProcessor)
    text_config, common = config_parts(proc.tokenizer)
    vision_config = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2,
        window_size=56,  # 2x2 merged units per window
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **common)
    return save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
