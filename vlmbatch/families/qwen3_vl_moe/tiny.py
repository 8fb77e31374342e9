"""Tiny random-weight Qwen3-VL-MoE checkpoints: Qwen3-VL's tower, DeepStack and prompts, with a
mixture-of-experts decoder (4 experts, top-2, renormalised; every layer sparse, as in 30B-A3B)."""

from __future__ import annotations

import json
from pathlib import Path

from vlmbatch.families.qwen3_vl.tiny import config_parts, eos_token_ids, processor
from vlmbatch.testing.checkpoints import save_checkpoint


def make_tiny_checkpoint(dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLMoeConfig

    proc = processor()
    text_config, vision_config, common = config_parts(proc.tokenizer)
    text_config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    config = Qwen3VLMoeConfig(text_config=text_config, vision_config=vision_config, **common)
    out = save_checkpoint(dir, config, proc, eos_token_ids(config), seed)
    # transformers 5.24 writes the expert count as `num_local_experts`; older readers (5.17,
    # vLLM 0.26) look for `num_experts`: write both, as the released configs carry it.
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["text_config"].setdefault("num_experts", saved["text_config"].get("num_local_experts", 4))
    path.write_text(json.dumps(saved, indent=2) + "\n")
    return out
