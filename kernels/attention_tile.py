"""What the decode and prefill kernels share: the step over one tile of paged keys, input checks.

Both kernels keep FlashAttention's running state per query row (max `m`, sum `l`,
unnormalised output `acc`) and fold in BLOCK_N keys at a time; only how they pick
query rows and key ranges differs. Scores are in the log2 domain (the scale is
pre-multiplied by log2(e)) so the kernel can use exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def load_paged_tile(
    cache_head_ptr,
    block_table_row_ptr,
    tile_start,
    offs_n,
    offs_d,
    kv_len,
    stride_block,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    """Keys or values for token positions `offs_n` (= tile_start + 0..BLOCK_N-1) of one
    sequence and KV head, `[BLOCK_N, BLOCK_D]`.

    Each token finds its page through the block table, so a tile may straddle pages
    and the pages need not be contiguous; positions >= kv_len read nothing (zeros).
    TILE_IN_PAGE (the caller's tiles start at multiples of BLOCK_N, and BLOCK_N divides
    PAGE_SIZE): the tile lies in one page, found with one scalar load instead of one per
    token, and its rows are consecutive slots.
    """
    in_context = offs_n < kv_len
    if TILE_IN_PAGE:
        page = tl.load(block_table_row_ptr + tile_start // PAGE_SIZE).to(tl.int64)
        rows = page * stride_block + (offs_n % PAGE_SIZE).to(tl.int64) * stride_slot
    else:
        page = tl.load(block_table_row_ptr + offs_n // PAGE_SIZE, mask=in_context, other=0).to(tl.int64)
        rows = page * stride_block + (offs_n % PAGE_SIZE) * stride_slot
    ptrs = cache_head_ptr + rows[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=in_context[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def attend_paged_tile(
    q,
    acc,
    m_i,
    l_i,
    k_head_ptr,
    v_head_ptr,
    block_table_row_ptr,
    tile_start,
    offs_n,
    offs_d,
    kv_len,
    score_mask,
    scale_log2,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr = False,
):
    """Fold keys `offs_n` (= tile_start + 0..BLOCK_N-1) into the online-softmax state;
    returns the new (acc, m_i, l_i).

    `score_mask` (broadcastable to `[rows, BLOCK_N]`) marks the allowed (row, key) pairs
    when APPLY_MASK. A row may see no key of a tile (a sliding window's lower edge): its
    running max then stays -inf and the tile adds nothing, instead of exp2(-inf - -inf).
    """
    k = load_paged_tile(
        k_head_ptr, block_table_row_ptr, tile_start, offs_n, offs_d, kv_len, stride_k_block, stride_k_slot, PAGE_SIZE, HEAD_DIM,
        TILE_IN_PAGE,
    ).to(q.dtype)  # an FP8 cache is read back in the compute dtype (a no-op otherwise)
    scores = tl.dot(q, tl.trans(k)) * scale_log2
    if APPLY_MASK:
        scores = tl.where(score_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if APPLY_MASK:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_paged_tile(
        v_head_ptr, block_table_row_ptr, tile_start, offs_n, offs_d, kv_len, stride_v_block, stride_v_slot, PAGE_SIZE, HEAD_DIM,
        TILE_IN_PAGE,
    ).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Reject layouts the kernels would silently misread (they index caches by flat strides)."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match, 4-D")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-2] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {k_cache.shape[2]} KV heads x {k_cache.shape[3]}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables rows must be contiguous")
