"""SiLU(gate) * up (or GeGLU: gelu_tanh(gate) * up) of a fused gate/up projection, as one kernel on the GPU.

In PyTorch this is two elementwise kernels with a full intermediate tensor between them
(measured ~0.2 ms of a 3.4 ms batch-64 decode step of the 3B shapes on the H200). The
Triton kernel reads gate and up once and rounds like PyTorch (the activation rounded to
the input dtype before the product), so results match the torch path
(`vlmbatch.engine.layers.activation`) up to the last bits of tanh (computed here from exp2).

`gated_fp8` writes the product straight as FP8 (e4m3) with its scales, for the FP8 down
projection that takes it next: what `quantize_fp8` makes of the rounded product, bit for
bit, without writing and re-reading the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE
from .pdl import follow_previous, launch_options, pdl_launch

_BLOCK = 1024
# `gated_fp8` keeps a group of up to this many columns in registers and reads it once (16
# values of gate, up and product a thread at 8 warps); wider ones take two reads.
_ONE_READ_MAX = 4096
_GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi); a constexpr: compiled kernels may read no other globals
_TWO_LOG2_E = tl.constexpr(2.8853900817779268)  # 2 / ln(2)


@triton.jit
def _gated_product(gate_up_ptr, row, stride_in, n_cols, offs, mask, GELU: tl.constexpr):
    """act(gate) * up at columns `offs` of one row, rounded to the input dtype as PyTorch rounds it."""
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (1 + e^(2y))
        inner = _GELU_C * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp2(inner * _TWO_LOG2_E))
        act = 0.5 * gate * (1.0 + tanh)
    else:
        act = gate * tl.sigmoid(gate)
    dtype = gate_up_ptr.dtype.element_ty
    return (act.to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def _gated_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr, GELU: tl.constexpr,
                  PDL: tl.constexpr):
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    tl.store(out_ptr + row * stride_out + offs, _gated_product(gate_up_ptr, row, stride_in, n_cols, offs, mask, GELU), mask=mask)


@triton.jit
def _gated_fp8_kernel(gate_up_ptr, q_ptr, s_ptr, n_cols, stride_in, stride_q, stride_s, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr, GELU: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    """One (row, group of GROUP columns). A group that fits one BLOCK is read once and kept
    in registers; a wider one is read twice: its largest magnitude first, then the product
    again, scaled and stored (the second read mostly hits the L2 cache, but not all: the
    Qwen2.5-VL tower's 3,456-column rows ran at ~2.3 TB/s so, session 16)."""
    follow_previous(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = group * GROUP
    if BLOCK >= GROUP:
        offs = start + tl.arange(0, BLOCK)
        mask = (offs < n_cols) & (offs < start + GROUP)
        product = _gated_product(gate_up_ptr, row, stride_in, n_cols, offs, mask, GELU).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(product), axis=0), MIN_SCALE_C) / FP8_MAX_C
        q = tl.clamp(product / scale, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for offset in range(0, GROUP, BLOCK):
            offs = start + offset + tl.arange(0, BLOCK)
            mask = (offs < n_cols) & (offs < start + GROUP)
            amax = tl.maximum(amax, tl.abs(_gated_product(gate_up_ptr, row, stride_in, n_cols, offs, mask, GELU).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), MIN_SCALE_C) / FP8_MAX_C
        for offset in range(0, GROUP, BLOCK):
            offs = start + offset + tl.arange(0, BLOCK)
            mask = (offs < n_cols) & (offs < start + GROUP)
            product = _gated_product(gate_up_ptr, row, stride_in, n_cols, offs, mask, GELU).to(tl.float32)
            q = tl.clamp(product / scale, -FP8_MAX_C, FP8_MAX_C)
            tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + group, scale)


def fused_silu_and_mul(gate_up: torch.Tensor, pdl_max_rows: int = 0) -> torch.Tensor:
    """`gate_up` [..., 2 * n] -> silu(gate) * up [..., n] in one Triton kernel (GPU, or the CPU under TRITON_INTERPRET=1)."""
    return _gated(gate_up, pdl_max_rows, gelu=False)


def fused_gelu_tanh_and_mul(gate_up: torch.Tensor, pdl_max_rows: int = 0) -> torch.Tensor:
    """GeGLU as Gemma computes it: gelu(gate, tanh approximation) * up, in one kernel."""
    return _gated(gate_up, pdl_max_rows, gelu=True)


def _gated(gate_up: torch.Tensor, pdl_max_rows: int, gelu: bool) -> torch.Tensor:
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[-1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _gated_kernel[(rows.shape[0], triton.cdiv(n, _BLOCK))](rows, out, n, rows.stride(0), out.stride(0), BLOCK=_BLOCK,
                                                                GELU=gelu, **launch_options(pdl_launch(rows, pdl_max_rows)))
    return out.view(*gate_up.shape[:-1], n)


def gated_fp8(gate_up: torch.Tensor, group: int | None = None, gelu: bool = False,
              pdl_max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(q float8_e4m3fn [M, n], scales float32 [M, groups]) of `gate_up` [M, 2 * n]:
    `quantize_fp8(act(gate) * up, group)` in one kernel (`group` None: one scale per token)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[-1] // 2
    group = group or n
    q = torch.empty((rows.shape[0], n), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((rows.shape[0], triton.cdiv(n, group)), dtype=torch.float32, device=gate_up.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(group)
        block = block if block <= _ONE_READ_MAX else _BLOCK
        _gated_fp8_kernel[(rows.shape[0], scales.shape[1])](
            rows, q, scales, n, rows.stride(0), q.stride(0), scales.stride(0), GROUP=group, BLOCK=block, GELU=gelu,
            FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, num_warps=8 if block >= 4096 else 4 if block >= 512 else 1,
            **launch_options(pdl_launch(rows, pdl_max_rows)),
        )  # fmt: skip
    return q, scales
