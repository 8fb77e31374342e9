"""FP8 kernels (`kernels/fp8.py`) against their torch references, and `Fp8Linear` on a GPU.

Kernel cases (`test_kernel_*`) run on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1:
when this process cannot run them, test_kernels_interpreter.py runs this file in a fresh
interpreter process (and `test_kernels_run_under_the_triton_interpreter`, `slow`, its kernel
cases). The interpreter's fp8 `tl.dot` is exact, but its float32 -> e4m3 cast rounds a few
percent of values wrongly (seen: 1.989 -> 1.0 where torch gives 2.0): there the
quantization test checks the scales exactly and that over 90% of the values equal torch's;
on the GPU it checks both exactly. The `gpu` cases also run the per-channel product
through `torch._scaled_mm` and an `Fp8Linear` on 3B shapes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmbatch.kernels import gated_fp8, rms_norm_fp8
from vlmbatch.kernels.fp8 import fp8_gemm, quantize_fp8, scaled_mm
from vlmbatch.kernels.reference import dequantize_fp8_ref, fp8_gemm_ref, quantize_fp8_blocks_ref, quantize_fp8_ref
from vlmbatch.kernels.testing import kernel_target

TARGET = kernel_target()
needs_kernels = pytest.mark.skipif(TARGET is None, reason="needs a GPU or TRITON_INTERPRET=1 (test_kernels_interpreter.py runs them so)")
DEVICE = TARGET.device if TARGET else "cpu"
gpu = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("rows, k, group", [(1, 64, None), (5, 200, 128), (33, 384, 128), (7, 1000, None), (19, 2500, None)])
def test_kernel_quantize_matches_the_reference(rows, k, group):
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-2, 2, rows, device=DEVICE)[:, None]
    q, s = quantize_fp8(x, group)
    q_ref, s_ref = quantize_fp8_ref(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    if DEVICE == "cuda":
        assert torch.equal(q.float(), q_ref.float())
    else:  # the interpreter's cast: most values equal, the others off (seen 1.989 -> 1.0, not 2.0)
        assert (q.float() == q_ref.float()).float().mean() > 0.9


def _weights(n: int, k: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEVICE)
    if layout == "channel":
        return quantize_fp8_ref(w, None)
    if layout == "row-blocks":  # [N, K / 128]: fused projections of odd sizes
        return quantize_fp8_ref(w, 128)
    q = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, torch.rand(-(-n // 128), -(-k // 128), device=DEVICE) + 0.01


@needs_kernels
@pytest.mark.parametrize("dtype", TARGET.dtypes if TARGET else [torch.float32])
@pytest.mark.parametrize("hidden, group", [(256, None), (200, None), (384, 128), (640, 128)])
@pytest.mark.parametrize("residual, offset", [(False, False), (True, False), (True, True)], ids=["plain", "residual", "gemma"])
def test_kernel_rms_norm_fp8_is_the_norm_then_its_quantization(dtype, hidden, group, residual, offset):
    """The fused norm's FP8 output is what `quantize_fp8` makes of `rms_norm`'s output, bit
    for bit (both kernels run the same float32 arithmetic and the same e4m3 cast), and its
    residual output is the unfused one; odd widths cover the padded last group."""
    from vlmbatch.kernels import rms_norm

    torch.manual_seed(hidden)
    x = (torch.randn(9, hidden, device=DEVICE) * torch.logspace(-2, 2, 9, device=DEVICE)[:, None]).to(dtype)
    res = torch.randn_like(x) if residual else None
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    unfused = rms_norm(x, weight, 1e-6, res, offset=offset)
    normed, summed = unfused if residual else (unfused, x)
    q_ref, s_ref = quantize_fp8(normed, group)
    q, s, fused_sum = rms_norm_fp8(x, weight, 1e-6, res, group=group, offset=offset)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(fused_sum, summed)


@needs_kernels
@pytest.mark.parametrize("dtype", TARGET.dtypes if TARGET else [torch.float32])
@pytest.mark.parametrize("n, group", [(96, None), (2100, None), (5000, None), (384, 128), (200, 128)])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "geglu"])
def test_kernel_gated_fp8_is_the_activation_then_its_quantization(dtype, n, group, gelu):
    """The fused gated activation's FP8 output is `quantize_fp8` of the unfused activation's
    output, bit for bit: one scale per token from one read of the row (n = 2100) or from two
    reads of its column blocks (n = 5000), or per 128 columns with a short last group (n = 200)."""
    from vlmbatch.kernels import fused_gelu_tanh_and_mul, fused_silu_and_mul

    torch.manual_seed(n)
    gate_up = (torch.randn(5, 2 * n, device=DEVICE) * torch.logspace(-1, 1, 5, device=DEVICE)[:, None]).to(dtype)
    product = (fused_gelu_tanh_and_mul if gelu else fused_silu_and_mul)(gate_up)
    q_ref, s_ref = quantize_fp8(product, group)
    q, s = gated_fp8(gate_up, group, gelu=gelu)
    assert q.shape == product.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("dtype", TARGET.dtypes if TARGET else [torch.float32])
@pytest.mark.parametrize("layout", ["channel", "blocks"])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "geglu"])
def test_kernel_fp8_mlp_takes_its_inputs_quantized_by_the_norm_and_the_activation(layout, gelu, dtype):
    """`DecoderLayer.emit_fp8_inputs`' two hookups, on the decoder's own modules: a norm
    feeding an FP8 gate/up and the gated activation feeding an FP8 down projection hand
    them `Fp8Activation`s, and the MLP's output is bit for bit the one where each FP8 layer
    quantizes its own input (per token, or per 128 columns). In the dtypes the kernels are
    checked in there, as the two fused kernels' own tests: float32 on the GPU is no FP8 path,
    and there the fused norm's scales came out 1 ulp off the unfused ones in 2 of 14 groups
    (session 17, `benchmarks/2026-12-04/s17-diag-fp8-mlp.log`)."""
    from vlmbatch import kernels
    from vlmbatch.engine.decoder import MLP
    from vlmbatch.engine.kernel_choice import Fp8Gemms, KernelSet
    from vlmbatch.engine.layers.fp8_linear import Fp8Activation, Fp8Linear
    from vlmbatch.engine.layers.norm import RMSNorm

    torch.manual_seed(0)
    hidden, intermediate = 256, 384
    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 1 << 30, lambda n, k: False, rms_norm_fp8, gated_fp8)
    kernel_set = KernelSet("triton", kernels.rms_norm, kernels.apply_rotary, kernels.fused_silu_and_mul, None, "cublas", 0,
                           gemms, kernels.fused_gelu_tanh_and_mul)  # fmt: skip
    mlp = MLP(hidden, intermediate, kernel_set, "gelu_tanh" if gelu else "silu")
    for name, (n, k) in {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}.items():
        w_q, w_s = _weights(n, k, layout)  # scaled so the products stay well inside float16
        setattr(mlp, name, Fp8Linear(w_q, w_s / (w_q.float().abs().mean() * k**0.5), None, gemms))
    norm = RMSNorm(hidden, 1e-6, kernels.rms_norm).to(DEVICE, dtype)
    x, residual = torch.randn(7, hidden, device=DEVICE, dtype=dtype), torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    h, summed = norm(x, residual)
    expected = mlp(h)
    norm.emit_fp8_for(mlp.gate_up_proj)
    mlp.emit_fp8_for_down()
    fused_h, fused_sum = norm(x, residual)
    assert isinstance(fused_h, Fp8Activation) and mlp.act_fp8 is not None
    assert expected.isfinite().all()
    assert torch.equal(fused_sum, summed) and torch.equal(mlp(fused_h), expected)


@needs_kernels
def test_kernel_qwen2_5_vl_tower_block_in_fp8_takes_its_inputs_quantized():
    """`quantize_vision` on Qwen2.5-VL's tower: after `VisionBlock.emit_fp8_inputs` its two
    norms and its activation hand q/k/v, gate/up and down their inputs in FP8, and the
    block's output (biases in every projection) is bit for bit the unfused one."""
    from vlmbatch import kernels
    from vlmbatch.engine.kernel_choice import Fp8Gemms, KernelSet
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear, quantize_online
    from vlmbatch.families.qwen2_5_vl.vision import VisionBlock

    torch.manual_seed(0)
    dim, heads, intermediate = 128, 2, 192
    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 1 << 30, lambda n, k: False, rms_norm_fp8, gated_fp8)
    kernel_set = KernelSet("triton", kernels.rms_norm, kernels.apply_rotary, kernels.fused_silu_and_mul, None, "cublas", 0,
                           gemms, kernels.fused_gelu_tanh_and_mul)  # fmt: skip
    block = VisionBlock(dim, heads, intermediate, kernel_set).to(DEVICE)
    for parent, name in ((block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "gate_up_proj"), (block.mlp, "down_proj")):
        linear = getattr(parent, name)
        setattr(parent, name, Fp8Linear(*quantize_online(linear.weight.detach() * 4), linear.bias.detach(), gemms))
    x, residual = torch.randn(12, dim, device=DEVICE), torch.randn(12, dim, device=DEVICE)
    angles = torch.rand(12, dim // heads, device=DEVICE)
    args = (angles.cos(), angles.sin(), (5, 7))
    with torch.no_grad():
        expected = block(x, residual, *args)
        block.emit_fp8_inputs()
        fused = block(x, residual, *args)
    assert block.norm1.fp8_kernel is not None and block.norm2.fp8_kernel is not None and block.mlp.act_fp8 is not None
    assert expected[0].isfinite().all()
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


@needs_kernels
@pytest.mark.parametrize("rows, n, k", [(1, 96, 64), (3, 256, 200), (40, 384, 512), (130, 136, 256)])
@pytest.mark.parametrize("layout", ["blocks", "row-blocks", "channel"])
def test_kernel_fp8_gemm_matches_the_reference(rows, n, k, layout):
    """Exact products, float32 accumulation: only the order of the additions differs."""
    w_q, w_s = _weights(n, k, layout)
    a_q, a_s = quantize_fp8_ref(torch.randn(rows, k, device=DEVICE), None if layout == "channel" else 128)
    bias = torch.randn(n, device=DEVICE)
    out = fp8_gemm(a_q, a_s, w_q, w_s, bias, out_dtype=torch.float32)
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, bias, out_dtype=torch.float32)
    assert (out - ref).norm() / ref.norm() < 1e-5


@needs_kernels
@pytest.mark.parametrize("rows", [1, 40])
def test_every_decode_tile_the_benchmark_times_is_exact(rows):
    """The tiles `bench kernels --sections fp8` times (K steps of 128..512, K not a
    multiple of them) compute the same product, so the fastest can become the default."""
    from vlmbatch.kernels.fp8 import FP8_DECODE_TILES, decode_config

    w_q, w_s = _weights(96, 320, "channel")
    a_q, a_s = quantize_fp8_ref(torch.randn(rows, 320, device=DEVICE), None)
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, out_dtype=torch.float32)
    for tile in FP8_DECODE_TILES:
        out = fp8_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.float32, config=decode_config(rows, *tile))
        assert (out - ref).norm() / ref.norm() < 1e-5, tile


# ---- Decode sizes: the GEMM split over K ----------------------------------------------------

GROUPS = {"channel": None, "blocks": 128, "row-blocks": 128}


def _decode_case(rows: int, n: int, k: int, layout: str, seed: int = 0):
    torch.manual_seed(seed)
    w_q, w_s = _weights(n, k, layout)
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-1, 1, rows, device=DEVICE)[:, None]
    x[:, 7] = 0.0  # an all-zero 1x128 group where K allows none otherwise
    if rows > 2:
        x[2] = 0.0  # an all-zero row: the amax floor
    return x, w_q, w_s, torch.randn(n, device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("rows, layout", [(rows, layout) for rows in (1, 3, 16, 64) for layout in ("channel", "blocks")]
                         + [(1, "row-blocks"), (16, "row-blocks")])  # fmt: skip
@pytest.mark.parametrize("n, k", [(96, 320), (136, 200), (40, 1000)])
def test_kernel_split_k_matches_the_unsplit_product(rows, layout, n, k):
    """The GEMM split over K (`_fp8_decode_kernel`, 3 ranges where K has the steps) equals
    the unsplit decode tile (`_fp8_gemm_kernel`) up to float32 reassociation, and the
    reference: every scale layout, odd N and K (masked tails, K not a multiple of the K
    step or of 128), an all-zero row, the bias."""
    from vlmbatch.kernels.fp8 import decode_config

    group = GROUPS[layout]
    x, w_q, w_s, bias = _decode_case(rows, n, k, layout)
    a_q, a_s = quantize_fp8(x, group)
    block_k = 128 if group else 64

    def run(split: int) -> torch.Tensor:
        return fp8_gemm(a_q, a_s, w_q, w_s, bias, torch.float32, config=decode_config(rows, 32, block_k, 4, split))

    split, unsplit = run(3), run(1)
    assert (split - unsplit).norm() / unsplit.norm() < 1e-6
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, bias, out_dtype=torch.float32)
    assert (split - ref).norm() / ref.norm() < 1e-5


@needs_kernels
def test_kernel_split_k_is_deterministic_and_leaves_its_counters_at_zero():
    """Split over K: the partial sums are added in range order by whichever program arrives
    last, so repeated launches agree bit for bit; they equal the unsplit product up to
    float32 reassociation; every tile's arrival counter is back at 0 (the next launch's
    start)."""
    from vlmbatch.kernels import fp8
    from vlmbatch.kernels.fp8 import decode_config

    x, w_q, w_s, _ = _decode_case(5, 200, 1000, "channel")
    a_q, a_s = quantize_fp8(x)

    def run(split: int) -> torch.Tensor:
        return fp8_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.float32, config=decode_config(5, 32, 64, 4, split))

    first = run(4)
    assert torch.equal(first, run(4)) and torch.equal(first, run(4))
    unsplit = run(1)
    assert (first - unsplit).norm() / unsplit.norm() < 1e-6
    assert all(int(counts.abs().sum()) == 0 for _, counts in fp8._SPLIT_WORKSPACE[x.device])


def test_split_k_workspace_grows_by_adding_buffers(monkeypatch):
    """A launch needing more partials or counters than are held gets new, larger buffers
    (counters zeroed); the old ones stay held, since captured graphs keep their addresses."""
    from vlmbatch.kernels import fp8

    device = torch.device("cpu")
    monkeypatch.setitem(fp8._SPLIT_WORKSPACE, device, [])
    first = fp8.split_buffers(device, 1000, 10)
    assert fp8.split_buffers(device, 1 << 20, 4096) is first  # the minimum sizes: 1M partials, 4096 counters
    second = fp8.split_buffers(device, (1 << 20) + 1, 10)
    assert second[0].numel() == 2 << 20 and not second[1].any() and fp8._SPLIT_WORKSPACE[device] == [first, second]


def test_split_k_workspace_is_never_allocated_during_a_graph_capture(monkeypatch):
    """A launch being captured uses the buffers already there (a captured graph keeps their
    addresses) and, where they are too small, runs unsplit rather than allocate."""
    from vlmbatch.kernels import fp8

    device = torch.device("cuda", 7)  # a key only: nothing is allocated on it here
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setitem(fp8._SPLIT_WORKSPACE, device, [(torch.empty(100), torch.zeros(10, dtype=torch.int32))])
    assert fp8.split_buffers(device, 100, 10) is fp8._SPLIT_WORKSPACE[device][-1]
    assert fp8.split_buffers(device, 101, 10) is None and fp8.split_buffers(device, 100, 11) is None
    assert len(fp8._SPLIT_WORKSPACE[device]) == 1


# The layer shapes `vlmbatch bench kernels` times (3B, 7B): (N, K).
LAYERS = {"3b qkv": (2560, 2048), "3b o": (2048, 2048), "3b gate_up": (22016, 2048), "3b down": (2048, 11008),
          "3b lm_head": (151936, 2048), "7b qkv": (4608, 3584), "7b o": (3584, 3584), "7b gate_up": (37888, 3584),
          "7b down": (3584, 18944), "7b lm_head": (152064, 3584)}  # fmt: skip
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the decode graphs' batch sizes up to 64


def test_decode_plan_follows_the_measurements_and_its_own_rules():
    """The selection table on the H200 (132 SMs): the best tiles where they were measured; a
    split over K only where the tiles leave SMs idle, up to 16 rows into as many ranges as
    give every SM two programs (at most 4), above 16 rows into 2 for a long K only, within
    its bounds."""
    from vlmbatch.kernels.fp8 import LONG_K, LONG_K_MAX_SPLIT, MAX_SPLIT_K, SPLIT_MAX_ROWS, decode_plan

    def plan(rows, layer, per_token=True):
        return decode_plan(rows, *LAYERS[layer], per_token)

    # 3B at 1 row: 80 q/k/v and 64 o / down strips of 32 -> 4 ranges; gate/up and the LM head fill the GPU
    assert [plan(1, layer).split_k for layer in ("3b qkv", "3b o", "3b down", "3b gate_up", "3b lm_head")] == [4, 4, 4, 1, 1]
    assert (plan(1, "7b o").split_k, plan(1, "7b qkv").split_k, plan(16, "3b qkv").split_k) == (3, 1, 4)  # 112 strips -> 336
    assert [plan(64, layer).split_k for layer in ("3b qkv", "3b o", "3b down", "7b down")] == [1, 1, 2, 2]
    assert (plan(32, "3b o").split_k, plan(32, "3b down", per_token=False).split_k) == (1, 2)
    assert (plan(1, "3b down").block_k, plan(64, "7b down").block_k) == (512, 512)
    assert (plan(1, "3b gate_up").block_k, plan(16, "7b gate_up").block_k, plan(1, "3b lm_head").block_k) == (128, 128, 256)
    for layer in ("3b gate_up", "3b lm_head", "7b lm_head"):
        config = plan(64, layer)
        assert (config.block_m, config.block_n, config.block_k, config.split_k) == (64, 128, 128, 1)
    for (n, k), rows, per_token in ((shape, rows, p) for shape in LAYERS.values() for rows in DECODE_ROWS for p in (True, False)):
        c = decode_plan(rows, n, k, per_token)
        tiles = -(-rows // c.block_m) * -(-n // c.block_n)
        most = MAX_SPLIT_K if rows <= SPLIT_MAX_ROWS else LONG_K_MAX_SPLIT if k >= LONG_K else 1
        assert c.block_m >= min(rows, 64) and c.block_m in (16, 32, 64)
        assert 1 <= c.split_k <= most and (c.split_k == 1 or (tiles < 132 and tiles * (c.split_k - 1) < 2 * 132))
        assert c.split_k <= max(1, -(-k // c.block_k) // 2) and c.split_k <= max(1, k // (16 * rows))
        assert per_token or c.block_k == 128


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 100])
@pytest.mark.parametrize("layout", ["channel", "blocks"])
def test_kernel_fp8_linear_runs_the_plan(rows, layout):
    """`fp8_linear` (what `Fp8Linear` runs off cuBLAS) is, bit for bit, the quantization
    kernel and the GEMM launch `decode_plan` names; past 64 rows, the prefill tiles."""
    from vlmbatch.kernels.decode_attention import sm_count
    from vlmbatch.kernels.fp8 import decode_plan, default_config, fp8_linear

    group = GROUPS[layout]
    x, w_q, w_s, bias = _decode_case(rows, 200, 384, layout)
    out = fp8_linear(x, w_q, w_s, bias, group)
    a_q, a_s = quantize_fp8(x, group)
    config = decode_plan(rows, 200, 384, group is None, sm_count(x.device)) if rows <= 64 else default_config(rows)
    assert out.dtype == x.dtype and torch.equal(out, fp8_gemm(a_q, a_s, w_q, w_s, bias, torch.float32, config=config))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 64, 512])
def test_scaled_mm_and_the_triton_gemm_agree_in_bf16_on_3b_shapes(rows):
    """cuBLAS and our kernel compute the same per-channel product; bf16 output: one rounding."""
    w_q, w_s = quantize_fp8_ref(torch.randn(22016, 2048, device="cuda") * 0.02, None)
    a_q, a_s = quantize_fp8(torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16))
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, out_dtype=torch.float32)
    for out in (scaled_mm(a_q, a_s, w_q, w_s), fp8_gemm(a_q, a_s, w_q, w_s)):
        assert out.dtype == torch.bfloat16 and (out.float() - ref).norm() / ref.norm() < 2.0**-8


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [129, 2048])
@pytest.mark.parametrize("n, k", [(2560, 2048), (22016, 2048), (2048, 11008), (3584, 18944)], ids=["3b qkv", "3b gate_up", "3b down", "7b down"])
def test_cublas_block_scaled_product_is_the_block_product_where_cublas_takes_it(rows, n, k):
    """`scaled_mm_blocks` (cuBLAS with 1x128 x 128x128 scales) computes the Triton block GEMM's
    function where cuBLAS takes the shape; where it refuses one (129 rows on the H200) or
    would compute it wrongly (K/128 = 86 for the 3B down, session 10) it raises instead of
    returning a wrong product, and the failure names the shape, so `bench kernels --sections
    fp8` can record what it takes."""
    from vlmbatch.kernels.fp8 import scaled_mm_blocks

    w_q, w_s = quantize_fp8_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    a_q, a_s = quantize_fp8(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), 128)
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, out_dtype=torch.float32)
    try:
        out = scaled_mm_blocks(a_q, a_s, w_q, w_s)
    except RuntimeError as exc:
        pytest.xfail(f"cuBLAS refused {rows}x{k} @ {k}x{n} with block scales: {str(exc)[:200]}")
    assert out.dtype == torch.bfloat16 and (out.float() - ref).norm() / ref.norm() < 2.0**-8
    assert (out.float() - fp8_gemm(a_q, a_s, w_q, w_s).float()).norm() / ref.norm() < 2.0**-7


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("layer", ["3b qkv", "3b o", "3b gate_up", "3b down"])
@pytest.mark.parametrize("layout", ["channel", "blocks"])
def test_fp8_linear_at_decode_sizes_in_bf16_on_3b_shapes(rows, layer, layout):
    """On the GPU, bf16 input: `fp8_linear` as planned equals torch's quantization with the
    reference product up to bf16's rounding; repeated launches (split ones included) agree
    bit for bit, eagerly and replayed in a CUDA graph with PDL (as decode graphs run them)."""
    from vlmbatch.kernels.fp8 import fp8_linear

    n, k = LAYERS[layer]
    group = GROUPS[layout]
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    w_q, w_s = quantize_fp8_ref(w, None) if group is None else quantize_fp8_blocks_ref(w)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if layer.endswith("qkv") else None
    out = fp8_linear(x, w_q, w_s, bias, group)
    x_q, x_s = quantize_fp8_ref(x.float(), group)
    ref = fp8_gemm_ref(x_q, x_s, w_q, w_s, bias.float() if bias is not None else None, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).norm() / ref.norm() < 2.0**-8
    assert all(torch.equal(out, fp8_linear(x, w_q, w_s, bias, group)) for _ in range(5))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, w_q, w_s, bias, group, pdl_max_rows=16)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_linear_block_layout_in_a_cuda_graph():
    """A block-layout `Fp8Linear` on 3B's gate/up shape, captured into a graph and replayed."""
    from vlmbatch.engine.kernel_choice import fp8_gemms
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    
    w_q, w_s = quantize_fp8_blocks_ref(torch.randn(22016, 2048, device="cuda") * 0.02)
    layer = Fp8Linear(w_q, w_s, None, fp8_gemms(torch.device("cuda")))
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    assert torch.equal(captured, eager)
    a_q, a_s = quantize_fp8_ref(x.float(), 128)
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s)
    assert (eager.float() - ref).norm() / ref.norm() < 2.0**-8


# slow: the default run has these cases under the interpreter already, in test_kernels_interpreter.py
# (this whole file, its skips checked); this runs them from this file alone, e.g. `pytest FILE -m slow`.
@pytest.mark.slow
@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_kernels_run_under_the_triton_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel_", "-m", "not gpu", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


@needs_kernels
@pytest.mark.parametrize("layout", ["blocks", "channel"])
def test_kernel_fp8_linear_is_the_quantized_product(layout):
    """`Fp8Linear` end to end (activation quantization + GEMM, leading dims kept) against
    the references; on the CPU up to the interpreter's few wrong e4m3 casts of activations."""
    from vlmbatch.engine.kernel_choice import Fp8Gemms
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    from vlmbatch.kernels.fp8 import scaled_mm_supported

    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 64, scaled_mm_supported, rms_norm_fp8, gated_fp8)
    w = torch.randn(192, 256, device=DEVICE) * 0.02
    w_q, w_s = quantize_fp8_blocks_ref(w) if layout == "blocks" else quantize_fp8_ref(w, None)
    bias = torch.randn(192, device=DEVICE)
    layer = Fp8Linear(w_q, w_s, bias, gemms)
    x = torch.randn(2, 3, 256, device=DEVICE)
    out = layer(x)
    a_q, a_s = quantize_fp8_ref(x.reshape(6, 256), 128 if layout == "blocks" else None)
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, bias).reshape(2, 3, 192)
    assert out.shape == (2, 3, 192) and (out - ref).norm() / ref.norm() < (1e-5 if DEVICE == "cuda" else 5e-2)


# ---- FP8 KV cache (`--kv-cache-dtype fp8`) ------------------------------------------------


def _fp8_paged_kv(context_lens: list[int], seed: int):
    from vlmbatch.kernels.testing import make_paged_kv

    kv = make_paged_kv(context_lens, 2, 32, 16, torch.float32, DEVICE, seed=seed)
    kv.k_cache, kv.v_cache = kv.k_cache.to(torch.float8_e4m3fn), kv.v_cache.to(torch.float8_e4m3fn)
    return kv


@needs_kernels
def test_kernel_attention_reads_an_fp8_cache_in_the_compute_dtype():
    """Decode and prefill attention over float8_e4m3fn caches equal the references, which
    read the same e4m3 values in float32 (the kernels cast each tile to the query's dtype)."""
    from vlmbatch.kernels import paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention, paged_prefill_attention_ref

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    kv = _fp8_paged_kv([1, 13, 40], seed=3)
    q = torch.randn(3, 8, 32, device=DEVICE, dtype=dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 32**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(paged_decode_attention(*args).float(), paged_decode_attention_ref(*args).float(), atol=tol, rtol=tol)
    q_lens = [1, 5, 40]
    cu = torch.tensor([0, 1, 6, 46], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(sum(q_lens), 8, 32, device=DEVICE, dtype=dtype)
    caches = (qp, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens)
    torch.testing.assert_close(paged_prefill_attention(*caches, 40, 32**-0.5).float(),
                               paged_prefill_attention_ref(*caches, 32**-0.5).float(), atol=tol, rtol=tol)  # fmt: skip


@needs_kernels
def test_kernel_kv_write_into_an_fp8_cache_clamps_and_rounds():
    """The KV-write kernel and the fused rotary + write store e4m3 values as the reference
    does (clamped to +-448, nearest even): exactly on the GPU; under the interpreter its
    float32 -> e4m3 cast is wrong for a few percent of values."""
    from vlmbatch.kernels import store_kvcache, store_kvcache_ref

    k = torch.randn(6, 2, 32, device=DEVICE) * 100  # some past 448
    v = torch.randn(6, 2, 32, device=DEVICE)
    slots = torch.tensor([0, 5, 17, -1, 30, 2], device=DEVICE)
    ours = [torch.zeros(4, 8, 2, 32, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(2)]
    ref = [torch.zeros_like(c) for c in ours]
    store_kvcache(k, v, *ours, slots)
    store_kvcache_ref(k, v, *ref, slots)
    from vlmbatch.kernels import apply_rotary_and_store, apply_rotary_ref

    q = torch.randn(6, 4, 32, device=DEVICE)
    angles = torch.rand(6, 16, device=DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    fused = [torch.zeros_like(c) for c in ours]
    apply_rotary_and_store(q, k, v, cos, sin, *fused, slots)
    rotated = [torch.zeros_like(c) for c in ours]
    store_kvcache_ref(apply_rotary_ref(q, k, cos, sin)[1], v, *rotated, slots)
    for a, b in [*zip(ours, ref), *zip(fused, rotated)]:
        assert not a.float().isnan().any() and a.float().abs().max() <= 448
        if DEVICE == "cuda":
            assert torch.equal(a.float(), b.float())
        else:
            assert (a.float() == b.float()).float().mean() > 0.9


# ---- FP8 experts in the fused MoE kernels ----------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("block_m, mma_rows, block_k, split_slots", [(1, 0, 64, 0), (1, 16, 64, 0), (1, 0, 64, 1), (16, 0, 64, 0), (16, 0, 256, 0)],
                         ids=["per-pair", "per-pair-mma", "per-pair-split-slots", "grouped", "grouped-wide-k-steps"])
@pytest.mark.parametrize("per_row_scales", [False, True], ids=["block-scales", "per-row-block-scales"])
def test_kernel_fused_moe_with_fp8_experts_matches_the_reference(block_m, mma_rows, block_k, split_slots, per_row_scales):
    """Block-scaled e4m3 experts (Qwen3-VL-30B-A3B-Instruct-FP8's layout): the per-pair GEMVs
    (and their MMA variants) dequantize each tile as `fused_moe_fp8_ref` dequantizes the whole
    expert, so they agree to the float32 order of additions; the grouped GEMMs quantize
    their inputs per token and 128 columns and multiply e4m3 by e4m3 (whatever K step the
    table's tile has: they step by whole 128-column groups), as the reference with
    `fp8_activations` does. The per-pair K steps of 64 columns read one row of block scales
    per step, steps of 256 a scale per column."""
    from vlmbatch.kernels.fused_moe import fused_moe
    from vlmbatch.kernels.moe_tiles import GemmTile, MoeConfig
    from vlmbatch.kernels.reference import fused_moe_fp8_ref

    experts, hidden, intermediate, tokens, top_k = 4, 256, 128, 9, 2
    gen = torch.Generator().manual_seed(0)

    def quantized(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_fp8_ref(torch.randn(rows, k, generator=gen), 128) if per_row_scales else
                 quantize_fp8_blocks_ref(torch.randn(rows, k, generator=gen)) for _ in range(experts)]  # fmt: skip
        return torch.stack([w for w, _ in parts]).to(DEVICE), torch.stack([s for _, s in parts]).to(DEVICE)

    w_gate_up, s_gate_up = quantized(2 * intermediate, hidden)
    w_down, s_down = quantized(hidden, intermediate)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE) * 0.1
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    config = MoeConfig(block_m, GemmTile(32, block_k, mma_rows=mma_rows), GemmTile(32, block_k, mma_rows=mma_rows, split_slots=split_slots))
    out = fused_moe(x, w_gate_up, w_down, weights, ids, config, gate_up_scales=s_gate_up, down_scales=s_down)
    ref = fused_moe_fp8_ref(x, w_gate_up, w_down, weights, ids, s_gate_up, s_down, fp8_activations=block_m > 1)
    # The grouped GEMMs quantize their inputs with `quantize_fp8`, bit for bit torch's cast on
    # the GPU; the interpreter's float32 -> e4m3 cast rounds ~2% of the values differently (by
    # up to 2x, module docstring of kernels/fp8.py), which the CPU bound allows for. The
    # products themselves are checked exactly on both by the expert-level test below.
    bound = 0.15 if block_m > 1 and DEVICE == "cpu" else 1e-5
    assert (out - ref).norm() / ref.norm() < bound


@needs_kernels
@pytest.mark.parametrize("hidden", [256, 320], ids=["whole-groups", "a-partial-group"])
def test_kernel_grouped_expert_gemms_multiply_e4m3_activations_by_e4m3_weights(hidden):
    """The grouped gate/up and down GEMMs on inputs already in e4m3 (quantized by the torch
    reference, so nothing here depends on the interpreter's cast): each 128-column step's
    e4m3 product times its activation and weight scales equals the float32 product of the
    dequantized operands, a K that ends inside a group included."""
    from vlmbatch.kernels.fused_moe import expert_down, expert_gate_up
    from vlmbatch.kernels.moe_align import moe_align
    from vlmbatch.kernels.moe_tiles import GemmTile

    experts, intermediate, tokens, top_k = 4, 128, 9, 2
    gen = torch.Generator().manual_seed(1)

    def quantized(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_fp8_blocks_ref(torch.randn(rows, k, generator=gen)) for _ in range(experts)]
        return torch.stack([w for w, _ in parts]).to(DEVICE), torch.stack([s for _, s in parts]).to(DEVICE)

    def dequantized(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.stack([dequantize_fp8_ref(w[e], s[e]) for e in range(experts)])

    w_gate_up, s_gate_up = quantized(2 * intermediate, hidden)
    w_down, s_down = quantized(hidden, intermediate)
    x_q, x_s = (t.to(DEVICE) for t in quantize_fp8_ref(torch.randn(tokens, hidden, generator=gen), 128))
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    blocks = moe_align(ids.to(torch.int32), experts, 16)
    act = expert_gate_up(x_q, w_gate_up, blocks, top_k, GemmTile(32, 128), scales=s_gate_up, hidden_scales=x_s, out_dtype=torch.float32)
    gate, up = torch.einsum("th,tknh->tkn", dequantize_fp8_ref(x_q, x_s), dequantized(w_gate_up, s_gate_up)[ids]).chunk(2, dim=-1)
    expected_act = (torch.nn.functional.silu(gate) * up).flatten(0, 1)
    assert act.dtype == torch.float32 and (act - expected_act).norm() / expected_act.norm() < 1e-5
    act_q, act_s = quantize_fp8_ref(expected_act, 128)
    per_pair = expert_down(act_q, w_down, weights, blocks, GemmTile(32, 128), scales=s_down, act_scales=act_s, out_dtype=torch.float32)
    expected = torch.einsum("pi,phi->ph", dequantize_fp8_ref(act_q, act_s), dequantized(w_down, s_down)[ids.flatten()]) * weights.reshape(-1, 1)
    assert (per_pair - expected).norm() / expected.norm() < 1e-5
    with pytest.raises(ValueError, match="K steps dividing 128"):
        expert_down(act_q, w_down, weights, blocks, GemmTile(32, 256), scales=s_down, act_scales=act_s, out_dtype=torch.float32)


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_fp8_kernels_compile_for_hopper():
    """The interpreter cannot check the GPU code, so compile for sm_90 here: the scaled GEMM
    must multiply e4m3 tiles on the tensor cores (Hopper wgmma for 64-row tiles and more,
    mma below) at every tile shape `default_config` picks; the norm's FP8 output and the KV
    write into an FP8 cache must build and convert to e4m3, and split-KV decode must read an
    FP8 cache into its tensor-core products. (The quantization's and the gated activation's
    launches: `test_kernels_hopper_compile.py`.)"""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fp8 import _fp8_gemm_kernel, default_config
    from vlmbatch.kernels.kv_cache_write import _store_kvcache_kernel

    def build(fn, args: dict[str, str], constants: dict, **options) -> str:
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in args.items()
                   if kind.startswith("*") or name.startswith("stride") or name in ("N", "K")}  # fmt: skip
        source = ASTSource(fn, {**args, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
        return compile(source, target=GPUTarget("cuda", 90, 64), options=options).asm["ptx"]

    gemm = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            **dict.fromkeys("M N K stride_am stride_asm stride_wn stride_wsn stride_om".split(), "i32")}  # fmt: skip
    for rows in (1, 64, 512):
        config = default_config(rows)
        for scale_rows, per_row in ((128, False), (1, True)):
            constants = dict(SCALE_ROWS=scale_rows, PER_ROW_SCALES=per_row, HAS_BIAS=per_row, PDL=False,
                             BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=128)  # fmt: skip
            ptx = build(_fp8_gemm_kernel, gemm, constants, num_warps=config.num_warps, num_stages=config.num_stages)
            assert ("wgmma" in ptx and "e4m3" in ptx) if config.block_m >= 64 else "mma" in ptx, (rows, per_row)
    from vlmbatch.kernels.norm import _rms_norm_kernel

    norm = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
            "residual_out_ptr": "*bf16", "eps": "fp32",
            **dict.fromkeys("stride_x stride_residual stride_out stride_scale stride_residual_out".split(), "i32")}  # fmt: skip
    for group in (128, 4096):  # block-wise and per-token scales of a 3,584-wide row
        ptx = build(_rms_norm_kernel, norm, dict(HIDDEN=3584, BLOCK=4096, HAS_RESIDUAL=True, OFFSET=False, FP8_GROUP=group,
                                                 FP8_MAX_C=448.0, MIN_SCALE_C=1e-12, PDL=False), num_warps=16)  # fmt: skip
        assert "e4m3" in ptx, group
    store = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_mapping_ptr": "*i64",
             **dict.fromkeys("stride_k_tok stride_k_head stride_v_tok stride_v_head stride_cache_slot stride_cache_head".split(), "i32")}  # fmt: skip
    assert "e4m3" in build(_store_kvcache_kernel, store, dict(NUM_HEADS=2, HEAD_DIM=128, BLOCK_H=2, BLOCK_D=128, FP8_CACHE=True), num_warps=4)
    from vlmbatch.kernels.decode_attention import _decode_split_kernel

    strides = ("stride_q_seq stride_q_head stride_k_block stride_k_slot stride_k_head stride_v_block stride_v_slot stride_v_head "
               "stride_bt_seq stride_o_seq stride_o_head stride_o_split stride_lse_seq stride_lse_head")  # fmt: skip
    decode = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
              "out_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32", "num_splits": "i32", "window": "i32", **dict.fromkeys(strides.split(), "i32")}  # fmt: skip
    ptx = build(_decode_split_kernel, decode, dict(GROUP_SIZE=8, PAGE_SIZE=256, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128,
                                                   STORE_LSE=True, PDL=False), num_warps=4)  # fmt: skip
    assert "mma" in ptx  # the e4m3 K/V tiles are converted to bf16 and go to the tensor cores


@needs_kernels
def test_kernel_fused_moe_block_with_fp8_experts_runs_them_as_the_fp8_reference():
    """`FusedMoE.use_fp8` (what loading an FP8 MoE checkpoint does where the kernels run):
    the block routes as transformers does and its experts compute what the reference
    computes for FP8 experts (grouped GEMMs at 5 tokens: w8a8)."""
    from vlmbatch import kernels
    from vlmbatch.engine.layers.moe import FusedMoE, select_experts
    from vlmbatch.kernels.reference import fused_moe_fp8_ref

    torch.manual_seed(0)
    ours = FusedMoE(128, 128, 4, 2, kernels=kernels, device=DEVICE, dtype=torch.float32)
    ours.gate.weight.data.normal_(0, 0.1)
    gate_up = [quantize_fp8_blocks_ref(torch.randn(256, 128, device=DEVICE)) for _ in range(4)]
    down = [quantize_fp8_blocks_ref(torch.randn(128, 128, device=DEVICE)) for _ in range(4)]
    ours.use_fp8(*(torch.stack(t) for t in zip(*gate_up)), *(torch.stack(t) for t in zip(*down)))
    x = torch.randn(5, 128, device=DEVICE) * 0.1
    weights, ids = select_experts(ours.gate(x), 2)
    expected = fused_moe_fp8_ref(x, ours.gate_up, ours.down, weights, ids, **ours.fp8_scales, fp8_activations=True)
    bound = 0.15 if DEVICE == "cpu" else 1e-5  # the interpreter's e4m3 cast (see the grouped test above)
    assert ours.gate_up.dtype == torch.float8_e4m3fn and (ours(x) - expected).norm() / expected.norm() < bound


@needs_kernels
def test_kernel_dummy_decoder_is_built_directly_in_fp8():
    """`load_format="dummy"` where FP8 GEMMs run: a decoder built on "meta" gets its
    projections as `Fp8Linear` (e4m3 weights, never a compute-dtype copy) and its MoE
    experts in e4m3 with block scales; norms at one; the layers compute."""
    from transformers import Qwen3VLMoeTextConfig

    from vlmbatch import kernels
    from vlmbatch.engine.decoder import Decoder, DecoderSpec
    from vlmbatch.engine.dummy_weights import materialize
    from vlmbatch.engine.kernel_choice import TORCH_KERNELS, Fp8Gemms
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    from vlmbatch.engine.layers.moe import FusedMoE
    from vlmbatch.engine.layers.rotary import RotaryEmbedding
    from vlmbatch.kernels.fp8 import scaled_mm_supported
    from vlmbatch.quantization import online_scheme

    cfg = Qwen3VLMoeTextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=64)  # fmt: skip
    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 64, scaled_mm_supported, rms_norm_fp8, gated_fp8)
    kernel_set = dataclasses.replace(TORCH_KERNELS, fp8=gemms)

    def mlp(text, layer, ks):
        return FusedMoE.from_config(text, kernels=kernels, device="meta")

    with torch.device("meta"):
        decoder = Decoder(cfg, RotaryEmbedding(torch.ones(16)), DecoderSpec(qk_norm=True, mlp=mlp), kernel_set)
    materialize(decoder, torch.device(DEVICE), torch.float32, online_scheme("fp8-block"), kernel_set)
    attention, moe = decoder.layers[0].self_attn, decoder.layers[0].mlp
    assert isinstance(attention.qkv_proj, Fp8Linear) and attention.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.gate_up.dtype == torch.float8_e4m3fn and moe.fp8_scales["gate_up_scales"].shape == (4, 2, 1)
    assert decoder.lm_head.weight.dtype == torch.float32 and torch.equal(decoder.norm.weight, torch.ones(128, device=DEVICE))
    assert not any(t.is_meta for t in [*decoder.parameters(), *decoder.buffers()])
    x = torch.randn(3, 128, device=DEVICE)
    assert attention.qkv_proj(x).shape == (3, 256) and moe(x).isfinite().all()


def test_the_block_scaled_cublas_product_refuses_k_groups_cublas_got_wrong():
    """K/128 = 86 (the 3B down): the H200's cuBLAS returned a wrong product there, so the
    wrapper refuses before calling it, on any device, naming K."""
    from vlmbatch.kernels.fp8 import scaled_mm_blocks

    a_q, a_s = quantize_fp8_ref(torch.randn(4, 11008), 128)
    w_q, w_s = quantize_fp8_blocks_ref(torch.randn(256, 11008))
    with pytest.raises(RuntimeError, match="K = 11008: K/128 = 86"):
        scaled_mm_blocks(a_q, a_s, w_q, w_s)
