"""Decode steps as CUDA graphs: static input buffers, one graph per batch size, replay.

A decode step has fixed shapes once its batch is padded, so the runner captures one CUDA
graph per batch size in 1, 2, 4, 8, 16, 32, 64, 96, ... up to `max_num_seqs` over the
static buffers below, and replays the smallest one that fits. Padding rows write their KV
into one spare block past the ones the block manager hands out, so they never touch a
sequence's cache.
"""

from __future__ import annotations

import torch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 32 else sizes[-1] + 32)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class StaticDecodeInputs:
    """The decode graphs' input buffers, filled by one host-to-device copy per step.

    Token ids, positions, slots, context lengths and block tables of the `size` rows a
    graph replays (padding rows included) are packed into a pinned host buffer and
    copied in one transfer; the graph itself spreads the first four into the static
    tensors it reads (`spread`, captured with the forward: their place in the packed
    buffer depends only on `size`), and one device copy places the block tables, whose
    width varies. A dozen small host-side tensor ops per step used to cost about as much
    host time as the whole batch-1 forward takes on the GPU. Slots and block tables have
    one row per KV-cache group (`kv_groups.py`; one for a model without windows).
    """

    def __init__(self, max_num_seqs: int, position_rows: int, max_blocks: int, device: torch.device, num_groups: int = 1):
        n = max_num_seqs
        self.position_rows = position_rows
        self.num_groups = num_groups
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((position_rows, n), dtype=torch.long, device=device)
        if position_rows == 1:
            self.positions = self.positions[0]
        self.slots = torch.zeros((num_groups, n), dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((num_groups, n, max_blocks), -1, dtype=torch.int32, device=device)
        capacity = n * (2 + position_rows + num_groups * (1 + max_blocks))
        # Two host buffers in turn: a step is staged while the previous one may still be
        # queued on the GPU (asynchronous decoding), so its buffer must not be rewritten
        # before its own copy has run (`copied`).
        self.hosts = [torch.empty(capacity, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.staging = torch.empty(capacity, dtype=torch.int64, device=device)

    def stage(self, ids: list[int], positions: torch.Tensor, slots: list[list[int]], tables: list[list[list[int]]],
              ctx: list[int], size: int, pad_slot: int, pad_block: int) -> None:
        """Rows [0, len(ids)) from the batch, rows up to `size` padding: slot `pad_slot`,
        context 1 in block `pad_block`. `slots` per group, `tables` per row and group.
        Table entries past a row's width keep whatever an earlier step left: kernels
        read a table only up to the row's context length."""
        n, p, g = len(ids), self.position_rows, self.num_groups
        width = max((len(t[0]) for t in tables), default=0) or 1
        turn, self.turn = self.turn, self.turn ^ 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # long done: it was queued two steps ago
        host_tensor = self.hosts[turn]
        host = host_tensor.numpy()
        at = 0

        def section(length: int):
            nonlocal at
            view = host[at : at + length]
            at += length
            return view

        host_ids, host_positions = section(size), section(p * size).reshape(p, size)
        host_slots, host_ctx = section(g * size).reshape(g, size), section(size)
        host_tables = section(g * size * width).reshape(g, size, width)
        host_ids[:n], host_ids[n:] = ids, 0
        host_positions[:, :n], host_positions[:, n:] = positions.reshape(p, n).numpy(), 0
        host_slots[:, :n], host_slots[:, n:] = slots, pad_slot
        host_ctx[:n], host_ctx[n:] = ctx, 1
        host_tables.fill(-1)
        for row, row_tables in enumerate(tables):  # a row's tables are of one length
            host_tables[:, row, : len(row_tables[0])] = row_tables
        host_tables[:, n:, 0] = pad_block
        self.staging[:at].copy_(host_tensor[:at], non_blocking=True)
        if self.staging.is_cuda:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()
        tables_at = (2 + p + g) * size
        self.block_tables[:, :size, :width].copy_(self.staging[tables_at : tables_at + g * size * width].view(g, size, width))

    def spread(self, size: int) -> None:
        """Ids, positions, slots and context lengths of a `size`-row step from the staging
        buffer into the static tensors (part of each captured graph)."""
        p, g = self.position_rows, self.num_groups
        ids, positions, slots, ctx = self.staging[: (2 + p + g) * size].split([size, p * size, g * size, size])
        self.ids[:size].copy_(ids)
        self.positions[..., :size].copy_(positions.view(p, size) if p > 1 else positions)
        self.slots[:, :size].copy_(slots.view(g, size))
        self.context_lens[:size].copy_(ctx)
