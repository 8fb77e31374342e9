"""Paged decode and prefill attention kernels against their pure-torch references.

Runs wherever the kernels can: under TRITON_INTERPRET=1 on the CPU (launched by
test_kernels_interpreter.py when the suite runs without it) or on a CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch

from vlmbatch.kernels import (
    DecodeConfig,
    PrefillConfig,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from vlmbatch.kernels.testing import TOLERANCE, kernel_target, make_paged_kv

TARGET = kernel_target()
needs_kernels = pytest.mark.skipif(
    TARGET is None, reason="needs a GPU or TRITON_INTERPRET=1 (test_kernels_interpreter.py runs it so)"
)
DTYPES = TARGET.dtypes if TARGET else ()
SCALE = 0.3


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def random_queries(num_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(dtype).to(TARGET.device)


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=TARGET.device)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(8, 2, 32), (4, 4, 16), (12, 2, 24)],
    ids=["gqa4", "mha", "gqa6-dim24"],
)
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, num_splits):
    # 1 token, a partial page, exact pages, several pages; 8 splits leave some splits empty.
    context_lens = [1, 13, 32, 75]
    kv = make_paged_kv(context_lens, num_kv_heads, head_dim, 16, dtype, TARGET.device, seed=1)
    q = random_queries(len(context_lens), num_q_heads, head_dim, dtype, seed=2)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, SCALE)
    out = paged_decode_attention(*args, num_splits=num_splits, config=DecodeConfig(block_n=16))
    assert_matches(out, paged_decode_attention_ref(*args))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("page_size", "block_n"), [(8, 32), (32, 16)], ids=["tile-spans-pages", "page-spans-tiles"])
def test_decode_tiles_independent_of_page_size(dtype, page_size, block_n):
    context_lens = [5, 40, 66]
    kv = make_paged_kv(context_lens, 2, 32, page_size, dtype, TARGET.device, seed=3)
    q = random_queries(len(context_lens), 8, 32, dtype, seed=4)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, SCALE)
    out = paged_decode_attention(*args, num_splits=2, config=DecodeConfig(block_n=block_n))
    assert_matches(out, paged_decode_attention_ref(*args))


@needs_kernels
def test_decode_of_an_empty_context_is_zero():
    """A padding row (context 0, e.g. in a CUDA-graph batch) must give zeros, not NaN."""
    dtype = DTYPES[-1]
    kv = make_paged_kv([20, 1], 2, 16, 16, dtype, TARGET.device, seed=5)
    kv.context_lens[1] = 0
    q = random_queries(2, 4, 16, dtype, seed=6)
    for num_splits in (1, 2):
        out = paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, SCALE, num_splits=num_splits
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = paged_decode_attention_ref(q[:1], kv.k_cache, kv.v_cache, kv.block_tables[:1], kv.context_lens[:1], SCALE)
        assert_matches(out[:1], ref)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 2), (6, 6)], ids=["gqa4", "mha"])
@pytest.mark.parametrize(
    ("block_m", "block_n", "page_size"),
    [(16, 16, 16), (32, 16, 64), (16, 32, 16)],
    ids=["tile-is-page", "tiles-in-page", "tile-spans-pages"],
)
def test_prefill_matches_reference_on_mixed_batches(dtype, num_q_heads, num_kv_heads, block_m, block_n, page_size):
    # fresh prompt; prefix-cache hit; one decode-like query; a chunk ending mid-page; a
    # prompt longer than one query tile.
    q_lens = [20, 7, 1, 11, 40]
    context_lens = [20, 37, 50, 27, 40]
    head_dim = 32
    kv = make_paged_kv(context_lens, num_kv_heads, head_dim, page_size, dtype, TARGET.device, seed=7)
    q = random_queries(sum(q_lens), num_q_heads, head_dim, dtype, seed=8)
    cu = cu_seqlens(q_lens)
    out = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, max(q_lens), SCALE,
        config=PrefillConfig(block_m=block_m, block_n=block_n),
    )  # fmt: skip
    ref = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, SCALE)
    assert_matches(out, ref)


@needs_kernels
def test_prefill_with_one_query_per_sequence_equals_decode():
    dtype = DTYPES[0]
    context_lens = [1, 30, 64]
    kv = make_paged_kv(context_lens, 2, 32, 16, dtype, TARGET.device, seed=9)
    q = random_queries(len(context_lens), 8, 32, dtype, seed=10)
    prefill = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([1, 1, 1]), kv.context_lens, 1, SCALE,
        config=PrefillConfig(block_m=16, block_n=16),
    )  # fmt: skip
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, SCALE)
    assert_matches(prefill, decode)


def test_num_splits_heuristic_fills_the_gpu_only_when_needed():
    assert choose_num_splits(256, 2, 1024, 132, 64) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 2, 4096, 132, 64) == 32  # one sequence: split as far as allowed
    assert choose_num_splits(1, 2, 100, 132, 64) == 1  # too short to split into 2-tile ranges
    few = choose_num_splits(32, 2, 4096, 132, 64)
    assert 1 < few and 32 * 2 * few >= 2 * 132


# ---- sliding windows and bidirectional spans (Gemma 3) ---------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "num_splits"), [(1, None), (5, 4), (40, 1), (40, 4)])
def test_decode_with_a_sliding_window_matches_reference(dtype, window, num_splits):
    # contexts shorter than, equal to and far longer than the window; tiles of 16 so the
    # window's first key falls mid-tile.
    context_lens = [1, 5, 23, 75, 130]
    kv = make_paged_kv(context_lens, 2, 32, 16, dtype, TARGET.device, seed=11)
    q = random_queries(len(context_lens), 8, 32, dtype, seed=12)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, SCALE)
    out = paged_decode_attention(*args, num_splits=num_splits, config=DecodeConfig(block_n=16), window=window)
    ref = paged_decode_attention_ref(*args, window=window)
    assert_matches(out, ref)
    if window < 75:  # the window changes the answer: a test that could not fail otherwise
        assert not torch.allclose(ref[3].float(), paged_decode_attention_ref(*args)[3].float(), atol=1e-3)


def span_key_ends(q_lens: list[int], context_lens: list[int], spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Per query: its position + 1, or the end of the bidirectional span it sits in."""
    ends = []
    for q_len, ctx, seq_spans in zip(q_lens, context_lens, spans):
        for pos in range(ctx - q_len, ctx):
            ends.append(next((e for s, e in seq_spans if s <= pos < e), pos + 1))
    return torch.tensor(ends, dtype=torch.int32, device=TARGET.device)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "block_m", "with_spans"),
    [(0, 16, True), (4, 32, True), (13, 16, True), (13, 32, False), (64, 16, True)],
)
def test_prefill_with_windows_and_spans_matches_reference(dtype, window, block_m, with_spans):
    # fresh prompts; a chunk after cached tokens whose span started in the cache (a prefix
    # hit ending mid-image); two spans in one query tile; spans longer than the window;
    # a one-query row.
    q_lens = [40, 19, 1, 33]
    context_lens = [40, 37, 50, 70]
    spans = [[(3, 21), (22, 30)], [(10, 30)], [], [(37, 38), (40, 69)]] if with_spans else [[] for _ in q_lens]
    kv = make_paged_kv(context_lens, 2, 32, 16, dtype, TARGET.device, seed=13)
    q = random_queries(sum(q_lens), 8, 32, dtype, seed=14)
    cu = cu_seqlens(q_lens)
    key_ends = span_key_ends(q_lens, context_lens, spans) if with_spans else None
    out = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, max(q_lens), SCALE,
        config=PrefillConfig(block_m=block_m, block_n=16), window=window, key_ends=key_ends,
    )  # fmt: skip
    ref = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, SCALE,
                                      window=window, key_ends=key_ends)
    assert_matches(out, ref)
    if with_spans:  # the spans change the answer
        causal = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, SCALE,
                                             window=window)
        assert not torch.allclose(ref[:40].float(), causal[:40].float(), atol=1e-3)


def test_prefill_launch_table_round_trip_and_lookup(tmp_path):
    """`bench kernels --write-table` keeps each length's fastest config; the kernel reads it
    back and picks the shortest swept length covering the step (the longest beyond them)."""
    from vlmbatch.bench.kernels import write_prefill_table
    from vlmbatch.kernels.prefill_attention import choose_prefill_config, load_tuned_configs

    small, large, other = PrefillConfig(64, 32, 4, 2), PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 32, 4, 3)
    rows = [
        {"length": 512, "config": small, "ms": 1.0, "tflop_s": 300.0},
        {"length": 512, "config": large, "ms": 1.2, "tflop_s": 250.0},
        {"length": 512, "config": None, "ms": 0.5, "tflop_s": 600.0},  # a peer (SDPA): never a launch
        {"length": 4096, "config": other, "ms": 9.0, "tflop_s": 280.0},
        {"length": 4096, "config": large, "ms": 8.0, "tflop_s": 320.0},
    ]
    table = load_tuned_configs(write_prefill_table(rows, "test GPU", tmp_path / "prefill_tuned.json"))
    assert table == {512: small, 4096: large}
    assert choose_prefill_config(1, table) == small
    assert choose_prefill_config(512, table) == small
    assert choose_prefill_config(513, table) == large
    assert choose_prefill_config(100_000, table) == large
    assert choose_prefill_config(100, {}) == PrefillConfig()


@needs_kernels
def test_triton_backend_runs_leading_one_token_rows_through_decode():
    """A mixed prefill step as the scheduler orders it: two decoding rows first (the decode
    kernel), then a prefix-cache hit and a fresh prompt (the prefill kernel); a sliding
    window too."""
    from vlmbatch.engine.attention import AttentionMetadata, TritonBackend

    dtype = DTYPES[0]
    q_lens, context_lens = [1, 1, 9, 20], [30, 5, 25, 20]
    kv = make_paged_kv(context_lens, 2, 32, 16, dtype, TARGET.device, seed=15)
    q = random_queries(sum(q_lens), 8, 32, dtype, seed=16)
    cu = cu_seqlens(q_lens)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(1, dtype=torch.int64, device=TARGET.device), block_tables=kv.block_tables,
        context_lens=kv.context_lens, cu_seqlens_q=cu, max_q_len=max(q_lens), max_context_len=max(context_lens),
        q_lens=q_lens, context_lens_host=context_lens, num_decode_rows=2,
    )  # fmt: skip
    for window in (0, 6):
        out = TritonBackend().prefill(q, None, None, kv.k_cache, kv.v_cache, meta, SCALE, window)
        ref = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, SCALE, window=window)
        assert_matches(out, ref)
