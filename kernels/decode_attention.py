"""Paged decode attention: split-KV flash-decoding with the GQA group packed into the matmul.

One program handles one (sequence, KV head, split): the query heads that share the KV
head form the M dimension of `tl.dot` (padded to 16 rows, the minimum tile), so every
key/value tile is read once per KV head and the tensor cores do the arithmetic. Decode is
bound by reading the cache; when sequences x KV heads are too few to fill the GPU, each
context is cut into `num_splits` ranges processed in parallel (stage 1) and their partial
results merged by log-sum-exp weights (stage 2). With a sliding `window` only the last
`window` keys are read: the splits cut that range, not the whole context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_tile import LOG2_E, attend_paged_tile, check_paged_inputs
from .pdl import follow_previous, launch_options, pdl_launch

H200_SM_COUNT = 132
MAX_SPLITS = 32
MIN_TILES_PER_SPLIT = 2


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the stage-1 kernel (tuned by `vlmbatch bench kernels`)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; the H200's count off the GPU so splits behave alike."""
    if device.type != "cuda":
        return H200_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int, block_n: int) -> int:
    """How many ranges to cut each context into so that enough programs fill the GPU.

    No split once there are two programs per SM (splitting then only adds the merge);
    otherwise aim at about four per SM, but keep at least MIN_TILES_PER_SPLIT tiles in a
    split. Depends only on shapes, never on tensor values, so it is stable under CUDA graphs.
    """
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv(4 * num_sms, programs)
    longest_useful = max(1, triton.cdiv(max_context_len, block_n * MIN_TILES_PER_SPLIT))
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


# What changes from step to step must not select a compiled variant (Triton keys integers
# on == 1 and % 16): the split count, which follows the step's batch size, the LSE strides
# made from it, and the block tables' row stride (the step's longest table), as for the
# prefill kernel (`prefill_attention._prefill_kernel`). LLaVA-OneVision's timed W1 compiled
# one variant of this kernel mid-run (session 16; which key changed was not recorded). Each
# is read once per program: no vector access to gain.
@triton.jit(do_not_specialize=["num_splits", "stride_bt_seq", "stride_lse_seq", "stride_lse_head"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    num_splits,
    window,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_lse_seq,
    stride_lse_head,
    GROUP_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    window_start = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)  # the first key the query sees
    first_tile = (window_start // BLOCK_N) * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - first_tile, BLOCK_N), num_splits)
    start = first_tile + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP_SIZE + offs_h
    row_mask = (offs_h[:, None] < GROUP_SIZE) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :], mask=row_mask, other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_head, v_head, block_table_row, tile_start, offs_n, offs_d, end,
            ((offs_n < end) & (offs_n >= window_start))[None, :], scale_log2,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, True,
        )  # fmt: skip

    # An empty split (a context shorter than the others) contributes weight 0 in stage 2.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + split * stride_o_split + offs_d[None, :]
    tl.store(out_ptrs, out, mask=row_mask)
    if STORE_LSE:
        lse_ptrs = lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split
        tl.store(lse_ptrs, tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf")), mask=offs_h < GROUP_SIZE)


@triton.jit(do_not_specialize=["num_splits", "stride_lse_seq", "stride_lse_head"])  # as `_decode_split_kernel`
def _decode_merge_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_lse_seq,
    stride_lse_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(
        lse_ptr + seq * stride_lse_seq + head * stride_lse_head + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    # All splits empty only for a zero-length context: its output is 0.
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    partial = tl.load(
        partial_ptr + seq * stride_p_seq + head * stride_p_head + offs_s[:, None] * stride_p_split + offs_d[None, :],
        mask=(offs_s[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d, out, mask=offs_d < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    pdl_max_rows: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q `[num_seqs, q_heads, head_dim]`; caches `[num_blocks, block_size, kv_heads, head_dim]`;
    block_tables int32 `[num_seqs, max_blocks]`; context_lens int32 `[num_seqs]` (including
    this token). num_splits None picks one from the shapes (`choose_num_splits`). `window`
    > 0: only the last `window` keys (a sliding-window layer).
    """
    config = config or DecodeConfig()
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if num_splits is None:
        max_context_len = block_tables.shape[1] * page_size
        if window:
            max_context_len = min(max_context_len, window + config.block_n)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, sm_count(q.device), config.block_n)

    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    pdl = pdl_launch(q, pdl_max_rows)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits == 1:
        stage1_out, lse = out.unsqueeze(2), out  # lse unused: the kernel normalises in place
    else:
        stage1_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, stage1_out, lse,
        softmax_scale * LOG2_E, num_splits, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        stage1_out.stride(0), stage1_out.stride(1), stage1_out.stride(2),
        lse.stride(0), lse.stride(1),
        GROUP_SIZE=group_size, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group_size)), BLOCK_N=config.block_n, BLOCK_D=block_d,
        STORE_LSE=num_splits > 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            stage1_out, lse, out, num_splits,
            stage1_out.stride(0), stage1_out.stride(1), stage1_out.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            # One tile for every split count the engine picks: a new power of two compiled a variant mid-run.
            BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
            num_warps=4, **launch_options(pdl),
        )  # fmt: skip
    return out

