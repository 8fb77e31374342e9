"""What generation returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmbatch.errors import RowError


@dataclass
class TokenLogprob:
    """One generated token's log probability and the `SamplingParams.logprobs` most likely
    tokens at its position, best first (from the adjusted logits, before temperature)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class CompletionOutput:
    """One generated continuation. `finish_reason` is "stop" (EOS or a stop string), "length",
    or "error" (nothing generated: a structured-output spec that cannot be compiled).

    `error` is set when the row failed although it may hold text: its structured output
    is incomplete (`length`), hit a dead end, or its spec could not be compiled; batch jobs
    write it to the row's `error_type` / `error`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or EOS token id that ended it
    error: RowError | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when `SamplingParams.logprobs` is set


@dataclass
class RequestOutput:
    """All continuations of one request plus what the prompt cost."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True

    @property
    def num_input_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
