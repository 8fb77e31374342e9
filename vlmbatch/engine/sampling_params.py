"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.structured.spec import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy decoding.

    `top_k <= 0` disables top-k. `stop` strings end generation and are not included
    in the output text. `ignore_eos` keeps generating past EOS (benchmarks use it to
    force exact output lengths).

    `structured_output` constrains the text to a JSON schema, choice, regex or grammar
    (`vlmbatch.structured.spec`; docs/structured.md): the engines mask every step's logits
    with it, and the row ends when the grammar does (whatever `ignore_eos` says).

    Logit adjustments, applied in this order to the model's logits (transformers'
    order, with OpenAI's penalties after its repetition penalty, as vLLM does):
    `logit_bias` (token id -> added value, OpenAI's clamp of [-100, 100]),
    `repetition_penalty` (transformers' definition, over prompt + generated tokens:
    a seen token's positive logit is divided by it, a negative one multiplied),
    `frequency_penalty` x count and `presence_penalty` (OpenAI's, generated tokens
    only), then `min_tokens` (EOS may not be drawn, and stop strings are not looked
    for, before that many tokens). `logprobs` = k returns each generated token's log
    probability and the k most likely (0: the chosen token's only), taken from the
    logits after those adjustments and before temperature, top-k and top-p.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    structured_output: StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # a mapping is accepted too
    logprobs: int | None = None
    # Whether any logit adjustment is on: read for every sequence of every step, so computed once.
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):  # back from `to_dict` (manifests, JSON transports)
            object.__setattr__(self, "structured_output", StructuredOutput.from_dict(self.structured_output))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        self.validate()
        object.__setattr__(self, "adjusts_logits", bool(self.logit_bias) or self.penalized or self.min_tokens > 0)

    def validate(self) -> None:
        """Raise `RowError(INVALID_ROW)` for out-of-range values (a row's override may be bad)."""
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(stop, str) and stop for stop in self.stop):
            problems.append(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.top_k, int):
            problems.append(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be a positive integer, got {self.n!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            problems.append(f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens if _is_int(self.max_tokens) else 0):
            problems.append(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            problems.append(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias is None:
            problems.append("logit_bias must map token ids to numbers in [-100, 100]")
        if problems:
            raise RowError(ErrorType.INVALID_ROW, "; ".join(problems))

    def check_vocabulary(self, vocab_size: int) -> None:
        """`logit_bias` may name only the model's tokens (checked where the tokenizer is known)."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            raise RowError(ErrorType.INVALID_ROW, f"logit_bias token ids {outside} are not in the vocabulary of "
                           f"{vocab_size} tokens", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def updated(self, **overrides: Any) -> "SamplingParams":
        """A copy with the non-None overrides applied (per-row overrides of job defaults)."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **clean) if clean else self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["adjusts_logits"]
        d["stop"] = list(self.stop)
        if self.structured_output is None:
            del d["structured_output"]  # manifests of unconstrained jobs stay as they were
        else:
            d["structured_output"] = self.structured_output.to_dict()
        d["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}  # JSON keys are strings
        return d


MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (JSON rows may hold NaN and Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...] | None:
    """`logit_bias` as sorted (token id, bias) pairs (hashable: the hf engine batches by it),
    from a mapping whose keys may be JSON's strings; None when it is malformed."""
    pairs: Iterable[Any] = value.items() if isinstance(value, Mapping) else (value or ())
    try:
        result = {int(token): float(bias) for token, bias in pairs}
    except (TypeError, ValueError):
        return None
    if any(token < 0 or not -100 <= bias <= 100 for token, bias in result.items()):
        return None
    return tuple(sorted(result.items()))
