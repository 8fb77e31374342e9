"""Continuous batching with chunked prefill and recompute preemption.

Each step, every running sequence that is decoding gets one token, and the rest of the
step's token budget (`max_num_batched_tokens`) goes to prompt chunks: first sequences
already running with a partially computed prompt, then waiting ones, oldest first. A long
prompt is thus split over several steps (chunked prefill) and new requests join without
stalling the decoding ones. A step with no prompt work is a pure decode step, whose
fixed shapes the runner replays as a CUDA graph; a step with prompt work lists its
one-token rows first, for attention to run them as one decode batch.

With `min_admission_batch` > 1, waiting requests join a running batch only once that
many slots are free (or the queue is shorter): each admission is then one larger
prefill step, instead of a mixed, eager step with a few prompts and their images after
every finishing sequence (what W2 on the H200 spent most of its time in: 275 mixed
steps for 1,024 requests).

A chunk never ends inside a bidirectional media span (Gemma 3's images,
`MultimodalData.bidirectional_spans`): the span's first tokens attend to its last, so the
whole span is computed in one step, as `transformers`' unchunked prefill computes it. The
chunk stops before the span instead; a span that alone exceeds the remaining budget is
taken whole by the step's first prompt chunk (over budget by at most the span) and waits
otherwise. A prefix-cache hit may end inside a span: those blocks were computed whole.

The vision tower's batch is bounded too: a step admits no further waiting prompt once
the media tokens it would encode pass `max_num_batched_tokens` (the step's first prompt is
always admitted, however large its media). Prompts that are mostly prefix-cache hits cost
almost nothing of the token budget, so without this a repeat of hundreds of image prompts
(W1's image ends past the last cached block) would send all their images through the tower
at once (on the H200: a 6.75 GiB activation, out of memory beside a full KV cache).

Sliding-window KV-cache groups free the blocks that fall out of their window after each
step (`BlockManager.release_out_of_window`), so what a step needs is counted in blocks of
every group: a new block per group when a sequence crosses into one.

When the cache runs out of blocks, the newest running sequence is preempted: its
blocks are released (they stay in the prefix cache until reused) and it goes back to
the front of the waiting queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vlmbatch.engine.block_manager import BlockManager
from vlmbatch.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, min_admission_batch: int = 1):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_admission_batch = min_admission_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill chunks that stopped short of the sequence end

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue `seqs` (forked samples) ahead of the other waiting sequences, in order."""
        self.waiting.extendleft(reversed(seqs))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    @staticmethod
    def _is_decoding(seq: Sequence) -> bool:
        # One token left to compute after its media were embedded in an earlier prefill.
        return bool(seq.block_tables) and seq.num_uncomputed_tokens == 1 and (
            seq.mm is None or seq.num_computed_tokens >= seq.num_prompt_tokens
        )

    def schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch([], [], is_prefill=False)
        running = [(seq, self._is_decoding(seq)) for seq in self.running]
        budget = max(0, self.max_num_batched_tokens - sum(decoding for _, decoding in running))
        for seq, decoding in running:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if decoding else self._chunk(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget), batch)
            if n == 0 or not self._make_room(seq, seq.num_computed_tokens + n, batch):
                continue
            if not decoding:
                budget = max(0, budget - n)  # a whole span may overrun it
                batch.is_prefill = True
            self._add(batch, seq, n)
        bm = self.block_manager
        if not self._admitting():
            return self._one_token_rows_first(batch) if batch.seqs else None
        media_budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.match_prefix(seq)  # none for a forked sample: it holds its shared blocks already
            computed = seq.num_computed_tokens if seq.block_tables else len(hits[0]) * bm.block_size
            n = self._chunk(seq, computed, min(len(seq) - computed, budget), batch)
            media = seq.mm.tokens_to_encode(computed) if seq.mm is not None else 0
            if n == 0 or (media > media_budget and batch.is_prefill) or not bm.can_allocate(seq, computed + n, hits):
                break
            media_budget -= media
            self.waiting.popleft()
            bm.allocate(seq, computed + n, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            batch.is_prefill = True
            budget = max(0, budget - n)  # a whole span may overrun it
        return self._one_token_rows_first(batch) if batch.seqs else None

    def upcoming(self) -> list[Sequence]:
        """The waiting sequences the next admission would most likely take, oldest first: as
        many as the free slots and the step's token budget allow (blocks, prefix hits and
        chunking not counted; the first always). With every slot taken the next admission
        comes once some finish, and takes the oldest waiting: then the token budget alone
        bounds the guess (else a slot-bound engine, whose finishing and admitting fall in
        consecutive steps, would never stage). A guess, for staging their media ahead."""
        seqs, budget = [], self.max_num_batched_tokens
        slots = self.max_num_seqs - len(self.running) or self.max_num_seqs
        for seq in self.waiting:
            if len(seqs) >= slots or (seqs and budget <= 0):
                break
            seqs.append(seq)
            budget -= seq.num_uncomputed_tokens
        return seqs

    @staticmethod
    def _one_token_rows_first(batch: ScheduledBatch) -> ScheduledBatch:
        """A prefill step lists its one-token rows (decoding sequences) first, in their
        order, so attention runs them as one decode batch (`AttentionMetadata.num_decode_rows`)."""
        if batch.is_prefill:
            order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
            batch.seqs = [batch.seqs[i] for i in order]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        return batch

    def decodes_next(self, seqs: list[Sequence]) -> bool:
        """Whether `schedule()` would now give a pure decode step of exactly `seqs`, in
        order: nobody to admit, every running sequence decoding, and blocks for each next
        token without preempting. The engine then launches that step before it has read
        the previous step's tokens (see `PagedEngine`)."""
        if self.running != seqs or (self.waiting and self._admitting()):
            return False
        bm = self.block_manager
        new_blocks = 0
        for seq in seqs:
            if not self._is_decoding(seq):
                return False
            new_blocks += seq.num_computed_tokens + 1 > seq.num_table_blocks * bm.block_size
        return new_blocks * bm.num_groups <= bm.num_free_blocks

    @staticmethod
    def _chunk(seq: Sequence, start: int, n: int, batch: ScheduledBatch) -> int:
        """`n` new tokens from `start`, cut so that the chunk does not end inside a
        bidirectional span (see the module docstring)."""
        end = start + n
        if seq.mm is None or end >= len(seq):
            return n
        for span_start, span_end in seq.mm.bidirectional_spans:
            if span_start < end < span_end:
                if span_start > start:
                    return span_start - start
                return 0 if batch.is_prefill else span_end - start
        return n

    def _admitting(self) -> bool:
        """Whether waiting requests may join this step (see `min_admission_batch`)."""
        wanted = min(self.min_admission_batch, len(self.waiting), self.max_num_seqs)
        return not self.running or self.max_num_seqs - len(self.running) >= wanted

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        if seq.num_computed_tokens + n < len(seq):
            self.num_chunked_prefills += 1

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Allocate blocks for `seq`, preempting the newest unscheduled running sequences
        if needed; preempts `seq` itself (and returns False) when nothing else is left."""
        bm = self.block_manager
        if num_tokens <= seq.num_table_blocks * bm.block_size:
            return True  # the common decode case: the last block still has room
        while not bm.can_allocate(seq, num_tokens):
            victim = next((s for s in reversed(self.running) if s is not seq and s not in batch.seqs), None)
            if victim is None:
                self._preempt(seq)
                return False
            self._preempt(victim)
        bm.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_step(self, batch: ScheduledBatch) -> None:
        """Account for the KV the step wrote (before new tokens are appended): register full
        blocks, then free those out of every window; sequences that finished meanwhile
        (asynchronous decoding) are left out. A block freed here may still be read by a
        step in flight: the next step that reuses it is queued after it on the stream."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            self.block_manager.release_out_of_window(seq)
