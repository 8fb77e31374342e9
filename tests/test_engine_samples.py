"""n > 1 in the paged engine: samples fork from the first once its prompt is computed and
share its KV blocks; in a mixed batch with logprobs and forced preemption each sample is
exactly the n = 1 request with its own seed, and greedy samples are HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_harness import single_thread, build_requests, hf_greedy, run_to_completion

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.registry import load_adapter


def _engine(adapter, **overrides) -> PagedEngine:
    options = dict(dtype="float32", device="cpu", num_kv_blocks=256, block_size=4, min_admission_batch=1)
    return PagedEngine(adapter, EngineConfig(**{**options, **overrides}))


def test_mixed_batch_with_n_logprobs_and_preemption(tiny_qwen):
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    requests = build_requests(adapter, "qwen2_5_vl", 6, seed=7)
    prepared = {rid: adapter.prepare(text, images, videos, max_tokens=12) for rid, text, images, videos, _ in requests}
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=11, n=3, logprobs=2, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0, n=3, logprobs=1)
    plain = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.2)
    kinds = [sampled, greedy, plain]
    params = {rid: kinds[i % 3] for i, rid in enumerate(prepared)}

    # A cache too small for everyone at once: samples get preempted and recomputed.
    small = _engine(adapter, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=48)
    for rid, prompt in prepared.items():
        small.add_request(rid, prompt, params[rid])
    outputs = run_to_completion(small)
    assert small.stats.num_preemptions > 0 and small.stats.num_forked_tokens > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks

    alone = _engine(adapter)  # the reference: each sample as its own n = 1 request, room for all
    for rid, prompt in prepared.items():
        p = params[rid]
        for k in range(p.n):
            alone.add_request(f"{rid}/{k}", prompt, p.updated(n=1, seed=None if p.seed is None else p.seed + k))
    references = run_to_completion(alone)
    assert alone.stats.num_preemptions == 0
    hf_model = load_hf_model(path, torch.float32, torch.device("cpu"))
    for rid, output in outputs.items():
        p = params[rid]
        assert [c.index for c in output.outputs] == list(range(p.n))
        for k, completion in enumerate(output.outputs):
            reference = references[f"{rid}/{k}"].outputs[0]
            assert completion.token_ids == reference.token_ids, (rid, k)
            if p.logprobs is None:
                assert completion.logprobs is None
                continue
            assert [e.token_id for e in completion.logprobs] == completion.token_ids
            assert [e.logprob for e in completion.logprobs] == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-4)
            assert all(len(e.top) == p.logprobs for e in completion.logprobs)
        if p is sampled:
            assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # seeds seed, seed + 1, ...
        else:
            tokens = hf_greedy(hf_model, adapter, prepared[rid], p.max_tokens) if p is greedy else None
            assert p is plain or all(c.token_ids == tokens for c in output.outputs)  # greedy samples are identical


def test_samples_share_the_prompt_blocks_without_prefix_caching(tiny_qwen):
    adapter = load_adapter(str(tiny_qwen))
    engine = _engine(adapter, enable_prefix_caching=False, max_num_batched_tokens=512)
    prompt = adapter.prepare("<|im_start|>user\n" + "the cat sits on the mat " * 6 + "<|im_end|>\n<|im_start|>assistant\n", max_tokens=4)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=4, ignore_eos=True))
    output = run_to_completion(engine)["r"]
    shared = (prompt.num_tokens - 1) // 4 * 4
    assert engine.stats.num_forked_tokens == 3 * shared
    assert engine.stats.num_prefix_hit_tokens == 0
    assert len(output.outputs) == 4 and all(len(c.token_ids) == 4 for c in output.outputs)
