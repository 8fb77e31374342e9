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
`kernels/fused_moe.py`: `vlmbatch bench moe --json moe_sweep.json --write-table`.
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
    REL_L2_BOUND,
    SINGLE_PROGRAM_PAIRS,
    TUNED_TABLE_PATH,
    ExpertBlocks,
    GemmTile,
    MoeConfig,
    expert_down,
    expert_gate_up,
    fused_moe,
    max_blocks,
    moe_align,
    pair_gate_up,
    sum_slots,
    token_down,
)
from vlmbatch.kernels.reference import fused_moe_ref, moe_down_ref, moe_gate_up_ref


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
TOKEN_DOWN_TILES = (GemmTile(4, 256, 1, 4, 1), GemmTile(8, 128, 1, 4, 1), GemmTile(8, 256, 1, 4, 1), GemmTile(16, 128, 1, 4, 1),
                    GemmTile(4, 512, 1, 4, 1), GemmTile(2, 1024, 1, 4, 1), GemmTile(4, 1024, 1, 8, 1), *TOKEN_DOWN_MMA_TILES)  # fmt: skip

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


def _stage_kernels(block_m: int, shape: MoeShape) -> tuple[Callable, Callable]:
    """(gate_up(x, w, weights, ids, blocks, tile), down(act, w, weights, ids, blocks, tile))
    of a BLOCK_M: the per-pair kernels (whose down adds the slots too) or the grouped GEMMs."""
    if block_m == 1:
        return (lambda x, w, weights, ids, blocks, tile: pair_gate_up(x, w, ids, tile),
                lambda act, w, weights, ids, blocks, tile: token_down(act, w, weights, ids, tile))  # fmt: skip
    return (lambda x, w, weights, ids, blocks, tile: expert_gate_up(x, w, blocks, shape.top_k, tile),
            lambda act, w, weights, ids, blocks, tile: expert_down(act, w, weights, blocks, tile))  # fmt: skip


def _compile_candidate(shape: dict, dtype_name: str, device: str, num_tokens: int, block_m: int, stage: str, tile: dict | None) -> str | None:
    """(In a worker process) launch one kernel of a candidate once on empty weights of the
    real shape, so that Triton compiles it into its on-disk cache: "align" (with the slot
    sum) or a stage's GEMM, given no expert blocks so that it returns at once. The error,
    if any (the sweep meets and records it again)."""
    moe = MoeShape(**shape)
    dtype = getattr(torch, dtype_name)
    try:
        weights, ids = select_experts(torch.randn(num_tokens, moe.num_experts, device=device).to(dtype), moe.top_k)
        if stage == "align":
            moe_align(ids, moe.num_experts, block_m)
            sum_slots(torch.zeros(num_tokens * moe.top_k, moe.hidden, dtype=dtype, device=device), ids, moe.num_experts)
        else:
            capacity = max_blocks(ids.numel(), moe.num_experts, block_m)
            no_blocks = ExpertBlocks(torch.empty(capacity * block_m, dtype=torch.int32, device=device), torch.empty(capacity, dtype=torch.int32, device=device),
                                     torch.zeros(1, dtype=torch.int32, device=device), block_m)  # fmt: skip
            gate_up, down = _stage_kernels(block_m, moe)
            if stage == "gate_up":
                w_gate_up = torch.empty(moe.num_experts, 2 * moe.intermediate, moe.hidden, dtype=dtype, device=device)
                gate_up(torch.zeros(num_tokens, moe.hidden, dtype=dtype, device=device), w_gate_up, weights, ids, no_blocks, GemmTile(**tile))
            else:
                w_down = torch.empty(moe.num_experts, moe.hidden, moe.intermediate, dtype=dtype, device=device)
                down(torch.zeros(num_tokens * moe.top_k, moe.intermediate, dtype=dtype, device=device), w_down, weights, ids, no_blocks, GemmTile(**tile))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001
        return f"block_m {block_m} {stage} {tile}: {type(error).__name__}"
    return None


def precompile(
    shape: MoeShape, token_counts: tuple[int, ...], choices: Choices, dtype: torch.dtype, device: torch.device, workers: int, echo: Callable[[str], None]
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
                pool.submit(_compile_candidate, asdict(shape), str(dtype).removeprefix("torch."), device.type, tokens, block_m, stage, tile and asdict(tile))
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


def _make_experts(shape: MoeShape, layers: int, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (gate_up, down) weights of `layers` layers, scaled so every stage stays O(1)."""
    gen = torch.Generator(device=device).manual_seed(0)
    experts = []
    for _ in range(layers):
        w_gate_up = torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device).mul_(shape.hidden**-0.5)
        w_down = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=gen, device=device).mul_(shape.intermediate**-0.5)
        experts.append((w_gate_up.to(dtype), w_down.to(dtype)))
    return experts


def _route(experts: list[tuple[torch.Tensor, torch.Tensor]], shape: MoeShape, num_tokens: int, dtype: torch.dtype) -> list[_Layer]:
    """Fresh activations and routings (random router logits through transformers' routing)."""
    device = experts[0][0].device
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    layers = []
    for w_gate_up, w_down in experts:
        x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(num_tokens, shape.num_experts, generator=gen, device=device).to(dtype), shape.top_k)
        layers.append(_Layer(x, w_gate_up, w_down, weights, ids))
    return layers


def _time_candidate(fn: Callable[[int], torch.Tensor], expected: torch.Tensor, layers: int, device: torch.device) -> dict:
    """Check (layer 0 against `expected`) then time one launch shape; a shape that cannot
    run here (too much shared memory, say) is recorded with its error, not fatal."""
    try:
        rel_err = _relative_l2(fn(0), expected)
        if not rel_err <= REL_L2_BOUND[expected.dtype]:
            return {"us": math.inf, "rel_err": rel_err, "error": "disagrees with the reference"}
        return {"us": 1000 * _ms_per_call(fn, layers, device), "rel_err": rel_err}
    except Exception as error:  # noqa: BLE001 - one bad candidate must not lose the others
        return {"us": math.inf, "rel_err": math.nan, "error": f"{type(error).__name__}: {str(error)[:200]}"}


def _fastest(rows: list[dict]) -> dict | None:
    ran = [row for row in rows if math.isfinite(row["us"])]
    return min(ran, key=lambda row: row["us"]) if ran else None


def _stage_runner(stage: str, block_m: int, shape: MoeShape, layers: list[_Layer], act_ref: torch.Tensor) -> Callable[..., torch.Tensor]:
    """run(layer_index, tile=...) of one stage; every layer's down stage reads layer 0's
    reference activations (of the same shape: only layer 0's output is checked)."""
    gate_up, down = _stage_kernels(block_m, shape)
    blocks = [moe_align(layer.ids, shape.num_experts, block_m) if block_m > 1 else None for layer in layers]
    if stage == "gate_up":
        return lambda i, tile: gate_up(layers[i].x, layers[i].w_gate_up, layers[i].weights, layers[i].ids, blocks[i], tile)
    return lambda i, tile: down(act_ref, layers[i].w_down, layers[i].weights, layers[i].ids, blocks[i], tile)


def _sweep_token_count(
    layers: list[_Layer], shape: MoeShape, num_tokens: int, choices: Choices, copy: float | None, device: torch.device, echo: Callable[[str], None]
) -> tuple[dict, list[dict]]:  # fmt: skip
    """Per BLOCK_M the fastest checked tile of each stage; of those configs, the one whose
    whole layer is fastest (the align and sum launches differ between them)."""
    first = layers[0]
    act_ref = moe_gate_up_ref(first.x, first.w_gate_up, first.ids)
    down_ref = moe_down_ref(act_ref, first.w_down, first.weights, first.ids)
    out_ref = down_ref.float().sum(dim=1).to(down_ref.dtype)  # what fused_moe_ref returns
    act_ref, down_ref = act_ref.flatten(0, 1), down_ref.flatten(0, 1)
    tried: list[dict] = []
    best: tuple[float, MoeConfig, dict, dict] | None = None
    for block_m, gate_up_tiles, down_tiles in choices(num_tokens):
        stage_rows: dict[str, list[dict]] = {"gate_up": [], "down": []}
        for stage, tiles, expected in (("gate_up", gate_up_tiles, act_ref), ("down", down_tiles, out_ref if block_m == 1 else down_ref)):
            run = _stage_runner(stage, block_m, shape, layers, act_ref)
            for tile in tiles:
                timing = _time_candidate(functools.partial(run, tile=tile), expected, len(layers), device)
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
    return fused_moe(layer.x, layer.w_gate_up, layer.w_down, layer.weights, layer.ids, config, pdl_max_rows=pdl_max_rows)


def _time_config(layers: list[_Layer], shape: MoeShape, num_tokens: int, config: MoeConfig, copy: float | None, device: torch.device) -> dict:
    """The whole layer under `config`: its time (with PDL too, at decode sizes the engine
    launches so), its align and sum launches, the expert bytes it reads, and those bytes
    per second as a share of copy bandwidth."""
    first = layers[0]
    dtype = first.x.dtype
    expected = fused_moe_ref(first.x, first.w_gate_up, first.w_down, first.weights, first.ids)
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
    nbytes = experts_read * shape.expert_bytes(dtype)
    tb_s = nbytes / (us * 1e-6) / 1e12
    return {
        "tokens": num_tokens, "config": {"block_m": config.block_m, "gate_up": asdict(config.gate_up), "down": asdict(config.down)},
        "us": us, "us_pdl": us_pdl, "align_us": align_us, "sum_us": sum_us, "experts_read": experts_read,
        "expert_mb": nbytes / 1e6, "tb_s": tb_s, "pct_of_copy": 100 * tb_s / copy if copy else None,
        "rel_err": rel_err, "ok": rel_err <= REL_L2_BOUND[dtype],
    }  # fmt: skip


def sweep_moe(
    shape: MoeShape = QWEN3_VL_30B_A3B, token_counts: tuple[int, ...] = TOKEN_COUNTS, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda", layers: int = 4, choices: Choices = candidates, json_path: Path | str | None = None,
    compile_workers: int = 12, echo: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Sweep the tile candidates (`choices(num_tokens)`) at each token count. Returns (and
    with `json_path` saves after each token count, so a run cut short keeps what it
    measured) a JSON-ready dict: `rows`, the chosen config per token count with its
    timings and bandwidth; `tried`, every candidate's time and error; the run's facts."""
    device = torch.device(device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(), "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape),
        "layers": layers, "compile_workers": compile_workers, "copy_tb_s": copy_tb_s(device) if device.type == "cuda" else None, "rows": [], "tried": [],
    }  # fmt: skip
    if device.type == "cuda" and compile_workers:
        precompile(shape, token_counts, choices, dtype, device, compile_workers, echo)
    experts = _make_experts(shape, layers, dtype, device)
    for num_tokens in token_counts:
        layer_inputs = _route(experts, shape, num_tokens, dtype)
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
    if isinstance(value, dict):  # a tile (with "/mma16" for a per-pair kernel's MMA variant, "/pf" when it prefetches)
        return ("/".join(str(value[k]) for k in ("block_n", "block_k", "group_m", "num_warps", "num_stages"))
                + (f"/mma{value['mma_rows']}" if value.get("mma_rows") else "") + ("/pf" if value.get("prefetch") else ""))  # fmt: skip
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "" if value is None else str(value)


def format_sweep(result: dict[str, Any]) -> str:
    """The chosen configs as a fixed-width table (tiles as block_n/block_k/group_m/warps/stages)."""
    rows = [{**row, **row.get("config", {})} for row in result["rows"]]
    cells = [[_cell(row.get(column)) for column in SWEEP_COLUMNS] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(SWEEP_COLUMNS)]
    lines = [f"fused MoE {result['shape']} {result['dtype']} on {result['device']}, copy {_cell(result['copy_tb_s'])} TB/s"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(SWEEP_COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def write_tuned_table(result: dict[str, Any], path: Path | str = TUNED_TABLE_PATH) -> Path:
    """Put the sweep's configs, with their measured time and share of copy bandwidth, into
    the tuned table (kernels/fused_moe_tuned.json or `path`), keeping the other shapes' and,
    of this shape, the token counts the sweep did not run (`--tokens 1,2,4,8` re-tunes those)."""
    path = Path(path)
    tables = json.loads(path.read_text()) if path.exists() else {}
    shape = MoeShape(**result["shape"])
    key = ",".join(str(part) for part in shape.key)
    configs = dict(tables.get(key, {}).get("configs", {}))
    configs.update({str(row["tokens"]): {**row["config"], "us": round(row["us"], 1), "pct_of_copy": round(row.get("pct_of_copy") or 0, 1)}
                    for row in result["rows"] if "config" in row})  # fmt: skip
    tables[key] = {
        "measured": f"{result['device']}, {result['dtype']}, {result.get('date', '')}: the whole layer's time; "
                    "pct_of_copy = expert bytes / time against a device copy",
        "configs": dict(sorted(configs.items(), key=lambda item: int(item[0]))),
    }  # fmt: skip
    path.write_text(json.dumps(tables, indent=1) + "\n")
    return path
