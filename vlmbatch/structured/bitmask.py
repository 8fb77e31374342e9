"""Token bitmasks of one step: filled on the host, applied to the logits on the device.

One `TokenBitmask` per engine, sized once: a host buffer `[max_batch, ceil(vocab / 32)]` of
int32 words (bit i of word w allows token 32w + i; pinned on CUDA) and its device twin. A
step's constrained rows are filled on the host (`fill`), then `apply` queues one
non-blocking copy of the rows in use and xgrammar's in-place kernel (Triton on CUDA, C++ on
the CPU) on the step's logits, before sampling. Nothing waits for the GPU: the only
synchronisation is on the previous step's copy, long finished by the time the host fills
the next step (the sampled tokens it read were computed after it).

Rows without a constraint are skipped through an index tensor, so a batch of mostly free
rows pays only for its constrained ones, and free rows' logits are untouched (their
tokens are exactly those of a batch without constrained rows).

A row whose mask allows no token (a grammar the vocabulary cannot continue) would sample
from all -inf logits: `apply` allows the stop token there instead, on the device. The row
then ends at once, and its matcher refuses that stop token when the engine accepts it
(`StructuredMatcher.accept` returns False), which is how the engine learns to flag it
(`structured_output_dead_end`) without reading the mask back.

`fill_threads > 1` fills through xgrammar's `BatchGrammarMatcher` (C++ threads, no GIL).
On 2 shared CPU cores it did not help (docs/structured.md has the figures); the engine
passes its configured count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from vlmbatch.structured.matcher import StructuredMatcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _as_int32_bit(bit: int) -> int:
    """1 << bit as the signed int32 value torch stores (bit 31 is the sign bit)."""
    value = 1 << bit
    return value - (1 << 32) if value >= 1 << 31 else value


class TokenBitmask:
    """The masks of up to `max_batch` rows over a `vocab_size`-wide logits tensor."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device | str, stop_token_id: int, *, fill_threads: int = 1):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.stop_word, self.stop_bit = stop_token_id // 32, _as_int32_bit(stop_token_id % 32)
        on_cuda = self.device.type == "cuda"
        words = bitmask_words(vocab_size)
        self.host = torch.full((max_batch, words), -1, dtype=torch.int32, pin_memory=on_cuda)
        self.host_rows = torch.zeros(max_batch, dtype=torch.int32, pin_memory=on_cuda)
        self.mask = torch.empty_like(self.host, device=self.device) if on_cuda else self.host
        self.rows = torch.empty_like(self.host_rows, device=self.device) if on_cuda else self.host_rows
        self._copied: torch.cuda.Event | None = None
        self.filled_rows: list[int] = []  # the logits rows the next `apply` masks (set by `fill`)
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads) if fill_threads > 1 else None

    def fill(self, constrained: Sequence[tuple[int, StructuredMatcher]]) -> int:
        """Write the mask of each (logits row, matcher) of this step into the host buffer;
        terminated matchers (their sequence already ended) are left out. Returns how many
        rows `apply` will mask."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the buffer
        live = [(row, matcher) for row, matcher in constrained if not matcher.is_terminated]
        if self._batch is not None and len(live) > 1:
            self._batch.batch_fill_next_token_bitmask([m.grammar_matcher for _, m in live], self.host, indices=[r for r, _ in live])
        else:
            for row, matcher in live:
                matcher.fill(self.host, row)
        self.filled_rows = [row for row, _ in live]
        return len(self.filled_rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask the filled rows of `logits` [batch, vocab] in place, on its device, without a
        host synchronisation; rows no matcher filled are left as they are."""
        count = len(self.filled_rows)
        if not count:
            return
        used = max(self.filled_rows) + 1
        self.host_rows.numpy()[:count] = self.filled_rows
        if self.mask is not self.host:
            self.mask[:used].copy_(self.host[:used], non_blocking=True)
            self.rows[:count].copy_(self.host_rows[:count], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        mask, rows = self.mask[:used], self.rows[:count]
        self._allow_stop_where_empty(mask, rows)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
        self.filled_rows = []

    def _allow_stop_where_empty(self, mask: torch.Tensor, rows: torch.Tensor) -> None:
        """Set the stop token's bit in every filled row that allows nothing (on the device)."""
        index = rows.long()
        empty = (mask.index_select(0, index) == 0).all(dim=1)
        stop = torch.where(empty, self.stop_bit, 0).to(torch.int32)
        mask[index, self.stop_word] = mask[index, self.stop_word] | stop

