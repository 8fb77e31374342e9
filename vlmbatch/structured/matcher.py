"""One sequence's grammar state: which tokens it may generate next.

How the engine uses a `StructuredMatcher` (the contract the tests hold it to):

- **One per constrained sequence, owned by the `Sequence`.** It is made from the compiled
  grammar once `GrammarCompiler.submit(spec)` is done, before the sequence is first scheduled.
- **Each generated token is accepted once, where the engine appends it** (`_append`):
  `accept(token)`. False means the token breaks the grammar, which only a guarded empty mask
  can cause (bitmask.py forces EOS there): the row ends with `structured_output_dead_end`.
  A sequence whose matcher `is_terminated` (it accepted a stop token) is finished.
- **Preemption needs nothing.** Our engine preempts by recompute: the sequence keeps its
  generated tokens and only its KV is rebuilt, so the matcher, which saw exactly those
  tokens, is still exact. `sync(tokens)` re-establishes "accepted == generated" from any
  state (roll back to the common prefix, accept the rest) and `replay(...)` builds a fresh
  matcher from the tokens: what a design that drops or moves sequences would call.
- **The mask of step k is filled after the token of step k - 1 was accepted.** With
  asynchronous decoding the forward of step k is launched on step k - 1's tokens while
  they are still on the device. Only sampling needs the mask, so a batch with constrained
  rows launches its forward as usual, then reads step k - 1's tokens (the engine does
  already), accepts them, fills the constrained rows' masks, and only then launches the
  mask kernel and the sampler of step k. The host fills while the GPU runs the forward;
  no extra host synchronisation, no placeholder token ever reaches a matcher, and no
  rollback is needed. (The simplest first integration, correct but without the overlap:
  run batches that hold constrained rows awaited, i.e. finish the step in flight first.)
  Rows whose sequence finished at step k - 1 (their slot in step k is wasted) are left
  out of the fill: their matcher has terminated.
- `rollback` is for designs that do need to take tokens back (speculative decoding,
  jump-forward); xgrammar keeps the whole history, so any number of tokens can go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class StructuredMatcher:
    """The grammar state after `accepted` tokens."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self.accepted: list[int] = []
        self.rejected_token: int | None = None  # the last token `accept` refused, if any

    @classmethod
    def replay(cls, compiled: xgr.CompiledGrammar, token_ids: Sequence[int]) -> "StructuredMatcher":
        """A matcher that has accepted `token_ids` (raises ValueError if the grammar refuses one)."""
        matcher = cls(compiled)
        if not matcher.sync(token_ids):
            raise ValueError(f"token {matcher.rejected_token} at position {len(matcher.accepted)} breaks the grammar")
        return matcher

    @property
    def grammar_matcher(self) -> xgr.GrammarMatcher:
        """The xgrammar matcher itself, for batched calls (`TokenBitmask` with fill threads)."""
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) if the grammar refuses it."""
        if self._matcher.accept_token(token_id):
            self.accepted.append(token_id)
            return True
        self.rejected_token = token_id
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w = token 32w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the sequence is done and has no next-token mask."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete match (the next token may be a stop token)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self.accepted):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.accepted)} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self.accepted[-num_tokens:]

    def sync(self, token_ids: Sequence[int]) -> bool:
        """Make the accepted tokens equal `token_ids` (a sequence's generated tokens): roll back
        to the longest common prefix, then accept the rest (O(len): for rare events, not per
        step). False if the grammar refuses one (`accepted` stops before it)."""
        common = 0
        limit = min(len(self.accepted), len(token_ids))
        while common < limit and self.accepted[common] == token_ids[common]:
            common += 1
        self.rollback(len(self.accepted) - common)
        return all(self.accept(token) for token in token_ids[common:])
