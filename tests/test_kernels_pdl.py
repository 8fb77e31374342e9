"""Programmatic dependent launch: where it applies, and that a kernel chain captured with
it computes bit for bit what plain launches compute (on a Hopper-or-newer GPU)."""

from __future__ import annotations

import pytest
import torch

from vlmbatch.kernels import apply_rotary_and_store, rms_norm
from vlmbatch.kernels.skinny_gemm import skinny_linear


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to("cuda")


def test_pdl_applies_only_inside_its_scope_and_only_on_a_gpu():
    from vlmbatch.kernels.pdl import launch_options, launches_with_pdl, pdl_enabled

    cpu = torch.zeros(1)
    with launches_with_pdl(True):
        assert not pdl_enabled(cpu)  # never off a GPU (nor under the interpreter)
        with launches_with_pdl(False):
            assert not pdl_enabled(cpu)
    assert launch_options(False) == {"PDL": False}
    assert launch_options(True) == {"PDL": True, "launch_pdl": True}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs a Hopper-or-newer GPU")
def test_pdl_chain_in_a_cuda_graph_computes_what_plain_launches_compute():
    """A decode-like chain (norm, linear, rotary + KV write, attention, linear) captured with
    and without PDL: PDL only changes when kernels start, so the results are bit-identical."""
    from vlmbatch.kernels import launches_with_pdl, paged_decode_attention
    from vlmbatch.kernels.pdl import device_supports_pdl, pdl_enabled
    from vlmbatch.kernels.testing import make_paged_kv

    assert device_supports_pdl(torch.cuda.current_device())
    dtype, hidden, q_heads, kv_heads, head_dim = torch.bfloat16, 512, 8, 2, 64
    x, residual = randn(1, hidden, dtype=dtype, seed=10), randn(1, hidden, dtype=dtype, seed=11)
    norm_weight = randn(hidden, dtype=dtype, seed=12)
    qkv_weight = randn((q_heads + 2 * kv_heads) * head_dim, hidden, dtype=dtype, seed=13) / hidden**0.5
    o_weight = randn(hidden, q_heads * head_dim, dtype=dtype, seed=14) / hidden**0.5
    cos, sin = randn(1, head_dim, dtype=dtype, seed=15), randn(1, head_dim, dtype=dtype, seed=16)
    kv = make_paged_kv([37], kv_heads, head_dim, block_size=16, dtype=dtype, device="cuda", seed=17)
    slot = (kv.block_tables[:, 36 // 16].long() * 16 + 36 % 16).cuda()  # the new token's slot

    def chain(k_cache, v_cache):
        h, _ = rms_norm(x, norm_weight, 1e-6, residual)
        q, k, v = skinny_linear(h, qkv_weight).split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, _ = apply_rotary_and_store(q.view(1, q_heads, head_dim), k.view(1, kv_heads, head_dim), v.reshape(1, kv_heads, head_dim),
                                      cos, sin, k_cache, v_cache, slot)
        out = paged_decode_attention(q, k_cache, v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)
        return skinny_linear(out.reshape(1, -1), o_weight)

    results = []
    for with_pdl in (False, True):
        k_cache, v_cache = kv.k_cache.clone(), kv.v_cache.clone()
        with launches_with_pdl(with_pdl):
            assert pdl_enabled(x) == with_pdl  # the second chain really launches with PDL
            chain(k_cache, v_cache)  # compile outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(k_cache, v_cache)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), k_cache, v_cache))
    for plain, pdl in zip(*results):
        assert torch.equal(plain, pdl)
