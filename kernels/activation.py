"""SiLU(gate) * up of a fused gate/up projection, as one kernel on the GPU.

In PyTorch this is two elementwise kernels with a full intermediate tensor between them
(measured ~0.2 ms of a 3.4 ms batch-64 decode step of the 3B shapes on the H200). The
Triton kernel reads gate and up once and rounds like PyTorch (SiLU rounded to the input
dtype before the product), so results match the torch path
(`vlmbatch.engine.layers.activation.silu_and_mul`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options, pdl_launch

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def fused_silu_and_mul(gate_up: torch.Tensor, pdl_max_rows: int = 0) -> torch.Tensor:
    """`gate_up` [..., 2 * n] -> silu(gate) * up [..., n] in one Triton kernel (GPU, or the CPU under TRITON_INTERPRET=1)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[-1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, _BLOCK))](rows, out, n, rows.stride(0), out.stride(0), BLOCK=_BLOCK, **launch_options(pdl_launch(rows, pdl_max_rows)))
    return out.view(*gate_up.shape[:-1], n)
