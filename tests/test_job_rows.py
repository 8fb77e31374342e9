"""Values JSON can carry but no model can take are the row's `invalid_row`, named, at parse
time: lone surrogates (`\\ud800` escapes) in prompts and message text, a message whose
part list is empty (OpenAI refuses it), and an HF image or video struct whose `bytes` is
a string. Before, they failed later as a processor's `unsupported_media` or, for the
struct, as an `engine_error`, and an empty turn was generated from."""

from __future__ import annotations

import json

import pytest

from vlmbatch.chat import parse_chat_messages
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.io.readers import ColumnMap
from vlmbatch.job.rows import parse_row
from vlmbatch.media.refs import MediaContext, resolve_media

LONE_SURROGATE = json.loads('"caf\\ud800"')


def test_a_prompt_with_a_lone_surrogate_is_an_invalid_row() -> None:
    with pytest.raises(RowError) as info:
        parse_row(0, {"prompt": LONE_SURROGATE}, ColumnMap(), SamplingParams())
    assert info.value.error_type == ErrorType.INVALID_ROW and info.value.param == "prompt"
    assert "lone surrogate at position 3" in info.value.message


@pytest.mark.parametrize(
    "content, param",
    [(LONE_SURROGATE, "messages[0].content"), ([{"type": "text", "text": LONE_SURROGATE}], "messages[0].content[0].text")],
)
def test_message_text_with_a_lone_surrogate_is_an_invalid_row(content, param: str) -> None:
    with pytest.raises(RowError) as info:
        parse_chat_messages([{"role": "user", "content": content}])
    assert info.value.error_type == ErrorType.INVALID_ROW and info.value.param == param


def test_a_message_with_an_empty_part_list_is_an_invalid_row() -> None:
    with pytest.raises(RowError) as info:
        parse_chat_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": []}])
    assert info.value.error_type == ErrorType.INVALID_ROW and info.value.param == "messages[1].content"


def test_a_media_struct_whose_bytes_are_text_is_an_invalid_row() -> None:
    with pytest.raises(RowError) as info:
        resolve_media({"bytes": "not bytes", "path": None}, MediaContext(), "video", "video")
    assert info.value.error_type == ErrorType.INVALID_ROW and "'bytes' must be bytes, got str" in info.value.message
