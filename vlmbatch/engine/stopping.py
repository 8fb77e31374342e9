"""Where a generated text ends: stop strings, the one rule every engine and the server share.

A stop string ends generation and is cut from the text. Both engines find it with
`find_stop` (the paged engine incrementally, on each new piece of text; the hf engine on
the finished rows), and the server's stream holds back `stop_holdback` characters, the
tail that could still grow into a stop string, so streamed text never differs from the
final text.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], since: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after position `since` (text before it
    was already checked): (where it starts, which one), or None."""
    found = []
    for stop in stops:
        at = text.find(stop, max(0, since - len(stop) + 1))
        if at >= 0:
            found.append((at, stop))
    return min(found) if found else None


def stop_holdback(stops: Sequence[str]) -> int:
    """Characters at the end of a growing text that may still turn out to start a stop string."""
    return max((len(s) for s in stops), default=1) - 1


class IncrementalDetokenizer:
    """Incremental detokenisation (`tokenizers.DecodeStream`): each step costs O(new tokens)."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""
