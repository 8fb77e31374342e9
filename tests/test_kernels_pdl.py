"""Programmatic dependent launch: where it applies, and that a kernel chain captured with
it computes bit for bit what plain launches compute (on a Hopper-or-newer GPU)."""

from __future__ import annotations

import pytest
import torch

from vlmbatch.kernels import apply_rotary_and_store, rms_norm
from vlmbatch.kernels.skinny_gemm import skinny_linear


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to("cuda")


@pytest.mark.parametrize(("rows", "max_rows", "capturing", "supported", "expected"), [
    (1, 16, True, True, True),
    (16, 16, True, True, True),
    (17, 16, True, True, False),  # a batch past the limit: plain launches
    (1, 0, True, True, False),  # VLMBATCH_PDL=0 or a device without PDL: the limit is 0
    (1, 16, False, True, False),  # eager launches never use PDL
    (1, 16, True, False, False),  # a pre-Hopper device
    (0, 16, True, True, False),  # an empty launch
])
def test_pdl_applies_to_captured_launches_up_to_the_row_limit(rows, max_rows, capturing, supported, expected):
    from vlmbatch.kernels.pdl import pdl_applies

    assert pdl_applies(rows, max_rows, capturing, supported) is expected


def test_pdl_never_applies_off_a_gpu_and_launch_options_name_the_switch():
    from vlmbatch.kernels.pdl import launch_options, pdl_launch

    assert not pdl_launch(torch.zeros(1, 4), max_rows=16)
    assert launch_options(False) == {"PDL": False}
    assert launch_options(True) == {"PDL": True, "launch_pdl": True}


def test_engine_config_sets_the_kernels_pdl_limit():
    """The kernels a model is built with carry the PDL limit chosen from the configuration:
    none with the torch kernels, none off a GPU, none with VLMBATCH_PDL=0."""
    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.kernel_choice import PDL_MAX_BATCH, choose_kernels

    cpu = torch.device("cpu")
    assert choose_kernels(EngineConfig(), cpu, "torch").pdl_max_rows == 0
    assert choose_kernels(EngineConfig(), cpu, "triton").pdl_max_rows == 0
    assert choose_kernels(EngineConfig(), cpu, "triton").rms_norm.keywords == {"pdl_max_rows": 0}
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        cuda = torch.device("cuda", 0)
        assert choose_kernels(EngineConfig(), cuda, "triton").pdl_max_rows == PDL_MAX_BATCH
        assert choose_kernels(EngineConfig.from_env({"VLMBATCH_PDL": "0"}), cuda, "triton").pdl_max_rows == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs a Hopper-or-newer GPU")
def test_pdl_chain_in_a_cuda_graph_computes_what_plain_launches_compute():
    """A decode-like chain (norm, linear, rotary + KV write, attention, linear) captured with
    and without PDL: PDL only changes when kernels start, so the results are bit-identical."""
    from vlmbatch.kernels import paged_decode_attention
    from vlmbatch.kernels.pdl import device_supports_pdl, pdl_launch
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

    def chain(k_cache, v_cache, pdl_max_rows):
        h, _ = rms_norm(x, norm_weight, 1e-6, residual, pdl_max_rows=pdl_max_rows)
        q, k, v = skinny_linear(h, qkv_weight, pdl_max_rows=pdl_max_rows).split(
            [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, _ = apply_rotary_and_store(q.view(1, q_heads, head_dim), k.view(1, kv_heads, head_dim), v.reshape(1, kv_heads, head_dim),
                                      cos, sin, k_cache, v_cache, slot, pdl_max_rows=pdl_max_rows)
        out = paged_decode_attention(q, k_cache, v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5, pdl_max_rows=pdl_max_rows)
        return skinny_linear(out.reshape(1, -1), o_weight, pdl_max_rows=pdl_max_rows)

    results = []
    for pdl_max_rows in (0, 16):
        k_cache, v_cache = kv.k_cache.clone(), kv.v_cache.clone()
        chain(k_cache, v_cache, pdl_max_rows)  # compile outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert pdl_launch(x, pdl_max_rows) == (pdl_max_rows > 0)  # the second chain really launches with PDL
            out = chain(k_cache, v_cache, pdl_max_rows)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), k_cache, v_cache))
    for plain, pdl in zip(*results):
        assert torch.equal(plain, pdl)
