"""LLaVA-NeXT and LLaVA-OneVision on the CPU in fp32: the paged engine's greedy tokens equal `transformers`'.

Mixed requests (text only, up to three images of odd sizes and aspect ratios so the tile
grid, the unpadding and OneVision's `anyres_max_9` downsampling all vary, OneVision's
multi-image rule, a video for OneVision, exact repeats) through a small KV cache and token
budget, so batching, chunked prefill, preemption and prefix- and encoder-cache hits all
happen; the engine's counters prove they did. The default run takes a few requests, the
50-request sweep is `slow`.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import SYSTEM, build_requests, hf_greedy, make_image, make_video, run_greedy

from vlmbatch.config import EngineConfig
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.registry import load_adapter

ODD_WIDTHS, ODD_HEIGHTS = (37, 64, 97, 131, 200), (29, 56, 61, 150)
ARCHS = ["llava_next", "llava_onevision"]


def onevision_prompt(text: str, num_images: int, with_video: bool) -> str:
    media = "<image>" * num_images + ("<video>" if with_video else "")
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user {media}\n{text}<|im_end|>\n<|im_start|>assistant\n"


def mistral_prompt(text: str, num_images: int, with_video: bool) -> str:
    return "[INST] " + "<image>\n" * num_images + f"{SYSTEM} {text} [/INST]"


PROMPTS = {"llava_next": mistral_prompt, "llava_onevision": onevision_prompt}


@pytest.fixture(scope="module", params=ARCHS)
def llava(request, tiny_model_dir):
    torch.set_num_threads(1)
    path = str(tiny_model_dir(request.param))
    return request.param, load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def _check_against_transformers(llava, count: int, seed: int) -> None:
    arch, adapter, hf_model = llava
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=128, block_size=4,
                                               max_num_seqs=6, max_num_batched_tokens=64, min_admission_batch=1))
    requests = build_requests(adapter, arch, count, seed=seed, max_images=3, widths=ODD_WIDTHS, heights=ODD_HEIGHTS,
                              make_prompt=PROMPTS[arch], video=arch == "llava_onevision")
    prepared, outputs = run_greedy(engine, adapter, requests)
    assert sorted(outputs) == sorted(prepared)
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0 and stats.num_encoder_cache_hits > 0
    tile_counts = {len(item.tensors["pixel_values"]) for p, _ in prepared.values() for item in p.media if item.kind == "image"}
    assert len(tile_counts) >= 3, tile_counts  # several tile grids (OneVision: and base-only images)
    assert arch == "llava_next" or any(item.kind == "video" for p, _ in prepared.values() for item in p.media)


def test_mixed_requests_match_transformers(llava):
    _check_against_transformers(llava, 12, seed=4)


@pytest.mark.slow
def test_fifty_mixed_requests_match_transformers(llava):
    _check_against_transformers(llava, 50, seed=3)
