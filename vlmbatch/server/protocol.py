"""Request and response bodies of the OpenAI-compatible API (the subset `vlmbatch serve` speaks).

`messages` stays a list of plain dicts here on purpose: `vlmbatch.chat.parse_chat_messages`
validates message parts for batch jobs and the server alike, and names the faulty part in
its error, so the two entry points cannot drift apart.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions`. Unknown fields are ignored, as OpenAI clients send extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's extensions
    top_k: int | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Per-request media loading options, e.g. {"video": {"num_frames": 4}}; they override
    # the server's `--media-io-kwargs` for this request only.
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    # Structured outputs: OpenAI's `response_format`, or vLLM's extra-body keys (one of them;
    # `vlmbatch.structured.spec` validates the values and names a bad one).
    response_format: Any = None
    guided_json: Any = None
    guided_choice: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    # vLLM's extension: the model processor's options, e.g. InternVL's {"max_patches": 4}.
    mm_processor_kwargs: dict[str, Any] | None = None
    # Tool calling is not served: tools are refused unless `tool_choice` is "none" (OpenAI's
    # default with tools is "auto", which would otherwise come back as plain text, silently).
    tools: list[Any] | None = None
    tool_choice: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is the newer name; it wins when both are sent."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """OpenAI's `choices[i].logprobs`: one entry per generated token."""

    content: list[TokenLogprob] | None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None  # the tokens generated since the choice's previous chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vlmbatch"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
