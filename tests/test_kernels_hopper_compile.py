"""Kernels compiled for Hopper (sm_90) on the CPU, where the interpreter cannot vouch for
them: it lets a kernel read any module global, compiled code only constexpr ones."""

from __future__ import annotations

import re

import pytest

from vlmbatch.kernels.testing import kernel_target, ptxas_spill_bytes

TARGET = kernel_target()


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_compiles_for_hopper(gelu):
    """The interpreter lets a kernel read any module global; compiled code may read only
    constexpr ones (Gemma 3's GeGLU constants stopped the 12B bench on the H200 so). Compile
    both activations for sm_90 here, where no GPU is needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.activation import _BLOCK, _gated_kernel

    args = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "stride_in": "i32", "stride_out": "i32"}
    constants = {"BLOCK": _BLOCK, "GELU": gelu, "PDL": False}
    source = ASTSource(_gated_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
    assert ".entry _gated_kernel" in ptx




@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
@pytest.mark.parametrize("group, block, num_warps", [(3456, 4096, 8), (11008, 1024, 4), (128, 128, 1)])
def test_gated_fp8_compiles_for_hopper_in_one_read_or_two(group, block, num_warps):
    """`gated_fp8`'s launches: a Qwen2.5-VL tower row kept in registers (one read), a 3B
    decoder row in 1,024-column steps (two reads), a 128-column group, each compiled for
    sm_90 without spilling."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.activation import _gated_fp8_kernel
    from vlmbatch.kernels.fp8 import FP8_MAX, MIN_SCALE

    args = {"gate_up_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", **dict.fromkeys("n_cols stride_in stride_q stride_s".split(), "i32")}
    constants = {"GROUP": group, "BLOCK": block, "GELU": False, "FP8_MAX_C": FP8_MAX, "MIN_SCALE_C": MIN_SCALE, "PDL": False}
    source = ASTSource(_gated_fp8_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps}).asm["ptx"]
    assert ".entry _gated_fp8_kernel" in ptx and "e4m3" in ptx and ptxas_spill_bytes(ptx) == 0

@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
@pytest.mark.parametrize("group, block, block_m", [(128, 128, 16), (4096, 1024, 2), (2048, 1024, 1)])
def test_quantize_tiles_compile_for_hopper(group, block, block_m):
    """`quantize_fp8`'s tiles of several rows (1x128 groups; per-token rows in 1,024-column
    steps; a one-row decode launch), compiled for sm_90 with the row reduction they use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fp8 import FP8_MAX, MIN_SCALE, _quantize_kernel

    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", **dict.fromkeys("M K stride_xm stride_qm stride_sm".split(), "i32")}
    constants = {"GROUP": group, "BLOCK": block, "BLOCK_M": block_m, "FP8_MAX_C": FP8_MAX, "MIN_SCALE_C": MIN_SCALE, "PDL": False}
    source = ASTSource(_quantize_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4 if block_m * block >= 512 else 1}).asm["ptx"]
    assert ".entry _quantize_kernel" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and ptxas_spill_bytes(ptx) == 0

# ---- FP8 GEMMs at decode sizes (`kernels/fp8.py`: `decode_plan`, `_fp8_decode_kernel`) ----------

# The decoder layers `vlmbatch bench kernels` times: name -> (N, K); q/k/v has a bias (Qwen2.5).
FP8_LAYERS = {"3b qkv": (2560, 2048), "3b o": (2048, 2048), "3b gate_up": (22016, 2048), "3b down": (2048, 11008),
              "3b lm_head": (151936, 2048), "7b qkv": (4608, 3584), "7b o": (3584, 3584), "7b gate_up": (37888, 3584),
              "7b down": (3584, 18944), "7b lm_head": (152064, 3584)}  # fmt: skip
H200_MAX_SHARED = 227 << 10  # shared memory one program may take on an H100/H200


def _compile_fp8(kernel, constants: dict, decode: bool, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = "M N K k_steps_per_split stride_am stride_asm stride_wn stride_wsn stride_om" if decode else "M N K stride_am stride_asm stride_wn stride_wsn stride_om"
    args = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            **({"partial_ptr": "*fp32", "count_ptr": "*i32"} if decode else {}), **dict.fromkeys(names.split(), "i32")}  # fmt: skip
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
               if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}  # fmt: skip
    source = ASTSource(kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
    return compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps, "num_stages": num_stages})


def _planned_launches() -> dict[tuple, tuple]:
    """Every distinct GEMM launch `fp8_linear` makes for the 3B/7B layers at the decode
    graphs' batch sizes (1..64), both scale layouts: key -> (kernel, constants, decode
    kernel?, warps, stages)."""
    from vlmbatch.kernels.fp8 import _fp8_decode_kernel, _fp8_gemm_kernel, decode_kernel_constants, decode_plan, split_ranges

    launches = {}
    for name, (n, k) in FP8_LAYERS.items():
        for rows in (1, 2, 4, 8, 16, 32, 64):
            for per_token in (True, False):
                config = decode_plan(rows, n, k, per_token)
                block_k = config.block_k if per_token else 128
                split, _ = split_ranges(-(-k // block_k), config.split_k)
                scale_rows, bias = 1 if per_token else 128, name.endswith("qkv")
                if split > 1:
                    constants = decode_kernel_constants(k, block_k, config, split, per_row=per_token, scale_rows=scale_rows,
                                                        has_bias=bias) | {"PDL": False}  # fmt: skip
                    kernel = _fp8_decode_kernel
                else:  # unsplit: the prefill kernel's decode tile
                    constants = dict(SCALE_ROWS=scale_rows, PER_ROW_SCALES=per_token, HAS_BIAS=bias, PDL=False, BLOCK_M=config.block_m,
                                     BLOCK_N=config.block_n, BLOCK_K=block_k)  # fmt: skip
                    kernel = _fp8_gemm_kernel
                launches.setdefault((kernel.__name__, tuple(sorted(constants.items())), config.num_warps, config.num_stages),
                                    (kernel, constants, split > 1, config.num_warps, config.num_stages))  # fmt: skip
    return launches


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_every_planned_fp8_decode_launch_compiles_for_hopper():
    """What `fp8.decode_plan` has the engine run at decode sizes, compiled for sm_90 (the
    interpreter accepts code that compiled Triton refuses): e4m3 products on the tensor
    cores (wgmma from 64-row tiles, mma below); shared memory within one H200 program's
    227 KiB (a launch past it fails only on the GPU); the split ones release their arrival
    after a CTA barrier (acq_rel, GPU scope) and read the partials past L1."""
    kinds = set()
    for kernel, constants, decode, num_warps, num_stages in _planned_launches().values():
        compiled = _compile_fp8(kernel, constants, decode, num_warps, num_stages)
        ptx, where = compiled.asm["ptx"], (kernel.__name__, constants, num_stages)
        assert compiled.metadata.shared <= H200_MAX_SHARED, where
        assert ("wgmma.mma_async" in ptx and "e4m3" in ptx) if constants["BLOCK_M"] >= 64 else "mma.sync" in ptx, where
        if decode:
            atom = ptx.index("atom.global.gpu.acq_rel.add")
            assert "bar.sync" in ptx[:atom] and "ld.global.cg" in ptx[atom:] and "atom.global.gpu.relaxed.exch" in ptx[atom:], where
        kinds.add((kernel.__name__, constants["PER_ROW_SCALES"]))
    assert len(kinds) == 4, kinds  # split (decode kernel) or not (prefill kernel) x layout


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_fp8_decode_kernel_with_pdl_and_the_benchmarked_split_tiles_compiles_for_hopper():
    """A split launch with programmatic dependent launch (as decode graphs of up to 16 rows
    run it), and every split tile the benchmark times at 64 rows (down's K), whose shared
    memory must fit too."""
    from vlmbatch.kernels.fp8 import FP8_SPLIT_TILES, _fp8_decode_kernel, decode_config, decode_kernel_constants

    config = decode_config(1, 32, 256, 4, 4)
    constants = decode_kernel_constants(2048, 256, config, 4, per_row=True, scale_rows=1, has_bias=True) | {"PDL": True}
    ptx = _compile_fp8(_fp8_decode_kernel, constants, True, 4, config.num_stages).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    for tile in FP8_SPLIT_TILES:
        config = decode_config(64, *tile)
        constants = decode_kernel_constants(11008, config.block_k, config, config.split_k, per_row=True, scale_rows=1, has_bias=False)
        compiled = _compile_fp8(_fp8_decode_kernel, constants | {"PDL": False}, True, config.num_warps, config.num_stages)
        assert compiled.metadata.shared <= H200_MAX_SHARED, (config, compiled.metadata.shared)


# ---- the fused MoE's per-pair MMA variants (`kernels/fused_moe.py`), every swept tile ----------


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_every_swept_per_pair_mma_moe_tile_compiles_for_hopper():
    """Each MMA tile `vlmbatch bench moe` tries on the per-pair path, at the 30B-A3B shapes in
    bf16: it builds for sm_90 within the H200's shared memory, streams its weight tiles with
    cp.async into tensor-core MMAs, and issues bulk L2 prefetches exactly when asked to."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.bench.moe import PAIR_GATE_UP_MMA_TILES, TOKEN_DOWN_MMA_TILES
    from vlmbatch.kernels.fused_moe import _expert_gemm_kernel, _token_down_mma_kernel

    def build(fn, args: dict[str, str], constants: dict, **options):
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items() if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}
        return compile(ASTSource(fn, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned), target=GPUTarget("cuda", 90, 64), options=options)

    ints = "N K num_experts stride_am stride_we stride_wn stride_wse stride_wsn stride_om"
    gemm = {"a_ptr": "*bf16", "as_ptr": "*fp32", "w_ptr": "*bf16", "ws_ptr": "*fp32", "out_ptr": "*bf16", "routing_ptr": "*bf16",
            "sorted_ptr": "*i64", "expert_ids_ptr": "*i64", "num_padded_ptr": "*i64"} | dict.fromkeys(("num_pairs num_blocks stride_asm " + ints).split(), "i32")  # fmt: skip
    down = {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "ids_ptr": "*i64", "routing_ptr": "*bf16", "out_ptr": "*bf16"} | dict.fromkeys(ints.split(), "i32")
    # 2048-column rows of 4 KiB in 8 prefetch pieces; 768-column rows of 1.5 KiB in 2 (`prefetch_pieces`)
    launches = [(_expert_gemm_kernel, gemm, tile, dict(PAIRS_PER_A_ROW=8, GATED=True, WEIGHTED=False, EVEN_K=True, EVEN_N=True, GROUP_M=1,
                                                       PAIR_BLOCKS=True, PREFETCH=8 if tile.prefetch else 0, FP8_A=False)) for tile in PAIR_GATE_UP_MMA_TILES]  # fmt: skip
    launches += [(_token_down_mma_kernel, down, tile, dict(TOP_K=8, SLOTS=8, PREFETCH=2 if tile.prefetch else 0)) for tile in TOKEN_DOWN_MMA_TILES]
    for fn, args, tile, constants in launches:
        constants |= dict(BLOCK_M=tile.mma_rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, DOT_PRECISION="tf32", PDL=True, FP8_W=False, SCALE_ROWS=1)
        kernel = build(fn, args, constants, num_warps=tile.num_warps, num_stages=tile.num_stages)
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= H200_MAX_SHARED, (fn.__name__, tile, kernel.metadata.shared)
        assert re.search(r"cp\.async\.c[ag]\.shared", ptx) and "mma" in ptx, (fn.__name__, tile)  # (not the bulk prefetch's cp.async)
        assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(tile.prefetch), (fn.__name__, tile)
