"""The torch attention backend follows the paged-KV contract defined by the kernels' references."""

import pytest
import torch

from vlmbatch.engine.attention import AttentionMetadata, TorchBackend, available_backends, create_backend
from vlmbatch.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def paged_setup(context_lens, q_lens):
    """A shuffled block pool holding random KV for each sequence, plus metadata."""
    torch.manual_seed(0)
    blocks_per_seq = [(c + BLOCK - 1) // BLOCK for c in context_lens]
    order = torch.randperm(sum(blocks_per_seq)).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(order[at : at + n] + [-1] * (max(blocks_per_seq) - n))
        at += n
    shape = (sum(blocks_per_seq), BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    slots = []
    for table, ctx, q_len in zip(tables, context_lens, q_lens):
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(ctx - q_len, ctx)]
    meta = AttentionMetadata(
        is_prefill=max(q_lens) > 1,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        max_q_len=max(q_lens),
        max_context_len=max(context_lens),
        q_lens=q_lens,
        context_lens_host=context_lens,
    )
    return k_cache, v_cache, meta


def step_kv(cache, meta):
    """The keys/values this step wrote (the backend receives them besides the cache)."""
    return cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping]


def test_decode_matches_reference():
    k_cache, v_cache, meta = paged_setup([1, 7, 13], [1, 1, 1])
    q = torch.randn(3, HEADS, DIM)
    out = TorchBackend().decode(q, k_cache, v_cache, meta, 0.3)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.3)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    ("context_lens", "q_lens"),
    [
        ([11, 9, 4], [5, 9, 1]),  # a chunk after 6 cached tokens, a fresh prompt, one token after 3 cached
        ([9, 4, 13], [1, 4, 1]),  # two decoding sequences share the step with a 4-token chunk
    ],
)
def test_prefill_matches_reference(context_lens, q_lens):
    k_cache, v_cache, meta = paged_setup(context_lens, q_lens)
    q = torch.randn(sum(q_lens), HEADS, DIM)
    out = TorchBackend().prefill(q, step_kv(k_cache, meta), step_kv(v_cache, meta), k_cache, v_cache, meta, 0.3)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, 0.3)
    torch.testing.assert_close(out, expected)


def test_store_writes_each_token_into_its_slot():
    k_cache, v_cache, meta = paged_setup([6], [6])
    k, v = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    TorchBackend().store_kv(k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(k_cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.view(-1, KV_HEADS, DIM)[meta.slot_mapping], v)


def test_auto_is_torch_on_cpu():
    assert available_backends(torch.device("cpu")) == ["torch"]
    assert create_backend("auto", torch.device("cpu")).name == "torch"
