"""DeltaTracker: streamed deltas always concatenate to the final text."""

from __future__ import annotations

from vlmbatch.server.streaming import SSE_DONE, DeltaTracker, sse_event


def _stream(snapshots: list[str], final: str, stop: tuple[str, ...] = ()) -> list[str]:
    tracker = DeltaTracker(stop)
    deltas = [tracker.next_delta(text, finished=False) for text in snapshots]
    deltas.append(tracker.next_delta(final, finished=True))
    return deltas


def test_plain_growth_is_sent_as_it_arrives() -> None:
    assert _stream(["He", "Hello", "Hello wo"], "Hello world") == ["He", "llo", " wo", "rld"]


def test_a_half_decoded_character_waits_for_its_other_half() -> None:
    deltas = _stream(["caf", "caf\ufffd", "café"], "café!")
    assert deltas == ["caf", "", "é", "!"]
    assert "".join(deltas) == "café!"


def test_a_tail_that_may_become_a_stop_string_is_held_back() -> None:
    # stop="END": the engine reports "abcEN" mid-way, then cuts the stop string at the end.
    deltas = _stream(["ab", "abcE", "abcEN"], "abc", stop=("END",))
    assert "".join(deltas) == "abc"
    assert all("E" not in d for d in deltas)


def test_sse_framing() -> None:
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
