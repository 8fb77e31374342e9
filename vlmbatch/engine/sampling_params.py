"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):  # back from `to_dict` (manifests, JSON transports)
            object.__setattr__(self, "structured_output", StructuredOutput.from_dict(self.structured_output))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        self.validate()

    def validate(self) -> None:
        """Raise `RowError(INVALID_ROW)` for out-of-range values (a row's override may be bad)."""
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            problems.append(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be a positive integer, got {self.n!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            problems.append(f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}")
        if problems:
            raise RowError(ErrorType.INVALID_ROW, "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def updated(self, **overrides: Any) -> "SamplingParams":
        """A copy with the non-None overrides applied (per-row overrides of job defaults)."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **clean) if clean else self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        if self.structured_output is None:
            del d["structured_output"]  # manifests of unconstrained jobs stay as they were
        else:
            d["structured_output"] = self.structured_output.to_dict()
        return d
