"""The experts of a mixture-of-experts layer (Qwen3-VL-MoE's sparse block) as grouped GEMMs.

Given each token's top-k experts and routing weights (from `moe_routing.route_topk` or
torch, exactly as transformers routes), four launches do the rest:

1. `moe_align` (moe_align.py): the (token, slot) pairs are sorted by expert and each
   expert's run is padded to a multiple of BLOCK_M, so every M block of the GEMMs belongs to one expert. Only
   experts that received a token get blocks: at decode batch 1 with top-8 there are exactly
   8 blocks, and no program is launched for the 120 idle experts' weights.
2. `expert_gate_up`: `x @ W_gate_up[e].T` per block with SiLU(gate) * up in the epilogue.
3. `expert_down`: `act @ W_down[e].T` per block, times the pair's routing weight.
4. `sum_slots`: each token's k weighted expert outputs summed in float32, in slot order
   (deterministic, no atomics), rounded once.

For a handful of tokens (BLOCK_M 1 in the config) two launches do it all: `pair_gate_up`
gives each (token, slot) pair its own programs (a GEMV, nothing to sort), and `token_down`
gives each token's programs its k experts' down rows, summed in the kernel. At batch 1,
reading the 8 experts takes ~18 us at copy bandwidth, so each launch's fixed cost (a few
us of ramp, tail and gap between kernels) counts; an expert that two pairs chose is read
twice, which costs little while few tokens share one. Each of the two is a GEMV or (a
tile's `mma_rows`) a tensor-core variant whose weight tiles stream through Triton's
cp.async pipeline, optionally with each program's whole weight slice asked of L2 up front
(`prefetch`), and the down GEMV may split a token's k slots over k programs (`split_slots`);
the table says which, per stage and token count.

A decode step is bound by reading the weights of the experts its tokens chose (9.4 MB an
expert at the 30B-A3B shapes), so the work depends on bytes, not FLOPs: grids are sized
from the worst case of the token count alone (fixed shapes for CUDA graphs; programs past
the real number of blocks exit at once), nothing waits on the host, and the tile shapes
come from a table measured on the H200 (`vlmbatch bench moe`, kept in fused_moe_tuned.json
and read by moe_tiles.py), keyed by the token count.
Rounding follows transformers' module (see `reference.fused_moe_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import quantize_fp8, split_buffers
from .moe_align import ExpertBlocks, moe_align
from .moe_tiles import FP8_BLOCK, GemmTile, MoeConfig, choose_config, fp8_tile
from .pdl import follow_previous, launch_options, pdl_launch

_FP8_BLOCK = tl.constexpr(FP8_BLOCK)  # FP8 expert weights' 128 x 128 scale blocks, readable inside the kernels

_SUM_ELEMENTS = 2048  # of a sum_slots program: [tokens, hidden] tile

# The kernels' relative L2 error against `reference.fused_moe_ref`: both round at the same
# points (gate, up, SiLU, their product, each weighted expert output, the sum) and differ
# only in the order of their float32 additions (~1e-6 relative), which moves a rounding by
# one ulp only where a value lies that close to a rounding boundary. So the error stays
# well under the dtype's unit roundoff (2^-9 in bf16, 2^-11 in fp16), the bound used.
REL_L2_BOUND = {torch.float32: 1e-5, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-9}
# FP8 experts against `reference.fused_moe_fp8_ref` (same quantized inputs and weights):
# bf16's rounding plus the rare value that a different float32 order moves across an e4m3
# rounding step of the activations between the GEMMs (1/16 of itself).
FP8_REL_L2_BOUND = 1e-2


# Bulk L2 prefetches (sm_90) go in pieces of about this many bytes of a weight row.
_PREFETCH_PIECE_BYTES = 512


def prefetch_pieces(weight: torch.Tensor, enabled: bool) -> int:
    """Pieces per weight row of `_prefetch_l2` (a power of two whose byte size is a multiple
    of 16 at 16-byte-aligned addresses), or 0: no prefetch (not asked for, not on a CUDA
    device, e.g. under the interpreter, or rows the bulk copy engine cannot address)."""
    row_bytes = weight.shape[-1] * weight.element_size()
    if not (enabled and weight.is_cuda) or row_bytes % 16 or (weight.stride(1) * weight.element_size()) % 16 or weight.data_ptr() % 16:
        return 0
    pieces = 1
    while pieces * 2 <= row_bytes // _PREFETCH_PIECE_BYTES and (row_bytes // 16) % (pieces * 2) == 0:
        pieces *= 2
    return pieces


@triton.jit
def _prefetch_l2(row_ptrs, row_elems, element_bytes: tl.constexpr, PIECES: tl.constexpr):
    """Ask L2 for the rows at `row_ptrs` ([R, C]) of `row_elems` elements, PIECES bulk
    prefetches a row (`cp.async.bulk.prefetch.L2`: no registers, nothing to wait for)."""
    piece = row_elems // PIECES
    piece_ptrs = row_ptrs[:, :, None] + (tl.arange(0, PIECES) * piece)[None, None, :]
    nbytes = tl.zeros(piece_ptrs.shape, dtype=tl.int32) + piece * element_bytes
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r", [piece_ptrs, nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _expert_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, routing_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, num_blocks, N, K, num_experts,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    PAIRS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr, PAIR_BLOCKS: tl.constexpr, PREFETCH: tl.constexpr = 0,
    FP8_A: tl.constexpr = False,
):  # fmt: skip
    """out[pair, n] = A[pair // PAIRS_PER_A_ROW] . W[expert(pair), n] over one BLOCK_M block of
    one expert. GATED: W holds [gate; up] (N rows each) and out = SiLU(gate) * up, rounded
    where transformers rounds; WEIGHTED: out = routing[pair] * the product, rounded once.
    FP8_A (with FP8_W, K steps inside one 128-column group): A is e4m3 too, with one float32
    scale per row and 128 columns at `as_ptr`; each step's e4m3 product (FP8 tensor cores)
    is added times its activation and weight scales, as block-wise FP8 checkpoints define
    the layer (`activation_scheme: dynamic`).
    PAIR_BLOCKS (few tokens, no sort): block b is pair b alone (row 0 of the tile, the other
    rows masked) and `expert_ids_ptr` is the flat top-k ids; sorted_ptr and num_padded_ptr
    are not read, and a pair whose id is outside [0, num_experts) is skipped."""
    if PDL:  # (tested here too: under the interpreter each jit call costs ~5 ms a program)
        follow_previous(PDL)
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N  # (tl.cdiv, sigmoid: jit calls, see above)
    if PAIR_BLOCKS:
        pid_m = pid // num_n
        pid_n = pid % num_n
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        if PREFETCH:  # this program's gate and up rows, whole (rows past N: the last row again)
            rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            halves = tl.arange(0, 2).to(tl.int64)[:, None] * N
            _prefetch_l2(w_ptr + expert * stride_we + (halves + rows[None, :]) * stride_wn, K, w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH)
    else:
        # GROUP_M blocks in a row share each weight strip while it is in L2 (prefill: many
        # blocks per expert); with GROUP_M 1 a block's strips follow each other (decode).
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_rows
        pid_n = (pid % group) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n[None, :] < N
    a_ptrs = a_ptr + (pairs // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] view of W rows
    up_offset = N.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        # Weights masked only along the dimensions that need it: unmasked loads vectorise.
        if EVEN_K:
            w_mask = n_mask
        else:
            w_mask = (offs_k[:, None] < k_left) & n_mask
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FP8_A:  # e4m3 x e4m3 on the tensor cores; the step's scales applied to its float32 product
            a_s = tl.load(as_ptr + (pairs // PAIRS_PER_A_ROW).to(tl.int64) * stride_asm + (k * BLOCK_K) // _FP8_BLOCK,
                          mask=pair_mask, other=0.0)
            s_ptrs = ws_ptr + expert * stride_wse + (k * BLOCK_K) // _FP8_BLOCK
            w_s = tl.load(s_ptrs + (offs_n[None, :] // SCALE_ROWS) * stride_wsn, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s)
        elif FP8_W:  # e4m3 weights times their 128x128 block scales, rounded to the activations' dtype
            if BLOCK_K <= _FP8_BLOCK:  # the step lies inside one 128-column block: one row of scales, broadcast
                s_mask = n_mask
                s_ptrs = ws_ptr + expert * stride_wse + (k * BLOCK_K) // _FP8_BLOCK
            else:
                s_mask = (offs_k[:, None] < k_left) & n_mask
                s_ptrs = ws_ptr + expert * stride_wse + (k * BLOCK_K + offs_k[:, None]) // _FP8_BLOCK
            w = (w.to(tl.float32) * tl.load(s_ptrs + (offs_n[None, :] // SCALE_ROWS) * stride_wsn, mask=s_mask, other=0.0)).to(a.dtype)
        if not FP8_A:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K and EVEN_N:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            if FP8_A:
                up_scales = tl.load(s_ptrs + ((offs_n[None, :] + N) // SCALE_ROWS) * stride_wsn, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, w_up) * (a_s[:, None] * up_scales)
            else:
                if FP8_W:
                    up_scales = tl.load(s_ptrs + ((offs_n[None, :] + N) // SCALE_ROWS) * stride_wsn, mask=s_mask, other=0.0)
                    w_up = (w_up.to(tl.float32) * up_scales).to(a.dtype)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    elif WEIGHTED:
        result = (acc * tl.load(routing_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]).to(dtype)
    else:
        result = acc.to(dtype)
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result, mask=pair_mask[:, None] & n_mask)


def _check_row_major(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the expert kernels need activations and weights [experts, N, K] contiguous along K")


def _scale_args(weight: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int]:
    """(scale tensor, its expert and row strides, weight rows per scale row) of FP8 expert
    weights; placeholders (the weight itself) when the weights are not FP8."""
    if scales is None:
        return weight, 0, 0, 1
    if scales.dim() != 3 or scales.shape[0] != weight.shape[0] or scales.shape[-1] != triton.cdiv(weight.shape[-1], FP8_BLOCK):
        raise ValueError(f"FP8 expert scales {tuple(scales.shape)} do not fit weights {tuple(weight.shape)} in {FP8_BLOCK}-blocks")
    return scales, scales.stride(0), scales.stride(1), 1 if scales.shape[1] == weight.shape[1] else FP8_BLOCK


def _launch_expert_gemm(
    a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, routing: torch.Tensor | None, blocks: ExpertBlocks | torch.Tensor,
    n: int, pairs_per_a_row: int, gated: bool, tile: GemmTile, pdl: bool = False, scales: torch.Tensor | None = None,
    a_scales: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`blocks`: the sorted expert blocks, or the flat top-k ids for one block a pair
    (PAIR_BLOCKS, BLOCK_M = tile.mma_rows). `a_scales`: `a` is e4m3 with these float32
    [rows, ceil(K / 128)] scales (FP8 weights only; the tile's K steps then divide 128)."""
    _check_row_major(a, weight)
    if a_scales is not None and (scales is None or FP8_BLOCK % tile.block_k or isinstance(blocks, torch.Tensor)):
        raise ValueError(f"e4m3 activations need FP8 weights, grouped blocks and K steps dividing {FP8_BLOCK}, not {tile.block_k}")
    k = weight.shape[-1]
    pair_blocks = isinstance(blocks, torch.Tensor)
    prefetch = 0
    if pair_blocks:
        ids = blocks
        num_blocks, block_m, sorted_pairs, expert_ids, num_padded = ids.numel(), tile.mma_rows, ids, ids, ids
        prefetch = prefetch_pieces(weight, bool(tile.prefetch))
    else:
        num_blocks, block_m = blocks.expert_ids.numel(), blocks.block_m
        sorted_pairs, expert_ids, num_padded = blocks.sorted_pairs, blocks.expert_ids, blocks.num_padded
    grid = (num_blocks * triton.cdiv(n, tile.block_n),)
    ws, stride_wse, stride_wsn, scale_rows = _scale_args(weight, scales)
    _expert_gemm_kernel[grid](
        a, a_scales if a_scales is not None else ws, weight, ws, out, routing if routing is not None else out, sorted_pairs,
        expert_ids, num_padded, out.shape[0], num_blocks, n, k, weight.shape[0],
        a.stride(0), a_scales.stride(0) if a_scales is not None else 0, weight.stride(0), weight.stride(1), stride_wse, stride_wsn,
        out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row, GATED=gated, WEIGHTED=routing is not None,
        EVEN_K=k % tile.block_k == 0, EVEN_N=n % tile.block_n == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        FP8_W=scales is not None, SCALE_ROWS=scale_rows, PAIR_BLOCKS=pair_blocks, PREFETCH=prefetch, FP8_A=a_scales is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )  # fmt: skip


def expert_gate_up(hidden: torch.Tensor, w_gate_up: torch.Tensor, blocks: ExpertBlocks, top_k: int, tile: GemmTile,
                   pdl: bool = False, scales: torch.Tensor | None = None, hidden_scales: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """SiLU(x W_gate[e].T) * (x W_up[e].T) for every pair: [tokens * k, intermediate], row
    `token * k + slot`; `w_gate_up` is [experts, 2 * intermediate, hidden] (gate rows first),
    the layout of transformers' `gate_up_proj`. `hidden_scales`: `hidden` is e4m3 with these
    per-128-column scales, and the result is `out_dtype`."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    intermediate = w_gate_up.shape[1] // 2
    act = torch.empty(hidden.shape[0] * top_k, intermediate, dtype=out_dtype or hidden.dtype, device=hidden.device)
    _launch_expert_gemm(hidden, w_gate_up, act, None, blocks, intermediate, top_k, True, tile, pdl, scales, hidden_scales)
    return act


def expert_down(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, blocks: ExpertBlocks, tile: GemmTile,
                pdl: bool = False, scales: torch.Tensor | None = None, act_scales: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """routing weight * (act W_down[e].T) for every pair: [tokens * k, hidden]; `w_down` is
    [experts, hidden, intermediate] (transformers' `down_proj`). `act_scales`: `act` is e4m3
    with these per-128-column scales, and the result is `out_dtype`."""
    out = torch.empty(act.shape[0], w_down.shape[1], dtype=out_dtype or act.dtype, device=act.device)
    _launch_expert_gemm(act, w_down, out, topk_weights.reshape(-1), blocks, w_down.shape[1], 1, False, tile, pdl, scales, act_scales)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _sum_slots_kernel(
    per_pair_ptr, ids_ptr, out_ptr, num_tokens, H, num_experts,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (tokens[:, None] < num_tokens) & (offs[None, :] < H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = tokens * TOP_K + slot
        expert = tl.load(ids_ptr + pair, mask=tokens < num_tokens, other=-1)
        taken = (expert >= 0) & (expert < num_experts)  # a pair placed on no expert adds nothing
        acc += tl.load(per_pair_ptr + pair[:, None] * H + offs[None, :], mask=mask & taken[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * H + offs[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots(per_pair: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, pdl: bool = False) -> torch.Tensor:
    """[tokens * k, hidden] -> [tokens, hidden]: each token's k expert outputs added in
    float32 in slot order and rounded once (deterministic, unlike atomic adds)."""
    num_tokens, top_k = topk_ids.shape
    hidden = per_pair.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    block_h = min(_SUM_ELEMENTS, triton.next_power_of_2(hidden))
    block_t = min(_SUM_ELEMENTS // block_h, triton.next_power_of_2(max(1, num_tokens)))
    if num_tokens:
        _sum_slots_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))](
            per_pair, topk_ids.contiguous(), out, num_tokens, hidden, num_experts,
            TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, **launch_options(pdl),
        )  # fmt: skip
    return out


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, ids_ptr, act_ptr, N, K, num_experts,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr,
):  # fmt: skip
    """act[pair, n] = SiLU(x W_gate[e].T) * (x W_up[e].T) for one pair and BLOCK_N columns:
    a GEMV over the expert's weight rows (contiguous along K), rounded as the GEMM rounds."""
    if PDL:
        follow_previous(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):  # no expert: its row is never read
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[:, None] < N
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_offset = N.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask & k_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        w_up = tl.load(w_rows + up_offset + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if FP8_W:  # dequantized as the grouped GEMM does: times the block scale, rounded to the activations' dtype
            s_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + offs_k[None, :] // _FP8_BLOCK
            w = (w * tl.load(s_ptrs + (offs_n[:, None] // SCALE_ROWS) * stride_wsn, mask=w_mask, other=0.0)).to(x_ptr.dtype.element_ty).to(tl.float32)
            up_scales = tl.load(s_ptrs + ((offs_n[:, None] + N) // SCALE_ROWS) * stride_wsn, mask=w_mask, other=0.0)
            w_up = (w_up * up_scales).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w * x, axis=1)
        acc_up += tl.sum(w_up * x, axis=1)
    dtype = act_ptr.dtype.element_ty
    gate = acc.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, (silu * acc_up.to(dtype).to(tl.float32)).to(dtype), mask=offs_n < N)


@triton.jit
def _token_down_kernel(
    act_ptr, w_ptr, ws_ptr, ids_ptr, routing_ptr, out_ptr, N, K, num_experts,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr,
):  # fmt: skip
    """out[token, n] = the sum over its k slots of round(routing * act[pair] W_down[e].T): the
    down GEMV and the per-token sum in one pass, rounded where the grouped path rounds. The
    slots are a dimension of the tile, so one token's k experts stream in parallel."""
    if PDL:
        follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS)
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=-1)
    taken = (experts >= 0) & (experts < num_experts)  # no expert: nothing read, nothing added
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.where(taken, experts, 0).to(tl.int64)[:, None, None] * stride_we + offs_n.to(tl.int64)[None, :, None] * stride_wn
    a_rows = act_ptr + pairs[:, None] * stride_am
    row_mask = taken[:, None, None] & (offs_n[None, :, None] < N)
    acc = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=taken[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w_mask = row_mask & k_mask[None, None, :]
        w = tl.load(w_rows + offs_k[None, None, :], mask=w_mask, other=0.0).to(tl.float32)
        if FP8_W:
            s_ptrs = (ws_ptr + tl.where(taken, experts, 0).to(tl.int64)[:, None, None] * stride_wse
                      + (offs_n[None, :, None] // SCALE_ROWS) * stride_wsn + offs_k[None, None, :] // _FP8_BLOCK)
            w = (w * tl.load(s_ptrs, mask=w_mask, other=0.0)).to(act_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
    weights = tl.load(routing_ptr + pairs, mask=taken, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    per_slot = (acc * weights[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, tl.sum(per_slot, axis=0).to(dtype), mask=offs_n < N)


@triton.jit(do_not_specialize=["num_tokens"])
def _token_down_split_kernel(
    act_ptr, w_ptr, ws_ptr, ids_ptr, routing_ptr, out_ptr, partial_ptr, count_ptr, N, K, num_experts, num_tokens,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr,
):  # fmt: skip
    """`_token_down_kernel` with a token's k slots in k programs: each streams BLOCK_N
    contiguous rows of one expert and stores its weighted product, rounded where the grouped
    path rounds it, in float32; the last of the k to arrive (an acq_rel counter per output
    tile) adds the k in slot order, writes the token's rows and resets the counter, so
    every launch sums alike. k times the per-token kernel's programs: more bytes in flight
    while a few tokens cannot fill the GPU."""
    if PDL:
        follow_previous(PDL)
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    token = (tile // n_tiles).to(tl.int64)
    offs_n = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    pair = token * TOP_K + slot
    expert = tl.load(ids_ptr + pair)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if (expert >= 0) & (expert < num_experts):  # no expert: its share is 0
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(act_ptr + pair * stride_am + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            if FP8_W:  # as `_token_down_kernel` dequantizes
                s_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + (offs_n[:, None] // SCALE_ROWS) * stride_wsn + offs_k[None, :] // _FP8_BLOCK
                w = (w * tl.load(s_ptrs, mask=w_mask, other=0.0)).to(act_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        acc = (acc * tl.load(routing_ptr + pair).to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(partial_ptr + (slot * num_tokens + token) * N + offs_n, acc, mask=n_mask)
    tl.debug_barrier()  # every thread's share is written before the arrival is released
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k_slot in range(TOP_K):  # slot order, whoever arrived last
            total += tl.load(partial_ptr + (k_slot * num_tokens + token) * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _token_down_mma_kernel(
    act_ptr, w_ptr, ws_ptr, ids_ptr, routing_ptr, out_ptr, N, K, num_experts,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, FP8_W: tl.constexpr, SCALE_ROWS: tl.constexpr, PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    """`_token_down_kernel` on tensor cores: one loop over the token's k slots x the K steps,
    so that the weight tiles of all k experts stream through one software pipeline
    (num_stages deep) instead of k short ones. Row 0 of each [BLOCK_M, BLOCK_K] A tile is the
    pair's activations, the other rows are masked; at a slot's last K step its product is
    weighted, rounded (as the grouped path rounds it) and added to the token's float32 sum
    in slot order, so the result is deterministic."""
    if PDL:
        follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS)
    experts = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=-1)
    taken = (experts >= 0) & (experts < num_experts)  # no expert: nothing read, nothing added
    experts = tl.where(taken, experts, 0).to(tl.int64)
    weights = tl.load(routing_ptr + token * TOP_K + slots, mask=taken, other=0.0).to(tl.float32)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:  # the k experts' rows of this program, whole (no expert: expert 0's, unread)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        _prefetch_l2(w_ptr + experts[:, None] * stride_we + rows[None, :] * stride_wn, K, w_ptr.dtype.element_ty.primitive_bitwidth // 8, PREFETCH)
    n_mask = offs_n[None, :] < N
    offs_k = tl.arange(0, BLOCK_K)
    first_row = (tl.arange(0, BLOCK_M) == 0)[:, None]
    num_k = (K + BLOCK_K - 1) // BLOCK_K
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, TOP_K * num_k):
        slot = step // num_k
        k0 = (step - slot * num_k) * BLOCK_K
        this = slots == slot
        expert = tl.sum(tl.where(this, experts, 0), axis=0)  # registers, not a dependent load
        used = tl.sum(tl.where(this, taken.to(tl.int32), 0), axis=0) > 0
        k_mask = (offs_k < K - k0)[None, :]
        a = tl.load(act_ptr + (token * TOP_K + slot) * stride_am + k0 + offs_k[None, :] + 0 * first_row,
                    mask=first_row & k_mask & used, other=0.0)  # fmt: skip
        w_mask = n_mask & (offs_k < K - k0)[:, None] & used
        w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [K, N] view of W rows
        w = tl.load(w_rows + k0 + offs_k[:, None], mask=w_mask, other=0.0)
        if FP8_W:  # as the grouped GEMM dequantizes: times the block scale, rounded to the activations' dtype
            s_ptrs = ws_ptr + expert * stride_wse + (offs_n[None, :] // SCALE_ROWS) * stride_wsn + (k0 + offs_k[:, None]) // _FP8_BLOCK
            w = (w.to(tl.float32) * tl.load(s_ptrs, mask=w_mask, other=0.0)).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        last = k0 + BLOCK_K >= K
        weight = tl.sum(tl.where(this, weights, 0.0), axis=0)
        total += tl.where(last, (acc * weight).to(dtype).to(tl.float32), 0.0)
        acc = tl.where(last, 0.0, acc)
    result = tl.sum(tl.where(first_row, total, 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + offs_n, result.to(dtype), mask=offs_n < N)


def pair_gate_up(hidden: torch.Tensor, w_gate_up: torch.Tensor, topk_ids: torch.Tensor, tile: GemmTile,
                 pdl: bool = False, scales: torch.Tensor | None = None) -> torch.Tensor:
    """`expert_gate_up` without the sort: programs per (token, slot) pair and BLOCK_N columns."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    _check_row_major(w_gate_up)
    num_experts, two_i, k = w_gate_up.shape
    ids = topk_ids.reshape(-1)
    act = torch.empty(ids.numel(), two_i // 2, dtype=hidden.dtype, device=hidden.device)
    if tile.mma_rows:  # the grouped GEMM, one block a pair: nothing to sort
        if ids.numel():
            _launch_expert_gemm(hidden, w_gate_up, act, None, ids, two_i // 2, topk_ids.shape[1], True, tile, pdl, scales)
        return act
    ws, stride_wse, stride_wsn, scale_rows = _scale_args(w_gate_up, scales)
    if ids.numel():
        _pair_gate_up_kernel[(ids.numel(), triton.cdiv(two_i // 2, tile.block_n))](
            hidden, w_gate_up, ws, ids, act, two_i // 2, k, num_experts,
            hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), stride_wse, stride_wsn, act.stride(0),
            TOP_K=topk_ids.shape[1], BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, FP8_W=scales is not None, SCALE_ROWS=scale_rows,
            num_warps=tile.num_warps, **launch_options(pdl),
        )  # fmt: skip
    return act


def token_down(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, tile: GemmTile,
               pdl: bool = False, scales: torch.Tensor | None = None) -> torch.Tensor:
    """`expert_down` and `sum_slots` in one launch: programs per token and BLOCK_N columns
    (and per slot with `tile.split_slots`)."""
    _check_row_major(act, w_down)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, k = w_down.shape
    out = torch.empty(num_tokens, hidden, dtype=act.dtype, device=act.device)
    ws, stride_wse, stride_wsn, scale_rows = _scale_args(w_down, scales)
    strips = triton.cdiv(hidden, tile.block_n)
    if not num_tokens:
        return out
    if tile.mma_rows:
        _token_down_mma_kernel[(num_tokens, strips)](
            act, w_down, ws, topk_ids.contiguous(), topk_weights.contiguous(), out, hidden, k, num_experts,
            act.stride(0), w_down.stride(0), w_down.stride(1), stride_wse, stride_wsn, out.stride(0),
            TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), BLOCK_M=tile.mma_rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            DOT_PRECISION="ieee" if act.dtype == torch.float32 else "tf32", FP8_W=scales is not None, SCALE_ROWS=scale_rows,
            PREFETCH=prefetch_pieces(w_down, bool(tile.prefetch)), num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
        )  # fmt: skip
    elif tile.split_slots and (workspace := split_buffers(act.device, top_k * num_tokens * hidden, num_tokens * strips)):
        _token_down_split_kernel[(num_tokens * strips, top_k)](
            act, w_down, ws, topk_ids.contiguous(), topk_weights.contiguous(), out, *workspace, hidden, k, num_experts, num_tokens,
            act.stride(0), w_down.stride(0), w_down.stride(1), stride_wse, stride_wsn, out.stride(0),
            TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, FP8_W=scales is not None, SCALE_ROWS=scale_rows,
            num_warps=tile.num_warps, **launch_options(pdl),
        )  # fmt: skip
    else:  # the unsplit GEMV, also where the split's workspace cannot be had (first sized inside a capture: `fp8.split_buffers`)
        _token_down_kernel[(num_tokens, strips)](
            act, w_down, ws, topk_ids.contiguous(), topk_weights.contiguous(), out, hidden, k, num_experts,
            act.stride(0), w_down.stride(0), w_down.stride(1), stride_wse, stride_wsn, out.stride(0),
            TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            FP8_W=scales is not None, SCALE_ROWS=scale_rows,
            num_warps=tile.num_warps, **launch_options(pdl),
        )  # fmt: skip
    return out


def fused_moe(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: MoeConfig | None = None, pdl_max_rows: int = 0,
    gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The experts' output [tokens, hidden] for `hidden` [tokens, hidden] routed to `topk_ids`
    [tokens, k] with `topk_weights` [tokens, k]; the same as `reference.fused_moe_ref`.

    Weights are laid out as transformers' Qwen3-VL-MoE experts hold them: `w_gate_up`
    [experts, 2 * intermediate, hidden], `w_down` [experts, hidden, intermediate]. Ids outside
    [0, experts) (e.g. -1 on a captured batch's padding rows) take no expert and add zero.
    Capturable in a CUDA graph: no host synchronisation, shapes fixed by the token count.
    `pdl_max_rows`: see `pdl.pdl_launch` (decided once, for the token count, for every kernel here).
    FP8 experts (block-wise checkpoints): float8_e4m3fn weights with float32 `*_scales`
    [experts, ceil(rows / 128) or rows, ceil(K / 128)]. The grouped GEMMs (prefill, larger
    decode batches) quantize each GEMM's input per token and 128 columns and multiply e4m3 by
    e4m3 on the tensor cores (`reference.fused_moe_fp8_ref` with `fp8_activations`); the
    per-pair GEMVs of a few tokens, bound by reading the weights, dequantize each weight tile
    in registers (times its block scale, rounded to the activations' dtype) and keep the
    activations as they are (`reference.fused_moe_fp8_ref`).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    config = config or choose_config(num_tokens, hidden.shape[1], intermediate, num_experts, top_k, fp8=gate_up_scales is not None)
    pdl = pdl_launch(hidden, pdl_max_rows)
    if config.block_m == 1:
        act = pair_gate_up(hidden, w_gate_up, topk_ids, config.gate_up, pdl, gate_up_scales)
        return token_down(act, w_down, topk_weights, topk_ids, config.down, pdl, down_scales)
    blocks = moe_align(topk_ids, num_experts, config.block_m, pdl)
    if gate_up_scales is None:
        act = expert_gate_up(hidden, w_gate_up, blocks, top_k, config.gate_up, pdl)
        per_pair = expert_down(act, w_down, topk_weights, blocks, config.down, pdl)
    else:  # w8a8: each GEMM's input quantized per token and 128 columns, as the checkpoint format says
        hidden_q, hidden_s = quantize_fp8(hidden, FP8_BLOCK, pdl_max_rows)
        act = expert_gate_up(hidden_q, w_gate_up, blocks, top_k, fp8_tile(config.gate_up, gated=True), pdl, gate_up_scales, hidden_s,
                             hidden.dtype)  # fmt: skip
        act_q, act_s = quantize_fp8(act, FP8_BLOCK, pdl_max_rows)
        per_pair = expert_down(act_q, w_down, topk_weights, blocks, fp8_tile(config.down, gated=False), pdl, down_scales, act_s, hidden.dtype)
    return sum_slots(per_pair, topk_ids, num_experts, pdl)
