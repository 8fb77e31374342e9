"""FP8 (e4m3) products: dynamic activation quantization and a scaled GEMM for both layouts.

A weight is `w_q` (float8_e4m3fn, [N, K]) times `w_s`, one float32 scale per block of
`scale_rows` rows by `group` columns: 128x128 in block-wise checkpoints (Qwen's `-FP8`),
1 row by K columns for per-channel ones (`-FP8-dynamic`, online quantization). The
activation is quantized as the step runs, one scale per token and group of `group`
columns (1x128 for blocks; the whole row, per token, for channels), so

    out[m, n] = sum over groups g of  a_s[m, g] * w_s[n // scale_rows, g] * (a_q[m, g] . w_q[n, g])

with each group's dot accumulated in float32. `fp8_gemm` takes any such pair; for
per-channel weights `torch._scaled_mm` (cuBLAS) computes the same thing, and which of the
two runs is the engine's choice (`engine/kernel_choice.py`). The references are
`quantize_fp8_ref` / `fp8_gemm_ref` in `reference.py`.

Under the Triton interpreter the fp8 `tl.dot` is exact, but its float32 -> e4m3 cast
rounds some values differently from torch's round-to-nearest-even (seen: 1.989 -> 1.0):
the quantization kernel is exact on the GPU, approximate on the CPU (tests say which).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options, pdl_launch

FP8_MAX = 448.0
MIN_SCALE = 1e-12  # amax floor: an all-zero group gets a tiny scale, not a division by zero


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * GROUP
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, GROUP, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = (cols < K) & (cols < start + GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_SCALE_C) / FP8_MAX_C
    for offset in range(0, GROUP, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = (cols < K) & (cols < start + GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_fp8(x: torch.Tensor, group: int | None = None, pdl_max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K], scales float32 [M, ceil(K / group)]) of `x` [M, K]:
    each token's groups of `group` columns (None: the whole row) scaled so their largest
    magnitude is 448. `x ≈ x_q * scale` per group."""
    rows, k = x.shape
    group = group or k
    num_groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(triton.next_power_of_2(group), 1024)
    _quantize_kernel[(rows, num_groups)](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
        GROUP=group, BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        num_warps=4 if block >= 512 else 1, **launch_options(pdl_launch(x, pdl_max_rows)),
    )  # fmt: skip
    return q, s


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch shape of `fp8_gemm`. `block_k` applies to per-channel weights; block weights
    always step by their activation group (128)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def default_config(rows: int) -> Fp8GemmConfig:
    """Tiles by batch rows. Up to 64 rows the product streams the weight (a decode step):
    32-column strips as in the bf16 skinny GEMM (`skinny_gemm.SkinnyConfig`, swept on the
    H200), so even a 2048-row projection spreads over 64 programs, and 256-byte K steps (the
    128-column tiles of 2026-12-01 left a 2048-row projection 16 programs at 64 rows: FP8
    decode ran at 26-29% of its roofline, slower than bf16). Prefill takes 128x128 tiles.
    Not yet swept for FP8: `vlmbatch bench kernels --sections fp8` times these against
    `FP8_DECODE_TILES`."""
    if rows <= 64:
        return decode_config(rows, block_n=32, block_k=256, num_warps=4)
    return Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def decode_config(rows: int, block_n: int, block_k: int, num_warps: int) -> Fp8GemmConfig:
    """A weight-streaming tile for at most 64 rows: the row tile follows the rows."""
    return Fp8GemmConfig(block_m=16 if rows <= 16 else 64, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=4)


# (block_n, block_k, num_warps) of the decode tiles the kernel benchmark times beside `default_config`.
FP8_DECODE_TILES = ((32, 128, 4), (32, 512, 4), (64, 256, 4), (128, 128, 4), (64, 256, 8))


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    SCALE_ROWS: tl.constexpr, PER_ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    as_ptrs = as_ptr + offs_m * stride_asm
    ws_ptrs = ws_ptr + (offs_n // SCALE_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k[None, :] < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask, other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask, other=0.0)
        if PER_ROW_SCALES:  # one scale per token and per output channel: applied once, after
            acc = tl.dot(a, tl.trans(w), acc)
        else:  # one scale per 1xBLOCK_K activation group and weight block
            a_s = tl.load(as_ptrs + k, mask=m_mask, other=0.0)
            w_s = tl.load(ws_ptrs + k, mask=n_mask, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PER_ROW_SCALES:
        acc = acc * tl.load(as_ptrs, mask=m_mask, other=0.0)[:, None] * tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, group: int = 128, config: Fp8GemmConfig | None = None,
             pdl_max_rows: int = 0) -> torch.Tensor:  # fmt: skip
    """`out [M, N]` of quantized activations (`a_q` [M, K], `a_s` [M, groups]) and a
    quantized weight (`w_q` [N, K], `w_s` [ceil(N / scale_rows), groups]). One group per
    row (`a_s.shape[1] == 1`): per-token x per-channel scales; else groups of `group`
    columns with `scale_rows = group` weight rows per scale (or 1: per-row block scales,
    from fusing projections whose sizes are not multiples of 128)."""
    rows, k = a_q.shape
    n = w_q.shape[0]
    per_row = a_s.shape[1] == 1 and w_s.shape[1] == 1
    scale_rows = 1 if w_s.shape[0] == n else group
    if w_q.shape[1] != k or w_q.stride(-1) != 1 or a_q.stride(-1) != 1:
        raise ValueError(f"fp8_gemm takes row-major a {tuple(a_q.shape)} and w {tuple(w_q.shape)} of equal K")
    if not per_row and (a_s.shape[1] != triton.cdiv(k, group) or w_s.shape != (triton.cdiv(n, scale_rows), triton.cdiv(k, group))):
        raise ValueError(f"fp8_gemm scales {tuple(a_s.shape)} / {tuple(w_s.shape)} do not fit groups of {group} of K={k}, N={n}")
    out = torch.empty(rows, n, dtype=out_dtype, device=a_q.device)
    if rows == 0:
        return out
    config = config or default_config(rows)
    block_k = config.block_k if per_row else group
    pdl = pdl_launch(a_q, pdl_max_rows)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](
        a_q, a_s, w_q, w_s, bias if bias is not None else w_s, out,
        rows, n, k,
        a_q.stride(0), a_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
        SCALE_ROWS=scale_rows, PER_ROW_SCALES=per_row, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )  # fmt: skip
    return out


def scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """The per-token x per-channel product through cuBLAS (`torch._scaled_mm`, rowwise
    scales): needs K and N multiples of 16 and a bf16 output. The bias is added after
    (rowwise scaling with a bias is not accepted by every torch/cuBLAS pairing)."""
    out = torch._scaled_mm(a_q, w_q.t(), scale_a=a_s, scale_b=w_s.reshape(1, -1), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)


def scaled_mm_supported(n: int, k: int) -> bool:
    return n % 16 == 0 and k % 16 == 0
