"""Shared pieces of the structured-output tests: the tiny model's tokenizer behind a real
`GrammarCompiler`, schemas, and a decode loop that samples random logits under the masks
(random weights must still emit valid JSON)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

# Strings are bounded by patterns: random weights would otherwise write ~600-token strings,
# and a byte-level grammar lets them emit invalid (overlong) UTF-8 that decodes to several
# U+FFFD characters, which breaks a maxLength count after decoding.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "total": {"type": "number", "minimum": 0, "maximum": 100000},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "paid": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city"],
        },
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["name", "qty"],
            },
        },
        "note": {"type": ["string", "null"], "pattern": "^[a-z ]{0,6}$"},
    },
    "required": ["vendor", "total", "currency", "items"],
}


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """Tiny matmuls are much slower with two threads on a shared 2-core machine (engine tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyGrammar:
    """The tiny Qwen checkpoint's tokenizer and vocabulary with one compiler."""

    def __init__(self, model_dir: Path):
        from transformers import AutoConfig, AutoTokenizer

        from vlmbatch.structured.grammar import GrammarCompiler

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = AutoConfig.from_pretrained(model_dir).text_config.vocab_size
        self.eos = self.tokenizer.eos_token_id
        self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, [self.eos], max_threads=2)

    def matcher(self, spec):
        from vlmbatch.structured.matcher import StructuredMatcher

        return StructuredMatcher(self.compiler.compiled(spec, timeout=60))

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t != self.eos])


@pytest.fixture(scope="session")
def tiny_grammar(tiny_qwen: Path) -> TinyGrammar:
    grammar = TinyGrammar(tiny_qwen)
    yield grammar
    grammar.compiler.close()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: which tokens each row of an int32 bitmask allows."""
    words = bitmask.cpu().numpy().view(np.uint32)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    return torch.from_numpy(bits.reshape(len(words), -1)[:, :vocab_size].astype(bool))


def masked_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """What masking must give: -inf where a listed row's bit is 0, everything else as it was."""
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
    for row in rows:
        expected[row] = logits[row].masked_fill(~allowed[row], float("-inf"))
    return expected


def random_logits(generator: torch.Generator, rows: int, vocab_size: int) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=generator)


def decode_one(tiny: TinyGrammar, matcher, seed: int, max_tokens: int = 300) -> list[int]:
    """Argmax of random logits under the matcher's mask until it terminates (or max_tokens)."""
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(seed)
    bitmask = xgr.allocate_token_bitmask(1, tiny.vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated and len(tokens) < max_tokens:
        logits = random_logits(generator, 1, tiny.vocab_size)
        matcher.fill(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept(token), f"sampled a masked token {token}"
        tokens.append(token)
    return tokens
