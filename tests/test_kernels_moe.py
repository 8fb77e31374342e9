"""The fused mixture-of-experts kernels against their torch reference, and the engine's
`FusedMoE` block against transformers' Qwen3-VL-MoE sparse block.

Kernel cases (`test_kernel_*`, `test_align_*`) run on a CUDA GPU, or on the CPU under
TRITON_INTERPRET=1 in fp32/fp16 (the interpreter's bf16 `tl.dot` is wrong): when this
process cannot run them, test_kernels_interpreter.py runs this file in a fresh
interpreter process (and `test_kernels_run_under_the_triton_interpreter`, `slow`, its kernel
cases).
The block-vs-transformers cases are plain torch, float32, on the CPU. The `gpu` cases run
the 30B-A3B shapes in bf16 and under CUDA-graph capture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlmbatch.kernels as kernels
from vlmbatch.engine.layers.moe import FusedMoE, select_experts
from vlmbatch.kernels.fused_moe import REL_L2_BOUND, fused_moe
from vlmbatch.kernels.moe_align import max_blocks, moe_align
from vlmbatch.kernels.moe_tiles import TUNED_CONFIGS, TUNED_TABLE_PATH, GemmTile, MoeConfig, load_tuned_configs
from vlmbatch.kernels.reference import fused_moe_ref
from vlmbatch.kernels.testing import TOLERANCE, kernel_target, ptxas_spill_bytes

TARGET = kernel_target()
needs_kernels = pytest.mark.skipif(TARGET is None, reason="needs a GPU or TRITON_INTERPRET=1 (test_kernels_interpreter.py runs them so)")
DTYPES = TARGET.dtypes if TARGET else ()
SMALL_TILES = MoeConfig(16, GemmTile(32, 32), GemmTile(32, 32))
PER_PAIR = MoeConfig(1, GemmTile(16, 32), GemmTile(8, 16))  # the GEMV kernels of a handful of tokens
PER_PAIR_MMA = MoeConfig(1, GemmTile(16, 32, 1, 4, 3, mma_rows=16), GemmTile(16, 16, 1, 4, 3, mma_rows=16))  # their tensor-core variants
PER_PAIR_SPLIT = MoeConfig(1, GemmTile(16, 32), GemmTile(8, 16, split_slots=1))  # the down GEMV with a program per slot


def routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int, hot: int | None = None, idle: tuple[int, ...] = ()):
    """(weights, ids) routed as the model routes, from random logits; `hot` is in every
    token's top-k, `idle` experts in none."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if hot is not None:
        logits[:, hot] += 100.0
    logits[:, list(idle)] = float("-inf")
    weights, ids = select_experts(logits, top_k)
    return weights.to(dtype), ids


def moe_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype, seed: int = 0, device: str | None = None, **loads):
    """Activations, expert weights (scaled so every stage stays O(1), drawn on `device`: the
    30B-A3B experts are 1.2 GB) and a routing."""
    device = device or TARGET.device
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device=device).mul_(hidden**-0.5)
    w_down = torch.randn(num_experts, hidden, intermediate, generator=gen, device=device).mul_(intermediate**-0.5)
    weights, ids = routing(num_tokens, num_experts, top_k, dtype, seed + 1, **loads)
    return [x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights.to(device), ids.to(device)]


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_matches_reference(inputs: list[torch.Tensor], config: MoeConfig | None) -> torch.Tensor:
    out = fused_moe(*inputs, config=config)
    expected = fused_moe_ref(*inputs)
    assert relative_l2(out, expected) < REL_L2_BOUND[out.dtype]
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    return out


# ---- kernels against the reference ------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, block_m", [(1, 16), (7, 16), (64, 16), (300, 32), (1, 1), (7, 1)])
def test_kernel_matches_reference(dtype, num_tokens, block_m):
    inputs = moe_inputs(num_tokens, 8, 2, 64, 32, dtype, seed=num_tokens)
    assert_matches_reference(inputs, MoeConfig(block_m, GemmTile(32, 32), GemmTile(64, 32)))


@needs_kernels
@pytest.mark.parametrize("top_k, num_tokens, block_m", [(1, 64, 16), (8, 7, 16), (8, 100, 32), (1, 3, 1), (8, 3, 1)])
def test_kernel_top_k(top_k, num_tokens, block_m):
    inputs = moe_inputs(num_tokens, 12, top_k, 32, 32, DTYPES[0], seed=top_k)
    assert_matches_reference(inputs, MoeConfig(block_m, GemmTile(32, 32), GemmTile(32, 32)))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (2, 12, 8), (3, 6, 4), (8, 8, 2), (16, 12, 4)])
def test_kernel_per_pair_mma_matches_the_reference_and_the_other_paths(dtype, num_tokens, num_experts, top_k):
    """The per-pair kernels' MMA variants (one pair a tensor-core tile, no sort) give the
    function of the GEMVs and of the grouped GEMMs: experts repeat across tokens (one is in
    every token's top-k) and the sizes are not multiples of the tiles (masked K and N)."""
    inputs = moe_inputs(num_tokens, num_experts, top_k, 48, 40, dtype, seed=10 + num_tokens, hot=num_experts - 1)
    out = assert_matches_reference(inputs, PER_PAIR_MMA)
    for other in (PER_PAIR, SMALL_TILES):
        assert relative_l2(out, fused_moe(*inputs, config=other)) < REL_L2_BOUND[dtype]
    if dtype == torch.float16:  # the same rounding points: equal up to an ulp where a float32 sum lies on a boundary
        torch.testing.assert_close(out, fused_moe(*inputs, config=PER_PAIR), atol=2e-3, rtol=2e-3)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (3, 4), (5, 2)])
def test_kernel_down_split_over_slots_sums_them_in_slot_order_every_launch(dtype, num_tokens, top_k):
    """The per-token down with each slot in its own programs: the last to arrive adds the k
    shares in slot order, so it gives the reference's function, the unsplit GEMV's result
    to the float32 order of the k additions, and the same bits launch after launch (the
    arrival counters are back at 0 after each)."""
    inputs = moe_inputs(num_tokens, 12, top_k, 48, 40, dtype, seed=40 + num_tokens, hot=11)
    out = assert_matches_reference(inputs, PER_PAIR_SPLIT)
    assert relative_l2(out, fused_moe(*inputs, config=PER_PAIR)) < REL_L2_BOUND[dtype]
    for _ in range(2):
        assert torch.equal(fused_moe(*inputs, config=PER_PAIR_SPLIT), out)


@needs_kernels
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_kernel_per_token_down_in_one_k_step_wider_than_k(num_tokens):
    """The one-token down tiles that read a pair's whole row in one K step (BLOCK_K past K,
    the tail masked: 1024 for the 30B-A3B's 768) give the reference's function."""
    inputs = moe_inputs(num_tokens, 8, 4, 48, 40, DTYPES[0], seed=30 + num_tokens)
    assert_matches_reference(inputs, MoeConfig(1, GemmTile(16, 32), GemmTile(2, 64)))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_uneven_loads(dtype):
    """One expert in every token's top-2 (it takes half of all pairs, over many blocks),
    three experts taking none."""
    inputs = moe_inputs(40, 8, 2, 32, 32, dtype, seed=5, hot=3, idle=(0, 5, 7))
    ids = inputs[-1]
    assert (ids == 3).sum() == 40 and not torch.isin(ids, torch.tensor([0, 5, 7], device=ids.device)).any()
    assert_matches_reference(inputs, SMALL_TILES)


@needs_kernels
@pytest.mark.parametrize("config", [SMALL_TILES, PER_PAIR, PER_PAIR_MMA, PER_PAIR_SPLIT], ids=["grouped", "per pair", "per pair mma", "per pair split"])
def test_kernel_pairs_on_no_expert_add_nothing(config):
    """Ids outside [0, experts) (a captured batch's padding rows) take no expert."""
    x, w_gate_up, w_down, weights, ids = moe_inputs(6, 8, 2, 32, 32, DTYPES[0], seed=6)
    ids[1] = -1
    ids[4, 1] = 8
    weights[1] = float("nan")  # never read
    out = assert_matches_reference([x, w_gate_up, w_down, weights, ids], config)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@needs_kernels
def test_kernel_ragged_tiles_and_grouping():
    """hidden and intermediate not multiples of the tiles (masked K and N), GROUP_M > 1,
    and the table-or-default launch shape."""
    inputs = moe_inputs(50, 6, 2, 40, 24, DTYPES[0], seed=7, hot=1)
    assert_matches_reference(inputs, MoeConfig(16, GemmTile(16, 32, group_m=4), GemmTile(32, 16, group_m=2)))
    assert_matches_reference(inputs, None)
    x, w_gate_up, w_down, weights, ids = inputs
    assert_matches_reference([x[:3], w_gate_up, w_down, weights[:3], ids[:3]], PER_PAIR)
    assert_matches_reference([x[:3], w_gate_up, w_down, weights[:3], ids[:3]], PER_PAIR_MMA)


@needs_kernels
def test_kernel_block_matches_the_torch_block():
    """`FusedMoE` on the kernels and on the reference, with the same weights."""
    torch_block = FusedMoE(32, 16, 6, 2, device=TARGET.device, dtype=DTYPES[0])
    kernel_block = FusedMoE(32, 16, 6, 2, kernels=kernels, device=TARGET.device, dtype=DTYPES[0])
    x, w_gate_up, w_down, _, _ = moe_inputs(9, 6, 2, 32, 16, DTYPES[0], seed=8)
    for block in (torch_block, kernel_block):
        block.gate.weight.copy_(torch.randn(6, 32, generator=torch.Generator().manual_seed(9)).to(block.gate.weight))
        block.copy_experts(w_gate_up, w_down)
    atol, rtol = TOLERANCE[DTYPES[0]]
    torch.testing.assert_close(kernel_block(x), torch_block(x), atol=atol, rtol=rtol)


def expected_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The align contract, written out: experts in order, each with its pairs in ascending
    order padded by the sentinel (the pair count) to a multiple of block_m."""
    flat = topk_ids.reshape(-1).cpu()
    sorted_pairs, expert_ids = [], []
    for expert in range(num_experts):
        pairs = torch.nonzero(flat == expert).flatten().to(torch.int32)
        padding = -len(pairs) % block_m
        sorted_pairs += [pairs, torch.full((padding,), len(flat), dtype=torch.int32)]
        expert_ids += [expert] * ((len(pairs) + padding) // block_m)
    return torch.cat(sorted_pairs), torch.tensor(expert_ids, dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize(
    "case",
    ["one token", "single program", "chunks", "experts not a power of two", "ids on no expert", "worst case"],
)
def test_align_invariants(case):
    num_experts, block_m = {"experts not a power of two": (6, 16), "worst case": (8, 4)}.get(case, (16, 16))
    if case == "worst case":  # every expert used, one takes the rest: the buffers fill exactly
        ids = torch.cat([torch.arange(num_experts), torch.zeros(3 * block_m, dtype=torch.int64)])[:, None]
    else:
        num_tokens, top_k = {"one token": (1, 8), "single program": (60, 4), "chunks": (700, 4)}.get(case, (45, 3))
        _, ids = routing(num_tokens, num_experts, top_k, torch.float32, seed=len(case), hot=1 if case == "chunks" else None)
        if case == "ids on no expert":
            ids[::4] = -1
            ids[1, 0] = num_experts
    ids = ids.to(TARGET.device)
    blocks = moe_align(ids, num_experts, block_m)
    capacity = max_blocks(ids.numel(), num_experts, block_m)
    assert blocks.expert_ids.shape == (capacity,) and blocks.sorted_pairs.shape == (capacity * block_m,)
    sorted_pairs, expert_ids = expected_blocks(ids, num_experts, block_m)
    used = int(blocks.num_padded)
    assert used == len(sorted_pairs)
    assert torch.equal(blocks.sorted_pairs[:used].cpu(), sorted_pairs)
    assert torch.equal(blocks.expert_ids[: used // block_m].cpu(), expert_ids)
    assert (blocks.expert_ids[used // block_m :] == -1).all()
    if case == "worst case":
        assert used == capacity * block_m


@needs_kernels
def test_kernel_sweep_picks_checked_configs_and_writes_the_table(tmp_path):
    """The device sweep end to end on tiny shapes: every candidate checked and timed, the
    fastest kept per token count, the table written back as data that rebuilds them."""
    from vlmbatch.bench.moe import MoeShape, format_sweep, sweep_moe, write_tuned_table

    shape = MoeShape(hidden=64, intermediate=32, num_experts=8, top_k=2)
    tiles = (GemmTile(64, 64), GemmTile(32, 32, 2))
    choices = {1: [(1, (GemmTile(16, 64),), (GemmTile(32, 32),)), (16, tiles, tiles)], 20: [(16, tiles, tiles), (32, tiles[:1], tiles[:1])]}
    result = sweep_moe(shape, token_counts=(1, 20), dtype=DTYPES[-1], device=TARGET.device, layers=2,
                       choices=choices.get, json_path=tmp_path / "sweep.json", compile_workers=0, echo=lambda line: None)  # fmt: skip
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert len(result["tried"]) == 2 + 4 + 4 + 2 and all(row["rel_err"] <= REL_L2_BOUND[DTYPES[-1]] for row in result["tried"])
    for row in result["rows"]:
        assert row["ok"] and row["experts_read"] >= 2 and row["us"] > 0
        stage_rows = [t for t in result["tried"] if t["tokens"] == row["tokens"] and t["block_m"] == row["config"]["block_m"]]
        for stage in ("gate_up", "down"):
            assert row[f"{stage}_us"] == min(t["us"] for t in stage_rows if t["stage"] == stage)
    assert "tokens" in format_sweep(result)

    table_path = tmp_path / "fused_moe_tuned.json"
    table_path.write_text(TUNED_TABLE_PATH.read_text())
    write_tuned_table(json.loads((tmp_path / "sweep.json").read_text()), table_path)
    tables = load_tuned_configs(table_path)
    assert tables[(2048, 768, 128, 8)] == TUNED_CONFIGS[(2048, 768, 128, 8)], "the other shapes' entries are kept"
    table = tables[(64, 32, 8, 2)]
    assert sorted(table) == [1, 20]
    for row in result["rows"]:
        config = row["config"]
        assert table[row["tokens"]] == MoeConfig(config["block_m"], GemmTile(**config["gate_up"]), GemmTile(**config["down"]))



@needs_kernels
def test_kernel_sweep_of_block_fp8_experts_checks_each_path_and_writes_its_own_table(tmp_path):
    """`bench moe --experts fp8-block` on tiny shapes: the per-pair candidates against the
    w8a16 reference, the grouped ones on inputs quantized beforehand against the w8a8
    reference (exactly, here too), one byte a weight in the bandwidth, and an entry of its
    own in the table beside bf16's, which FP8 experts then take."""
    from vlmbatch.bench.moe import MoeShape, sweep_moe, write_tuned_table
    from vlmbatch.kernels.fused_moe import FP8_REL_L2_BOUND

    shape = MoeShape(hidden=64, intermediate=32, num_experts=8, top_k=2)
    tiles = (GemmTile(64, 64), GemmTile(32, 32, 2))
    choices = {1: [(1, (GemmTile(16, 64),), (GemmTile(32, 32),)), (16, tiles, tiles)], 20: [(16, tiles, tiles)]}
    result = sweep_moe(shape, token_counts=(1, 20), dtype=DTYPES[-1], device=TARGET.device, layers=2, choices=choices.get,
                       compile_workers=0, echo=lambda line: None, experts="fp8-block")  # fmt: skip
    assert len(result["tried"]) == 2 + 4 + 4 and all(row["rel_err"] <= FP8_REL_L2_BOUND for row in result["tried"])
    for row in result["rows"]:
        assert row["expert_mb"] == pytest.approx(row["experts_read"] * 3 * 64 * 32 / 1e6)
        # The whole layer quantizes with the Triton kernel, whose float32 -> e4m3 cast the
        # interpreter gets wrong for a few percent of values; on the GPU it is torch's cast.
        assert row["ok"] or (TARGET.device == "cpu" and row["config"]["block_m"] > 1)

    table_path = tmp_path / "fused_moe_tuned.json"
    table_path.write_text(TUNED_TABLE_PATH.read_text())
    write_tuned_table(result, table_path)
    assert "64,32,8,2,fp8-block" in json.loads(table_path.read_text())
    assert load_tuned_configs(table_path) == TUNED_CONFIGS, "the bf16 tables are kept as they were"
    fp8_table = load_tuned_configs(table_path, experts="fp8-block")[(64, 32, 8, 2)]
    assert sorted(fp8_table) == [1, 20] and fp8_table[20].block_m == 16

def test_partial_sweep_rewrites_only_its_token_counts(tmp_path):
    """`--tokens 1,2` re-tunes 1 and 2 tokens of the shape and keeps its other entries (and
    the other shapes') with their dates; a tile's MMA and prefetch fields survive the round trip."""
    from vlmbatch.bench.moe import QWEN3_VL_30B_A3B, write_tuned_table

    table_path = tmp_path / "fused_moe_tuned.json"
    table_path.write_text(TUNED_TABLE_PATH.read_text())
    before = load_tuned_configs(table_path)[QWEN3_VL_30B_A3B.key]
    new = MoeConfig(1, GemmTile(64, 128, 1, 4, 4, 16, 1), GemmTile(16, 256, 1, 4, 6, 16))
    config = {"block_m": 1, "gate_up": new.gate_up.__dict__, "down": new.down.__dict__}
    result = {"shape": QWEN3_VL_30B_A3B.__dict__, "device": "test", "dtype": "bfloat16", "date": "2099-01-01",
              "rows": [{"tokens": 1, "config": config, "us": 20.0, "pct_of_copy": 88.0}]}
    dates_before = {n: entry["date"] for n, entry in json.loads(table_path.read_text())["2048,768,128,8"]["configs"].items()}
    write_tuned_table(result, table_path)
    after = load_tuned_configs(table_path)[QWEN3_VL_30B_A3B.key]
    assert after[1] == new and sorted(after) == sorted(before)
    assert all(after[n] == before[n] for n in before if n != 1)
    dates_after = {n: entry["date"] for n, entry in json.loads(table_path.read_text())["2048,768,128,8"]["configs"].items()}
    assert dates_after == {**dates_before, "1": "2099-01-01"}, "only the re-tuned entry is re-dated"


# slow: the default run has these cases under the interpreter already, in test_kernels_interpreter.py
# (this whole file, its skips checked); this runs them from this file alone, e.g. `pytest FILE -m slow`.
@pytest.mark.slow
@pytest.mark.skipif(TARGET is not None, reason="this process runs the kernel tests directly")
@pytest.mark.timeout(300)
def test_kernels_run_under_the_triton_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel_ or align_", "-m", "not gpu", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


H200_SHARED_MEMORY = 232448  # bytes a block may use (227 KiB), as the H200 reported it (session 14)


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_every_grouped_tile_fits_the_h200s_shared_memory_and_registers_with_fp8_experts():
    """The tuned table's grouped-GEMM tiles (prefill and large decode batches) were swept on
    the H200 with bf16 experts, the defaults for unswept shapes never; FP8 experts run both
    with e4m3 activations in K steps of 128 (`fp8_tile`). Compiled for sm_90 so, each must
    fit in a Hopper block's shared memory
    (session 14: FP8 experts that gathered a [BLOCK_K, BLOCK_N] tile of scales per K step
    asked 320 KiB at prefill on the H200 and the engine failed to start), multiply e4m3
    on the tensor cores (wgmma from 64 rows) and keep its registers (session 16: the
    uncapped prefill tiles spilled in the main loop and ran at half bf16's speed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fused_moe import _expert_gemm_kernel
    from vlmbatch.kernels.moe_tiles import default_config, fp8_tile

    defaults = [default_config(tokens, 128, 8) for tokens in (16, 64, 512, 4096)]  # shapes never swept
    tiles = {(config.block_m, gated, tile) for config in [*defaults, *(c for table in TUNED_CONFIGS.values() for c in table.values())]
             if config.block_m > 1 for gated, tile in ((True, config.gate_up), (False, config.down))}  # fmt: skip
    assert tiles, "the tuned table has no grouped-GEMM tiles"
    ints = "num_pairs num_blocks N K num_experts stride_am stride_asm stride_we stride_wn stride_wse stride_wsn stride_om"
    args = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16", "routing_ptr": "*bf16",
            "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32", **dict.fromkeys(ints.split(), "i32")}  # fmt: skip
    aligned = {(_expert_gemm_kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
               if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}  # fmt: skip
    for block_m, gated, tile in sorted(tiles, key=str):
        tile = fp8_tile(tile, gated)
        constants = dict(PAIRS_PER_A_ROW=8 if gated else 1, GATED=gated, WEIGHTED=not gated, EVEN_K=True, EVEN_N=True,
                         DOT_PRECISION="tf32", PDL=False, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                         GROUP_M=tile.group_m, PAIR_BLOCKS=False, PREFETCH=0, FP8_W=True, SCALE_ROWS=128, FP8_A=True)  # fmt: skip
        source = ASTSource(_expert_gemm_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
        kernel = compile(source, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
        assert kernel.metadata.shared <= H200_SHARED_MEMORY, (block_m, gated, tile, kernel.metadata.shared)
        ptx = kernel.asm["ptx"]
        assert "e4m3" in ptx and ("wgmma" in ptx if block_m >= 64 else "mma" in ptx), (block_m, gated, tile)
        assert ptxas_spill_bytes(ptx) == 0, (block_m, gated, tile)


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_kernels_compile_for_hopper_with_streamed_weights():
    """bf16 cannot be checked in the interpreter, so compile the bf16 kernels for sm_90 here:
    each must build; the grouped GEMMs must stream their tiles asynchronously (cp.async)
    into tensor-core MMAs, the per-pair GEMVs load their weights in vectors; the same with
    FP8 (e4m3) expert weights and their float32 block scales."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fused_moe import (
        _expert_gemm_kernel, _pair_gate_up_kernel, _sum_slots_kernel, _token_down_kernel, _token_down_mma_kernel, _token_down_split_kernel,
    )  # fmt: skip
    from vlmbatch.kernels.moe_align import _place_pairs_kernel

    def build(fn, args: dict[str, str], constants: dict, **options) -> str:
        # Pointers, strides and sizes 16-aligned, as the JIT specialises them for these shapes.
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items() if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}
        source = ASTSource(fn, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
        return compile(source, target=GPUTarget("cuda", 90, 64), options=options).asm["ptx"]

    def signature(pointers: dict[str, str], ints: str) -> dict[str, str]:
        return pointers | dict.fromkeys(ints.split(), "i32")

    for weights, fp8 in (("*bf16", {"FP8_W": False, "SCALE_ROWS": 1}), ("*fp8e4nv", {"FP8_W": True, "SCALE_ROWS": 128})):
        gemm = signature({"a_ptr": "*bf16", "as_ptr": "*fp32", "w_ptr": weights, "ws_ptr": "*fp32", "out_ptr": "*bf16", "routing_ptr": "*bf16",
                          "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32"},
                         "num_pairs num_blocks N K num_experts stride_am stride_asm stride_we stride_wn stride_wse stride_wsn stride_om")  # fmt: skip
        for gated, block_m, tile, pair_blocks in [(True, 16, GemmTile(64, 128, 1, 4, 4), False), (False, 64, GemmTile(128, 64, 8, 4, 3), False),
                                                  (True, 16, GemmTile(16, 256, 1, 4, 4, 16), True), (True, 16, GemmTile(64, 128, 1, 4, 4, 16, 8), True)]:  # fmt: skip
            constants = dict(PAIRS_PER_A_ROW=8 if gated else 1, GATED=gated, WEIGHTED=not gated, EVEN_K=True, EVEN_N=True, DOT_PRECISION="tf32",
                             PDL=pair_blocks, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                             PAIR_BLOCKS=pair_blocks, PREFETCH=tile.prefetch, FP8_A=False, **fp8)  # fmt: skip
            ptx = build(_expert_gemm_kernel, gemm | ({"expert_ids_ptr": "*i64"} if pair_blocks else {}), constants,
                        num_warps=tile.num_warps, num_stages=tile.num_stages)  # fmt: skip
            assert re.search(r"cp\.async\.c[ag]\.shared", ptx) and "mma" in ptx, f"gated={gated} pairs={pair_blocks} {weights}: tiles not pipelined into tensor-core MMAs"
            assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(tile.prefetch)
        gate_up = signature({"x_ptr": "*bf16", "w_ptr": weights, "ws_ptr": "*fp32", "ids_ptr": "*i64", "act_ptr": "*bf16"},
                            "N K num_experts stride_xm stride_we stride_wn stride_wse stride_wsn stride_am")  # fmt: skip
        ptx = build(_pair_gate_up_kernel, gate_up, dict(TOP_K=8, BLOCK_N=8, BLOCK_K=512, PDL=True, **fp8), num_warps=2)
        assert "ld.global.v4" in ptx or "ld.global.v2" in ptx
        down = signature({"act_ptr": "*bf16", "w_ptr": weights, "ws_ptr": "*fp32", "ids_ptr": "*i64", "routing_ptr": "*bf16", "out_ptr": "*bf16"},
                         "N K num_experts stride_am stride_we stride_wn stride_wse stride_wsn stride_om")  # fmt: skip
        ptx = build(_token_down_kernel, down, dict(TOP_K=8, SLOTS=8, BLOCK_N=8, BLOCK_K=256, PDL=False, **fp8), num_warps=4)
        assert "ld.global.v4" in ptx or "ld.global.v2" in ptx
        split = down | signature({"partial_ptr": "*fp32", "count_ptr": "*i32"}, "num_tokens")
        ptx = build(_token_down_split_kernel, split, dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256, PDL=True, **fp8), num_warps=4)
        assert ("ld.global.v4" in ptx or "ld.global.v2" in ptx) and "atom.global.gpu.acq_rel.add" in ptx, f"slot-split down {weights}"
        for tile, pdl in ((GemmTile(16, 256, 1, 4, 6, 16), True), (GemmTile(32, 128, 1, 4, 4, 16), False), (GemmTile(16, 128, 1, 4, 4, 16, 2), True)):
            constants = dict(TOP_K=8, SLOTS=8, BLOCK_M=tile.mma_rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, DOT_PRECISION="tf32", PDL=pdl,
                             PREFETCH=tile.prefetch, **fp8)  # fmt: skip
            ptx = build(_token_down_mma_kernel, down, constants, num_warps=tile.num_warps, num_stages=tile.num_stages)
            assert re.search(r"cp\.async\.c[ag]\.shared", ptx) and "mma" in ptx, f"token down MMA {tile} {weights}: tiles not pipelined into tensor-core MMAs"
            assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(tile.prefetch)
    place = signature({"ids_ptr": "*i64", "chunk_counts_ptr": "*i32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32"},
                      "num_pairs chunk num_chunks num_blocks num_experts")  # fmt: skip
    build(_place_pairs_kernel, place, dict(BLOCK_M=16, E_PAD=128, ROWS=64, COUNT_HERE=False, PDL=True), num_warps=4)
    sums = signature({"per_pair_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16"}, "num_tokens H num_experts")
    build(_sum_slots_kernel, sums, dict(TOP_K=8, BLOCK_T=1, BLOCK_H=2048, PDL=False), num_warps=4)


# ---- the block against transformers' ------------------------------------------------------


def tiny_hf_block(num_experts: int = 6, top_k: int = 2, seed: int = 0):
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(hidden_size=32, moe_intermediate_size=24, num_experts=num_experts, num_experts_per_tok=top_k, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    block = Qwen3VLMoeTextSparseMoeBlock(config).eval()
    for weight in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        torch.nn.init.normal_(weight, std=0.3)
    return config, block


@torch.no_grad()
def test_block_matches_transformers_in_float32():
    config, hf_block = tiny_hf_block()
    ours = FusedMoE.from_config(config, device="meta")
    ours.load_from_hf(hf_block)
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(1))  # 33 tokens: every expert used
    _, hf_weights, hf_ids = hf_block.gate(x.view(-1, 32))
    weights, ids = select_experts(ours.gate(x.view(-1, 32)), config.num_experts_per_tok)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    torch.testing.assert_close(ours(x.view(-1, 32)).view(3, 11, 32), hf_block(x), atol=2e-6, rtol=2e-6)


def test_routing_reference_is_transformers_routing_away_from_ties():
    """`route_topk_ref` (the kernel's contract: ties to the lower id) is `select_experts`
    (transformers' routing: test_block_matches_transformers_in_float32) wherever no two
    probabilities tie; with ties it takes the lower ids first."""
    logits = torch.randn(33, 128, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, 8)
    ref_weights, ref_ids = kernels.route_topk_ref(logits, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    tied = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0]])
    weights, ids = kernels.route_topk_ref(tied, 2)
    assert ids.tolist() == [[1, 3]] and torch.allclose(weights, torch.tensor([[0.5, 0.5]]))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_experts", "top_k", "renormalize"), [(128, 8, True), (6, 2, True), (100, 3, False)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_route_topk_matches_the_reference(dtype, num_experts, top_k, renormalize, ties):
    """The one-launch router against `route_topk_ref`: the same experts in the same order,
    the same weights (up to the exp's last bits), on 30B-A3B's 128 experts and odd counts;
    `ties` puts the logits on a coarse grid, so equal logits abound."""
    logits = torch.randn(37, num_experts, generator=torch.Generator().manual_seed(num_experts + top_k)) * 3
    if ties:
        logits = logits.round()
    logits = logits.to(dtype).to(TARGET.device)
    logits[5, : num_experts // 2] = float("-inf")  # a token whose router rules half the experts out

    weights, ids = kernels.route_topk(logits, top_k, renormalize)

    expected_weights, expected_ids = kernels.route_topk_ref(logits, top_k, renormalize)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and weights.shape == ids.shape == (37, top_k)
    assert torch.equal(ids, expected_ids)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(weights, expected_weights, atol=atol, rtol=rtol)


@needs_kernels
def test_route_topk_refuses_more_picks_than_experts():
    with pytest.raises(ValueError, match="top_k"):
        kernels.route_topk(torch.zeros(2, 4, device=TARGET.device), 5)


@torch.no_grad()
def test_load_from_hf_adopts_or_copies_expert_by_expert():
    config, hf_block = tiny_hf_block(num_experts=4, top_k=1, seed=2)
    adopted = FusedMoE.from_config(config, device="meta")
    adopted.load_from_hf(hf_block)
    assert adopted.gate_up.data_ptr() == hf_block.experts.gate_up_proj.data_ptr()
    assert adopted.down.data_ptr() == hf_block.experts.down_proj.data_ptr()
    copied = FusedMoE.from_config(config, dtype=torch.float64)
    copied.load_from_hf(hf_block)
    assert copied.gate_up.dtype == torch.float64 and copied.gate_up.data_ptr() != hf_block.experts.gate_up_proj.data_ptr()
    assert torch.equal(copied.gate_up.float(), hf_block.experts.gate_up_proj) and torch.equal(copied.down.float(), hf_block.experts.down_proj)
    # The checkpoint layout (transformers transposes it at load) gives the same weights.
    from_checkpoint = FusedMoE.from_config(config)
    from_checkpoint.copy_experts(hf_block.experts.gate_up_proj.transpose(1, 2), hf_block.experts.down_proj.transpose(1, 2), transposed=True)
    assert torch.equal(from_checkpoint.gate_up, hf_block.experts.gate_up_proj) and torch.equal(from_checkpoint.down, hf_block.experts.down_proj)
    # Weights that are not row-major (a transposed view) are copied into row-major ones.
    hf_block.experts.gate_up_proj.data = hf_block.experts.gate_up_proj.data.transpose(1, 2).contiguous().transpose(1, 2)
    reordered = FusedMoE.from_config(config, device="meta")
    reordered.load_from_hf(hf_block)
    assert reordered.gate_up.is_contiguous() and torch.equal(reordered.gate_up, hf_block.experts.gate_up_proj)
    with pytest.raises(ValueError, match="do not fit"):
        FusedMoE(32, 16, 4, 1).load_from_hf(hf_block)


# ---- the H200: bf16 at the 30B-A3B shapes, CUDA graphs ------------------------------------

A3B = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
BF16_REL_L2 = REL_L2_BOUND[torch.bfloat16]  # bf16's unit roundoff; why, at REL_L2_BOUND


A3B_PER_PAIR = MoeConfig(1, GemmTile(8, 512, 1, 2, 1), GemmTile(8, 256, 1, 4, 1))
A3B_PER_PAIR_MMA = MoeConfig(1, GemmTile(16, 256, 1, 4, 4, 16), GemmTile(16, 256, 1, 4, 6, 16))
A3B_PER_PAIR_MMA_PREFETCH = MoeConfig(1, GemmTile(64, 128, 1, 4, 4, 16, 1), GemmTile(16, 128, 1, 4, 4, 16, 1))  # bulk L2 prefetches
A3B_PER_PAIR_SPLIT = MoeConfig(1, GemmTile(8, 512, 1, 2, 1), GemmTile(16, 256, 1, 4, 1, split_slots=1))  # the down split over slots


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, config", [(1, None), (64, None), (256, None), (2048, None), (1, A3B_PER_PAIR), (4, A3B_PER_PAIR),
                                                  (1, A3B_PER_PAIR_MMA), (8, A3B_PER_PAIR_MMA), (1, A3B_PER_PAIR_MMA_PREFETCH), (4, A3B_PER_PAIR_MMA_PREFETCH),
                                                  (1, A3B_PER_PAIR_SPLIT), (4, A3B_PER_PAIR_SPLIT)])
def test_gpu_bf16_at_30b_a3b_shapes(num_tokens, config):
    """The tuned (or default) launch shapes at decode and prefill sizes, and the per-pair kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 products stay exact
    inputs = moe_inputs(num_tokens, **A3B, dtype=torch.bfloat16, seed=num_tokens, device="cuda")
    out = fused_moe(*inputs, config=config)
    expected = fused_moe_ref(*inputs)
    assert relative_l2(out, expected) < BF16_REL_L2
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])
def test_gpu_fp8_block_experts_at_30b_a3b_shapes(num_tokens):
    """Qwen3-VL-30B-A3B-Instruct-FP8's experts (128x128 block scales) through the tuned
    launches: the per-pair GEMVs at one token (weights dequantized per tile), the grouped
    w8a8 GEMMs from 64 (`quantize_fp8` is torch's cast bit for bit here). Against the
    reference of each, within `FP8_REL_L2_BOUND`."""
    from vlmbatch.kernels.fused_moe import FP8_REL_L2_BOUND
    from vlmbatch.kernels.moe_tiles import choose_config
    from vlmbatch.kernels.reference import fused_moe_fp8_ref, quantize_fp8_blocks_ref

    x, w_gate_up, w_down, weights, ids = moe_inputs(num_tokens, **A3B, dtype=torch.bfloat16, seed=num_tokens, device="cuda")
    gate_up, down = ([quantize_fp8_blocks_ref(w.float()) for w in ws] for ws in (w_gate_up, w_down))
    (w_gate_up, s_gate_up), (w_down, s_down) = ((torch.stack(t) for t in zip(*parts)) for parts in (gate_up, down))
    grouped = choose_config(num_tokens, A3B["hidden"], A3B["intermediate"], A3B["num_experts"], A3B["top_k"], fp8=True).block_m > 1
    out = fused_moe(x, w_gate_up, w_down, weights, ids, gate_up_scales=s_gate_up, down_scales=s_down)
    expected = fused_moe_fp8_ref(x, w_gate_up, w_down, weights, ids, s_gate_up, s_down, fp8_activations=grouped)
    assert grouped == (num_tokens > 8) and relative_l2(out, expected) < FP8_REL_L2_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, pdl, config", [(1, True, None), (2, True, A3B_PER_PAIR), (2, True, A3B_PER_PAIR_MMA), (1, True, A3B_PER_PAIR_MMA_PREFETCH),
                                                     (1, True, A3B_PER_PAIR_SPLIT), (64, False, None), (256, False, None)])
def test_gpu_fused_moe_replays_in_a_cuda_graph(num_tokens, pdl, config):
    """Captured once, replayed with new routings (one with a hot expert taking a pair of
    every token): no host synchronisation, buffers big enough for any routing."""
    x, w_gate_up, w_down, weights, ids = moe_inputs(num_tokens, **A3B, dtype=torch.bfloat16, seed=1, device="cuda")
    pdl_max_rows = 16 if pdl else 0
    fused_moe(x, w_gate_up, w_down, weights, ids, config, pdl_max_rows=pdl_max_rows)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w_gate_up, w_down, weights, ids, config, pdl_max_rows=pdl_max_rows)
    for seed, loads in [(2, {}), (3, {"hot": 5, "idle": tuple(range(64, 128))})]:
        new_weights, new_ids = routing(num_tokens, A3B["num_experts"], A3B["top_k"], torch.bfloat16, seed, **loads)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert relative_l2(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids)) < BF16_REL_L2
