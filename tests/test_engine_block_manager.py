"""Block manager: ref counts, prefix-cache hits (tokens and media), freeing and eviction."""

from vlmbatch.engine.block_manager import BlockManager
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.sequence import MultimodalData, Sequence
from vlmbatch.families.prompt import MediaItem


def make_seq(tokens, request_id="r", media=None):
    """`media`: (content hash, (start, end) placeholder span) per image."""
    items = [MediaItem("image", {}, end - start, content_hash) for content_hash, (start, end) in media or ()]
    mm = MultimodalData(items=items, token_spans=[span for _, span in media]) if media else None
    return Sequence(request_id, list(tokens), SamplingParams(), mm=mm)


def run_prefill(bm, seq):
    hits = bm.match_prefix(seq)
    assert bm.can_allocate(seq, len(seq), hits)
    bm.allocate(seq, len(seq), hits)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return hits


def test_allocate_counts_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    run_prefill(bm, seq)
    assert len(seq.block_tables[0]) == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_tables[0])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_tables == [] and seq.num_computed_tokens == 0


def test_shared_prefix_hits_full_blocks_and_shares_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(9)), "a")
    run_prefill(bm, first)
    second = make_seq(list(range(8)) + [99, 100], "b")
    hits = run_prefill(bm, second)
    assert hits == [first.block_tables[0][:2]]
    assert bm.num_prefix_hit_tokens == 8
    assert [bm.blocks[b].ref_count for b in hits[0]] == [2, 2]
    assert second.block_tables[0][2] != first.block_tables[0][2]
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in hits[0]] == [1, 1]


def test_whole_prompt_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prefill(bm, make_seq(range(8), "a"))
    again = make_seq(range(8), "b")
    assert len(bm.match_prefix(again)[0]) == 1  # 8 tokens: only block 0; the last token must run


def test_same_tokens_different_image_do_not_share():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = [1, 5, 5, 5, 5, 5, 2, 3, 4]
    run_prefill(bm, make_seq(tokens, "a", media=[("cat", (1, 6))]))
    assert bm.match_prefix(make_seq(tokens, "b", media=[("dog", (1, 6))])) == [[]]
    assert len(bm.match_prefix(make_seq(tokens, "c", media=[("cat", (1, 6))]))[0]) == 2


def test_uncommitted_blocks_are_not_hits_and_disabled_cache_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    pending = make_seq(range(9), "a")
    bm.allocate(pending, len(pending))  # KV not computed yet
    assert bm.match_prefix(make_seq(range(9), "b")) == [[]]
    off = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run_prefill(off, make_seq(range(9), "a"))
    assert off.match_prefix(make_seq(range(9), "b")) == [[]]


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(range(9), "a")
    run_prefill(bm, seq)
    bm.free(seq)
    assert len(bm.match_prefix(make_seq(range(9), "b"))[0]) == 2
    other = make_seq(range(100, 112), "c")  # needs all 3 blocks: evicts the cached ones
    run_prefill(bm, other)
    bm.free(other)
    assert bm.match_prefix(make_seq(range(9), "d")) == [[]]


def test_can_allocate_counts_revived_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(range(9), "a")
    run_prefill(bm, seq)
    bm.free(seq)
    again = make_seq(range(12), "b")
    hits = bm.match_prefix(again)
    assert len(hits[0]) == 2 and bm.can_allocate(again, 12, hits)
    assert not bm.can_allocate(again, 13, hits)


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    kept = make_seq(range(9), "a")
    run_prefill(bm, kept)
    dropped = make_seq(range(50, 59), "b")
    run_prefill(bm, dropped)
    bm.free(dropped)
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(range(50, 59), "c")) == [[]]
    assert bm.match_prefix(make_seq(range(9), "d")) == [kept.block_tables[0][:2]]
