"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Fusing saves a full read and write of the hidden states per norm; the rounding points
match Hugging Face's Qwen2/Llama RMSNorm (see `reference.rms_norm_ref`), or with `offset`
Gemma's: the weight applied as (1 + w), in fp32, and one rounding at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options, pdl_launch


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
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
    tl.store(out_ptr + row * stride_out + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl_max_rows: int = 0,
    offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise each row of `x[..., hidden]`; with `residual`, return `(norm(x + residual), x + residual)`.
    `pdl_max_rows`: see `pdl.pdl_launch`; `offset`: Gemma's (1 + weight)."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        residual2d = residual.reshape(-1, hidden).contiguous()
        residual_out = torch.empty_like(out)
    else:
        residual2d = residual_out = out  # placeholders, never touched
    if x2d.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, residual2d, weight, out, residual_out,
            x2d.stride(0), residual2d.stride(0), out.stride(0), residual_out.stride(0),
            eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, OFFSET=offset,
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl_launch(x2d, pdl_max_rows)),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)
