"""Paged KV-cache bookkeeping: ref-counted blocks and a prefix cache keyed by block hash.

The cache is one preallocated pool of `num_blocks` blocks of `block_size` token slots.
A sequence owns a block table (list of block ids). Full blocks whose KV has been
computed are registered under a hash chain over their token ids and the content hashes
of the media overlapping them, so a later sequence with the same prefix (a shared system
prompt, the same image) reuses them instead of recomputing. Blocks are registered only
after their KV is written (`commit`), so a hit never reads KV that is still pending.
Freed blocks keep their hash until the slot is handed out again, which lets a preempted
sequence (or a repeated prompt) find its KV still in place.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vlmbatch.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered: blocks freed longest ago are reused first, so recently
        # used prefixes stay cached longest (LRU eviction for free).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.num_prefix_hit_tokens = 0  # stats: tokens whose prefill a cache hit skipped
        self.num_forked_tokens = 0  # stats: prompt tokens a forked sample shares instead of computing

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

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

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of a sequence without blocks (no side effects).

        At least the last token is always left out, because its forward pass yields the
        logits of the next token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` (a sample of the same prompt, without blocks) share the parent's full
        prompt blocks, whose KV the parent has computed: their ref counts go up and the
        child computes only the rest (the partial last block, at least the last token,
        whose logits it samples from), so it never writes into a shared block."""
        shared = min((parent.num_prompt_tokens - 1) // self.block_size, parent.num_computed_tokens // self.block_size)
        for block_id in parent.block_table[:shared]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = shared * self.block_size
        self.num_forked_tokens += child.num_computed_tokens

    def _blocks_to_add(self, seq: Sequence, num_tokens: int, hits: list[int]) -> int:
        table_len = len(seq.block_table) + len(hits)
        return max(0, seq.num_blocks_needed(self.block_size, num_tokens) - table_len)

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether the sequence can hold `num_tokens` tokens (after taking `hits`)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self._blocks_to_add(seq, num_tokens, list(hits)) <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Give the sequence room for `num_tokens` tokens, first taking the prefix `hits`
        (from `match_prefix`), whose tokens then count as computed."""
        if hits:
            for block_id in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
            seq.num_computed_tokens = len(hits) * self.block_size
            self.num_prefix_hit_tokens += seq.num_computed_tokens
        for _ in range(self._blocks_to_add(seq, num_tokens, [])):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        block.ref_count = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return  # the common decode step: no block filled up
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                block.hash = seq.block_hashes[index]
                self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; unreferenced blocks stay cached until reused.
        Tail blocks are released first so they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget the KV of unreferenced blocks (e.g. before comparing attention backends,
        so one backend's results are not served to another)."""
        for block in self.blocks:
            if block.ref_count == 0 and block.hash is not None:
                if self.hash_to_block.get(block.hash) == block.block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
