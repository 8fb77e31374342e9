"""Idefics3 and SmolVLM on the CPU in fp32: the paged engine's greedy tokens equal `transformers'`.

Mixed requests (text only, up to three images of odd sizes and aspect ratios, so each is
split into a different grid of tiles plus its global image; a timestamped video on
SmolVLM; exact repeats) through a small KV cache and token budget, so batching, chunked
prefill (also through an image's tiles), preemption and prefix- and encoder-cache hits
all happen; the engine's counters prove they did. The default run takes a few prompts per
model type; the 50-prompt sweep is `slow`.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import build_requests, hf_greedy, make_image, make_video, run_greedy, smolvlm_prompt

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.registry import load_adapter

# Wide, tall and small images: 1x3 .. 3x3 tile grids, and unsplit ones from the tokens' view.
ODD_WIDTHS, ODD_HEIGHTS = (23, 37, 97, 131, 200), (29, 61, 150)
ARCHS = ["idefics3", "smolvlm"]


@pytest.fixture(scope="module", params=ARCHS)
def idefics3(request, tiny_model_dir):
    torch.set_num_threads(1)
    path = str(tiny_model_dir(request.param))
    return request.param, load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def _check_mixed_requests(arch, adapter, hf_model, count: int, seed: int) -> None:
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=40, block_size=8,
                                               max_num_seqs=4, max_num_batched_tokens=96, min_admission_batch=1))
    requests = build_requests(adapter, arch, count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS)
    prepared, outputs = run_greedy(engine, adapter, requests)
    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    tiles = {len(item.tensors["pixel_values"]) for prompt, _ in prepared.values() for item in prompt.media}
    assert len(tiles) >= 3, tiles  # images split into different grids
    assert any(videos for *_, videos, _ in requests) == (arch == "smolvlm")


def test_mixed_requests_match_transformers(idefics3):
    _check_mixed_requests(*idefics3, count=10, seed=3)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(idefics3):
    _check_mixed_requests(*idefics3, count=50, seed=5)
