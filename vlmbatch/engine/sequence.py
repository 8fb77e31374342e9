"""One request's state inside the paged engine.

A `Sequence` holds everything the scheduler, block manager and runner need about a
request: its tokens (prompt followed by generated ones), how many of them already have
KV in the cache, which cache blocks it owns, and its multimodal extras. Preemption
recomputes: the sequence goes back to WAITING with its block tables dropped, and its
prompt + generated tokens are prefilled again later (no KV swapping).
"""

from __future__ import annotations

import enum
import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlmbatch.engine.outputs import TokenLogprob
from vlmbatch.engine.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sequence's last token while the step that samples it is in flight (asynchronous decoding)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class MultimodalData:
    """What a sequence's media contribute to the decoder.

    `items` are the media items in placeholder order and `token_spans` the (start, end)
    prompt positions each item's placeholder tokens occupy; the block manager mixes the
    content hashes of the items that overlap a block into its prefix-cache key.
    `embeds` holds the rows of just the items whose span ends after `embeds_from`: a
    forward reads no others (those inside a prefix-cache hit are never encoded). They and
    `rope_delta` (M-RoPE: position of generated token i is i + rope_delta) live here so
    that a preempted sequence is recomputed without encoding again, unless it comes back
    with fewer computed tokens than `embeds_from` (then `missing` names what it lacks).
    `bidirectional_spans` (Gemma 3) are the (start, end) runs of media tokens that attend
    to each other in prefill; the scheduler never ends a prompt chunk inside one.
    """

    items: list[Any]  # MediaItem
    token_spans: list[tuple[int, int]]
    embeds: Any = None  # [rows of the held items, hidden * (1 + deepstack_levels)]
    media_index: Any = None  # int64 [num_prompt_tokens]: media row (items' tokens in order) of each media token, else -1
    embed_rows: Any = None  # int64 [num_media_tokens]: row of `embeds` for each media row, -1 for items not held
    embeds_from: int = sys.maxsize  # every item whose span ends after this position is held (none yet)
    rope_positions: Any = None  # [3, num_prompt_tokens] for M-RoPE models
    rope_delta: int = 0
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)

    def missing(self, start: int) -> list[int]:
        """The items a forward from prompt position `start` reads (span ending after it) that are not held."""
        return [i for i, (_, end) in enumerate(self.token_spans) if start < end <= self.embeds_from]

    def tokens_to_encode(self, start: int) -> int:
        """Media tokens the tower must make before a forward from `start`: the scheduler's
        per-step media budget counts these."""
        return sum(self.items[i].num_tokens for i in self.missing(start))

    def hold(self, indices: list[int], rows: torch.Tensor | None, start: int) -> None:
        """Hold `rows`, the embeddings of the items `indices` = `missing(start)` concatenated,
        beside those held. New tensors, never written in place: forked samples share the old ones."""
        if indices:
            sizes = [item.num_tokens for item in self.items]
            offsets = list(itertools.accumulate(sizes, initial=0))
            held = 0 if self.embeds is None else len(self.embeds)
            embed_rows = torch.full((offsets[-1],), -1) if self.embed_rows is None else self.embed_rows.clone()
            for i in indices:
                embed_rows[offsets[i] : offsets[i + 1]] = torch.arange(held, held + sizes[i])
                held += sizes[i]
            self.embeds = rows if self.embeds is None else torch.cat([self.embeds, rows])
            self.embed_rows = embed_rows
        self.embeds_from = start


@dataclass(eq=False)  # identity: `seq in running` must not compare token lists field by field
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    mm: MultimodalData | None = None
    index: int = 0  # which of the request's n completions this is
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = field(init=False)
    prompt_token_ids: list[int] = field(init=False)
    # Tokens whose KV is in the cache (prefix-cache hits included). The scheduler
    # advances it after each step; tokens [num_computed_tokens:] still need a forward.
    num_computed_tokens: int = 0
    # One block table per KV-cache group (`BlockManager`), all of one length; [] = no blocks.
    block_tables: list[list[int]] = field(default_factory=list)
    # Prefix-cache keys of the sequence's full blocks, a hash chain (block i's key covers
    # blocks 0..i); extended lazily by the block manager, valid as long as the tokens are.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of the block tables already registered in the prefix cache: each step's
    # commit then only looks at blocks filled since (0 again when the table is dropped).
    num_registered_blocks: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    detokenizer: Any = None  # incremental detokeniser state of `text`
    # A structured-output sequence's `GrammarState` (engine/structured_decoding.py). Its matcher
    # has accepted exactly the generated tokens: preemption recomputes KV only, so it stays exact.
    grammar: Any = None
    error: Any = None  # the RowError of a row that failed after it was admitted (structured outputs)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the params ask for them

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.prompt_token_ids = list(self.token_ids)  # never changes: outputs share it instead of copying
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @functools.cached_property
    def prompt_id_array(self) -> np.ndarray:
        """The prompt's ids as int64 (the repetition penalty uploads them every step)."""
        return np.array(self.prompt_token_ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_table_blocks(self) -> int:
        """Entries in each of the sequence's block tables (dropped ones included)."""
        return len(self.block_tables[0]) if self.block_tables else 0

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        """Blocks that hold the first `num_tokens` tokens (all of them by default)."""
        n = len(self.token_ids) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def media_hashes_in(self, start: int, end: int) -> list[str]:
        """Hashes of the media whose placeholder tokens overlap positions [start, end)."""
        if self.mm is None:
            return []
        return [i.content_hash for i, (s, e) in zip(self.mm.items, self.mm.token_spans) if s < end and e > start]
