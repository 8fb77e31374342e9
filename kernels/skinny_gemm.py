"""Linear layers of decode steps: `x @ W.T (+ b)` for few rows of `x` and a large weight.

A decode step multiplies at most a few dozen token rows by each weight matrix, so the
product is bound by reading the weight once. cuBLAS picks tiles made for square problems
and reaches 1.3-1.7 TB/s on the small attention projections of a 3B model on an H200
(BENCHMARKS.md). Here each program streams a narrow strip of output features
(`block_n` weight rows) over the whole reduction dimension, so the grid has enough
programs to keep every SM loading without splitting K (no partial sums, no second
kernel), and the few token rows ride along as the M side of `tl.dot`, padded to 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options, pdl_launch

MAX_ROWS = 64  # beyond this the product stops being weight-bound: cuBLAS serves it


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape (swept on the H200 by `vlmbatch bench kernels`)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[:, None] < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask, other=0.0) if not EVEN_N else tl.load(w_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask & k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask & (offs_n[None, :] < N))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None,
                  pdl_max_rows: int = 0) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x` [M, K] with M <= MAX_ROWS; float32 is exact
    (no TF32), as `F.linear` is by default."""
    config = config or SkinnyConfig()
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows and a row-major weight: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out,
        num_rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl_launch(x, pdl_max_rows)),
    )  # fmt: skip
    return out
