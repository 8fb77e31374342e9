"""`/v1/chat/completions`: request → media → prompt → shared engine → JSON or an SSE stream.

Everything that can fail because of the client (messages, media, sampling values, prompt
length) is checked before the request enters the engine, so those failures are proper
4xx answers and never reach the engine thread or a half-sent stream.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vlmbatch.chat import TOOLS_REFUSED, parse_chat_messages, refuses_tools
from vlmbatch.engine.logprobs import TokenTexts
from vlmbatch.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import RowError
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import PreparedPrompt
from vlmbatch.server.async_engine import AsyncEngine
from vlmbatch.server.errors import APIError
from vlmbatch.server.media import ServerMedia, media_part_params
from vlmbatch.server.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprob as LogprobEntry,
    TopLogprob,
    Usage,
    new_completion_id,
)
from vlmbatch.server.settings import ServerSettings
from vlmbatch.server.streaming import SSE_DONE, DeltaTracker, sse_event
from vlmbatch.structured.spec import STRUCTURED_KEYS, StructuredOutput, parse_structured_output, resolve


@dataclass
class PreparedRequest:
    """A request that passed every client-side check and only needs the engine."""

    request_id: str
    prompt: PreparedPrompt
    params: SamplingParams


def _usage(output: RequestOutput) -> Usage:
    prompt_tokens = output.num_input_tokens
    completion_tokens = output.num_generated_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def _raise_failed(output: RequestOutput) -> None:
    """A completion the engine could not start (its grammar failed to compile) fails the request;
    others keep their text (an incomplete structured output ends with finish_reason "length")."""
    failed = next((o.error for o in output.outputs if o.finish_reason == "error" and o.error is not None), None)
    if failed is not None:
        raise failed


def _logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI's `logprobs` object for some of a choice's tokens."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=texts.text(token_id), logprob=logprob, bytes=list(texts.bytes(token_id)))

    return ChoiceLogprobs(content=[
        LogprobEntry(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(t, v) for t, v in e.top]) for e in entries
    ])


def _new_logprobs(texts: TokenTexts, completion: CompletionOutput, sent: dict[int, int]) -> ChoiceLogprobs:
    """The logprobs of the choice's tokens not streamed yet (`sent`: how many were, per choice)."""
    start = sent.get(completion.index, 0)
    sent[completion.index] = len(completion.logprobs)
    return _logprobs(texts, completion.logprobs[start:])


class ChatCompletions:
    """Turns chat requests into engine requests and engine progress into OpenAI responses."""

    def __init__(self, adapter: ModelAdapter, engine: AsyncEngine, media: ServerMedia, settings: ServerSettings):
        self._adapter = adapter
        self._engine = engine
        self._media = media
        self._settings = settings
        # Prompt rendering and HF processors are not safe to share across threads, so one
        # thread does all of it; media fetching and decoding run in the media pool.
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="vlmbatch-prompt")

    @functools.cached_property
    def _token_texts(self) -> TokenTexts:
        """Built on the first request that asks for logprobs."""
        return TokenTexts(self._adapter.processor.tokenizer)

    def close(self) -> None:
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Validate and tokenise; raises `APIError` / `RowError` (→ 4xx) for the client's mistakes."""
        if request.model is not None and request.model != self._settings.model_id:
            raise APIError(
                404, f"The model `{request.model}` does not exist; this server serves `{self._settings.model_id}`.",
                param="model", code="model_not_found",
            )
        if refuses_tools(request.tools, request.tool_choice):  # before any media are fetched
            raise APIError(400, TOOLS_REFUSED, param="tools", code="invalid_request")
        structured = self._structured_output(request)
        _, image_refs, video_refs = parse_chat_messages(request.messages)
        self._check_media_counts(len(image_refs), len(video_refs))
        images, videos = await self._media.load(
            image_refs, video_refs, media_part_params(request.messages), request.media_io_kwargs
        )
        loop = asyncio.get_running_loop()
        try:
            prompt = await loop.run_in_executor(
                self._prompt_thread, self._render, request.messages, images, videos, request.requested_max_tokens or 1,
                request.mm_processor_kwargs,
            )
        except RowError as error:
            if error.param == "prompt":  # the client sent messages, not the rendered prompt
                error.param = "messages"
            raise
        # Without a limit the request may use the rest of the context (`prepare` left at least 1).
        max_tokens = request.requested_max_tokens or self._adapter.max_model_len - prompt.num_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_request")
        given = {name: getattr(request, name) for name in ("top_k", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop_strings,
            n=request.n,
            ignore_eos=request.ignore_eos,
            structured_output=structured,
            min_tokens=request.min_tokens,
            logit_bias=request.logit_bias or {},
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        ).updated(**given)
        params.check_vocabulary(len(self._adapter.tokenizer))
        return PreparedRequest(new_completion_id(), prompt, params)

    @staticmethod
    def _structured_output(request: ChatCompletionRequest) -> StructuredOutput | None:
        """The request's constraint; a malformed one, or one xgrammar cannot compile, is the
        client's mistake (`RowError` → 400 naming the key), found before the engine sees it."""
        from vlmbatch.structured.grammar import build_grammar

        spec = resolve(parse_structured_output({key: getattr(request, key) for key in STRUCTURED_KEYS}))
        if spec is not None:
            build_grammar(spec)
        return spec

    def _render(self, messages: list[dict[str, Any]], images: list[Any], videos: list[Any], max_tokens: int,
                processor_kwargs: dict[str, Any] | None = None) -> PreparedPrompt:
        """OpenAI messages (the adapter places the media placeholders) → token ids and pixels."""
        text = self._adapter.apply_chat_template(messages)
        return self._adapter.prepare(text, images or None, videos or None, max_tokens, processor_kwargs)

    def _check_media_counts(self, num_images: int, num_videos: int) -> None:
        for modality, count in (("image", num_images), ("video", num_videos)):
            limit = self._settings.limit_for(modality)
            if count > limit:
                raise APIError(
                    400,
                    f"this request has {count} {modality}s; at most {limit} per prompt are allowed (--limit-mm-per-prompt)",
                    param="messages",
                    code="too_many_media",
                )

    async def complete(self, request: PreparedRequest) -> ChatCompletion:
        final: RequestOutput | None = None
        async for output in self._engine.generate(request.request_id, request.prompt, request.params):
            final = output
        assert final is not None  # generate() ends only on a finished output or an exception
        _raise_failed(final)
        return ChatCompletion(
            id=request.request_id,
            model=self._settings.model_id,
            choices=[
                Choice(index=o.index, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason or "stop",
                       logprobs=None if o.logprobs is None else _logprobs(self._token_texts, o.logprobs))
                for o in final.outputs
            ],
            usage=_usage(final),
        )

    async def stream(self, request: PreparedRequest, include_usage: bool, created: int) -> AsyncIterator[str]:
        """SSE events: a role chunk, content deltas, one chunk per choice with its
        `finish_reason`, the usage chunk when asked for, then `[DONE]`."""

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(
                id=request.request_id, created=created, model=self._settings.model_id, choices=choices, usage=usage
            )
            return sse_event(body.model_dump())

        yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(request.params.n)])
        trackers = {i: DeltaTracker(request.params.stop) for i in range(request.params.n)}
        logprobs_sent: dict[int, int] = {}
        final: RequestOutput | None = None
        try:
            async for output in self._engine.generate(request.request_id, request.prompt, request.params):
                final = output
                _raise_failed(output)
                choices = []
                for completion in output.outputs:
                    tracker = trackers.pop(completion.index, None)
                    if tracker is None:  # this choice already sent its finish_reason
                        continue
                    done = output.finished or completion.finish_reason is not None
                    delta = tracker.next_delta(completion.text, done)
                    logprobs = None if completion.logprobs is None else _new_logprobs(self._token_texts, completion, logprobs_sent)
                    if delta or done or (logprobs is not None and logprobs.content):
                        choices.append(
                            ChunkChoice(
                                index=completion.index,
                                delta=Delta(content=delta),
                                finish_reason=(completion.finish_reason or "stop") if done else None,
                                logprobs=logprobs,
                            )
                        )
                    if not done:
                        trackers[completion.index] = tracker
                if choices:
                    yield chunk(choices)
        except RowError as error:
            yield sse_event(APIError.from_row_error(error).body())
        else:
            if include_usage and final is not None:
                yield chunk([], usage=_usage(final))
        yield SSE_DONE
