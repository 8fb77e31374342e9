"""The experts of a mixture-of-experts layer (Qwen3-VL-MoE's sparse block) as grouped GEMMs.

Given each token's top-k experts and routing weights (the router stays in torch, exactly as
transformers computes it), four launches do the rest:

1. `moe_align`: the (token, slot) pairs are sorted by expert and each expert's run is padded
   to a multiple of BLOCK_M, so every M block of the GEMMs belongs to one expert. Only
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
come from a table measured on the H200 (`vlmbatch bench moe`, kept in fused_moe_tuned.json),
keyed by the token count.
Rounding follows transformers' module (see `reference.fused_moe_ref`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8 import quantize_fp8, split_buffers
from .pdl import follow_previous, launch_options, pdl_launch

FP8_BLOCK = 128  # FP8 expert weights: one scale per 128 x 128 block
_FP8_BLOCK = tl.constexpr(FP8_BLOCK)  # the same, readable inside the kernels

# moe_align: up to this many (token, slot) pairs one program counts and places them all
# (one launch); beyond it each program takes a chunk and a first launch counts the chunks.
SINGLE_PROGRAM_PAIRS = 512
MIN_CHUNK_PAIRS = 512
MAX_CHUNKS = 128
_ALIGN_ROWS = 64  # pairs per step inside an align program ([rows, experts] one-hot tiles)
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


@dataclass(frozen=True)
class GemmTile:
    """Launch shape of one expert GEMM (BLOCK_M is shared by both and lives in MoeConfig).
    The per-pair kernels of BLOCK_M 1 use block_n, block_k and num_warps, and `mma_rows`:
    0 for the GEMV kernels (`_pair_gate_up_kernel`, `_token_down_kernel`), else the rows of
    the tensor-core tile of their MMA variants (one real row, the rest masked: the weight
    tiles then stream through the software pipeline, num_stages deep, as the grouped GEMMs'
    do, while no sort is needed). `prefetch` (MMA variants, on a CUDA device): each program
    first asks L2 for its whole weight slice (`_prefetch_l2`), so that all of its bytes are
    in flight at once rather than num_stages tiles of them. `split_slots` (the per-token
    down GEMV): 1 gives each of a token's k slots its own programs
    (`_token_down_split_kernel`), k times the programs, each streaming one expert's rows."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    mma_rows: int = 0
    prefetch: int = 0
    split_slots: int = 0


@dataclass(frozen=True)
class MoeConfig:
    """block_m: the rows of an expert block of the grouped GEMMs, or 1 for the per-pair kernels."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


# The tile table measured by `vlmbatch bench moe --write-table` (data beside this module):
# {"hidden,intermediate,num_experts,top_k": {"measured": ..., "configs": {tokens: config}}},
# and with block-FP8 experts (`--experts fp8-block`) under "hidden,...,top_k,fp8-block".
TUNED_TABLE_PATH = Path(__file__).with_name("fused_moe_tuned.json")
EXPERT_FORMATS = ("bf16", "fp8-block")  # the experts' weights a table was measured with


def config_from_json(entry: dict) -> MoeConfig:
    """One config of the tuned table (extra keys such as the measured time are notes)."""
    return MoeConfig(entry["block_m"], GemmTile(**entry["gate_up"]), GemmTile(**entry["down"]))


def table_key(shape: tuple[int, int, int, int], experts: str = "bf16") -> str:
    """The tuned table's key of a shape (hidden, intermediate, num_experts, top_k) and expert format."""
    return ",".join(str(part) for part in (*shape, *([experts] if experts != "bf16" else [])))


def load_tuned_configs(path: Path = TUNED_TABLE_PATH, experts: str = "bf16") -> dict[tuple[int, int, int, int], dict[int, MoeConfig]]:
    """The table of one expert format keyed by (hidden, intermediate, num_experts, top_k), then token count."""
    if not path.exists():
        return {}
    tables = json.loads(path.read_text())
    parsed = {}
    for key, table in tables.items():
        parts = key.split(",")
        if (parts.pop() if not parts[-1].isdigit() else "bf16") == experts:
            parsed[tuple(int(part) for part in parts)] = {int(n): config_from_json(entry) for n, entry in table["configs"].items()}
    return parsed


TUNED_CONFIGS = load_tuned_configs()
TUNED_FP8_CONFIGS = load_tuned_configs(experts="fp8-block")


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeConfig:
    """A reasonable launch for shapes the table lacks: BLOCK_M near the mean number of rows
    of an expert that has any (padding rows cost reads of nothing but MMA time), narrow
    weight strips while the product is bound by reading weights, square tiles once not."""
    pairs = num_tokens * top_k
    rows_per_expert = pairs / max(1, min(num_experts, pairs))
    if rows_per_expert <= 16:
        return MoeConfig(16, GemmTile(64, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTile(64, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if rows_per_expert <= 96:
        return MoeConfig(64, GemmTile(128, 64, 8, 4, 3), GemmTile(128, 64, 8, 4, 3))
    return MoeConfig(128, GemmTile(128, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))


def choose_config(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, fp8: bool = False) -> MoeConfig:
    """The tuned entry for the smallest swept token count >= num_tokens (the largest beyond
    them), or `default_config` for shapes that were never swept. FP8 experts take the table
    swept with them where there is one, else bf16's (its grouped tiles then go through
    `fp8_tile` at launch)."""
    shape = (hidden, intermediate, num_experts, top_k)
    table = (TUNED_FP8_CONFIGS.get(shape) if fp8 else None) or TUNED_CONFIGS.get(shape)
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    key = min((n for n in table if n >= num_tokens), default=max(table))
    return table[key]


class ExpertBlocks(NamedTuple):
    """The (token, slot) pairs sorted by expert, in BLOCK_M runs (fixed-size, worst-case buffers).

    `sorted_pairs[i]` is a flat pair index `token * top_k + slot`, or `num_pairs` in the
    padding of an expert's last block; `expert_ids[b]` is block b's expert (-1 past the
    used blocks); `num_padded[0]` is how many entries of `sorted_pairs` are used.
    """

    sorted_pairs: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks `num_pairs` pairs can need: each of n used experts rounds its
    run up, sum(ceil(c_e / B)) <= n + (pairs - n) // B, largest at n = min(experts, pairs)."""
    used = min(num_experts, num_pairs)
    return used + (num_pairs - used) // block_m


@triton.jit
def _load_ids(ids_ptr, offs, end, num_experts):
    """Expert ids at `offs` (< end), with -1 for ids outside [0, num_experts): they match no expert."""
    ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
    return tl.where((ids >= 0) & (ids < num_experts), ids, -1)


@triton.jit
def _count_pairs(ids_ptr, start, count, num_experts, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Pairs per expert among ids[start : start + count] ([E_PAD] int32)."""
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for step in range(0, count, ROWS):
        ids = _load_ids(ids_ptr, start + step + tl.arange(0, ROWS), start + count, num_experts)
        totals += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return totals


@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_chunks_kernel(ids_ptr, chunk_counts_ptr, num_pairs, chunk, num_experts, E_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    follow_previous(PDL)
    p = tl.program_id(0)
    start = p * chunk
    counts = _count_pairs(ids_ptr, start, tl.minimum(chunk, num_pairs - start), num_experts, E_PAD, ROWS)
    tl.store(chunk_counts_ptr + p * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks", "num_blocks"])
def _place_pairs_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, chunk, num_chunks, num_blocks, num_experts,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr, COUNT_HERE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program p places the pairs of its chunk: expert e's run starts at the padded total
    of experts < e; within it pairs keep their order (earlier chunks first, then the rank
    among this chunk's pairs of e). Program 0 also writes the padding sentinels, the block
    experts and the used length. Ids outside [0, E) match no expert and are never placed."""
    follow_previous(PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    start = p * chunk
    count = tl.minimum(chunk, num_pairs - start)
    if COUNT_HERE:  # a single program: the whole input is its chunk
        totals = _count_pairs(ids_ptr, 0, num_pairs, num_experts, E_PAD, ROWS)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        totals = tl.zeros([E_PAD], dtype=tl.int32)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)
        for q0 in range(0, num_chunks, ROWS):
            qs = q0 + tl.arange(0, ROWS)
            counts = tl.load(chunk_counts_ptr + qs[:, None] * E_PAD + experts[None, :], mask=qs[:, None] < num_chunks, other=0)
            totals += tl.sum(counts, axis=0)
            earlier += tl.sum(tl.where(qs[:, None] < p, counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    next_slot = ends - padded + earlier
    for step in range(0, count, ROWS):
        offs = start + step + tl.arange(0, ROWS)
        ids = _load_ids(ids_ptr, offs, start + count, num_experts)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1  # among this step's pairs of the same expert
        dest = tl.sum(onehot * (next_slot[None, :] + rank), axis=1)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=tl.sum(onehot, axis=1) > 0)
        next_slot += tl.sum(onehot, axis=0)
    if p == 0:
        used = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, used)
        lane = tl.arange(0, BLOCK_M)
        pad_slots = (ends - padded + totals)[:, None] + lane[None, :]
        sentinel = tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_ptr + pad_slots, sentinel, mask=lane[None, :] < (padded - totals)[:, None])
        block_ends = ends // BLOCK_M
        for b0 in range(0, num_blocks, ROWS):
            blocks = b0 + tl.arange(0, ROWS)
            owner = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
            owner = tl.where(blocks < used // BLOCK_M, owner, -1)
            tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False) -> ExpertBlocks:
    """Sort the pairs of `topk_ids` [tokens, k] by expert into BLOCK_M-padded runs, on the
    device and without waiting for it (buffers sized by `max_blocks`)."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    if num_pairs == 0:
        num_padded.zero_()
        return ExpertBlocks(sorted_pairs, expert_ids, num_padded, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    options = launch_options(pdl)
    if num_pairs <= SINGLE_PROGRAM_PAIRS:
        chunk, num_chunks, chunk_counts = num_pairs, 1, num_padded  # no chunk counts to read
    else:
        chunk = max(MIN_CHUNK_PAIRS, triton.next_power_of_2(triton.cdiv(num_pairs, MAX_CHUNKS)))
        num_chunks = triton.cdiv(num_pairs, chunk)
        chunk_counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=ids.device)
        _count_chunks_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, chunk, num_experts, E_PAD=e_pad, ROWS=_ALIGN_ROWS, **options)
    _place_pairs_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_pairs, expert_ids, num_padded,
        num_pairs, chunk, num_chunks, blocks, num_experts,
        BLOCK_M=block_m, E_PAD=e_pad, ROWS=_ALIGN_ROWS, COUNT_HERE=num_chunks == 1, **options,
    )  # fmt: skip
    return ExpertBlocks(sorted_pairs, expert_ids, num_padded, block_m)


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


# Widest output tile of a w8a8 grouped GEMM per accumulator: the gated GEMM keeps two (gate,
# up), and each K step's float32 product needs a third tile of registers before it is scaled.
FP8_MAX_BLOCK_N = {True: 64, False: 128}


def fp8_tile(tile: GemmTile, gated: bool) -> GemmTile:
    """A grouped-GEMM tile of the table (measured with bf16 operands) for e4m3 operands: K
    steps of one whole 128-column scale group, which is the shared memory a bf16 step of 64
    columns takes, and half the steps (each scaled once). Its columns are capped
    (`FP8_MAX_BLOCK_N`): with the table's 128-column gate/up and 256-column down tiles of
    128 rows, ptxas ran out of registers (255) and spilled in the main loop (sm_90, session
    16): the likely reason the w8a8 grouped GEMMs lost to bf16 on the H200 (232 against 116
    ms for one 30B-A3B prefill step; capped, 118 ms in session 17). The sweep with FP8
    experts (`bench moe --experts fp8-block`) measures tiles of its own; this maps bf16's
    where no FP8 table is."""
    return replace(tile, block_k=FP8_BLOCK, block_n=min(tile.block_n, FP8_MAX_BLOCK_N[gated]))
