"""Tiny random-weight checkpoints in the real Hugging Face layout, one builder per family.

Each family's builder lives in its folder (`vlmbatch/families/<name>/tiny.py`) and keeps
the family's real architecture features (Qwen2.5-VL: GQA, M-RoPE, windowed vision
attention, 2x2 patch merge; LLaVA-1.5: CLIP tower + projector + Llama), small enough to
build in a second and run on a CPU; `vlmbatch make-tiny-model` and the test fixtures call
`make_tiny_model`.
"""

from __future__ import annotations

from pathlib import Path

from vlmbatch.families.registry import FAMILIES

ARCHS: tuple[str, ...] = tuple(FAMILIES)


def make_tiny_model(dir: str | Path, arch: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Write a tiny random-weight `arch` checkpoint (config, weights, tokenizer, processor,
    chat template, generation config) into `dir` and return its path."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return FAMILIES[arch].parts().make_tiny_checkpoint(dir, seed)
