"""Pieces every family's tiny-checkpoint builder shares (`vlmbatch/families/<name>/tiny.py`).

Tests, the README demo and the benchmarks need models that load exactly like hub models
(`AutoProcessor` / `AutoModelForImageTextToText.from_pretrained(dir)`), with the family's
real architecture features but small enough to build in a second and run on a CPU.
Nothing is downloaded: the tokenizer is trained here on a built-in corpus and the weights
are random, seeded, and byte-identical for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Enough ordinary English for a byte-level BPE to learn common words, so prompts
# tokenise into a sensible number of tokens and generated text decodes to words.
CORPUS = """
Describe the image in one sentence. What is shown in this picture? The photo shows a red
square on a white background. A small blue circle is next to a green triangle. How many
objects are there in the video? Please answer the question with a short answer.
The cat sits on the mat and the dog runs in the park. A person is riding a bicycle down
the street while the sun is shining. There are two people standing near the water.
Write a caption for this image. The quick brown fox jumps over the lazy dog.
You are a helpful assistant. The user asks a question and the assistant answers it.
What color is the car? The car is yellow. Where is the book? The book is on the table.
This is a test of the batch inference system for vision language models. Count the
frames, read the text, and summarise what happens from the start to the end of the clip.
Hello world, this is a tiny model with random weights used only for testing.
""".strip()

# The language model of every family: 2 layers, hidden 64, 4 query heads of dim 16.
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

_BPE_VOCAB_SIZE = 600  # learned tokens; specials come first, so ids are small and fixed


# How every ChatML chat template ends (Qwen's, InternVL's, OneVision's): the turn closes,
# then the assistant's turn opens when asked.
CHATML_TURN_END = ("{{ '<|im_end|>\\n' }}{%- endfor -%}"
                   "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def chatml_tokenizer(special_tokens: list[str]):
    """`train_tokenizer` with ChatML's end-of-turn and padding tokens, no BOS."""
    tokenizer = train_tokenizer(special_tokens, add_bos=None)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    return tokenizer


def token_id_fields(ids: dict[str, int], bos: str, eos: str, pad: str) -> dict[str, int]:
    """A text config's `bos/eos/pad_token_id`, from the tokenizer's special tokens."""
    return {"bos_token_id": ids[bos], "eos_token_id": ids[eos], "pad_token_id": ids[pad]}


def train_tokenizer(special_tokens: list[str], add_bos: str | None, literal_tokens: Sequence[str] = ()):
    """A byte-level BPE trained on `CORPUS`, wrapped as a transformers tokenizer.

    `literal_tokens` are ordinary (not special) tokens added after training: matched in the
    text before the byte-level split and kept in the vocabulary as written, as a SentencePiece
    vocabulary has them (Gemma's newline runs), where byte-level BPE would spell "\n" as "Ċ"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import TokenizersBackend

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in literal_tokens])
    if add_bos is not None:
        bos_id = tok.token_to_id(add_bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{add_bos} $A", pair=f"{add_bos} $A $B", special_tokens=[(add_bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return TokenizersBackend(tokenizer_object=tok, additional_special_tokens=special_tokens)


def padded_vocab(tokenizer) -> int:
    """Model vocab rounded up to a multiple of 64, like real checkpoints (ids past the
    tokenizer's exist but are never produced by it)."""
    return (len(tokenizer) + 63) // 64 * 64


def save_checkpoint(out: str | Path, config: Any, processor: Any, eos_token_ids: int | list[int], seed: int) -> Path:
    """Random weights for `config` (seeded; the caller's global RNG untouched), a generation
    config, the processor and its per-component files, all written to `out`."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = torch.float32
    text = config.get_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=eos_token_ids, pad_token_id=text.pad_token_id
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # Hub checkpoints also carry the per-component files (preprocessor_config.json,
    # video_preprocessor_config.json) that older transformers and other tools read.
    processor.image_processor.save_pretrained(out)
    if getattr(processor, "video_processor", None) is not None:
        processor.video_processor.save_pretrained(out)
    return out
