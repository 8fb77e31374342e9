"""KV-cache write, RMSNorm and rotary kernels against their references, and the
references against the Hugging Face layers they stand in for.

Kernel cases run under TRITON_INTERPRET=1 on the CPU (launched by
test_kernels_interpreter.py when the suite runs without it) or on a CUDA GPU; the
reference-vs-Hugging-Face cases are plain torch and run there too.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from vlmbatch.kernels import apply_rotary, apply_rotary_and_store, apply_rotary_ref, rms_norm, rms_norm_ref, store_kvcache, store_kvcache_ref
from vlmbatch.kernels.skinny_gemm import SkinnyConfig, skinny_linear
from vlmbatch.kernels.testing import TOLERANCE, kernel_target

TARGET = kernel_target()
needs_kernels = pytest.mark.skipif(
    TARGET is None, reason="needs a GPU or TRITON_INTERPRET=1 (test_kernels_interpreter.py runs it so)"
)
DTYPES = TARGET.dtypes if TARGET else ()


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(TARGET.device)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_writes_only_mapped_slots(dtype):
    num_kv_heads, head_dim, num_tokens = 2, 24, 6
    # k and v are strided views into a fused qkv projection, as the engine produces them.
    qkv = randn(num_tokens, 3, num_kv_heads, head_dim, dtype=dtype, seed=0)
    k, v = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.tensor([5, 17, -1, 0, 31, -1], dtype=torch.int64, device=TARGET.device)
    k_cache = randn(4, 8, num_kv_heads, head_dim, dtype=dtype, seed=1)
    v_cache = randn(4, 8, num_kv_heads, head_dim, dtype=dtype, seed=2)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, expected_k, expected_v, slot_mapping)

    store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[17], k[1])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48], ids=["pow2", "masked"])
@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_matches_reference(dtype, hidden, offset):
    x = randn(2, 3, hidden, dtype=dtype, seed=3)
    residual = randn(2, 3, hidden, dtype=dtype, seed=4)
    weight = randn(hidden, dtype=dtype, seed=5)
    atol, rtol = TOLERANCE[dtype]

    torch.testing.assert_close(rms_norm(x, weight, 1e-6, offset=offset), rms_norm_ref(x, weight, 1e-6, offset=offset),
                               atol=atol, rtol=rtol)
    out, new_residual = rms_norm(x, weight, 1e-6, residual=residual, offset=offset)
    expected_out, expected_residual = rms_norm_ref(x, weight, 1e-6, residual=residual, offset=offset)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected_out, atol=atol, rtol=rtol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_geglu_matches_gemmas_activation(dtype):
    from transformers.activations import ACT2FN

    from vlmbatch.engine.layers.activation import gelu_tanh_and_mul
    from vlmbatch.kernels import fused_gelu_tanh_and_mul

    gate_up = randn(3, 2 * 1500, dtype=dtype, seed=11) * 3  # two column blocks, a ragged tail, both tails of tanh
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up  # Gemma3MLP's own
    assert torch.equal(gelu_tanh_and_mul(gate_up), expected)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(fused_gelu_tanh_and_mul(gate_up), expected, atol=atol, rtol=rtol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype):
    num_tokens, head_dim = 5, 32
    q = randn(num_tokens, 6, head_dim, dtype=dtype, seed=6)
    k = randn(num_tokens, 2, head_dim, dtype=dtype, seed=7)
    angles = randn(num_tokens, head_dim, dtype=torch.float32, seed=8)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    atol, rtol = TOLERANCE[dtype]
    for actual, expected in zip(apply_rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)):
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("offset", [False, True], ids=["qwen2", "gemma3"])
def test_rms_norm_reference_is_hugging_faces_norm(offset):
    """Qwen2's norm (the weight times the rounded normalised value), or with `offset`
    Gemma 3's ((1 + w) in fp32, one rounding): each equals its own, not the other."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hidden = 64
    layer = (Gemma3RMSNorm if offset else Qwen2RMSNorm)(hidden, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(9)))
        x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
        assert torch.equal(rms_norm_ref(x, layer.weight, 1e-6, offset=offset), layer(x))
        assert not torch.equal(rms_norm_ref(x, layer.weight, 1e-6, offset=not offset), layer(x))


def test_rotary_reference_with_gathered_mrope_cos_sin_is_hugging_faces_mrope():
    """M-RoPE is only a different cos/sin: its sections are interleaved before the rotation."""
    head_dim = 32
    config = Qwen2VLTextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )  # fmt: skip
    rotary = Qwen2VLRotaryEmbedding(config)
    num_tokens = 6
    generator = torch.Generator().manual_seed(11)
    position_ids = torch.randint(0, 50, (3, 1, num_tokens), generator=generator)  # distinct t, h, w positions
    q = torch.randn(num_tokens, 2, head_dim, generator=generator)
    k = torch.randn(num_tokens, 1, head_dim, generator=generator)
    cos, sin = rotary(q, position_ids)  # [1, tokens, head_dim], sections already interleaved

    hf_q, hf_k = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    ref_q, ref_k = apply_rotary_ref(q, k, cos[0], sin[0])
    torch.testing.assert_close(ref_q, hf_q[0])
    torch.testing.assert_close(ref_k, hf_k[0])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias", "config"),
    [
        (1, 96, 256, True, SkinnyConfig(block_n=32, block_k=128)),  # one decoding sequence, q/k/v with bias
        (5, 80, 200, False, SkinnyConfig(block_n=32, block_k=64)),  # ragged N and K: the masked paths
        (64, 64, 128, False, SkinnyConfig(block_n=16, block_k=128)),  # the largest batch it serves
    ],
)
def test_skinny_linear_matches_f_linear(dtype, rows, n, k, bias, config):
    x = randn(rows, k, dtype=dtype, seed=3)
    weight = randn(n, k, dtype=dtype, seed=4) / k**0.5
    b = randn(n, dtype=dtype, seed=5) if bias else None
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())

    out = skinny_linear(x, weight, b, config)

    assert out.dtype == dtype and out.shape == (rows, n)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@needs_kernels
def test_skinny_linear_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(randn(65, 32, dtype=DTYPES[0], seed=0), randn(16, 32, dtype=DTYPES[0], seed=1))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_and_store_equals_rotary_then_store(dtype):
    num_tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = randn(num_tokens, q_heads + 2 * kv_heads, head_dim, dtype=dtype, seed=6)  # strided views, as the engine has them
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    angles = randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=7).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slot_mapping = torch.tensor([3, 12, -1, 0, 7], dtype=torch.int64, device=TARGET.device)
    k_cache = randn(2, 8, kv_heads, head_dim, dtype=dtype, seed=8)
    v_cache = randn(2, 8, kv_heads, head_dim, dtype=dtype, seed=9)
    expected_q, expected_k = apply_rotary(q, k, cos, sin)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(expected_k, v, expected_k_cache, expected_v_cache, slot_mapping)

    out_q, out_k = apply_rotary_and_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(k_cache, expected_k_cache) and torch.equal(v_cache, expected_v_cache)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True], ids=["qwen3", "gemma"])
@pytest.mark.parametrize("head_dim", [16, 24], ids=["pow2", "masked"])
def test_rotary_with_head_norms_equals_norms_then_rotary(dtype, offset, head_dim):
    """Qwen3's / Gemma 3's q/k head norms inside the rotary launch: the same values as the
    norm kernel on each head followed by the plain launch, on strided views of one q/k/v
    projection as the decoder has them."""
    num_tokens, q_heads, kv_heads = 5, 4, 2
    qkv = randn(num_tokens, q_heads + 2 * kv_heads, head_dim, dtype=dtype, seed=10) * 3
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    angles = randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=11).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_weight, k_weight = randn(head_dim, dtype=dtype, seed=12), randn(head_dim, dtype=dtype, seed=13)
    eps = 1e-6
    slot_mapping = torch.tensor([3, 12, -1, 0, 7], dtype=torch.int64, device=TARGET.device)
    k_cache, v_cache = randn(2, 8, kv_heads, head_dim, dtype=dtype, seed=14), randn(2, 8, kv_heads, head_dim, dtype=dtype, seed=15)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    expected_q, expected_k = apply_rotary_ref(rms_norm_ref(q, q_weight, eps, offset=offset), rms_norm_ref(k, k_weight, eps, offset=offset),
                                              cos, sin)
    store_kvcache_ref(expected_k, v, expected_k_cache, expected_v_cache, slot_mapping)

    out_q, out_k = apply_rotary_and_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, head_norms=(q_weight, k_weight, eps, offset))
    plain_q, plain_k = apply_rotary(q, k, cos, sin, head_norms=(q_weight, k_weight, eps, offset))

    atol, rtol = TOLERANCE[dtype]
    for out, expected in ((out_q, expected_q), (out_k, expected_k), (plain_q, expected_q), (plain_k, expected_k),
                          (k_cache, expected_k_cache), (v_cache, expected_v_cache)):
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    unnormed_q, _ = apply_rotary(q, k, cos, sin)
    assert not torch.allclose(unnormed_q.float(), out_q.float(), atol=atol, rtol=rtol)  # the norms did something
