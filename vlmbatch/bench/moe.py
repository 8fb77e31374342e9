"""The fused-MoE tile sweep: which launch shapes read the experts fastest, per token count.

For each token count (decode batches 1..256, prefill chunks up to 16384) and each candidate
BLOCK_M, every candidate tile of the gate/up GEMM and of the down GEMM is checked against
the torch reference and timed on its own; the fastest of each, under the BLOCK_M whose sum
is least, make the token count's `MoeConfig`, which is then timed as the whole layer
(align, both GEMMs, the slot sum). A decode step reads the weights of the experts its
tokens chose, so the figure of merit is those bytes per second as a share of a measured
device-to-device copy (bytes read + written), the goal of issue 18 being >= 70% at decode
batches 1, 64 and 256.

Timings are CUDA-graph replays (no launch gaps, as the engine's decode graphs run) of two
passes over `layers` distinct weight sets and routings, one call each, so that every call
reads its experts from memory, not from L2 (4 layers of 30B-A3B are 4.8 GB). The kernels
are compiled first in parallel processes. `write_tuned_table` puts the chosen configs into
`kernels/moe_tiles.py`: `vlmbatch bench moe --json moe_sweep.json --write-table`.

With block-FP8 experts (`--experts fp8-block`, e4m3 weights with 128x128 block scales, as
Qwen's -FP8 checkpoints hold them) the per-pair kernels dequantize weight tiles (w8a16) and
the grouped GEMMs multiply e4m3 by e4m3 (w8a8) on inputs quantized per token and 128
columns before they are timed, each checked against `fused_moe_fp8_ref`'s path; the
grouped candidates are the tiles as `fp8_tile` runs them. The table gets its own entry.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vlmbatch.engine.kernel_choice import PDL_MAX_BATCH
from vlmbatch.engine.layers.moe import select_experts
from vlmbatch.kernels.fused_moe import (
    FP8_REL_L2_BOUND,
    REL_L2_BOUND,
    expert_down,
    expert_gate_up,
    fused_moe,
    pair_gate_up,
    sum_slots,
    token_down,
)
from vlmbatch.kernels.moe_align import SINGLE_PROGRAM_PAIRS, ExpertBlocks, max_blocks, moe_align
from vlmbatch.kernels.moe_tiles import EXPERT_FORMATS, FP8_BLOCK, TUNED_TABLE_PATH, GemmTile, MoeConfig, fp8_tile, table_key
from vlmbatch.kernels.reference import (
    fused_moe_fp8_ref,
    fused_moe_fp8_stages_ref,
    fused_moe_ref,
    moe_down_ref,
    moe_gate_up_ref,
    quantize_fp8_blocks_ref,
    quantize_fp8_ref,
)


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        """The key of `TUNED_CONFIGS`."""
        return (self.hidden, self.intermediate, self.num_experts, self.top_k)

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Weights of one expert: gate, up and down."""
        return 3 * self.hidden * self.intermediate * dtype.itemsize


QWEN3_VL_30B_A3B = MoeShape(hidden=2048, intermediate=768, num_experts=128, top_k=8)
TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
PDL_MAX_TOKENS = PDL_MAX_BATCH  # the engine launches decode graphs up to this batch with PDL
GRAPH_PASSES = 2  # over the layers, in each timed graph (amortises the graph's launch)

# Narrow weight strips while the product is bound by reading weights (few rows an expert;
# at batch 1 only 8 experts, so strips of 16-32 rows give every SM work), square tiles with
# L2 grouping once it is bound by the tensor cores; for BLOCK_M 1 (the per-pair GEMVs) few
# rows and long K steps, in as many registers as fit without spilling (ptxas -v, sm_90).
# Each tile compiles once per BLOCK_M: ~60 variants, compiled in parallel processes first.
DECODE_TILES = (
    GemmTile(16, 256, 1, 4, 4), GemmTile(32, 256, 1, 4, 4), GemmTile(64, 128, 1, 4, 4), GemmTile(64, 256, 1, 4, 3), GemmTile(128, 128, 1, 4, 3),
)  # fmt: skip
PREFILL_TILES = (GemmTile(128, 64, 8, 4, 3), GemmTile(128, 64, 8, 8, 4), GemmTile(128, 128, 8, 8, 3), GemmTile(256, 64, 8, 8, 3))
# The per-pair kernels' MMA variants (mma_rows 16: one real row of a tensor-core tile, the
# weight tiles pipelined num_stages deep; tl.dot needs 16 columns at least). The gate/up
# one is the grouped GEMM with one block a pair, so it tries the grouped decode tiles (at
# 1 token the 64-column ones won there, 16.6 us) without the sort's launch, and narrower
# ones for more programs. At 1 token the down's programs are (tokens x hidden / block_n):
# 128 of block_n 16, so deeper pipelines keep more bytes in flight per SM.
PAIR_GATE_UP_MMA_TILES = (
    GemmTile(16, 128, 1, 4, 4, 16), GemmTile(16, 256, 1, 4, 4, 16), GemmTile(32, 256, 1, 4, 4, 16), GemmTile(64, 128, 1, 4, 4, 16), GemmTile(64, 256, 1, 4, 3, 16),
)  # fmt: skip
TOKEN_DOWN_MMA_TILES = (
    GemmTile(16, 128, 1, 4, 4, 16), GemmTile(16, 128, 1, 4, 8, 16), GemmTile(16, 256, 1, 4, 4, 16), GemmTile(16, 256, 1, 4, 6, 16), GemmTile(32, 128, 1, 4, 4, 16),
)  # fmt: skip
# ... and with each program's whole weight slice asked of L2 up front (bulk prefetches: all
# of a program's bytes in flight at once, not only num_stages tiles; 1 = on, the kernel
# picks the pieces per row).
PAIR_GATE_UP_MMA_TILES += tuple(GemmTile(n, k, 1, 4, stages, 16, 1) for n, k, stages in ((16, 256, 4), (32, 256, 4), (64, 128, 4)))
TOKEN_DOWN_MMA_TILES += tuple(GemmTile(16, k, 1, 4, stages, 16, 1) for k, stages in ((128, 4), (256, 4), (256, 6)))
PAIR_GATE_UP_TILES = (GemmTile(8, 512, 1, 2, 1), GemmTile(8, 1024, 1, 4, 1), GemmTile(16, 256, 1, 4, 1), GemmTile(16, 512, 1, 4, 1), *PAIR_GATE_UP_MMA_TILES)
# At one token the down GEMV ran at 47% of copy bandwidth (benchmarks/2026-12-02/s9-moe.log:
# 4/256, three dependent K steps of 768): the 512- and 1024-column steps put a pair's whole
# row in flight in one or two loads.
# The slot-split GEMV (`split_slots`): a program per (token, BLOCK_N rows, slot), each
# streaming one expert's BLOCK_N contiguous rows: at one token 8x the programs of 4/256.
TOKEN_DOWN_SPLIT_TILES = tuple(GemmTile(n, k, 1, warps, 1, split_slots=1) for n, k, warps in
                               ((8, 256, 2), (16, 256, 4), (16, 1024, 8), (32, 256, 4), (64, 128, 4)))  # fmt: skip
TOKEN_DOWN_TILES = (GemmTile(4, 256, 1, 4, 1), GemmTile(8, 128, 1, 4, 1), GemmTile(8, 256, 1, 4, 1), GemmTile(16, 128, 1, 4, 1),
                    GemmTile(4, 512, 1, 4, 1), GemmTile(2, 1024, 1, 4, 1), GemmTile(4, 1024, 1, 8, 1), *TOKEN_DOWN_MMA_TILES,
                    *TOKEN_DOWN_SPLIT_TILES)  # fmt: skip

Candidate = tuple[int, tuple[GemmTile, ...], tuple[GemmTile, ...]]  # BLOCK_M, gate/up tiles, down tiles
Choices = Callable[[int], list[Candidate]]


def candidates(num_tokens: int) -> list[Candidate]:
    """What to try at `num_tokens` (top-8 of 128 experts: 1/16 of the token count lands on
    an average expert). The per-pair kernels read an expert once per pair that chose it,
    which costs little while few tokens share an expert (8 tokens: 64 pairs on ~50 experts;
    16 tokens: 128 pairs on ~80, where the grouped GEMMs should win, which the sweep checks).
    Their GEMV and MMA tiles are one list per stage, so either stage may pick either."""
    wide = DECODE_TILES[1:]
    # Where an expert often gets two blocks of 16, GROUP_M 2 runs them side by side, so the
    # second reads each weight strip from L2.
    paired = (*DECODE_TILES, GemmTile(64, 128, 2, 4, 4))
    if num_tokens <= 16:
        return [(1, PAIR_GATE_UP_TILES, TOKEN_DOWN_TILES), (16, DECODE_TILES, DECODE_TILES)]
    if num_tokens <= 64:
        return [(16, DECODE_TILES, DECODE_TILES)]
    if num_tokens <= 256:
        return [(16, paired, paired), (32, DECODE_TILES, DECODE_TILES)]
    if num_tokens <= 512:
        return [(32, DECODE_TILES, DECODE_TILES), (64, wide, wide)]
    if num_tokens <= 1024:
        return [(64, wide + PREFILL_TILES, wide + PREFILL_TILES)]
    return [(64, PREFILL_TILES, PREFILL_TILES), (128, PREFILL_TILES, PREFILL_TILES)]


def fp8_candidates(num_tokens: int) -> list[Candidate]:
    """`candidates` for block-FP8 experts: the grouped tiles as `fp8_tile` runs them (K steps
    of one 128-column scale group, columns capped so that no tile spills registers)."""
    mapped = []
    for block_m, gate_up, down in candidates(num_tokens):
        if block_m > 1:
            gate_up = tuple(dict.fromkeys(fp8_tile(tile, gated=True) for tile in gate_up))
            down = tuple(dict.fromkeys(fp8_tile(tile, gated=False) for tile in down))
        mapped.append((block_m, gate_up, down))
    return mapped


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def _ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` on the GPU (Triton's do_bench, L2 flushed between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def _ms_per_call(fn: Callable[[int], object], layers: int, device: torch.device) -> float:
    """Milliseconds per `fn(layer)`: GRAPH_PASSES passes over the layers captured in a CUDA
    graph on a GPU; elsewhere (the interpreter, for tests) one timed pass."""
    if device.type != "cuda":
        started = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        return 1000 * (time.perf_counter() - started) / layers
    for layer in range(layers):
        fn(layer)  # compiles, and warms the allocator, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_PASSES):
            for layer in range(layers):
                fn(layer)
    ms = _ms(graph.replay) / (GRAPH_PASSES * layers)
    del graph
    return ms


def _stage_kernels(block_m: int, shape: MoeShape, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """(gate_up(x, x_scales, w, w_scales, weights, ids, blocks, tile), down(act, act_scales, w,
    w_scales, weights, ids, blocks, tile)) of a BLOCK_M: the per-pair kernels (whose down adds
    the slots too) or the grouped GEMMs. Scales are None for bf16 experts; with FP8 experts the
    grouped GEMMs take e4m3 inputs with their scales and write `dtype`."""
    if block_m == 1:
        return (lambda x, xs, w, ws, weights, ids, blocks, tile: pair_gate_up(x, w, ids, tile, scales=ws),
                lambda act, acts, w, ws, weights, ids, blocks, tile: token_down(act, w, weights, ids, tile, scales=ws))  # fmt: skip
    return (lambda x, xs, w, ws, weights, ids, blocks, tile: expert_gate_up(x, w, blocks, shape.top_k, tile, scales=ws, hidden_scales=xs, out_dtype=dtype),
            lambda act, acts, w, ws, weights, ids, blocks, tile: expert_down(act, w, weights, blocks, tile, scales=ws, act_scales=acts, out_dtype=dtype))  # fmt: skip


def _compile_candidate(shape: dict, dtype_name: str, device: str, num_tokens: int, block_m: int, stage: str, tile: dict | None,
                       experts: str = "bf16") -> str | None:  # fmt: skip
    """(In a worker process) launch one kernel of a candidate once on empty weights of the
    real shape, so that Triton compiles it into its on-disk cache: "align" (with the slot
    sum) or a stage's GEMM, given no expert blocks so that it returns at once. The error,
    if any (the sweep meets and records it again)."""
    moe = MoeShape(**shape)
    dtype = getattr(torch, dtype_name)
    fp8 = experts == "fp8-block"
    w_dtype = torch.float8_e4m3fn if fp8 else dtype
    in_dtype = torch.float8_e4m3fn if fp8 and block_m > 1 else dtype  # the grouped GEMMs' e4m3 inputs

    def scales(rows: int, cols: int) -> torch.Tensor | None:  # of FP8 expert weights [experts, rows, cols]
        return torch.ones(moe.num_experts, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK), device=device) if fp8 else None

    def input_scales(rows: int, cols: int) -> torch.Tensor | None:
        return torch.ones(rows, -(-cols // FP8_BLOCK), device=device) if fp8 and block_m > 1 else None

    try:
        weights, ids = select_experts(torch.randn(num_tokens, moe.num_experts, device=device).to(dtype), moe.top_k)
        if stage == "align":
            moe_align(ids, moe.num_experts, block_m)
            sum_slots(torch.zeros(num_tokens * moe.top_k, moe.hidden, dtype=dtype, device=device), ids, moe.num_experts)
        else:
            capacity = max_blocks(ids.numel(), moe.num_experts, block_m)
            no_blocks = ExpertBlocks(torch.empty(capacity * block_m, dtype=torch.int32, device=device), torch.empty(capacity, dtype=torch.int32, device=device),
                                     torch.zeros(1, dtype=torch.int32, device=device), block_m)  # fmt: skip
            gate_up, down = _stage_kernels(block_m, moe, dtype)
            if stage == "gate_up":
                w_gate_up = torch.empty(moe.num_experts, 2 * moe.intermediate, moe.hidden, dtype=w_dtype, device=device)
                gate_up(torch.zeros(num_tokens, moe.hidden, dtype=in_dtype, device=device), input_scales(num_tokens, moe.hidden),
                        w_gate_up, scales(2 * moe.intermediate, moe.hidden), weights, ids, no_blocks, GemmTile(**tile))  # fmt: skip
            else:
                pairs = num_tokens * moe.top_k
                w_down = torch.empty(moe.num_experts, moe.hidden, moe.intermediate, dtype=w_dtype, device=device)
                down(torch.zeros(pairs, moe.intermediate, dtype=in_dtype, device=device), input_scales(pairs, moe.intermediate),
                     w_down, scales(moe.hidden, moe.intermediate), weights, ids, no_blocks, GemmTile(**tile))  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001
        return f"block_m {block_m} {stage} {tile}: {type(error).__name__}"
    return None


def precompile(
    shape: MoeShape, token_counts: tuple[int, ...], choices: Choices, dtype: torch.dtype, device: torch.device, workers: int, echo: Callable[[str], None],
    experts: str = "bf16",
) -> None:  # fmt: skip
    """Compile every candidate in `workers` spawned processes, one job per (BLOCK_M, stage,
    tile) and per variant of the align kernel: Triton caches the binaries on disk, where
    this process's first launch of each finds them. One after another they would take
    most of the sweep."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs: dict[tuple[int, int, str, GemmTile | None], None] = {}  # (tokens, BLOCK_M, stage, tile), in order
    for num_tokens in token_counts:
        # One token count of each align variant (one program, or chunks) stands for all.
        align_tokens = 1 if num_tokens * shape.top_k <= SINGLE_PROGRAM_PAIRS else SINGLE_PROGRAM_PAIRS // shape.top_k + 1
        for block_m, gate_up_tiles, down_tiles in choices(num_tokens):
            jobs.update(dict.fromkeys((1, block_m, "gate_up", tile) for tile in gate_up_tiles))
            jobs.update(dict.fromkeys((1, block_m, "down", tile) for tile in down_tiles))
            if block_m > 1:
                jobs[(align_tokens, block_m, "align", None)] = None
    started = time.perf_counter()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [
                pool.submit(_compile_candidate, asdict(shape), str(dtype).removeprefix("torch."), device.type, tokens, block_m, stage, tile and asdict(tile), experts)
                for tokens, block_m, stage, tile in jobs
            ]  # fmt: skip
            errors = [error for future in futures if (error := future.result())]
    except Exception as error:  # noqa: BLE001 - e.g. a __main__ that spawned processes cannot import
        echo(f"precompile failed ({type(error).__name__}: {error}); each kernel compiles when first timed")
        return
    echo(f"[{time.perf_counter() - started:5.0f} s] compiled {len(jobs)} candidates in {workers} processes" + (f"; errors: {errors}" if errors else ""))


def copy_tb_s(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the yardstick)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _ms(lambda: dst.copy_(src)) / 1e9


@dataclass
class _Layer:
    """One layer's experts with the activations and routing of the token count being swept."""

    x: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    gate_up_scales: torch.Tensor | None = None  # block-FP8 experts' scales
    down_scales: torch.Tensor | None = None


Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # gate_up, down, and FP8 scales


def _blockwise_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert of `w` [experts, N, K] in e4m3 with 128x128 block scales, as -FP8 checkpoints hold them."""
    parts = [quantize_fp8_blocks_ref(expert.float()) for expert in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def _make_experts(shape: MoeShape, layers: int, dtype: torch.dtype, device: torch.device, experts: str = "bf16") -> list[Experts]:
    """Random (gate_up, down) weights of `layers` layers, scaled so every stage stays O(1),
    in `dtype` or block-FP8 (`experts`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    made = []
    for _ in range(layers):
        w_gate_up = torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device).mul_(shape.hidden**-0.5)
        w_down = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=gen, device=device).mul_(shape.intermediate**-0.5)
        if experts == "fp8-block":
            (gate_up_q, gate_up_s), (down_q, down_s) = _blockwise_fp8(w_gate_up), _blockwise_fp8(w_down)
            made.append((gate_up_q, down_q, gate_up_s, down_s))
        else:
            made.append((w_gate_up.to(dtype), w_down.to(dtype), None, None))
    return made


def _route(experts: list[Experts], shape: MoeShape, num_tokens: int, dtype: torch.dtype) -> list[_Layer]:
    """Fresh activations and routings (random router logits through transformers' routing)."""
    device = experts[0][0].device
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    layers = []
    for w_gate_up, w_down, gate_up_scales, down_scales in experts:
        x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(num_tokens, shape.num_experts, generator=gen, device=device).to(dtype), shape.top_k)
        layers.append(_Layer(x, w_gate_up, w_down, weights, ids, gate_up_scales, down_scales))
    return layers


def _bound(layer: _Layer) -> float:
    """How far a kernel may be from its reference: the dtype's rounding, or FP8's bound."""
    return REL_L2_BOUND[layer.x.dtype] if layer.gate_up_scales is None else FP8_REL_L2_BOUND


def _time_candidate(fn: Callable[[int], torch.Tensor], expected: torch.Tensor, bound: float, layers: int, device: torch.device) -> dict:
    """Check (layer 0 against `expected`) then time one launch shape; a shape that cannot
    run here (too much shared memory, say) is recorded with its error, not fatal."""
    try:
        rel_err = _relative_l2(fn(0), expected)
        if not rel_err <= bound:
            return {"us": math.inf, "rel_err": rel_err, "error": "disagrees with the reference"}
        return {"us": 1000 * _ms_per_call(fn, layers, device), "rel_err": rel_err}
    except Exception as error:  # noqa: BLE001 - one bad candidate must not lose the others
        return {"us": math.inf, "rel_err": math.nan, "error": f"{type(error).__name__}: {str(error)[:200]}"}


def _fastest(rows: list[dict]) -> dict | None:
    ran = [row for row in rows if math.isfinite(row["us"])]
    return min(ran, key=lambda row: row["us"]) if ran else None


def _stage_references(layer: _Layer, w8a8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [tokens, k, I], weighted down [tokens, k, hidden]) of `layer` by the reference of
    its experts: transformers' arithmetic for bf16, `fused_moe_fp8_ref`'s path for FP8 (w8a8
    for the grouped GEMMs, w8a16 for the per-pair kernels)."""
    if layer.gate_up_scales is None:
        act = moe_gate_up_ref(layer.x, layer.w_gate_up, layer.ids)
        return act, moe_down_ref(act, layer.w_down, layer.weights, layer.ids)
    return fused_moe_fp8_stages_ref(layer.x, layer.w_gate_up, layer.w_down, layer.weights, layer.ids, layer.gate_up_scales, layer.down_scales, w8a8)


def _stage_input(x: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM's input as the kernel takes it: as it is, or (w8a8) quantized per token and 128
    columns by torch, which the kernels' quantization equals bit for bit on the GPU."""
    return quantize_fp8_ref(x, FP8_BLOCK) if quantize else (x, None)


def _stage_runner(stage: str, block_m: int, shape: MoeShape, layers: list[_Layer], act_ref: torch.Tensor) -> Callable[..., torch.Tensor]:
    """run(layer_index, tile=...) of one stage; every layer's down stage reads layer 0's
    reference activations (of the same shape: only layer 0's output is checked). The grouped
    GEMMs of FP8 experts get their inputs quantized beforehand (w8a8), untimed."""
    dtype = layers[0].x.dtype
    w8a8 = block_m > 1 and layers[0].gate_up_scales is not None
    gate_up, down = _stage_kernels(block_m, shape, dtype)
    blocks = [moe_align(layer.ids, shape.num_experts, block_m) if block_m > 1 else None for layer in layers]
    if stage == "gate_up":
        inputs = [_stage_input(layer.x, w8a8) for layer in layers]
        return lambda i, tile: gate_up(*inputs[i], layers[i].w_gate_up, layers[i].gate_up_scales, layers[i].weights, layers[i].ids, blocks[i], tile)
    act = _stage_input(act_ref, w8a8)
    return lambda i, tile: down(*act, layers[i].w_down, layers[i].down_scales, layers[i].weights, layers[i].ids, blocks[i], tile)


def _sweep_token_count(
    layers: list[_Layer], shape: MoeShape, num_tokens: int, choices: Choices, copy: float | None, device: torch.device, echo: Callable[[str], None]
) -> tuple[dict, list[dict]]:  # fmt: skip
    """Per BLOCK_M the fastest checked tile of each stage; of those configs, the one whose
    whole layer is fastest (the align and sum launches differ between them)."""
    first = layers[0]
    tried: list[dict] = []
    best: tuple[float, MoeConfig, dict, dict] | None = None
    references: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # by w8a8: bf16 experts have one path
    for block_m, gate_up_tiles, down_tiles in choices(num_tokens):
        w8a8 = block_m > 1 and first.gate_up_scales is not None
        if w8a8 not in references:
            references[w8a8] = _stage_references(first, w8a8)
        act_ref, down_ref = references[w8a8]
        out_ref = down_ref.float().sum(dim=1).to(down_ref.dtype)  # what the whole layer's reference returns
        act_ref, down_ref = act_ref.flatten(0, 1), down_ref.flatten(0, 1)
        stage_rows: dict[str, list[dict]] = {"gate_up": [], "down": []}
        for stage, tiles, expected in (("gate_up", gate_up_tiles, act_ref), ("down", down_tiles, out_ref if block_m == 1 else down_ref)):
            run = _stage_runner(stage, block_m, shape, layers, act_ref)
            for tile in tiles:
                timing = _time_candidate(functools.partial(run, tile=tile), expected, _bound(first), len(layers), device)
                row = {"tokens": num_tokens, "stage": stage, "block_m": block_m, "tile": asdict(tile), **timing}
                stage_rows[stage].append(row)
                tried.append(row)
        fastest = {stage: _fastest(rows) for stage, rows in stage_rows.items()}
        if None in fastest.values():
            continue
        config = MoeConfig(block_m, GemmTile(**fastest["gate_up"]["tile"]), GemmTile(**fastest["down"]["tile"]))
        whole_us = 1000 * _ms_per_call(lambda i, c=config: _whole_layer(layers[i], c), len(layers), device)
        if best is None or whole_us < best[0]:
            best = (whole_us, config, fastest["gate_up"], fastest["down"])
    if best is None:
        echo(f"tokens {num_tokens}: no candidate ran (see the errors in 'tried')")
        return {"tokens": num_tokens, "error": "no candidate ran"}, tried
    _, config, gate_up_row, down_row = best
    row = _time_config(layers, shape, num_tokens, config, copy, device)
    row.update(gate_up_us=gate_up_row["us"], down_us=down_row["us"])
    return row, tried


def _whole_layer(layer: _Layer, config: MoeConfig, pdl_max_rows: int = 0) -> torch.Tensor:
    return fused_moe(layer.x, layer.w_gate_up, layer.w_down, layer.weights, layer.ids, config, pdl_max_rows=pdl_max_rows,
                     gate_up_scales=layer.gate_up_scales, down_scales=layer.down_scales)  # fmt: skip


def _time_config(layers: list[_Layer], shape: MoeShape, num_tokens: int, config: MoeConfig, copy: float | None, device: torch.device) -> dict:
    """The whole layer under `config`: its time (with PDL too, at decode sizes the engine
    launches so), its align and sum launches, the expert bytes it reads, and those bytes
    per second as a share of copy bandwidth."""
    first = layers[0]
    dtype = first.x.dtype
    if first.gate_up_scales is None:
        expected = fused_moe_ref(first.x, first.w_gate_up, first.w_down, first.weights, first.ids)
    else:
        expected = fused_moe_fp8_ref(first.x, first.w_gate_up, first.w_down, first.weights, first.ids, first.gate_up_scales, first.down_scales,
                                     fp8_activations=config.block_m > 1)  # fmt: skip
    rel_err = _relative_l2(_whole_layer(first, config), expected)
    us = 1000 * _ms_per_call(lambda i: _whole_layer(layers[i], config), len(layers), device)
    us_pdl = align_us = sum_us = None
    if num_tokens <= PDL_MAX_TOKENS and device.type == "cuda":
        us_pdl = 1000 * _ms_per_call(lambda i: _whole_layer(layers[i], config, PDL_MAX_TOKENS), len(layers), device)
    if config.block_m > 1:
        per_pair = torch.zeros(num_tokens * shape.top_k, shape.hidden, dtype=dtype, device=device)
        align_us = 1000 * _ms_per_call(lambda i: moe_align(layers[i].ids, shape.num_experts, config.block_m), len(layers), device)
        sum_us = 1000 * _ms_per_call(lambda i: sum_slots(per_pair, layers[i].ids, shape.num_experts), len(layers), device)
    experts_read = sum(int(layer.ids.unique().numel()) for layer in layers) / len(layers)
    nbytes = experts_read * shape.expert_bytes(first.w_gate_up.dtype)  # FP8: one byte a weight (block scales: ~1/4096 more)
    tb_s = nbytes / (us * 1e-6) / 1e12
    return {
        "tokens": num_tokens, "config": {"block_m": config.block_m, "gate_up": asdict(config.gate_up), "down": asdict(config.down)},
        "us": us, "us_pdl": us_pdl, "align_us": align_us, "sum_us": sum_us, "experts_read": experts_read,
        "expert_mb": nbytes / 1e6, "tb_s": tb_s, "pct_of_copy": 100 * tb_s / copy if copy else None,
        "rel_err": rel_err, "ok": rel_err <= _bound(first),
    }  # fmt: skip


def sweep_moe(
    shape: MoeShape = QWEN3_VL_30B_A3B, token_counts: tuple[int, ...] = TOKEN_COUNTS, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda", layers: int = 4, choices: Choices | None = None, json_path: Path | str | None = None,
    compile_workers: int = 12, echo: Callable[[str], None] = print, experts: str = "bf16",
) -> dict[str, Any]:  # fmt: skip
    """Sweep the tile candidates (`choices(num_tokens)`; by default `candidates`, or
    `fp8_candidates` for `experts` "fp8-block") at each token count, the activations in
    `dtype`. Returns (and with `json_path` saves after each token count, so a run cut short
    keeps what it measured) a JSON-ready dict: `rows`, the chosen config per token count
    with its timings and bandwidth; `tried`, every candidate's time and error; the run's facts."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMATS)}, not {experts!r}")
    device = torch.device(device)
    choices = choices or (fp8_candidates if experts == "fp8-block" else candidates)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "experts": experts,
        "date": datetime.date.today().isoformat(), "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape),
        "layers": layers, "compile_workers": compile_workers, "copy_tb_s": copy_tb_s(device) if device.type == "cuda" else None, "rows": [], "tried": [],
    }  # fmt: skip
    if device.type == "cuda" and compile_workers:
        precompile(shape, token_counts, choices, dtype, device, compile_workers, echo, experts)
    weights = _make_experts(shape, layers, dtype, device, experts)
    for num_tokens in token_counts:
        layer_inputs = _route(weights, shape, num_tokens, dtype)
        row, tried = _sweep_token_count(layer_inputs, shape, num_tokens, choices, result["copy_tb_s"], device, echo)
        result["rows"].append(row)
        result["tried"] += tried
        result["elapsed_s"] = time.perf_counter() - started
        echo(f"[{result['elapsed_s']:5.0f} s] tokens {num_tokens}: " + (f"{row['us']:.1f} us, {row['pct_of_copy'] or 0:.0f}% of copy" if "us" in row else row["error"]))
        if json_path is not None:
            Path(json_path).write_text(json.dumps(result, indent=1, default=str))
    return result


SWEEP_COLUMNS = ["tokens", "block_m", "gate_up", "down", "us", "us_pdl", "gate_up_us", "down_us", "align_us", "sum_us",
                 "experts_read", "expert_mb", "tb_s", "pct_of_copy", "rel_err"]  # fmt: skip


def _cell(value: object) -> str:
    if isinstance(value, dict):  # a tile ("/mma16": a per-pair kernel's MMA variant, "/pf": it prefetches, "/slots": split over slots)
        return ("/".join(str(value[k]) for k in ("block_n", "block_k", "group_m", "num_warps", "num_stages"))
                + (f"/mma{value['mma_rows']}" if value.get("mma_rows") else "") + ("/pf" if value.get("prefetch") else "")
                + ("/slots" if value.get("split_slots") else ""))  # fmt: skip
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "" if value is None else str(value)


def format_sweep(result: dict[str, Any]) -> str:
    """The chosen configs as a fixed-width table (tiles as block_n/block_k/group_m/warps/stages)."""
    rows = [{**row, **row.get("config", {})} for row in result["rows"]]
    cells = [[_cell(row.get(column)) for column in SWEEP_COLUMNS] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(SWEEP_COLUMNS)]
    lines = [f"fused MoE {result['shape']} {result['dtype']}, {result.get('experts', 'bf16')} experts, on {result['device']}, "
             f"copy {_cell(result['copy_tb_s'])} TB/s"]  # fmt: skip
    lines += ["  ".join(c.ljust(w) for c, w in zip(SWEEP_COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def write_tuned_table(result: dict[str, Any], path: Path | str = TUNED_TABLE_PATH) -> Path:
    """Put the sweep's configs, with their measured time and share of copy bandwidth, into
    the tuned table (kernels/fused_moe_tuned.json or `path`), keeping the other shapes' and,
    of this shape, the token counts the sweep did not run (`--tokens 1,2,4,8` re-tunes those),
    each entry dated by the sweep that measured it."""
    path = Path(path)
    tables = json.loads(path.read_text()) if path.exists() else {}
    shape = MoeShape(**result["shape"])
    experts = result.get("experts", "bf16")
    key = table_key(shape.key, experts)
    configs = dict(tables.get(key, {}).get("configs", {}))
    configs.update({str(row["tokens"]): {**row["config"], "us": round(row["us"], 1), "pct_of_copy": round(row.get("pct_of_copy") or 0, 1),
                                         "date": result.get("date", "")}
                    for row in result["rows"] if "config" in row})  # fmt: skip
    tables[key] = {
        "measured": f"{result['device']}, {result['dtype']}, {experts} experts: the whole layer's time on the entry's date "
                    "(a partial sweep re-dates only its token counts); pct_of_copy = expert bytes / time against a device copy",
        "configs": dict(sorted(configs.items(), key=lambda item: int(item[0]))),
    }  # fmt: skip
    path.write_text(json.dumps(tables, indent=1) + "\n")
    return path
