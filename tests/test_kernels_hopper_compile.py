"""Kernels compiled for Hopper (sm_90) on the CPU, where the interpreter cannot vouch for
them: it lets a kernel read any module global, compiled code only constexpr ones."""

from __future__ import annotations

import re

import pytest

from vlmbatch.kernels.testing import kernel_target

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


# ---- FP8 GEMMs at decode sizes (`kernels/fp8.py`: `decode_plan`, `_fp8_decode_kernel`) ----------

# The decoder layers `vlmbatch bench kernels` times: name -> (N, K); q/k/v has a bias (Qwen2.5).
FP8_LAYERS = {"3b qkv": (2560, 2048), "3b o": (2048, 2048), "3b gate_up": (22016, 2048), "3b down": (2048, 11008),
              "3b lm_head": (151936, 2048), "7b qkv": (4608, 3584), "7b o": (3584, 3584), "7b gate_up": (37888, 3584),
              "7b down": (3584, 18944), "7b lm_head": (152064, 3584)}  # fmt: skip
H200_MAX_SHARED = 227 << 10  # shared memory one program may take on an H100/H200
FLOAT_DIV = r"\bdiv\.(?:full|approx|rn)[\w.]*\.f32\b"


def _compile_fp8(kernel, constants: dict, a_dtype: str, decode: bool, num_warps: int, num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = "M N K k_steps_per_split stride_am stride_asm stride_wn stride_wsn stride_om" if decode else "M N K stride_am stride_asm stride_wn stride_wsn stride_om"
    args = {"a_ptr": a_dtype, "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            **({"partial_ptr": "*fp32", "count_ptr": "*i32"} if decode else {}), **dict.fromkeys(names.split(), "i32")}  # fmt: skip
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
               if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}  # fmt: skip
    source = ASTSource(kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
    return compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps, "num_stages": num_stages})


def _planned_launches() -> dict[tuple, tuple]:
    """Every distinct launch `fp8_linear` makes for the 3B/7B layers at the decode graphs'
    batch sizes (1..64), both scale layouts, bf16 inputs: key -> (kernel, constants, A dtype,
    decode kernel?, warps, stages)."""
    from vlmbatch.kernels.fp8 import _fp8_decode_kernel, _fp8_gemm_kernel, decode_kernel_constants, decode_plan, split_ranges

    launches = {}
    for name, (n, k) in FP8_LAYERS.items():
        for rows in (1, 2, 4, 8, 16, 32, 64):
            for per_token in (True, False):
                plan = decode_plan(rows, n, k, per_token)
                config = plan.config
                block_k = config.block_k if per_token else 128
                split, _ = split_ranges(-(-k // block_k), config.split_k)
                scale_rows, bias = 1 if per_token else 128, name.endswith("qkv")
                if plan.fused or split > 1:
                    constants = decode_kernel_constants(k, block_k, config, split, per_row=per_token, scale_rows=scale_rows,
                                                        quantize=plan.fused, has_bias=bias) | {"PDL": False}  # fmt: skip
                    launch = (_fp8_decode_kernel, constants, "*bf16" if plan.fused else "*fp8e4nv", True)
                else:  # unsplit with a separate quantization: the prefill kernel's decode tile
                    constants = dict(SCALE_ROWS=scale_rows, PER_ROW_SCALES=per_token, HAS_BIAS=bias, PDL=False, BLOCK_M=config.block_m,
                                     BLOCK_N=config.block_n, BLOCK_K=block_k)  # fmt: skip
                    launch = (_fp8_gemm_kernel, constants, "*fp8e4nv", False)
                launches.setdefault((launch[0].__name__, launch[2], tuple(sorted(constants.items())), config.num_warps, config.num_stages),
                                    (*launch, config.num_warps, config.num_stages))  # fmt: skip
    return launches


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_every_planned_fp8_decode_launch_compiles_for_hopper():
    """What `fp8.decode_plan` has the engine run at decode sizes, compiled for sm_90 (the
    interpreter accepts code that compiled Triton refuses): e4m3 products on the tensor
    cores (wgmma from 64-row tiles, mma below); shared memory within one H200 program's
    227 KiB (a launch past it fails only on the GPU); the fused launches quantize with the
    quantization kernel's float division and e4m3 cast; the split ones release their
    arrival after a CTA barrier (acq_rel, GPU scope) and read the partials past L1."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fp8 import _quantize_kernel

    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", **dict.fromkeys("K stride_xm stride_qm stride_sm".split(), "i32")}
    constants = dict(GROUP=2048, BLOCK=1024, FP8_MAX_C=448.0, MIN_SCALE_C=1e-12, PDL=False)
    quant = compile(ASTSource(_quantize_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants),
                    target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]  # fmt: skip
    quant_divisions = set(re.findall(FLOAT_DIV, quant))
    assert quant_divisions and "cvt.rn.satfinite.e4m3x2.f32" in quant
    launches = _planned_launches()
    kinds = set()
    for kernel, constants, a_dtype, decode, num_warps, num_stages in launches.values():
        compiled = _compile_fp8(kernel, constants, a_dtype, decode, num_warps, num_stages)
        ptx, where = compiled.asm["ptx"], (kernel.__name__, constants, num_stages)
        assert compiled.metadata.shared <= H200_MAX_SHARED, where
        assert ("wgmma.mma_async" in ptx and "e4m3" in ptx) if constants["BLOCK_M"] >= 64 else "mma.sync" in ptx, where
        if constants.get("QUANTIZE_A"):
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and set(re.findall(FLOAT_DIV, ptx)) == quant_divisions, where
        if constants.get("SPLIT_K", 1) > 1:
            atom = ptx.index("atom.global.gpu.acq_rel.add")
            assert "bar.sync" in ptx[:atom] and "ld.global.cg" in ptx[atom:] and "atom.global.gpu.relaxed.exch" in ptx[atom:], where
        kinds.add((kernel.__name__, bool(constants.get("QUANTIZE_A")), constants.get("SPLIT_K", 1) > 1, constants["PER_ROW_SCALES"]))
    assert len(kinds) == 8, kinds  # fused or not x split or not x layout: the unsplit, unfused ones on the prefill kernel


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_fp8_decode_kernel_with_pdl_and_the_largest_benchmarked_tiles_compiles_for_hopper():
    """A fused, split launch with programmatic dependent launch (as decode graphs of up to 16
    rows run it), and the benchmark's largest tiles (64 rows, 512-column K steps, fused and
    not), whose shared memory must fit too."""
    from vlmbatch.kernels.fp8 import _fp8_decode_kernel, decode_config, decode_kernel_constants, fused_config

    config = fused_config(1, 32, 256, 4, 2)
    constants = decode_kernel_constants(2048, 256, config, 2, per_row=True, scale_rows=1, quantize=True, has_bias=True) | {"PDL": True}
    ptx = _compile_fp8(_fp8_decode_kernel, constants, "*bf16", True, 4, config.num_stages).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    for config, quantize in ((fused_config(64, 32, 512, 4, 4), True), (decode_config(64, 32, 512, 4, 4), False),
                             (fused_config(64, 128, 128, 4, 4), True)):  # fmt: skip
        constants = decode_kernel_constants(11008, config.block_k, config, 4, per_row=True, scale_rows=1, quantize=quantize, has_bias=False)
        compiled = _compile_fp8(_fp8_decode_kernel, constants | {"PDL": False}, "*bf16" if quantize else "*fp8e4nv", True, 4, config.num_stages)
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
    gemm = {"a_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "out_ptr": "*bf16", "routing_ptr": "*bf16", "sorted_ptr": "*i64",
            "expert_ids_ptr": "*i64", "num_padded_ptr": "*i64"} | dict.fromkeys(("num_pairs num_blocks " + ints).split(), "i32")  # fmt: skip
    down = {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "ids_ptr": "*i64", "routing_ptr": "*bf16", "out_ptr": "*bf16"} | dict.fromkeys(ints.split(), "i32")
    # 2048-column rows of 4 KiB in 8 prefetch pieces; 768-column rows of 1.5 KiB in 2 (`prefetch_pieces`)
    launches = [(_expert_gemm_kernel, gemm, tile, dict(PAIRS_PER_A_ROW=8, GATED=True, WEIGHTED=False, EVEN_K=True, EVEN_N=True, GROUP_M=1,
                                                       PAIR_BLOCKS=True, PREFETCH=8 if tile.prefetch else 0)) for tile in PAIR_GATE_UP_MMA_TILES]  # fmt: skip
    launches += [(_token_down_mma_kernel, down, tile, dict(TOP_K=8, SLOTS=8, PREFETCH=2 if tile.prefetch else 0)) for tile in TOKEN_DOWN_MMA_TILES]
    for fn, args, tile, constants in launches:
        constants |= dict(BLOCK_M=tile.mma_rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, DOT_PRECISION="tf32", PDL=True, FP8_W=False, SCALE_ROWS=1)
        kernel = build(fn, args, constants, num_warps=tile.num_warps, num_stages=tile.num_stages)
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= H200_MAX_SHARED, (fn.__name__, tile, kernel.metadata.shared)
        assert re.search(r"cp\.async\.c[ag]\.shared", ptx) and "mma" in ptx, (fn.__name__, tile)  # (not the bulk prefetch's cp.async)
        assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(tile.prefetch), (fn.__name__, tile)
