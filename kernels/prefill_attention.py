"""Varlen prefill attention over the paged cache (FlashAttention-2 style).

Serves fresh prompts, chunked prefill and prefix-cache hits alike: this step's keys and
values are already in the cache, and sequence b's q_len queries are the last q_len of its
context_len positions, so query i attends to keys 0..context_len - q_len + i. One program
handles BLOCK_M queries of one head of one sequence. Keys every query of the tile may see
are processed without masks; only the tiles along the causal diagonal pay for masking.

Two refinements (see `reference.paged_prefill_attention_ref`): a sliding `window` (query
q sees key k only when q - k < window; tiles below every row's window are skipped, those
on its lower edge masked) and per-query `key_ends` (query q sees keys < key_ends[q]:
bidirectional spans such as one image's tokens; the diagonal tiles then reach the
tile's largest end).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

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


# Launch shapes by the step's longest query run, measured on the H200 by `vlmbatch bench
# kernels --sections prefill --write-table`: {"measured": ..., "configs": {max_q_len: config}}.
TUNED_TABLE_PATH = Path(__file__).with_name("prefill_tuned.json")


def load_tuned_configs(path: Path = TUNED_TABLE_PATH) -> dict[int, PrefillConfig]:
    """The table keyed by the swept query length (extra keys of an entry are notes)."""
    if not path.exists():
        return {}
    fields = asdict(PrefillConfig()).keys()
    configs = json.loads(path.read_text())["configs"]
    return {int(length): PrefillConfig(**{name: entry[name] for name in fields}) for length, entry in configs.items()}


TUNED_CONFIGS = load_tuned_configs()


def choose_prefill_config(max_q_len: int, table: dict[int, PrefillConfig] | None = None) -> PrefillConfig:
    """The tuned launch for the shortest swept length >= max_q_len (the longest beyond them);
    the default launch when nothing was measured. Short prompts want small query tiles (less
    masked work on the diagonal), long ones large tiles (more reuse of each key tile)."""
    table = TUNED_CONFIGS if table is None else table
    if not table:
        return PrefillConfig()
    return table[min((length for length in table if length >= max_q_len), default=max(table))]


# Nothing here that changes from step to step may select a compiled variant: the block
# tables' row stride (the step's longest table; Triton keys integers on == 1 and % 16) and
# the addresses of the per-sequence arrays, which a mixed step passes as slices past its
# decode rows (Triton keys pointers on 16-byte alignment: rows % 4 for int32). Specialized,
# they compiled two new variants in the middle of every first timed run (the bench's
# per-pass compile counts, session 15). They are read once per program: no vector loads
# to gain.
@triton.jit(do_not_specialize=["stride_bt_seq"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr", "key_ends_ptr"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    key_ends_ptr,
    out_ptr,
    scale_log2,
    window,
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
    SLIDING: tl.constexpr,
    HAS_KEY_ENDS: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    # The last query tiles see the most keys: launching them first keeps the GPU's final
    # wave short on long prompts.
    query_tile = tl.num_programs(0) - 1 - tl.program_id(0)
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

    first_pos = prefix_len + first_query
    if HAS_KEY_ENDS:
        key_end = tl.load(key_ends_ptr + q_start + offs_m, mask=offs_m < q_len, other=0)
        key_end = tl.where(offs_m < q_len, key_end, query_pos + 1)  # padding rows: causal, never past the tile
        tiles_end = tl.minimum(context_len, tl.max(key_end, 0))
    else:
        key_end = query_pos + 1
        tiles_end = tl.minimum(context_len, first_pos + BLOCK_M)
    # Keys below the tile's first query position are visible to all its rows (causal side).
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    tiles_start = 0
    edge_end = 0
    if SLIDING:  # keys >= the last row's window start are visible to every row (window side)
        tiles_start = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        edge_end = tl.minimum(tl.cdiv(tl.maximum(first_pos + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, tiles_end)
        edge_end = tl.maximum(edge_end, tiles_start)
        window_start = query_pos - window + 1
        for tile_start in range(tiles_start, edge_end, BLOCK_N):
            offs_n = tile_start + tl.arange(0, BLOCK_N)
            visible = (offs_n[None, :] >= window_start[:, None]) & (offs_n[None, :] < key_end[:, None]) & (offs_n[None, :] < context_len)
            acc, m_i, l_i = attend_paged_tile(
                q, acc, m_i, l_i, k_head, v_head, block_table_row, tile_start, offs_n, offs_d, context_len,
                visible, scale_log2,
                stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
                PAGE_SIZE, HEAD_DIM, True, TILE_IN_PAGE,
            )  # fmt: skip
    middle_start = edge_end if SLIDING else 0
    for tile_start in range(middle_start, unmasked_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_head, v_head, block_table_row, tile_start, offs_n, offs_d, context_len,
            None, scale_log2,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, False, TILE_IN_PAGE,
        )  # fmt: skip
    for tile_start in range(tl.maximum(middle_start, unmasked_end), tiles_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] < key_end[:, None]) & (offs_n[None, :] < context_len)
        if SLIDING:
            visible = visible & (offs_n[None, :] >= window_start[:, None])
        acc, m_i, l_i = attend_paged_tile(
            q, acc, m_i, l_i, k_head, v_head, block_table_row, tile_start, offs_n, offs_d, context_len,
            visible, scale_log2,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            PAGE_SIZE, HEAD_DIM, True, TILE_IN_PAGE,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # padding rows past a window's end see no key
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
    window: int = 0,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q[total_q_tokens, q_heads, head_dim]` over each sequence's paged context.

    cu_seqlens_q int32 `[num_seqs + 1]` delimits the sequences' queries; context_lens int32
    counts each sequence's cached tokens including this step's; max_q_len (a host int, so no
    device sync) bounds the launch grid. `window` > 0: a sliding window; `key_ends` int32
    `[total_q_tokens]`: query i sees keys < key_ends[i] (each at least its position + 1).
    `config` None: the measured launch for max_q_len (`choose_prefill_config`).
    """
    config = config or choose_prefill_config(max_q_len)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if cu_seqlens_q.dtype != torch.int32 or (key_ends is not None and key_ends.dtype != torch.int32):
        raise ValueError("cu_seqlens_q and key_ends must be int32")
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
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        key_ends if key_ends is not None else context_lens, out,
        softmax_scale * LOG2_E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP_SIZE=num_q_heads // num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SLIDING=window > 0, HAS_KEY_ENDS=key_ends is not None, TILE_IN_PAGE=page_size % config.block_n == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
