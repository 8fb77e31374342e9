"""A byte-level BPE tokenizer of any size, trained here (nothing downloaded).

Benchmarks of grammar-constrained decoding need a vocabulary as large as a real model's
(Qwen's 151,936 tokens): mask time grows with it. The corpus is generated: a lexicon of
pseudo-words from syllables (long English-like tokens with and without a leading space),
CJK words (multi-byte UTF-8 tokens, as in Qwen's vocabulary), numbers and JSON
punctuation, repeated with Zipf-like counts so the trainer learns merges of every length.
About 10 s on one core; the same arguments give the same tokenizer.
"""

from __future__ import annotations

import numpy as np

QWEN_VOCAB_SIZE = 151_936
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou") + ["th", "sh", "ch", "qu", "ng", "st"]


def _lexicon(rng: np.random.Generator, num_words: int) -> list[str]:
    syllables = np.array(_SYLLABLES)
    lengths = rng.integers(1, 5, num_words)
    words = np.full(num_words, "", dtype=object)
    for position in range(4):
        picked = syllables[rng.integers(0, len(syllables), num_words)]
        words = np.where(lengths > position, words + picked.astype(object), words)
    cjk = np.array([chr(c) for c in range(0x4E00, 0x4E00 + 4000)], dtype=object)
    cjk_words = cjk[rng.integers(0, len(cjk), num_words // 6)] + np.where(rng.random(num_words // 6) < 0.5, cjk[rng.integers(0, len(cjk), num_words // 6)], "")
    punctuation = ['{"', '":', '",', '"}', '": "', '", "', "},{", "[{", "}]", "\n", "  ", "    "]
    return list(dict.fromkeys([*words.tolist(), *cjk_words.tolist(), *map(str, range(3000)), *punctuation]))


def make_large_tokenizer(vocab_size: int = QWEN_VOCAB_SIZE, seed: int = 0):
    """A transformers tokenizer with exactly `vocab_size` tokens (specials first), EOS `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    rng = np.random.default_rng(seed)
    words = _lexicon(rng, max(50_000, vocab_size * 3))
    counts = np.maximum(1, 2000 / np.arange(1, len(words) + 1) ** 0.6).astype(int)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(((" " + word) * int(count) for word, count in zip(words, counts)), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus gave {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    return TokenizersBackend(tokenizer_object=tokenizer, eos_token="<|im_end|>", additional_special_tokens=_SPECIAL_TOKENS)
