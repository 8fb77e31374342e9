"""Paged KV-cache bookkeeping: ref-counted blocks and a prefix cache keyed by block hash.

The cache is one preallocated pool of `num_blocks` blocks of `block_size` token slots,
shared by the model's KV-cache groups (`kv_groups.py`: one group for a model without
sliding windows). A sequence owns one block table (list of block ids) per group, all of
the same length: entry i holds tokens [i * block_size, (i + 1) * block_size) of that
group's layers. A sliding-window group returns a block to the pool as soon as no future
query of the sequence can see any of its tokens (`release_out_of_window`) and puts
`null_block` in its place: the spare block past the pool, which kernels may read (a key
tile can start below the window) but whose keys they always mask.

Full blocks whose KV has been computed are registered under a hash chain over their
token ids and the content hashes of the media overlapping them (one chain, one cache
per group), so a later sequence with the same prefix (a shared system prompt, the same
image) reuses them instead of recomputing. Blocks are registered only after their KV is
written (`commit`), so a hit never reads KV that is still pending. Freed blocks keep
their hash until the slot is handed out again, which lets a preempted sequence (or a
repeated prompt) find its KV still in place. A hit of h blocks needs every global group's
blocks 0..h-1 but a sliding group's only from the first one its next query sees, so h is
the longest prefix for which all of those are cached (`match_prefix`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vlmbatch.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    group: int = 0  # whose prefix cache `hash` is registered in


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, windows: tuple[int, ...] = (0,)):
        """`windows`: per KV-cache group, its layers' sliding window (0 = global)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self.has_windows = any(windows)  # without, `release_out_of_window` has nothing to do
        self.null_block = num_blocks  # the spare block: what a dropped table entry points at
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered: blocks freed longest ago are reused first, so recently
        # used prefixes stay cached longest (LRU eviction for free).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: list[dict[bytes, int]] = [{} for _ in windows]
        self.num_prefix_hit_tokens = 0  # stats: tokens whose prefill a cache hit skipped
        self.num_forked_tokens = 0  # stats: prompt tokens a forked sample shares instead of computing
        self.num_window_freed_blocks = 0  # stats: blocks sliding groups returned before their sequence ended

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def max_tokens_alone(self, longest_chunk: int) -> int:
        """The longest sequence that always fits in the pool alone, computing at most
        `longest_chunk` tokens a step: each global group holds its whole context, each
        sliding one at most its window and a step's tokens (or a fork's start, one block
        back, `_first_future_query`), plus the blocks those straddle."""
        bs = self.block_size
        caps = [(window + max(longest_chunk, bs) + bs - 1) // bs + 2 for window in self.windows if window]
        num_global = self.num_groups - len(caps)
        if not num_global:
            return sys.maxsize if sum(caps) <= self.num_blocks else 0

        def blocks(entries: int) -> int:  # what a table of `entries` blocks costs in every group
            return num_global * entries + sum(min(entries, cap) for cap in caps)

        low, high = 0, self.num_blocks  # the longest table that fits, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks(mid) <= self.num_blocks else (low, mid - 1)
        return low * bs

    def _first_visible_block(self, group: int, position: int) -> int:
        """The first block a query at `position` sees in `group` (0 for a global one)."""
        window = self.windows[group]
        return max(0, position - window + 1) // self.block_size if window else 0

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        start = index * self.block_size
        digest = hashlib.blake2b(digest_size=16)
        if index > 0:
            digest.update(seq.block_hashes[index - 1])
        digest.update(array("q", seq.token_ids[start : start + self.block_size]).tobytes())
        for media_hash in seq.media_hashes_in(start, start + self.block_size):
            digest.update(media_hash.encode())
        return digest.digest()

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        while len(seq.block_hashes) < num_full_blocks:
            seq.block_hashes.append(self._block_hash(seq, len(seq.block_hashes)))

    def match_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the cached blocks that hold the start of a sequence without blocks,
        `null_block` where a sliding group needs none (no side effects).

        At least the last token is always left out, because its forward pass yields the
        logits of the next token.
        """
        none: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching or seq.block_tables:
            return none
        max_blocks = (len(seq) - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hashes = seq.block_hashes[:max_blocks]
        num_hits = max_blocks
        for group, window in enumerate(self.windows):
            if not window:  # a global group: the cached run from block 0
                cache = self.hash_to_block[group]
                num_hits = next((i for i, h in enumerate(hashes[:num_hits]) if h not in cache), num_hits)
        while num_hits and not all(
            all(h in self.hash_to_block[g] for h in hashes[self._first_visible_block(g, num_hits * self.block_size) : num_hits])
            for g, window in enumerate(self.windows) if window
        ):
            num_hits -= 1
        if not num_hits:
            return none
        tables = []
        for group in range(self.num_groups):
            first = self._first_visible_block(group, num_hits * self.block_size)
            cache = self.hash_to_block[group]
            tables.append([self.null_block] * first + [cache[h] for h in hashes[first:num_hits]])
        return tables

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` (a sample of the same prompt, without blocks) share the parent's full
        prompt blocks, whose KV the parent has computed: their ref counts go up and the
        child computes only the rest (the partial last block, at least the last token,
        whose logits it samples from), so it never writes into a shared block. The parent
        keeps what the child's first query sees (`_first_future_query`)."""
        shared = min((parent.num_prompt_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size)
        child.block_tables = [self._reference(table[:shared]) for table in parent.block_tables] if shared else []
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = shared * self.block_size
        self.num_forked_tokens += child.num_computed_tokens

    def _reference(self, table: list[int]) -> list[int]:
        """`table`'s blocks with one more reference each (dropped entries stay dropped)."""
        for block_id in table:
            if block_id != self.null_block:
                self.blocks[block_id].ref_count += 1
        return table

    def _blocks_to_add(self, seq: Sequence, num_tokens: int, num_hits: int) -> int:
        """Blocks each group's table still needs for `num_tokens` tokens."""
        return max(0, seq.num_blocks_needed(self.block_size, num_tokens) - seq.num_table_blocks - num_hits)

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[list[int]] | None = None) -> bool:
        """Whether the sequence can hold `num_tokens` tokens (after taking `hits`)."""
        hits = hits or [[]]
        revived = sum(1 for table in hits for b in table if b != self.null_block and self.blocks[b].ref_count == 0)
        return self._blocks_to_add(seq, num_tokens, len(hits[0])) * self.num_groups <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[list[int]] | None = None) -> None:
        """Give the sequence room for `num_tokens` tokens, first taking the prefix `hits`
        (from `match_prefix`), whose tokens then count as computed."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        if hits and hits[0]:
            for table, group_hits in zip(seq.block_tables, hits):
                for block_id in group_hits:
                    if block_id != self.null_block and self.blocks[block_id].ref_count == 0:
                        del self.free_block_ids[block_id]
                table.extend(self._reference(group_hits))
            seq.num_computed_tokens = len(hits[0]) * self.block_size
            self.num_prefix_hit_tokens += seq.num_computed_tokens
        for _ in range(self._blocks_to_add(seq, num_tokens, 0)):
            for group, table in enumerate(seq.block_tables):
                table.append(self._take_free_block(group))

    def _take_free_block(self, group: int) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block[block.group].get(block.hash) == block_id:
            del self.hash_to_block[block.group][block.hash]
        block.hash = None
        block.group = group
        block.ref_count = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, seq.num_table_blocks)
        if num_full <= seq.num_registered_blocks:
            return  # the common decode step: no block filled up
        self._extend_hashes(seq, num_full)
        for group, table in enumerate(seq.block_tables):
            for index in range(seq.num_registered_blocks, num_full):
                if table[index] == self.null_block:
                    continue  # a prefix hit that began past this block: never held
                block = self.blocks[table[index]]
                if block.hash is None:
                    block.hash = seq.block_hashes[index]
                    self.hash_to_block[group].setdefault(block.hash, block.block_id)
        seq.num_registered_blocks = num_full

    def _first_future_query(self, seq: Sequence) -> int:
        """The lowest position a query of `seq` may still have: its next token, or, until
        it has sampled one, where a fork of it starts (the end of its full prompt blocks)."""
        if seq.num_output_tokens:
            return seq.num_computed_tokens
        return min(seq.num_computed_tokens, (seq.num_prompt_tokens - 1) // self.block_size * self.block_size)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Return to the pool the sliding groups' blocks that no future query sees (call
        after `commit`, so they stay cached for prefix hits until reused)."""
        if not self.has_windows:
            return  # every step of every sequence of the families without windows
        position = self._first_future_query(seq)
        for group, table in enumerate(seq.block_tables):
            if not self.windows[group]:
                continue
            # Dropped entries are a leading run: walk down from the first visible block to it.
            for index in range(min(self._first_visible_block(group, position), len(table)) - 1, -1, -1):
                if table[index] == self.null_block:
                    break
                self._release(table[index])
                table[index] = self.null_block
                self.num_window_freed_blocks += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; unreferenced blocks stay cached until reused.
        Tail blocks are released first so they are evicted before the shared prefix."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != self.null_block:
                    self._release(block_id)
        seq.block_tables = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget the KV of unreferenced blocks (e.g. before comparing attention backends,
        so one backend's results are not served to another)."""
        for block in self.blocks:
            if block.ref_count == 0 and block.hash is not None:
                if self.hash_to_block[block.group].get(block.hash) == block.block_id:
                    del self.hash_to_block[block.group][block.hash]
                block.hash = None
