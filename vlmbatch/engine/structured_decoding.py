"""Constrained decoding inside an engine: one object per engine, one `GrammarState` per sequence.

Both engines use it the same way (docs/structured.md, "Engine integration"):

- `submit(spec)` on `add_request`: each distinct spec is compiled once per engine, on the
  compiler's background thread (`GrammarCompiler`), and the request gets a future at once.
  The paged engine keeps a sequence out of its scheduler until the future is done, so a
  slow compile (1-2 s for pattern-bounded strings on a 150k vocabulary) never stalls the
  rows already running; it blocks only when nothing else is left to run.
- `mask(matchers, logits)` after each forward, before sampling: the rows' bitmasks are
  filled on the host (xgrammar, GIL released) and applied to the logits on their device
  (`TokenBitmask`: a pinned buffer, a non-blocking copy, xgrammar's kernel; no host sync).
  Free rows are not touched. A row whose mask allows nothing gets the stop token instead.
- `GrammarState.accept(token)` where the engine appends a token: the matcher advances;
  a refused token (only the forced stop token of an empty mask) is a dead end.

xgrammar (and torch's side of it) is imported on the first constrained request only: an
engine that never sees one does not load it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.structured.spec import StructuredOutput


@dataclass
class MaskStats:
    """What masking cost (benchmarks report it per masked step). `apply_s` is host time to
    queue the copy and the kernel; on CUDA the kernel itself runs later, on the stream."""

    num_masked_steps: int = 0
    num_masked_rows: int = 0
    fill_s: float = 0.0
    apply_s: float = 0.0


@dataclass(eq=False)
class GrammarState:
    """One sequence's constraint: its compile future, then its matcher."""

    spec: StructuredOutput
    future: Future
    matcher: Any = None  # StructuredMatcher once `start` succeeded
    num_accepted: int = 0

    def ready(self) -> bool:
        return self.future.done()

    def start(self) -> RowError | None:
        """Make the matcher from the compiled grammar (waits for it); the compile's
        `RowError` when the spec cannot be compiled."""
        from vlmbatch.structured.matcher import StructuredMatcher

        error = self.future.exception()
        if error is not None:
            if isinstance(error, RowError):
                return error
            return RowError(ErrorType.ENGINE, f"{self.spec.source}: grammar compilation failed: {type(error).__name__}: {error}",
                            self.spec.source)
        self.matcher = StructuredMatcher(self.future.result())
        return None

    def accept(self, token: int) -> bool:
        """Advance by a generated token; False when the grammar refuses it (a dead end)."""
        if self.matcher.accept(token):
            self.num_accepted += 1
            return True
        return False

    def sync(self, tokens: Sequence[int]) -> bool:
        """Accept `tokens` from the start (the hf engine, after `generate()`): False at a refused one."""
        ok = self.matcher.sync(tokens)
        self.num_accepted = len(self.matcher.accepted)
        return ok

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated

    def dead_end(self) -> RowError:
        return RowError(ErrorType.STRUCTURED_OUTPUT_DEAD_END,
                        f"no token could continue the {self.spec.kind} after {self.num_accepted} tokens (the stop token was forced)")

    def incomplete(self) -> RowError | None:
        """The error of a row cut by max_tokens (or the context) before its grammar completed."""
        if self.matcher is None or self.matcher.is_completed:
            return None
        return RowError(ErrorType.STRUCTURED_OUTPUT_INCOMPLETE,
                        f"max_tokens reached after {self.num_accepted} tokens, before the {self.spec.kind} was complete")


@dataclass
class StructuredDecoding:
    """An engine's grammar compiler and bitmask, both made on first use.

    `vocab_size` is the width of the logits; `stop_token_ids` the engine's EOS ids (the
    grammar allows them exactly when the text is complete; the first is the one an empty
    mask allows); `max_rows` the most logits rows a step masks (the bitmask's size)."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: Sequence[int]
    device: torch.device
    max_rows: int
    fill_threads: int = 1
    stats: MaskStats = field(default_factory=MaskStats)
    _compiler: Any = None
    _bitmask: Any = None

    def submit(self, spec: StructuredOutput) -> GrammarState:
        """A new sequence's state; the compile (if this spec is new) runs in the background."""
        if self._compiler is None:
            from vlmbatch.structured.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.stop_token_ids))
        return GrammarState(spec, self._compiler.submit(spec))

    def mask(self, states: Sequence[tuple[int, GrammarState]], logits: torch.Tensor) -> None:
        """Mask the logits rows of the given (row, state) pairs in place; other rows untouched."""
        rows = [(row, state.matcher) for row, state in states if state.matcher is not None]
        if not rows:
            return
        started = time.perf_counter()
        bitmask = self._bitmask_for(logits.shape[0])
        bitmask.fill(rows)
        filled = time.perf_counter()
        bitmask.apply(logits)
        s = self.stats
        s.num_masked_steps += 1
        s.num_masked_rows += len(rows)
        s.fill_s += filled - started
        s.apply_s += time.perf_counter() - filled

    def _bitmask_for(self, num_rows: int) -> Any:
        if self._bitmask is None or self._bitmask.host.shape[0] < num_rows:
            from vlmbatch.structured.bitmask import TokenBitmask

            self.max_rows = max(num_rows, self.max_rows)
            self._bitmask = TokenBitmask(self.max_rows, self.vocab_size, self.device, self.stop_token_ids[0],
                                         fill_threads=self.fill_threads)
        return self._bitmask

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
