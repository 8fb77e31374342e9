"""Rotary position embedding (neox / rotate-half layout) on q and k in one launch.

cos/sin arrive gathered per token (`[num_tokens, head_dim]`); for M-RoPE the caller has
already interleaved the temporal/height/width sections into them, so the same kernel
serves Qwen2-VL's 3-D positions and plain 1-D RoPE. Computed in float32, rounded once.
`apply_rotary_and_store` also writes the rotated keys and the values into the paged KV
cache in the same launch: one kernel fewer per layer, which small-batch decode is made of.

`head_norms` (Qwen3, Gemma 3: an RMSNorm over each head of q and k before rotary) are
applied in the same launch, rounding where the unfused norm does (`reference.rms_norm_ref`):
unfused, each norm reads q or k as a strided view of the q/k/v projection, so it costs a
copy to make it contiguous, the norm's own pass, and a launch each (on the H200 a full
Qwen3-VL-8B prefill step took 398.5 ms unfused, 377.8 ms fused: BENCHMARKS.md session 13).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_cache_write import check_cache_write, to_cache
from .pdl import follow_previous, launch_options, pdl_launch


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_x_tok, stride_x_head, stride_o_tok, stride_o_head, token,
    cos1, cos2, sin1, sin2, offs_half, norm_ptr, eps,
    NUM_HEADS: tl.constexpr, HALF_DIM: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr, OFFSET_NORM: tl.constexpr,
):  # fmt: skip
    """out = x * cos + rotate_half(x) * sin for all heads of one token (with NORM, x each
    head RMS-normalised by `norm_ptr`'s weight first); returns both halves, rounded to the
    output dtype, for a caller that stores them elsewhere too."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    mask = (offs_h < NUM_HEADS) & (offs_half < HALF_DIM)
    first_ptrs = x_ptr + token * stride_x_tok + offs_h * stride_x_head + offs_half
    x1 = tl.load(first_ptrs, mask=mask, other=0.0)
    x2 = tl.load(first_ptrs + HALF_DIM, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF_DIM) + eps)[:, None]
        half_mask = offs_half < HALF_DIM
        w1 = tl.load(norm_ptr + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF_DIM + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        if OFFSET_NORM:  # Gemma: (1 + w) in fp32, one rounding
            x1f = (x1f * inv_rms * (1.0 + w1)).to(x1.dtype).to(tl.float32)
            x2f = (x2f * inv_rms * (1.0 + w2)).to(x1.dtype).to(tl.float32)
        else:  # Qwen3/Llama: the normalised value rounded, then the weight, rounded again
            x1f = ((x1f * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
            x2f = ((x2f * inv_rms).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    out1 = (x1f * cos1 - x2f * sin1).to(out_ptr.dtype.element_ty)
    out2 = (x2f * cos2 + x1f * sin2).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + token * stride_o_tok + offs_h * stride_o_head + offs_half
    tl.store(out_ptrs, out1, mask=mask)
    tl.store(out_ptrs + HALF_DIM, out2, mask=mask)
    return out1, out2, mask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_qo_tok, stride_qo_head, stride_ko_tok, stride_ko_head,
    stride_cos_tok, stride_sin_tok,
    stride_v_tok, stride_v_head, stride_cache_slot, stride_cache_head,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF_DIM: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE_KV: tl.constexpr, FP8_CACHE: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr, OFFSET_NORM: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    token = tl.program_id(0)
    offs_half = tl.arange(0, BLOCK_HALF)[None, :]
    half_mask = offs_half < HALF_DIM
    cos_row = cos_ptr + token * stride_cos_tok + offs_half
    sin_row = sin_ptr + token * stride_sin_tok + offs_half
    cos1 = tl.load(cos_row, mask=half_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF_DIM, mask=half_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=half_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF_DIM, mask=half_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head, token,
        cos1, cos2, sin1, sin2, offs_half, q_norm_ptr, eps, NUM_Q_HEADS, HALF_DIM, BLOCK_QH, NORM, OFFSET_NORM,
    )  # fmt: skip
    k1, k2, k_mask = _rotate_heads(
        k_ptr, k_out_ptr, stride_k_tok, stride_k_head, stride_ko_tok, stride_ko_head, token,
        cos1, cos2, sin1, sin2, offs_half, k_norm_ptr, eps, NUM_K_HEADS, HALF_DIM, BLOCK_KH, NORM, OFFSET_NORM,
    )  # fmt: skip
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_KH)[:, None]
            cache_offs = slot * stride_cache_slot + offs_h * stride_cache_head + offs_half
            tl.store(k_cache_ptr + cache_offs, to_cache(k1, k_cache_ptr, FP8_CACHE), mask=k_mask)
            tl.store(k_cache_ptr + cache_offs + HALF_DIM, to_cache(k2, k_cache_ptr, FP8_CACHE), mask=k_mask)
            v_ptrs = v_ptr + token * stride_v_tok + offs_h * stride_v_head + offs_half
            tl.store(v_cache_ptr + cache_offs, to_cache(tl.load(v_ptrs, mask=k_mask), v_cache_ptr, FP8_CACHE), mask=k_mask)
            tl.store(v_cache_ptr + cache_offs + HALF_DIM, to_cache(tl.load(v_ptrs + HALF_DIM, mask=k_mask), v_cache_ptr, FP8_CACHE),
                     mask=k_mask)


# (q weight [D], k weight [D], eps, offset): what `_launch` needs of q/k head norms
HeadNormWeights = tuple[torch.Tensor, torch.Tensor, float, bool]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pdl_max_rows: int = 0,
    head_norms: HeadNormWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[tokens, q_heads, D]` and k `[tokens, kv_heads, D]` by per-token cos/sin
    `[tokens, D]`; with `head_norms` (q weight, k weight, eps, offset), each head
    RMS-normalised first, as `rms_norm(x, weight, eps, offset=offset)` would."""
    return _launch(q, k, cos, sin, None, pdl_max_rows, head_norms)


def apply_rotary_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl_max_rows: int = 0,
    head_norms: HeadNormWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary`, and the rotated keys with `v` written into the paged cache at
    `slot_mapping` (int64, -1 = skip), as `store_kvcache` would."""
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    v = v if v.stride(-1) == 1 else v.contiguous()
    return _launch(q, k, cos, sin, (v, k_cache, v_cache, slot_mapping), pdl_max_rows, head_norms)


def _launch(q, k, cos, sin, store, pdl_max_rows: int, head_norms: HeadNormWeights | None) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or k.shape[::2] != q.shape[::2] or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"rotary shapes do not fit: q {tuple(q.shape)} k {tuple(k.shape)} cos {tuple(cos.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v, k_cache, v_cache, slot_mapping = store if store is not None else (k, k_out, k_out, k_out)  # placeholders when not storing
    q_norm, k_norm, eps, offset = head_norms if head_norms is not None else (cos, cos, 0.0, False)  # placeholders when not norming
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, cos, sin, q_out, k_out,
            v, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            v.stride(0), v.stride(1), k_cache.stride(-3), k_cache.stride(-2),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF_DIM=half,
            BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half), STORE_KV=store is not None,
            FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn, NORM=head_norms is not None, OFFSET_NORM=offset,
            **launch_options(pdl_launch(q, pdl_max_rows)),
        )  # fmt: skip
    return q_out, k_out
