"""FP8 kernels (`kernels/fp8.py`) against their torch references, and `Fp8Linear` on a GPU.

Kernel cases (`test_kernel_*`) run on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1:
when this process cannot run them, `test_kernels_run_under_the_triton_interpreter` runs
them in a fresh interpreter process. The interpreter's fp8 `tl.dot` is exact, but its
float32 -> e4m3 cast rounds a few percent of values wrongly (seen: 1.989 -> 1.0 where
torch gives 2.0): there the quantization test checks the scales exactly and that over 90%
of the values equal torch's; on the GPU it checks both exactly. The `gpu` cases also run the
per-channel product through `torch._scaled_mm` and an `Fp8Linear` on 3B shapes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmbatch.kernels.fp8 import fp8_gemm, quantize_fp8, scaled_mm
from vlmbatch.kernels.reference import fp8_gemm_ref, quantize_fp8_blocks_ref, quantize_fp8_ref
from vlmbatch.kernels.testing import kernel_target

TARGET = kernel_target()
needs_kernels = pytest.mark.skipif(TARGET is None, reason="needs a GPU or TRITON_INTERPRET=1 (test_kernels_run_under_the_triton_interpreter runs them so)")
DEVICE = TARGET.device if TARGET else "cpu"
gpu = pytest.mark.gpu


@needs_kernels
@pytest.mark.parametrize("rows, k, group", [(1, 64, None), (5, 200, 128), (33, 384, 128), (7, 1000, None)])
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

    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 64, scaled_mm_supported)
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
@pytest.mark.parametrize("block_m", [1, 16], ids=["per-pair", "grouped"])
@pytest.mark.parametrize("per_row_scales", [False, True], ids=["block-scales", "per-row-block-scales"])
def test_kernel_fused_moe_with_fp8_experts_matches_the_reference(block_m, per_row_scales):
    """Block-scaled e4m3 experts (Qwen3-VL-30B-A3B-Instruct-FP8's layout): the grouped GEMMs
    and the per-pair GEMVs dequantize each tile as `fused_moe_fp8_ref` dequantizes the whole
    expert, so they agree to the float32 order of additions."""
    from vlmbatch.kernels.fused_moe import GemmTile, MoeConfig, fused_moe
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
    config = MoeConfig(block_m, GemmTile(32, 64), GemmTile(32, 64))
    out = fused_moe(x, w_gate_up, w_down, weights, ids, config, gate_up_scales=s_gate_up, down_scales=s_down)
    ref = fused_moe_fp8_ref(x, w_gate_up, w_down, weights, ids, s_gate_up, s_down)
    assert (out - ref).norm() / ref.norm() < 1e-5


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
def test_fp8_kernels_compile_for_hopper():
    """The interpreter cannot check the GPU code, so compile for sm_90 here: the scaled GEMM
    must multiply e4m3 tiles on the tensor cores (Hopper wgmma for 64-row tiles and more,
    mma below) at every tile shape `default_config` picks; the quantization kernel and the
    KV write into an FP8 cache must build and convert to e4m3, and split-KV decode must read
    an FP8 cache into its tensor-core products."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.fp8 import _fp8_gemm_kernel, _quantize_kernel, default_config
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
    quant = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", **dict.fromkeys("K stride_xm stride_qm stride_sm".split(), "i32")}
    ptx = build(_quantize_kernel, quant, dict(GROUP=128, BLOCK=128, FP8_MAX_C=448.0, MIN_SCALE_C=1e-12, PDL=False), num_warps=1)
    assert "e4m3" in ptx
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
def test_kernel_fused_moe_block_with_fp8_experts_equals_the_dequantized_block():
    """`FusedMoE.use_fp8` (what loading an FP8 MoE checkpoint does where the kernels run):
    the block's output equals the torch reference block holding the dequantized experts."""
    from vlmbatch import kernels
    from vlmbatch.engine.layers.moe import FusedMoE
    from vlmbatch.kernels.reference import dequantize_fp8_ref

    torch.manual_seed(0)
    ours = FusedMoE(128, 128, 4, 2, kernels=kernels, device=DEVICE, dtype=torch.float32)
    reference = FusedMoE(128, 128, 4, 2, kernels=None, device=DEVICE, dtype=torch.float32)
    ours.gate.weight.data.normal_(0, 0.1)
    reference.gate.weight.data.copy_(ours.gate.weight)
    gate_up = [quantize_fp8_blocks_ref(torch.randn(256, 128, device=DEVICE)) for _ in range(4)]
    down = [quantize_fp8_blocks_ref(torch.randn(128, 128, device=DEVICE)) for _ in range(4)]
    ours.use_fp8(*(torch.stack(t) for t in zip(*gate_up)), *(torch.stack(t) for t in zip(*down)))
    reference.gate_up.data.copy_(torch.stack([dequantize_fp8_ref(w, s) for w, s in gate_up]))
    reference.down.data.copy_(torch.stack([dequantize_fp8_ref(w, s) for w, s in down]))
    x = torch.randn(5, 128, device=DEVICE) * 0.1
    expected = reference(x)
    assert ours.gate_up.dtype == torch.float8_e4m3fn and (ours(x) - expected).norm() / expected.norm() < 1e-5


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
    gemms = Fp8Gemms(quantize_fp8, fp8_gemm, scaled_mm, 64, scaled_mm_supported)
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
