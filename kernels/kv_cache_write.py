"""The KV-cache write: scatter this step's keys and values into their paged slots.

An FP8 cache (`--kv-cache-dtype fp8`, float8_e4m3fn) stores each value clamped to the
e4m3 range and rounded to nearest even, with a per-tensor scale of 1 (vLLM's default
without calibrated scales: keys and values of these models stay far inside +-448);
readers cast the tile back to the compute dtype before their dot products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


FP8_MAX = 448.0


@triton.jit
def to_cache(x, cache_ptr, FP8_CACHE: tl.constexpr):
    """`x` as the cache stores it: the cache's dtype, clamped to +-448 first for FP8."""
    if FP8_CACHE:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    cache_offs = slot * stride_cache_slot + offs_h * stride_cache_head + offs_d
    k = tl.load(k_ptr + token * stride_k_tok + offs_h * stride_k_head + offs_d, mask=mask)
    tl.store(k_cache_ptr + cache_offs, to_cache(k, k_cache_ptr, FP8_CACHE), mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + offs_h * stride_v_head + offs_d, mask=mask)
    tl.store(v_cache_ptr + cache_offs, to_cache(v, v_cache_ptr, FP8_CACHE), mask=mask)


def check_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What every kernel that writes this step's k/v into the paged cache requires."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must be contiguous and of the same shape")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match the cache {tuple(k_cache.shape)} and slot_mapping")
    if slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64")


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v `[num_tokens, kv_heads, head_dim]` into flat slots `slot_mapping` (int64; -1 = skip).

    k and v may be strided views (e.g. slices of a fused qkv projection) as long as each
    head's vector is contiguous; the caches must be contiguous.
    """
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn,
    )  # fmt: skip
