"""Turn a request's growing text into server-sent-event deltas that add up to the final text.

Text that is still in flux is held back: a trailing U+FFFD is usually half of a multi-byte
character the detokenizer has not finished, and the tail that could still grow into a stop
string would be cut from the final text. Sending either early would make the streamed text
differ from the non-streamed one, which the API promises never happens.
"""

from __future__ import annotations

import json
from typing import Any

from vlmbatch.engine.stopping import stop_holdback

_INCOMPLETE_CHAR = "\ufffd"


class DeltaTracker:
    """Per-choice memory of what was already sent."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self._holdback = stop_holdback(stop)
        self.sent = ""

    def next_delta(self, text: str, finished: bool) -> str:
        """The new text safe to send now (everything that is left once `finished`)."""
        end = len(text) if finished else len(text) - self._holdback
        if not finished:
            while end > len(self.sent) and text[end - 1] == _INCOMPLETE_CHAR:
                end -= 1
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
