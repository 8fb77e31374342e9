"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Fusing saves a full read and write of the hidden states per norm; the rounding points
match Hugging Face's Qwen2/Llama RMSNorm (see `reference.rms_norm_ref`), or with `offset`
Gemma's: the weight applied as (1 + w), in fp32, and one rounding at the end.

`rms_norm_fp8` writes the normalised rows straight as FP8 (e4m3) with their scales, for
an FP8 projection that takes them next: the values `quantize_fp8` would make of
`rms_norm`'s output, bit for bit, without writing and re-reading that output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE
from .pdl import follow_previous, launch_options, pdl_launch


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    scale_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_scale,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add is rounded to the model dtype first, as the unfused layer does.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        out = (xf * inv_rms) * (1.0 + weight)
    else:
        out = (xf * inv_rms).to(x.dtype).to(tl.float32) * weight
    if FP8_GROUP:  # quantize the output as rounded to the model dtype, per group of FP8_GROUP columns
        groups = tl.reshape(out.to(x.dtype).to(tl.float32), [BLOCK // FP8_GROUP, FP8_GROUP])
        scale = tl.maximum(tl.max(tl.abs(groups), axis=1), MIN_SCALE_C) / FP8_MAX_C
        q = tl.reshape(tl.clamp(groups / scale[:, None], -FP8_MAX_C, FP8_MAX_C), [BLOCK])
        tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        group_ids = tl.arange(0, BLOCK // FP8_GROUP)
        tl.store(scale_ptr + row * stride_scale + group_ids, scale, mask=group_ids * FP8_GROUP < HIDDEN)
    else:
        tl.store(out_ptr + row * stride_out + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl_max_rows: int = 0,
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise each row of `x[..., hidden]`; with `residual`, return `(norm(x + residual), x + residual)`.
    `pdl_max_rows`: see `pdl.pdl_launch`; `offset`: Gemma's (1 + weight)."""
    out, _, residual_out = _launch(x, weight, eps, residual, pdl_max_rows, offset, fp8_group=None)
    return out if residual is None else (out, residual_out)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, group: int | None = None,
    pdl_max_rows: int = 0, offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, hidden], scales float32 [M, groups], x + residual (x without one))
    of `x` [M, hidden]: `quantize_fp8(rms_norm(...), group)` in one kernel (`group` None: one
    scale per token, as per-channel FP8 layers take it; 128: block-wise checkpoints')."""
    q, scales, residual_out = _launch(x, weight, eps, residual, pdl_max_rows, offset, fp8_group=group or x.shape[-1])
    return q, scales, x if residual is None else residual_out


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, pdl_max_rows: int, offset: bool,
            fp8_group: int | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """(output: as x, or [M, hidden] in FP8; the FP8 scales or None; x + residual, or a placeholder without a residual)."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    block = triton.next_power_of_2(hidden)
    if fp8_group:
        if fp8_group == hidden:
            fp8_group = block  # one group over the whole (padded) row
        elif block % fp8_group:
            raise ValueError(f"FP8 groups of {fp8_group} columns must divide the row block {block}")
        out = torch.empty(x2d.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(x2d.shape[0], triton.cdiv(hidden, fp8_group), dtype=torch.float32, device=x.device)
    else:
        out, scales = torch.empty(x2d.shape, dtype=x.dtype, device=x.device), None
    if residual is not None:
        residual2d = residual.reshape(-1, hidden).contiguous()
        residual_out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    else:
        residual2d = residual_out = x2d  # placeholders, never touched
    scale_arg = scales if scales is not None else out  # a placeholder without FP8
    if x2d.shape[0]:
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, residual2d, weight, out, scale_arg, residual_out,
            x2d.stride(0), residual2d.stride(0), out.stride(0), scale_arg.stride(0), residual_out.stride(0),
            eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, OFFSET=offset, FP8_GROUP=fp8_group or 0,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl_launch(x2d, pdl_max_rows)),
        )  # fmt: skip
    return out.view(x2d.shape if fp8_group else x.shape), scales, residual_out.view(x.shape)
