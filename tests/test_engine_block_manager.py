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


# ---- KV-cache groups: a global group and sliding-window ones share the pool -------------


def decode_to(bm, seq, length):
    """Decode `seq` (prefilled) one token at a time up to `length` tokens, as the scheduler does."""
    while len(seq) < length:
        seq.token_ids.append(7)
        assert bm.can_allocate(seq, len(seq))
        bm.allocate(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        bm.commit(seq)
        bm.release_out_of_window(seq)


def test_a_sliding_group_frees_the_blocks_its_window_left_behind():
    bm = BlockManager(num_blocks=32, block_size=4, windows=(0, 6))
    seq = make_seq(range(10))
    run_prefill(bm, seq)
    bm.release_out_of_window(seq)
    assert [len(t) for t in seq.block_tables] == [3, 3] and bm.num_free_blocks == 26
    decode_to(bm, seq, 11)  # the next query (position 11) sees keys 6.. : block 0 is behind it
    assert seq.block_tables[1][0] == bm.null_block == 32 and bm.num_free_blocks == 27
    decode_to(bm, seq, 21)  # position 21 sees keys 16..: blocks 0..3 behind it
    global_table, sliding = seq.block_tables
    assert len(global_table) == 6 and sliding[:4] == [bm.null_block] * 4 and bm.null_block not in sliding[4:]
    assert bm.num_window_freed_blocks == 4 and bm.num_free_blocks == 32 - 6 - 2
    bm.free(seq)  # the null entries are nobody's
    assert bm.num_free_blocks == 32 and all(b.ref_count == 0 for b in bm.blocks)


def test_one_group_never_frees_early():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(range(10))
    run_prefill(bm, seq)
    decode_to(bm, seq, 30)
    assert bm.null_block not in seq.block_tables[0] and bm.num_window_freed_blocks == 0


def test_allocation_counts_a_block_per_group():
    bm = BlockManager(num_blocks=7, block_size=4, windows=(0, 8, 8))
    seq = make_seq(range(10))
    assert not bm.can_allocate(seq, 10)  # 3 blocks in each of 3 groups
    assert bm.can_allocate(seq, 8)
    bm.allocate(seq, 8)
    assert [len(t) for t in seq.block_tables] == [2, 2, 2] and len({b for t in seq.block_tables for b in t}) == 6


def test_the_longest_sequence_alone_counts_windows_and_chunks():
    assert BlockManager(num_blocks=30, block_size=4).max_tokens_alone(8) == 120
    # each sliding group: (8 + 8) / 4 + 1 blocks, one more for a fork's start: 6; the global one the rest
    assert BlockManager(num_blocks=30, block_size=4, windows=(0, 8, 8)).max_tokens_alone(8) == (30 - 12) * 4
    assert BlockManager(num_blocks=30, block_size=4, windows=(0, 8, 8)).max_tokens_alone(40) == 30 // 3 * 4


def test_a_fork_shares_the_window_the_parent_kept_for_it():
    """Until it samples a token the parent keeps what a fork's first query (the end of the
    full prompt blocks) sees, not only its own next query's window."""
    bm = BlockManager(num_blocks=32, block_size=4, windows=(0, 12))
    parent = make_seq(range(21), "p")
    run_prefill(bm, parent)
    bm.release_out_of_window(parent)  # the fork starts at 20, which sees keys 9..: block 2 on
    assert parent.block_tables[1][:2] == [bm.null_block] * 2 and bm.null_block not in parent.block_tables[1][2:]
    child = make_seq(range(21), "c")
    bm.fork(parent, child)
    assert child.num_computed_tokens == 20 and child.block_tables[1] == parent.block_tables[1][:5]
    assert [bm.blocks[b].ref_count for b in child.block_tables[1][2:]] == [2, 2, 2]
    assert [bm.blocks[b].ref_count for b in child.block_tables[0]] == [2] * 5
    decode_to(bm, parent, 30)  # the parent moves on (position 30 sees 19..); the child still holds its window
    assert [bm.blocks[b].ref_count for b in child.block_tables[1][2:]] == [1, 1, 2]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 32


def test_a_prefix_hit_needs_each_sliding_window_cached():
    """The hit's global blocks from the start, a sliding group's only from where its next
    query's window begins: freed blocks still cached are revived, and a hit shrinks to
    where every sliding group's window is still cached."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(0, 6))
    first = make_seq(range(30), "a")
    run_prefill(bm, first)
    decode_to(bm, first, 40)  # the sliding group dropped blocks 0..7, which stay cached
    assert first.block_tables[1][:8] == [bm.null_block] * 8
    again = make_seq(range(30), "b")
    hits = bm.match_prefix(again)  # 7 blocks (the last token is left to compute); position 28 sees 23..: blocks 5, 6
    assert hits[0] == first.block_tables[0][:7] and hits[1][:5] == [bm.null_block] * 5 and len(hits[1]) == 7
    assert bm.can_allocate(again, 30, hits)
    free_before = bm.num_free_blocks
    bm.allocate(again, 30, hits)
    assert bm.num_free_blocks == free_before - 2 - 2  # blocks 5 and 6 revived, one new block per group
    bm.free(again)
    del bm.hash_to_block[1][first.block_hashes[6]]  # evicted: the 7-block hit lacks its window
    assert len(bm.match_prefix(make_seq(range(30), "c"))[0]) == 6
    bm.reset_prefix_cache()  # every dropped sliding block forgotten: no window left for any hit
    assert bm.match_prefix(make_seq(range(30), "d")) == [[], []]
