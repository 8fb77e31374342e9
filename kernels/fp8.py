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

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .decode_attention import H200_SM_COUNT, sm_count
from .pdl import follow_previous, launch_options, pdl_launch

FP8_MAX = 448.0
MIN_SCALE = 1e-12  # amax floor: an all-zero group gets a tiny scale, not a division by zero
BLOCK_GROUP = 128  # the block layouts' activation group (1x128) and weight block (128x128)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One group of `BLOCK_M` rows per program: a 128-column group is 256 bytes of a row, far
    too little work for a program of its own."""
    follow_previous(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    start = group * GROUP
    row_mask = rows < M
    rows = rows.to(tl.int64)
    amax = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
    for offset in range(0, GROUP, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & ((cols < K) & (cols < start + GROUP))[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=1), MIN_SCALE_C) / FP8_MAX_C
    for offset in range(0, GROUP, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & ((cols < K) & (cols < start + GROUP))[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale[:, None], -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + group, scale, mask=row_mask)


# Elements of a quantization program's tile: 16 rows of a 128-column group (4 KiB of bf16),
# or 2 rows of a per-token row in 1,024-column steps.
QUANTIZE_TILE = 2048


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
    block_m = min(max(1, QUANTIZE_TILE // block), triton.next_power_of_2(rows))
    _quantize_kernel[(triton.cdiv(rows, block_m), num_groups)](
        x, q, s, rows, k, x.stride(0), q.stride(0), s.stride(0),
        GROUP=group, BLOCK=block, BLOCK_M=block_m, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        num_warps=4 if block_m * block >= 512 else 1, **launch_options(pdl_launch(x, pdl_max_rows)),
    )  # fmt: skip
    return q, s


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch shape of the FP8 GEMMs. `block_k` applies to per-channel weights; block weights
    always step by their activation group (128). `split_k` > 1 cuts K's steps into that many
    contiguous ranges, one program each per output tile (`_fp8_decode_kernel`); the last of
    a tile's programs to finish adds the partial sums in range order (deterministic)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


def default_config(rows: int) -> Fp8GemmConfig:
    """Tiles by batch rows when the weight's shape is not known. Up to 64 rows the product
    streams the weight (a decode step): 32-column strips as in the bf16 skinny GEMM, 256-byte
    K steps (`decode_plan` refines this per shape from the H200 measurements). Prefill takes
    128x128 tiles."""
    if rows <= DECODE_MAX_ROWS:
        return decode_config(rows, block_n=32, block_k=256, num_warps=4)
    return Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def decode_config(rows: int, block_n: int, block_k: int, num_warps: int, split_k: int = 1) -> Fp8GemmConfig:
    """A weight-streaming tile for at most 64 rows: the row tile follows the rows (16, 32 or 64)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return Fp8GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=4, split_k=split_k)


# What `vlmbatch bench kernels --sections fp8` times beside `decode_plan`'s choice, up to 64 rows,
# each after a separate quantization: (block_n, block_k, num_warps) unsplit, and (block_n,
# block_k, num_warps, split_k) split over K.
FP8_DECODE_TILES = ((32, 128, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (128, 128, 4), (64, 256, 8))
FP8_SPLIT_TILES = (
    (32, 128, 4, 2), (32, 128, 4, 4), (32, 256, 4, 2), (32, 256, 4, 4), (32, 512, 4, 2), (32, 512, 4, 4),
    (64, 256, 4, 2), (128, 128, 4, 4),
)  # fmt: skip

# ---- The decode selection table ---------------------------------------------------------------
#
# What `fp8_linear` runs for at most DECODE_MAX_ROWS rows, per (rows, N, K, layout): `decode_plan`'s
# launch of the GEMM, after `quantize_fp8`. Its tiles follow `vlmbatch bench kernels --sections fp8`
# on the H200 (benchmarks/2026-12-02/s8-fp8-kernels.log; unsplit, per channel, us per layer):
# - 512-column K steps for a long K (down, K 11008 / 18944), at 1 / 16 / 64 rows: 3B 21.1 / 20.0 /
#   18.1 against 22.7 / 21.1 / 19.4 with 256; 7B 39.6 / 38.4 / 36.5 against 43.2 / 42.1 / 40.9;
# - 128-column K steps for gate/up at 1 / 16 rows: 3B 17.1 / 17.2 against 17.6 / 18.7; 7B 40.9 /
#   42.3 against 43.9 / 43.2 (the LM heads, 152k rows, were faster with 256: 82.0 vs 84.5 ...);
# - 128x128 tiles at 64 rows for gate/up and the LM heads (32-column strips read the 64 input
#   rows once per 32 weight rows): 3B gate/up 18.4 against 22.0, LM head 94.1 against 115.0; 7B
#   49.0 against 50.6 and 154.2 against 179.6;
# - otherwise 32-column strips with 256-column K steps: best or within 2.5% for q/k/v, o and the
#   LM heads at 1 and 16 rows and the 3B q/k/v and o at 64 (7B q/k/v at 64: 11.3, 64-column
#   strips 10.75).
# Its split over K follows the same section's run on the 3B layers (benchmarks/2026-12-02/
# s9-fp8-3b-gemms.log; per channel, 132 SMs, us per layer; 32-column strips make 80 output tiles
# for q/k/v, 64 for o and down, 688 and more for gate/up and the LM head):
# - at 1 row more K ranges were faster up to 4, the most timed: q/k/v (256-column steps) 7.55
#   unsplit, 7.43 in 2, 7.07 in 4; o 7.36, 6.96 in 3, 6.52 in 4; down (512) 20.85, 14.98 in 3,
#   14.04 in 4 (13.33 with 256-column steps in 4). Gate/up, whose tiles fill the GPU, lost: 16.9
#   unsplit, 19.9-21.1 in 2 or 4 (128-column steps). Hence, up to 16 rows, as many ranges as give every SM two
#   programs, at most 4 (16 rows were not timed);
# - at 64 rows only the long K gained, in 2 ranges: down 14.40 against 18.09 unsplit, 19.02 in 3
#   and 19.21 in 4 (its 64x512 tile takes 192 KiB of shared memory compiled for sm_90: one program
#   per SM, so more than 132 programs run in two waves); q/k/v 7.14 unsplit against 8.61 in 2, o
#   6.98 against 7.21. Hence, above 16 rows, 2 ranges for K >= LONG_K only.
# The GEMM that quantized its own input (removed) lost at the plan's tiles everywhere, 1.4-2.8x per
# token (3B gate/up at 1 row 47.99 against 16.88 with a separate quantization, the LM head 194.4
# against 82.8); only 4-range tiles in 1x128 groups on q/k/v and o at 1 row beat the plan's, by
# under 1 us. Its plan made the FP8 decode step at batch 1 4.1 ms, against 2.77 before it.
DECODE_MAX_ROWS = 64
LARGE_N = 16384  # gate/up (22016, 37888) and LM heads: enough 32-column strips to fill the GPU
VOCAB_N = 65536  # LM heads (151936, 152064)
LONG_K = 8192  # down projections (11008, 18944)
SPLIT_MAX_ROWS = 16  # up to here any layer whose tiles leave SMs idle splits; above, only a long K
MAX_SPLIT_K = 4  # the most ranges timed (and the fastest at 1 row)
LONG_K_MAX_SPLIT = 2  # above SPLIT_MAX_ROWS: 3 or 4 ranges lost to 2 at 64 rows


def decode_plan(rows: int, n: int, k: int, per_token: bool, num_sms: int = H200_SM_COUNT) -> Fp8GemmConfig:
    """The GEMM's launch for `rows` <= DECODE_MAX_ROWS: the decode selection table (the
    measurements are in the comment above it).

    Tile: 128x128 above 16 rows when N >= LARGE_N; else 32-column strips with K steps of 256
    columns per token (512 when K >= LONG_K, 128 for LARGE_N <= N < VOCAB_N), of 128 (the
    group) for block weights. The row tile follows the rows (`decode_config`).

    Split over K, only when the output tiles leave SMs idle: up to SPLIT_MAX_ROWS rows, as
    many ranges as give every SM two programs (4 for the 3B q/k/v's 80 tiles on 132 SMs),
    at most MAX_SPLIT_K; above, LONG_K_MAX_SPLIT ranges where K >= LONG_K, none otherwise.
    Always >= 2 K steps per range, and partial sums (written and read once: 8 bytes per
    row, column and range) within half the weight's bytes, i.e. at most K / (16 x rows)."""
    if rows > 16 and n >= LARGE_N:
        block_n, block_k = 128, 128
    elif not per_token:
        block_n, block_k = 32, 128
    else:
        block_n, block_k = 32, 512 if k >= LONG_K else 128 if LARGE_N <= n < VOCAB_N else 256
    tiles = triton.cdiv(rows, decode_config(rows, block_n, block_k, 4).block_m) * triton.cdiv(n, block_n)
    most = MAX_SPLIT_K if rows <= SPLIT_MAX_ROWS else LONG_K_MAX_SPLIT if k >= LONG_K else 1
    split = 1
    if tiles < num_sms:
        split = min(triton.cdiv(2 * num_sms, tiles), most, max(1, triton.cdiv(k, block_k) // 2), max(1, k // (16 * rows)))
    return decode_config(rows, block_n, block_k, 4, split)


# ---- Split-K workspace ------------------------------------------------------------------------
#
# Partial sums (float32 [split, M, N]) and one arrival counter per output tile, per device. A
# split launch leaves every counter at 0 (the last arrival resets its tile's), so one zeroed
# buffer serves every later launch. Buffers are never freed or replaced (a CUDA graph keeps the
# addresses it captured), only added when a launch needs more, and never during a capture: a
# launch captured before its size was ever run eagerly runs unsplit instead. Split launches on
# two streams of one device at once would share the buffers: the engine runs one stream. The
# fused MoE's slot-split down kernel (`fused_moe._token_down_split_kernel`) takes them too.
_SPLIT_WORKSPACE: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def split_buffers(device: torch.device, partials: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    held = _SPLIT_WORKSPACE.setdefault(device, [])
    if held and held[-1][0].numel() >= partials and held[-1][1].numel() >= tiles:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    last_partials, last_tiles = (held[-1][0].numel(), held[-1][1].numel()) if held else (0, 0)
    held.append((torch.empty(max(partials, 2 * last_partials, 1 << 20), dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, 2 * last_tiles, 4096), dtype=torch.int32, device=device)))  # fmt: skip
    return held[-1]


@triton.jit
def _decode_epilogue(acc, a_scale, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_wsn, stride_om,
                     SCALE_ROWS: tl.constexpr, PER_ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Per-token x per-channel scales (in `_fp8_gemm_kernel`'s order), the bias, one rounding."""
    if PER_ROW_SCALES:
        acc = acc * a_scale[:, None] * tl.load(ws_ptr + (offs_n // SCALE_ROWS) * stride_wsn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


@triton.jit
def _fp8_decode_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, partial_ptr, count_ptr,
    M, N, K, k_steps_per_split,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    SCALE_ROWS: tl.constexpr, PER_ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`_fp8_gemm_kernel` split over K, for decode sizes: program `pid` computes range
    `pid % SPLIT_K` of K's steps of tile `pid // SPLIT_K`, stores its float32 partial sum,
    and the tile's last program to arrive (an acq_rel counter) adds all SPLIT_K partials in
    range order, applies the scales and bias, and resets the counter for the next launch.
    SPLIT_K == 1 (where `_launch_decode` falls back) is the plain product."""
    follow_previous(PDL)
    pid = tl.program_id(0)
    tile, split = pid // SPLIT_K, pid % SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // num_n, tile % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    ws_ptrs = ws_ptr + (offs_n // SCALE_ROWS) * stride_wsn
    a_scale = tl.load(as_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)  # per token (for groups, reloaded at each step)
    k_begin = split * k_steps_per_split
    k_end = tl.minimum(k_begin + k_steps_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(k_begin, k_end):
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (offs_k < K)[None, :]
            a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
        if PER_ROW_SCALES:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            a_scale = tl.load(as_ptr + offs_m * stride_asm + step, mask=m_mask, other=0.0)
            w_s = tl.load(ws_ptrs + step, mask=n_mask, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_s[None, :]
    if SPLIT_K == 1:
        _decode_epilogue(acc, a_scale, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_wsn, stride_om,
                         SCALE_ROWS, PER_ROW_SCALES, HAS_BIAS)  # fmt: skip
    else:
        part_rows = offs_m[:, None] * N + offs_n[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(partial_ptr + split * M * N + part_rows, acc, mask=mn_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is released
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # range order, whoever arrived last: the same sum every launch
                total += tl.load(partial_ptr + s * M * N + part_rows, mask=mn_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            _decode_epilogue(total, a_scale, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_wsn, stride_om,
                             SCALE_ROWS, PER_ROW_SCALES, HAS_BIAS)  # fmt: skip


def split_ranges(k_steps: int, split_k: int) -> tuple[int, int]:
    """(ranges, K steps per range) of a split of `k_steps` into at most `split_k` ranges, none empty."""
    per_split = triton.cdiv(k_steps, max(1, min(split_k, k_steps)))
    return triton.cdiv(k_steps, per_split), per_split


def decode_kernel_constants(k: int, block_k: int, config: Fp8GemmConfig, split: int, *, per_row: bool, scale_rows: int,
                            has_bias: bool) -> dict:  # fmt: skip
    """The constexpr arguments of one `_fp8_decode_kernel` launch but PDL (`launch_options`);
    the sm_90 compile test builds the kernel from these."""
    return dict(SCALE_ROWS=scale_rows, PER_ROW_SCALES=per_row, HAS_BIAS=has_bias, SPLIT_K=split, EVEN_K=k % block_k == 0,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k)  # fmt: skip


def _launch_decode(a: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, per_row: bool, scale_rows: int, block_k: int, config: Fp8GemmConfig, pdl: bool) -> None:  # fmt: skip
    """`_fp8_decode_kernel` on `a` (e4m3 with scales `a_s`), writing `out`; the split over K
    as `config` asks where the workspace allows (else unsplit, on the same kernel)."""
    rows, k = a.shape
    n = w_q.shape[0]
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n)
    k_steps = triton.cdiv(k, block_k)
    split, per_split = split_ranges(k_steps, config.split_k)
    partials = counts = out
    if split > 1 and split * rows * n >= 1 << 31:  # partial offsets are int32 in the kernel: decode sizes are far below
        split, per_split = 1, k_steps
    if split > 1:
        buffers = split_buffers(a.device, split * rows * n, tiles)
        if buffers is None:
            split, per_split = 1, k_steps
        else:
            partials, counts = buffers
    constants = decode_kernel_constants(k, block_k, config, split, per_row=per_row, scale_rows=scale_rows, has_bias=bias is not None)
    _fp8_decode_kernel[(tiles * split,)](
        a, a_s, w_q, w_s, bias if bias is not None else w_s, out, partials, counts,
        rows, n, k, per_split,
        a.stride(0), a_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
        **constants, num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )  # fmt: skip


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
             out_dtype: torch.dtype = torch.bfloat16, group: int = BLOCK_GROUP, config: Fp8GemmConfig | None = None,
             pdl_max_rows: int = 0) -> torch.Tensor:  # fmt: skip
    """`out [M, N]` of quantized activations (`a_q` [M, K], `a_s` [M, groups]) and a
    quantized weight (`w_q` [N, K], `w_s` [ceil(N / scale_rows), groups]). One group per
    row (`a_s.shape[1] == 1`): per-token x per-channel scales; else groups of `group`
    columns with `scale_rows = group` weight rows per scale (or 1: per-row block scales,
    from fusing projections whose sizes are not multiples of 128). Without a `config`, up to
    DECODE_MAX_ROWS rows take `decode_plan`'s launch; a split over K runs `_fp8_decode_kernel`."""
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
    if config is None:
        config = decode_plan(rows, n, k, per_row, sm_count(a_q.device)) if rows <= DECODE_MAX_ROWS else default_config(rows)
    block_k = config.block_k if per_row else group
    pdl = pdl_launch(a_q, pdl_max_rows)
    if config.split_k > 1:
        _launch_decode(a_q, a_s, w_q, w_s, bias, out, per_row, scale_rows, block_k, config, pdl)
        return out
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


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None, group: int | None = None,
               out_dtype: torch.dtype | None = None, pdl_max_rows: int = 0) -> torch.Tensor:  # fmt: skip
    """`x @ dequant(w_q, w_s).T + bias` with `x` quantized per token (`group` None) or per
    token and `group` columns, on the Triton kernels: `quantize_fp8`, then `fp8_gemm` with
    `decode_plan`'s launch up to DECODE_MAX_ROWS rows, its prefill tiles above. What
    `Fp8Linear` runs off cuBLAS."""
    q, s = quantize_fp8(x, group, pdl_max_rows)
    return fp8_gemm(q, s, w_q, w_s, bias, out_dtype or x.dtype, group or BLOCK_GROUP, pdl_max_rows=pdl_max_rows)


def scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, bias_in_gemm: bool = False) -> torch.Tensor:  # fmt: skip
    """The per-token x per-channel product through cuBLAS (`torch._scaled_mm`, rowwise
    scales): needs K and N multiples of 16 and a bf16 output. The bias goes into the GEMM's
    epilogue where `scaled_mm_takes_bias` found that this torch build takes it, else it is
    added after (one more pass over the output)."""
    fused = bias if bias_in_gemm and bias is not None and bias.dtype == out_dtype else None
    out = torch._scaled_mm(a_q, w_q.t(), scale_a=a_s, scale_b=w_s.reshape(1, -1), bias=fused, out_dtype=out_dtype)
    return out if bias is None or fused is not None else out.add_(bias)


@functools.cache
def scaled_mm_takes_bias(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` with rowwise scales adds a bf16 bias in its epilogue on
    `device` (not every torch and cuBLAS pairing accepts it): one 16x16x16 product, checked
    against the bias added after."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    w = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    scales, bias = torch.ones(16, 1, device=device), torch.arange(16, device=device, dtype=torch.bfloat16)
    try:
        fused = torch._scaled_mm(a, w.t(), scale_a=scales, scale_b=scales.reshape(1, -1), bias=bias, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError):
        return False
    return bool(torch.equal(fused, torch.full((16, 16), 16.0, device=device, dtype=torch.bfloat16) + bias))


def scaled_mm_supported(n: int, k: int) -> bool:
    return n % 16 == 0 and k % 16 == 0


def scaled_mm_blocks(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """The 1x128-group x 128x128-block product through cuBLAS (`torch._scaled_mm` with
    block scales: cuBLAS >= 12.9 on sm_90), a candidate for prefill-sized block products,
    where the Triton block GEMM ran 1.3-2.7x slower than bf16 on the H200 and cuBLAS's
    rowwise FP8 1.1-1.5x faster (benchmarks/2026-12-02/s8-fp8-kernels.log). `torch` takes
    the activation scales [M, K/128] outer-dim-major (column-major) and the weight's
    [N/128, K/128] row-major as the transpose of B's; `vlmbatch bench kernels --sections
    fp8` times it ("fp8 block cublas") before the engine uses it. Refused where K/128 is not
    a multiple of 4: there the H200's cuBLAS returned a wrong product instead of an error
    (the 3B down, K = 11008, at 2,048 rows; BENCHMARKS.md session 10)."""
    groups = a_q.shape[-1] // 128
    if groups % 4:
        raise RuntimeError(f"block-scaled cuBLAS FP8 product not taken for K = {a_q.shape[-1]}: K/128 = {groups} is not a multiple of 4")
    out = torch._scaled_mm(a_q, w_q.t(), scale_a=a_s.t().contiguous().t(), scale_b=w_s.t(), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)
