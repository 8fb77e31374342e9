"""PagedEngine on CPU (fp32, tiny checkpoints) against `transformers` `generate()`.

The cache and token budget are made small on purpose so that chunked prefill,
preemption, prefix-cache hits and encoder-cache hits all happen; the stats counters
prove they did. Greedy tokens must be identical to HF's for every request.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import (single_thread, WORDS, assert_logprobs_match, build_requests, hf_greedy, hf_greedy_logprobs, qwen_prompt,
                            run_greedy, run_to_completion)

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.families.registry import load_adapter

@pytest.mark.parametrize(("arch", "count"), [("qwen2_5_vl", 30), ("llava", 24), ("qwen2_vl", 8)])
def test_greedy_tokens_match_transformers(arch, count, tiny_model_dir):
    path = str(tiny_model_dir(arch))
    adapter = load_adapter(path)
    hf_model = load_hf_model(path, torch.float32, torch.device("cpu"))
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=48, block_size=4,
        max_num_seqs=6, max_num_batched_tokens=40, min_admission_batch=1,  # admit eagerly: forces preemption
    ))
    requests = build_requests(adapter, arch, count, seed=1)
    prepared, outputs = run_greedy(engine, adapter, requests)

    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        ours = outputs[request_id].outputs[0]
        assert_logprobs_match(outputs[request_id], hf_greedy_logprobs(hf_model, adapter, prompt, max_tokens), request_id)
        assert ours.text == adapter.tokenizer.decode(ours.token_ids, skip_special_tokens=True)
        assert ours.finish_reason == ("stop" if ours.token_ids[-1] in adapter.eos_token_ids else "length")
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    assert stats.num_mixed_decode_rows > 0  # decoding rows in prefill steps: decode-step inputs, one decode batch
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # all freed


def test_static_decode_buffers_with_padding_match_transformers(tiny_qwen):
    """The CUDA-graph decode path (static buffers, batch padded to a captured size, padding
    rows writing into the spare block) run eagerly on the CPU."""
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=7))
    engine.async_decode = True  # graph inputs fed from the previous step's tokens on the device
    engine.runner.prepare_static_decode(7, capture=False)
    assert sorted(engine.runner.graphs) == [1, 2, 4, 7]
    hf_model = load_hf_model(path, torch.float32, torch.device("cpu"))
    prepared, outputs = run_greedy(engine, adapter, build_requests(adapter, "qwen2_5_vl", 10, seed=5))
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    assert engine.stats.num_graph_replays == engine.stats.num_decode_steps > engine.stats.num_async_decode_steps > 0


@pytest.fixture(scope="module")
def qwen_engine(tiny_model_dir):
    path = str(tiny_model_dir("qwen2_5_vl"))
    adapter = load_adapter(path)
    return adapter, PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4))


def generate(engine, adapter, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (text, params) in requests.items():
        engine.add_request(request_id, adapter.prepare(text, max_tokens=params.max_tokens), params)
    return run_to_completion(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(qwen_engine):
    adapter, engine = qwen_engine
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = generate(engine, adapter, {"s": (qwen_prompt("the cat", 0, False), seeded)})
    crowd = {f"o{i}": (qwen_prompt("the dog runs " * i, 0, False), SamplingParams(max_tokens=8, temperature=1.0)) for i in range(5)}
    crowd["s"] = (qwen_prompt("the cat", 0, False), seeded)
    together = generate(engine, adapter, crowd)
    assert together["s"].outputs[0].token_ids == alone["s"].outputs[0].token_ids


def test_stop_string_truncates_text_and_abort_drops_request(qwen_engine):
    adapter, engine = qwen_engine
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = generate(engine, adapter, {"a": (qwen_prompt("the park", 0, False), greedy)})["a"].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip() and full.text.find(stop) > 0
    engine.add_request("stopped", adapter.prepare(qwen_prompt("the park", 0, False)), greedy.updated(stop=(stop,)))
    engine.add_request("aborted", adapter.prepare(qwen_prompt("the mat", 0, False)), greedy)
    engine.step()
    engine.abort_request("aborted")
    outputs = run_to_completion(engine)
    assert "aborted" not in outputs
    stopped = outputs["stopped"].outputs[0]
    assert stopped.text == full.text[: full.text.find(stop)]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_completions_come_back_together_and_follow_their_seeds(qwen_engine):
    adapter, engine = qwen_engine
    prompt = qwen_prompt("the quick brown fox", 0, False)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3, ignore_eos=True)
    output = generate(engine, adapter, {"many": (prompt, params)})["many"]
    assert [c.index for c in output.outputs] == [0, 1, 2] and output.finished
    assert all(len(c.token_ids) == 10 for c in output.outputs)
    # sampled bytes often end mid-character: the final text still is the full decode
    assert all(c.text == adapter.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # completion k is the single request seeded seed + k
    second = generate(engine, adapter, {"one": (prompt, params.updated(n=1, seed=4))})["one"]
    assert second.outputs[0].token_ids == output.outputs[1].token_ids


def test_request_longer_than_the_cache_is_a_row_error(tiny_qwen):
    from vlmbatch.errors import ErrorType, RowError

    path = str(tiny_qwen)
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=4, block_size=4))
    prompt = adapter.prepare(qwen_prompt("the cat", 0, False))
    assert prompt.num_tokens + 1 > 4 * 4  # more than the 4 blocks of 4 slots hold
    with pytest.raises(RowError) as raised:
        engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    assert raised.value.error_type == ErrorType.PROMPT_TOO_LONG
    assert not engine.has_unfinished_requests()


def test_streamed_texts_grow_into_the_final_text(qwen_engine):
    adapter, engine = qwen_engine
    prompt = adapter.prepare(qwen_prompt("a person is riding", 0, False))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    engine.stream_outputs = True
    engine.add_request("s", prompt, params)
    texts = []
    try:
        while engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in engine.step()]
    finally:
        engine.stream_outputs = False
    assert len(texts) == 20 and all(texts[-1].startswith(text) for text in texts)
    # batch mode (the default): one output, at the end, with the same text
    engine.add_request("b", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].text) for o in outputs] == [("b", True, texts[-1])]


def test_asynchronous_decoding_gives_the_synchronous_tokens(tiny_qwen):
    """Decode step n + 1 is launched on step n's tokens before the host reads them: EOS,
    stop strings, length limits and an abort while a step is in flight must come out as
    when every step is awaited."""
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    texts = [qwen_prompt(" ".join(WORDS[i : i + 5]), 0, False) for i in range(6)]
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0, ignore_eos=i % 2 == 0) for i in range(6)]
    results = {}
    for async_decode in (False, True):
        engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4))
        engine.async_decode = async_decode
        for i, (text, p) in enumerate(zip(texts, params)):
            engine.add_request(str(i), adapter.prepare(text, max_tokens=p.max_tokens), p)
        engine.add_request("aborted", adapter.prepare(texts[0]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                finished[output.request_id] = output
            if engine.stats.num_decode_steps == 3 and "aborted" in engine.requests:
                engine.abort_request("aborted")
        results[async_decode] = {k: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for k, o in finished.items()}
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert (engine.stats.num_async_decode_steps > 0) == async_decode
    assert sorted(results[True]) == [str(i) for i in range(6)]
    assert results[True] == results[False]


def test_decoding_rows_of_a_prefill_step_get_the_per_sequence_inputs(tiny_qwen, monkeypatch):
    """A prefill step's decoding rows are built as a decode step's plain lists
    (`_leading_decode_rows`); they must equal what the per-sequence path builds: ids,
    embeddings, M-RoPE positions (images make rope_delta non-zero), slots, lengths."""
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
                                               max_num_seqs=8, max_num_batched_tokens=512, min_admission_batch=1))
    engine.async_decode = False  # no step in flight while this test schedules one by hand
    requests = build_requests(adapter, "qwen2_5_vl", 6, seed=3)
    for request_id, text, images, videos, _ in requests[:4]:
        engine.add_request(request_id, adapter.prepare(text, images, videos, 40), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()  # the four prompts
    engine.step()  # their first decode step
    for request_id, text, images, videos, _ in requests[4:]:
        engine.add_request(request_id, adapter.prepare(text, images, videos, 40), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    batch = engine.scheduler.schedule()
    engine._encode_media(batch)
    runner = engine.runner
    assert batch.is_prefill and runner._leading_decode_rows(batch) == 4
    assert any(seq.mm is not None and seq.mm.rope_delta != 0 for seq in batch.seqs[:4])
    fast = runner._prefill_inputs(batch)
    monkeypatch.setattr(type(runner), "_leading_decode_rows", staticmethod(lambda batch: 0))
    slow = runner._prefill_inputs(batch)
    torch.testing.assert_close(fast[0], slow[0], rtol=0, atol=0)  # embeddings
    assert torch.equal(fast[1], slow[1])  # positions [3, tokens]
    for got, expected in zip(fast[2], slow[2]):
        assert torch.equal(got.slot_mapping, expected.slot_mapping) and torch.equal(got.block_tables, expected.block_tables)
        assert (got.q_lens, got.context_lens_host, got.num_decode_rows) == (expected.q_lens, expected.context_lens_host, 4)
