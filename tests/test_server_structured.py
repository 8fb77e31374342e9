"""Structured outputs through `vlmbatch serve`: a real server process on the tiny random-weight
checkpoint, driven by the official `openai` client (`response_format`, its `parse` helper on a
pydantic model, vLLM's `guided_*` extra-body keys), streaming and not; bad specs get a 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from vlmbatch.testing.server_process import ServerProcess

KEY = "sk-structured"
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["label", "count", "kind"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Describe the animal as JSON."}]


class Animal(BaseModel):
    name: str = Field(pattern="^[a-z]{1,6}$")
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]
    tame: bool


@pytest.fixture(scope="module")
def server(tiny_qwen: Path):
    with ServerProcess(["--model", str(tiny_qwen), "--api-key", KEY, "--log-level", "warning"]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}


def test_response_format_json_schema_streaming_and_not(client: openai.OpenAI, tiny_qwen: Path) -> None:
    whole = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=200, temperature=0,
                                           response_format=_schema_format())
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=200, temperature=0,
                                            response_format=_schema_format(), stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_parse_helper_on_a_pydantic_model(client: openai.OpenAI, tiny_qwen: Path) -> None:
    """The client sends the model's strict schema and parses the answer back into the model."""
    for seed in range(3):
        completion = client.chat.completions.parse(model=str(tiny_qwen), messages=USER, max_tokens=200, temperature=1.0,
                                                   seed=seed, response_format=Animal)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Animal) and parsed.kind in ("cat", "dog", "bird")


def test_vllm_guided_keys_in_extra_body(client: openai.OpenAI, tiny_qwen: Path) -> None:
    choice = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=20, temperature=0, n=2, seed=1,
                                            extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.message.content in ("yes", "no", "maybe") for c in choice.choices)
    regex = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=20, temperature=0, stream=True,
                                           extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    text = "".join(c.choices[0].delta.content or "" for c in regex if c.choices)
    assert len(text) == 6 and text[:3].isupper() and text[3] == "-" and text[4:].isdigit()
    schema = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=200, temperature=0,
                                            extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMA)


def test_json_object_and_text_formats(client: openai.OpenAI, tiny_qwen: Path) -> None:
    obj = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=24, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")  # random weights may not close it in 24 tokens
    text = client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=6, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 6


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": 2}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
])
def test_bad_specs_are_400s(client: openai.OpenAI, tiny_qwen: Path, extra: dict, param: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=str(tiny_qwen), messages=USER, max_tokens=8, stream=stream, extra_body=extra)
        error = caught.value.body
        assert caught.value.status_code == 400 and error["param"] == param and error["code"] == "invalid_row", error
        assert error["type"] == "invalid_request_error" and error["message"]
