"""Scheduler: continuous batching, chunked prefill budget, preemption and resumption."""

from types import SimpleNamespace

from vlmbatch.engine.block_manager import BlockManager
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.scheduler import Scheduler
from vlmbatch.engine.sequence import MultimodalData, Sequence, SequenceStatus


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def run_step(scheduler, next_token=7):
    """Schedule, pretend the model ran, append a token to sequences whose tokens are all computed."""
    batch = scheduler.schedule()
    scheduler.finish_step(batch)
    for seq in batch.seqs:
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(next_token)
    return batch


def test_prefill_then_decode_and_new_requests_join_running_batch_without_stalling_it():
    sched = make_scheduler()
    a = Sequence("a", [1, 2, 3], SamplingParams())
    sched.add(a)
    first = run_step(sched)
    assert first.is_prefill and first.num_new_tokens == [3]
    assert not run_step(sched).is_prefill
    b = Sequence("b", [4, 5], SamplingParams())
    sched.add(b)
    joined = run_step(sched)  # a keeps decoding in the step that prefills b
    assert joined.is_prefill and joined.seqs == [a, b] and joined.num_new_tokens == [1, 2]
    decode = run_step(sched)
    assert not decode.is_prefill and decode.seqs == [a, b] and decode.num_new_tokens == [1, 1]


def test_a_prefill_step_lists_its_one_token_rows_first():
    """Decoding rows lead a mixed step, whatever the running order: attention runs them as
    one decode batch (`AttentionMetadata.num_decode_rows`)."""
    sched = make_scheduler(budget=4)
    a, c = Sequence("a", [1, 2], SamplingParams()), Sequence("c", list(range(10)), SamplingParams())
    sched.add(a)
    sched.add(c)
    first = run_step(sched)
    assert first.seqs == [a, c] and first.num_new_tokens == [2, 2]
    sched.running.reverse()  # c (mid-prompt) ahead of a (decoding)
    mixed = run_step(sched)
    assert mixed.is_prefill and mixed.seqs == [a, c] and mixed.num_new_tokens == [1, 3]


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(budget=5)
    long_seq = Sequence("long", list(range(12)), SamplingParams())
    short = Sequence("short", [1, 2], SamplingParams())
    sched.add(long_seq)
    sched.add(short)
    chunks = []
    while long_seq.num_computed_tokens < 12:
        batch = run_step(sched)
        assert batch.is_prefill and batch.num_tokens <= 5
        chunks.append(dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)))
    assert chunks[0] == {"long": 5} and chunks[1] == {"long": 5} and chunks[2] == {"long": 2, "short": 2}
    assert sched.num_chunked_prefills == 2 and len(long_seq) == 13


def test_max_num_seqs_limits_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(Sequence(str(i), [1, 2], SamplingParams()))
    batch = run_step(sched)
    assert [s.request_id for s in batch.seqs] == ["0", "1"] and len(sched.waiting) == 1


def test_decoders_count_against_the_prompt_budget():
    sched = make_scheduler(budget=6)
    a, b = Sequence("a", [1, 2], SamplingParams()), Sequence("b", [3, 4], SamplingParams())
    sched.add(a)
    sched.add(b)
    run_step(sched)
    late = Sequence("late", list(range(10)), SamplingParams())
    sched.add(late)
    batch = run_step(sched)
    assert batch.num_new_tokens == [1, 1, 4] and sched.num_chunked_prefills == 1


def test_preempts_newest_when_blocks_run_out_and_resumes_it():
    sched = make_scheduler(num_blocks=4, block_size=4)
    old = Sequence("old", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    new = Sequence("new", [9, 8, 7, 6, 5, 4, 3], SamplingParams())
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled: 2 blocks each, cache full
    batch = run_step(sched)  # both have 8 tokens, still fit
    assert batch.seqs == [old, new]
    batch = run_step(sched)  # 9 tokens need a third block: "new" is preempted
    assert batch.seqs == [old] and sched.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.block_tables == [] and sched.waiting[0] is new
    sched.remove(old)  # old finishes: its blocks come back
    resumed = run_step(sched)
    assert resumed.is_prefill and resumed.seqs == [new]
    assert new.num_computed_tokens == 9 and len(new) == 10


def test_admission_batch_holds_new_requests_until_enough_slots_are_free():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, min_admission_batch=2)
    running = [Sequence(name, [1, 2], SamplingParams()) for name in "abc"]
    for seq in running:
        sched.add(seq)
    assert run_step(sched).seqs == running  # nothing running: admitted at once
    late = [Sequence(name, [3, 4], SamplingParams()) for name in "de"]
    for seq in late:
        sched.add(seq)
    held = run_step(sched)  # one free slot of the two wanted: a pure decode step
    assert not held.is_prefill and held.seqs == running
    sched.remove(running[0])
    sched.remove(running[1])
    joined = run_step(sched)
    assert joined.is_prefill and joined.seqs == [running[2], *late]


def test_decodes_next_only_for_a_pure_decode_of_the_same_sequences():
    """What lets the engine launch the next decode step before reading this one's tokens."""
    sched = make_scheduler(num_blocks=3, block_size=4, budget=64)
    a, b = Sequence("a", [1, 2, 3], SamplingParams()), Sequence("b", [4, 5, 6], SamplingParams())
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled, one token each: 4 tokens in one block each
    assert sched.decodes_next([a, b])
    assert not sched.decodes_next([b, a]) and not sched.decodes_next([a])  # other rows than the step in flight
    run_step(sched)  # a 5th token each: the next step needs a second block for both, one is free
    assert not sched.decodes_next([a, b])  # the step would preempt
    c = Sequence("c", [7], SamplingParams())
    sched.remove(b)
    sched.add(c)
    assert not sched.decodes_next([a])  # c is waiting to be admitted


def test_chunks_never_end_inside_a_bidirectional_span():
    """A chunk stops before a span it cannot finish; a span larger than the budget is taken
    whole by the step's first prompt chunk."""
    sched = make_scheduler(num_blocks=32, budget=6)
    seq = Sequence("img", list(range(100, 120)), SamplingParams())
    seq.mm = MultimodalData(items=[], token_spans=[], bidirectional_spans=[(3, 5), (8, 17)])
    other = Sequence("other", list(range(9)), SamplingParams())
    sched.add(other)
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < 20:
        batch = run_step(sched)
        chunks.append({s.request_id: (s.num_computed_tokens - n, n) for s, n in zip(batch.seqs, batch.num_new_tokens)})
    # other takes the first 6; img starts beside other's last 3 with tokens 0..2 (not into
    # the span 3..5); then 3..7 beside other's first decode, stopping before the span
    # 8..17, which alone exceeds the budget and so is taken whole (9 tokens) by the next
    # step's first prompt chunk.
    assert chunks[0] == {"other": (0, 6)}
    assert chunks[1] == {"other": (6, 3), "img": (0, 3)}
    assert chunks[2] == {"other": (9, 1), "img": (3, 5)}
    assert chunks[3] == {"other": (10, 1), "img": (8, 9)}
    assert chunks[4] == {"other": (11, 1), "img": (17, 3)}
    for chunk in chunks:
        start, n = chunk.get("img", (0, 0))
        assert not any(s < start + n < e for s, e in seq.mm.bidirectional_spans)


def _image_prompt(request_id: str, image_hash: str, image_tokens: int = 16) -> Sequence:
    """Two text tokens, the image, one text token: with 4-token blocks a repeat finds every
    full block cached, the image's end among them only when the image ends by a block end."""
    seq = Sequence(request_id, [1, 2] + [9] * image_tokens + [3], SamplingParams())
    seq.mm = MultimodalData(items=[SimpleNamespace(num_tokens=image_tokens, content_hash=image_hash)],
                            token_spans=[(2, 2 + image_tokens)])
    return seq


def test_a_step_encodes_at_most_its_token_budget_of_media_when_prompts_are_mostly_cached():
    """A repeat of image prompts costs 3 uncached tokens each, but their images still need
    the tower (the last one ends past the cached blocks): the step admits prompts only while
    their media fit the token budget, so the tower never gets hundreds at once; the first
    prompt of a step is admitted whatever its media."""
    sched = make_scheduler(num_blocks=64, budget=40)
    first = [_image_prompt(f"p{i}", f"h{i}") for i in range(6)]
    for seq in first:
        sched.add(seq)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in first):
        run_step(sched)
    for seq in first:
        sched.remove(seq)  # their full blocks stay in the prefix cache
    again = [_image_prompt(f"again{i}", f"h{i}") for i in range(6)]
    for seq in again:
        sched.add(seq)
    batch = sched.schedule()
    assert [seq.num_computed_tokens for seq in batch.seqs] == [16, 16]  # 4 cached blocks each
    assert batch.num_new_tokens == [3, 3] and batch.seqs == again[:2]  # 2 x 16 media tokens fit 40, a third would not

    big = make_scheduler(num_blocks=64, budget=40)
    large = [_image_prompt("large", "h-large", image_tokens=48), _image_prompt("next", "h-next")]
    for seq in large:
        big.add(seq)
    assert big.schedule().seqs == [large[0]]  # 48 media tokens alone, over the budget: the step's first prompt


def test_sliding_groups_free_blocks_during_chunked_prefill_and_decode():
    """Two sequences of 24 tokens hold 2 x 6 blocks in each of two groups at the end: 24
    blocks, more than the pool; the sliding group (window 4) frees what falls behind, so
    both run to the end without preemption, and `decodes_next` counts both groups."""
    sched = Scheduler(BlockManager(20, 4, windows=(0, 4)), max_num_seqs=2, max_num_batched_tokens=8)
    bm = sched.block_manager
    a, b = Sequence("a", list(range(12)), SamplingParams()), Sequence("b", list(range(50, 62)), SamplingParams())
    sched.add(a)
    sched.add(b)
    assert run_step(sched).num_new_tokens == [8]  # a's first chunk: its next chunk starts at 8, which sees 5..
    assert a.block_tables[1][0] == bm.null_block and bm.null_block not in a.block_tables[0]
    while len(b) < 24:
        run_step(sched)
    assert sched.num_preemptions == 0 and 2 * (a.num_table_blocks + b.num_table_blocks) > 20  # whole tables would not fit
    for seq in (a, b):  # the next query sees keys from num_computed - 3 on
        first_kept = (seq.num_computed_tokens - 3) // 4
        assert seq.block_tables[1][:first_kept] == [bm.null_block] * first_kept
        assert bm.null_block not in seq.block_tables[1][first_kept:] + seq.block_tables[0]
    held = {block for seq in (a, b) for table in seq.block_tables for block in table} - {bm.null_block}
    assert bm.num_free_blocks == 20 - len(held) > 0
    while not any(s.num_computed_tokens + 1 > s.num_table_blocks * 4 for s in (a, b)):
        run_step(sched)
    needed = 2 * sum(s.num_computed_tokens + 1 > s.num_table_blocks * 4 for s in (a, b))  # a block in each group
    filler = Sequence("f", list(range(40)), SamplingParams())
    while bm.num_free_blocks >= 2:
        assert sched.decodes_next([a, b]) == (needed <= bm.num_free_blocks)
        bm.allocate(filler, (filler.num_table_blocks + 1) * 4)
    assert not sched.decodes_next([a, b])
