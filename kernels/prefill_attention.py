"""Varlen prefill attention over the paged cache (FlashAttention-2 style).

Serves fresh prompts, chunked prefill and prefix-cache hits alike: this step's keys and
values are already in the cache, and sequence b's q_len queries are the last q_len of its
context_len positions, so query i attends to keys 0..context_len - q_len + i. One program
handles BLOCK_M queries of one head of one sequence. Keys every query of the tile may see
are processed without masks; only the tiles along the causal diagonal pay for masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_tile import LOG2_E, attend_paged_tile, check_paged_inputs


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel (tuned by `vlmbatch bench kernels`)."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    query_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_query = query_tile * BLOCK_M
    if first_query >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    offs_m = first_query + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    query_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt_seq
    kv_head = head // GROUP_SIZE
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head

    # Keys below the tile's first query position are visible to all its rows.
    unmasked_end = ((prefix_len + first_query) // BLOCK_N) * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_head, v_head, block_table_row, offs_n, offs_d, context_len,
            None, scale_log2,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, False,
        )  # fmt: skip
    causal_end = tl.minimum(context_len, prefix_len + first_query + BLOCK_M)
    for tile_start in range(unmasked_end, causal_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] <= query_pos[:, None]) & (offs_n[None, :] < context_len)
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_head, v_head, block_table_row, offs_n, offs_d, context_len,
            visible, scale_log2,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, True,
        )  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out,
        mask=row_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    softmax_scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of `q[total_q_tokens, q_heads, head_dim]` over each sequence's paged context.

    cu_seqlens_q int32 `[num_seqs + 1]` delimits the sequences' queries; context_lens int32
    counts each sequence's cached tokens including this step's; max_q_len (a host int, so no
    device sync) bounds the launch grid.
    """
    config = config or PrefillConfig()
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if cu_seqlens_q.dtype != torch.int32:
        raise ValueError("cu_seqlens_q must be int32")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return out
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    grid = (triton.cdiv(max_q_len, config.block_m), num_q_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        softmax_scale * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP_SIZE=num_q_heads // num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
