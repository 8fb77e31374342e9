"""The fused MoE's first step: (token, slot) pairs sorted by expert into BLOCK_M-padded runs.

Every M block of the grouped GEMMs then belongs to one expert, and only experts that
received a token get blocks: at decode batch 1 with top-8 there are exactly 8 blocks, and
no program is launched for the idle experts' weights. It runs on the device with buffers
sized for the worst case of the token count, so nothing waits on the host and a CUDA graph
can capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options

# moe_align: up to this many (token, slot) pairs one program counts and places them all
# (one launch); beyond it each program takes a chunk and a first launch counts the chunks.
SINGLE_PROGRAM_PAIRS = 512
MIN_CHUNK_PAIRS = 512
MAX_CHUNKS = 128
_ALIGN_ROWS = 64  # pairs per step inside an align program ([rows, experts] one-hot tiles)


class ExpertBlocks(NamedTuple):
    """The (token, slot) pairs sorted by expert, in BLOCK_M runs (fixed-size, worst-case buffers).

    `sorted_pairs[i]` is a flat pair index `token * top_k + slot`, or `num_pairs` in the
    padding of an expert's last block; `expert_ids[b]` is block b's expert (-1 past the
    used blocks); `num_padded[0]` is how many entries of `sorted_pairs` are used.
    """

    sorted_pairs: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks `num_pairs` pairs can need: each of n used experts rounds its
    run up, sum(ceil(c_e / B)) <= n + (pairs - n) // B, largest at n = min(experts, pairs)."""
    used = min(num_experts, num_pairs)
    return used + (num_pairs - used) // block_m


@triton.jit
def _load_ids(ids_ptr, offs, end, num_experts):
    """Expert ids at `offs` (< end), with -1 for ids outside [0, num_experts): they match no expert."""
    ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
    return tl.where((ids >= 0) & (ids < num_experts), ids, -1)


@triton.jit
def _count_pairs(ids_ptr, start, count, num_experts, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Pairs per expert among ids[start : start + count] ([E_PAD] int32)."""
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for step in range(0, count, ROWS):
        ids = _load_ids(ids_ptr, start + step + tl.arange(0, ROWS), start + count, num_experts)
        totals += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return totals


@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_chunks_kernel(ids_ptr, chunk_counts_ptr, num_pairs, chunk, num_experts, E_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    follow_previous(PDL)
    p = tl.program_id(0)
    start = p * chunk
    counts = _count_pairs(ids_ptr, start, tl.minimum(chunk, num_pairs - start), num_experts, E_PAD, ROWS)
    tl.store(chunk_counts_ptr + p * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks", "num_blocks"])
def _place_pairs_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, chunk, num_chunks, num_blocks, num_experts,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, COUNT_HERE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program p places the pairs of its chunk: expert e's run starts at the padded total
    of experts < e; within it pairs keep their order (earlier chunks first, then the rank
    among this chunk's pairs of e). Program 0 also writes the padding sentinels, the block
    experts and the used length. Ids outside [0, E) match no expert and are never placed."""
    follow_previous(PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    start = p * chunk
    count = tl.minimum(chunk, num_pairs - start)
    if COUNT_HERE:  # a single program: the whole input is its chunk
        totals = _count_pairs(ids_ptr, 0, num_pairs, num_experts, E_PAD, ROWS)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        totals = tl.zeros([E_PAD], dtype=tl.int32)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
        for q0 in range(0, num_chunks, ROWS):
            qs = q0 + tl.arange(0, ROWS)
            counts = tl.load(chunk_counts_ptr + qs[:, None] * E_PAD + experts[None, :], mask=qs[:, None] < num_chunks, other=0)
            totals += tl.sum(counts, axis=0)
            earlier += tl.sum(tl.where(qs[:, None] < p, counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    next_slot = ends - padded + earlier
    for step in range(0, count, ROWS):
        offs = start + step + tl.arange(0, ROWS)
        ids = _load_ids(ids_ptr, offs, start + count, num_experts)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1  # among this step's pairs of the same expert
        dest = tl.sum(onehot * (next_slot[None, :] + rank), axis=1)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=tl.sum(onehot, axis=1) > 0)
        next_slot += tl.sum(onehot, axis=0)
    if p == 0:
        used = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, used)
        lane = tl.arange(0, BLOCK_M)
        pad_slots = (ends - padded + totals)[:, None] + lane[None, :]
        sentinel = tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_ptr + pad_slots, sentinel, mask=lane[None, :] < (padded - totals)[:, None])
        block_ends = ends // BLOCK_M
        for b0 in range(0, num_blocks, ROWS):
            blocks = b0 + tl.arange(0, ROWS)
            owner = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
            owner = tl.where(blocks < used // BLOCK_M, owner, -1)
            tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False) -> ExpertBlocks:
    """Sort the pairs of `topk_ids` [tokens, k] by expert into BLOCK_M-padded runs, on the
    device and without waiting for it (buffers sized by `max_blocks`)."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    if num_pairs == 0:
        num_padded.zero_()
        return ExpertBlocks(sorted_pairs, expert_ids, num_padded, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    options = launch_options(pdl)
    if num_pairs <= SINGLE_PROGRAM_PAIRS:
        chunk, num_chunks, chunk_counts = num_pairs, 1, num_padded  # no chunk counts to read
    else:
        chunk = max(MIN_CHUNK_PAIRS, triton.next_power_of_2(triton.cdiv(num_pairs, MAX_CHUNKS)))
        num_chunks = triton.cdiv(num_pairs, chunk)
        chunk_counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=ids.device)
        _count_chunks_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, chunk, num_experts, E_PAD=e_pad, ROWS=_ALIGN_ROWS, **options)
    _place_pairs_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_pairs, expert_ids, num_padded,
        num_pairs, chunk, num_chunks, blocks, num_experts,
        BLOCK_M=block_m, E_PAD=e_pad, ROWS=_ALIGN_ROWS, COUNT_HERE=num_chunks == 1, **options,
    )  # fmt: skip
    return ExpertBlocks(sorted_pairs, expert_ids, num_padded, block_m)
