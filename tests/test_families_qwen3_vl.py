"""Qwen3-VL, dense and mixture-of-experts, on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

Fifty mixed requests (text only, up to three images of odd sizes and aspect ratios, a
timestamped video, exact repeats) through a small KV cache and token budget, so batching,
chunked prefill (also through DeepStack's media rows), preemption and prefix- and
encoder-cache hits all happen; the engine's counters prove they did.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import build_requests, hf_greedy, make_video, qwen_prompt, run_to_completion

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.registry import load_adapter

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3(request, tiny_model_dir):
    torch.set_num_threads(1)
    path = str(tiny_model_dir(request.param))
    return load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def test_fifty_mixed_requests_match_transformers(qwen3):
    adapter, hf_model = qwen3
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=96, block_size=4,
                                               max_num_seqs=6, max_num_batched_tokens=48, min_admission_batch=1))
    requests = build_requests(adapter, "qwen3_vl", 50, seed=3, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared = {}
    for request_id, text, images, videos, max_tokens in requests:
        prepared[request_id] = (adapter.prepare(text, images, videos, max_tokens), max_tokens)
        engine.add_request(request_id, prepared[request_id][0], SamplingParams(max_tokens=max_tokens, temperature=0))
    outputs = run_to_completion(engine)
    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    assert {len(images) for _, _, images, _, _ in requests} == {0, 1, 2, 3}
    assert any(videos for *_, videos, _ in requests)


def test_video_frames_carry_their_real_timestamps(qwen3):
    """Each temporal pair of frames is preceded by its timestamp (the pair's mean), in the
    prompt the processor writes, from the frames' own presentation times."""
    adapter, _ = qwen3
    video = make_video(1, frames=4)  # frames at 0, 0.5, 1.0, 1.5 s
    text = adapter.tokenizer.decode(adapter.prepare(qwen_prompt("What happens?", 0, True), videos=[video]).prompt_token_ids)
    assert "<0.2 seconds>" in text and "<1.2 seconds>" in text
    uneven = make_video(1, frames=4)
    uneven.timestamps = [0.0, 0.1, 3.0, 5.0]  # a variable-frame-rate clip
    text = adapter.tokenizer.decode(adapter.prepare(qwen_prompt("What happens?", 0, True), videos=[uneven]).prompt_token_ids)
    assert "<0.1 seconds>" in text and "<4.0 seconds>" in text
