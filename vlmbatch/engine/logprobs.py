"""Logprobs as people read them: each token's text and bytes next to its id (results, `serve`).

A token alone often is not valid UTF-8 (byte-level BPE splits characters), so its text is
what the tokenizer decodes for it (with U+FFFD for a partial character) and its `bytes`
are the raw bytes it stands for, which concatenate to the exact output (OpenAI's `bytes`).
"""

from __future__ import annotations

from typing import Any

from vlmbatch.engine.outputs import TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE writes its token strings in -> the bytes they stand for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Text and bytes of token ids for one tokenizer, cached (results repeat the same ids)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        self._alphabet = _byte_level_alphabet() if decoder == "ByteLevel" else None
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id])
            raw = None
            if self._alphabet is not None:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is not None and all(c in self._alphabet for c in piece):
                    raw = bytes(self._alphabet[c] for c in piece)
            entry = self._cache[token_id] = (text, raw if raw is not None else text.encode("utf-8"))
        return entry

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def records(self, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The results column's shape: token, token_id, logprob, top_logprobs [{token, token_id, logprob}]."""
        return [
            {"token": self.text(e.token_id), "token_id": e.token_id, "logprob": e.logprob,
             "top_logprobs": [{"token": self.text(t), "token_id": t, "logprob": v} for t, v in e.top]}
            for e in logprobs
        ]
