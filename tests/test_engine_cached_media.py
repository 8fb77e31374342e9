"""Media of prompt spans the prefix cache holds are not encoded (CPU, fp32, tiny checkpoints).

A forward reads media embeddings only from a sequence's computed tokens on, so the items
whose placeholders lie inside a prefix-cache hit never go through the tower (nor the
encoder cache); a sequence that comes back from preemption with fewer computed tokens
encodes the ones it now reads. Greedy tokens must stay `transformers`' throughout; the
families cover M-RoPE with a video placed before the images (items are grouped by kind,
so the skipped ones are not a prefix of them), DeepStack (Qwen3-VL) and bidirectional
image spans (Gemma 3).
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_harness import SYSTEM, WORDS, single_thread, hf_greedy, make_image, make_video, run_to_completion
from family_harness import load_family

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.sequence import MultimodalData
from vlmbatch.families.prompt import MediaItem

ARCHS = ["qwen2_5_vl", "qwen3_vl", "gemma3"]
GREEDY = SamplingParams(max_tokens=8, temperature=0)
IMAGE, VIDEO = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"


def prepare(adapter, arch: str, text: str, images: list, with_video: bool):
    """A prompt with its video (Qwen) first, then its images, the last one after the text
    (so that a prefix-cache hit can end between it and the others)."""
    if arch == "gemma3":
        prompt = f"<start_of_turn>user\n{SYSTEM}\n\n" + "<start_of_image>" * (len(images) - 1) + text
        return adapter.prepare(prompt + "<start_of_image><end_of_turn>\n<start_of_turn>model\n", images, [], GREEDY.max_tokens)
    media = (VIDEO if with_video else "") + IMAGE * (len(images) - 1)
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{media}{text}{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    return adapter.prepare(prompt, images, [make_video(7)] if with_video else [], GREEDY.max_tokens)


def engine_for(adapter) -> PagedEngine:
    """Room for every prompt's KV (nothing evicted) and the whole repeat in one step."""
    return PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=256, block_size=4,
                                             max_num_seqs=8, max_num_batched_tokens=512, min_admission_batch=1))


def tower_counts(engine: PagedEngine) -> tuple[int, int]:
    return engine.model.num_encoded_items, engine.model.num_encoder_cache_hits


@pytest.mark.parametrize("arch", ARCHS)
def test_a_repeat_served_from_the_prefix_cache_encodes_no_media(arch, tiny_model_dir):
    _, adapter, hf_model = load_family(arch, tiny_model_dir)
    engine = engine_for(adapter)
    images = [[make_image(0, (56, 40))], [make_image(1, (56, 56)), make_image(10, (40, 56))], [make_image(2, (56, 72))]]
    prompts = {f"p{i}": prepare(adapter, arch, " ".join(WORDS[i : i + 4]), chosen, with_video=i == 1) for i, chosen in enumerate(images)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    first = {k: o.outputs[0].token_ids for k, o in run_to_completion(engine).items()}
    assert first == {k: hf_greedy(hf_model, adapter, prompt, GREEDY.max_tokens) for k, prompt in prompts.items()}
    encoded, hits = tower_counts(engine)
    assert encoded == sum(len(p.media) for p in prompts.values())
    prefix_hits = engine.stats.num_prefix_hit_tokens

    for request_id, prompt in prompts.items():  # again, one of them as two forked samples
        engine.add_request(f"{request_id}-again", prompt, GREEDY.updated(n=2) if request_id == "p1" else GREEDY)
    again = run_to_completion(engine)
    assert tower_counts(engine) == (encoded, hits)  # neither the tower nor its cache was asked for an item
    assert engine.stats.num_prefix_hit_tokens - prefix_hits >= sum(p.num_tokens - 4 for p in prompts.values())
    assert {k: [c.token_ids for c in o.outputs] for k, o in again.items()} == {
        f"{k}-again": [tokens] * (2 if k == "p1" else 1) for k, tokens in first.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_media_skipped_on_a_cached_prefix_are_encoded_when_a_preempted_sequence_needs_them(arch, tiny_model_dir):
    """The last image differs from the cached prompt's, so only it is encoded at first;
    then the sequence is preempted with the prefix cache emptied and recomputes from the
    start: the skipped items are encoded, after the held one (embedding rows out of order)."""
    _, adapter, hf_model = load_family(arch, tiny_model_dir)
    engine = engine_for(adapter)
    engine.model.encoder_cache_size = 0  # the tower itself must run on what is needed again
    text, shared = "what is in the picture", make_image(1, (56, 84))
    cached = prepare(adapter, arch, text, [shared, make_image(2, (84, 56))], with_video=arch != "gemma3")
    prompt = prepare(adapter, arch, text, [shared, make_image(3, (84, 56))], with_video=arch != "gemma3")
    engine.add_request("cached", cached, GREEDY)
    run_to_completion(engine)
    encoded = engine.model.num_encoded_items

    engine.add_request("again", prompt, GREEDY)
    seq = engine.requests["again"][0]
    while not seq.num_output_tokens:  # admitted on the prefix cache, which holds the video and the first image
        engine.step()
    assert engine.model.num_encoded_items == encoded + 1
    engine.scheduler._preempt(seq)  # as when the pool runs out
    engine.block_manager.reset_prefix_cache()  # and its blocks were handed out meanwhile
    outputs = run_to_completion(engine)

    assert engine.model.num_encoded_items == encoded + len(prompt.media)
    assert outputs["again"].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, GREEDY.max_tokens)
    assert engine.stats.num_preemptions == 1 and engine.model.num_encoder_cache_hits == 0


def test_held_rows_map_from_media_rows_whatever_the_order_they_came_in():
    """Items in kind order (two images, then a video placed first in the prompt, its
    tokens interleaved with text); each `hold` appends rows and never writes the tensors
    it replaces, which forked samples still share."""
    items = [MediaItem("image", {}, 3, "a"), MediaItem("image", {}, 2, "b"), MediaItem("video", {}, 4, "v")]
    media_index = torch.full((16,), -1)
    positions = {0: [8, 9, 10], 1: [13, 14], 2: [2, 3, 5, 6]}
    for row, position in enumerate(p for i in range(3) for p in positions[i]):
        media_index[position] = row
    mm = MultimodalData(items, [(8, 11), (13, 15), (2, 7)], media_index=media_index)
    embeds = {i: torch.full((item.num_tokens, 2), float(i)) for i, item in enumerate(items)}

    def rows_at(data: MultimodalData, i: int) -> torch.Tensor:
        return data.embeds[data.embed_rows[data.media_index[positions[i]]]]

    assert mm.missing(12) == [1]
    mm.hold([1], embeds[1], 12)
    assert mm.missing(12) == [] and mm.missing(9) == [0]
    forked = copy.copy(mm)  # as `PagedEngine._fork` shares it
    mm.hold([0], embeds[0], 9)
    assert mm.missing(0) == [2]
    mm.hold([2], embeds[2], 0)
    assert mm.missing(0) == [] and mm.embeds_from == 0
    assert all(torch.equal(rows_at(mm, i), embeds[i]) for i in range(3))
    assert torch.equal(rows_at(forked, 1), embeds[1]) and forked.missing(0) == [0, 2]
    assert (forked.embed_rows[:3] == -1).all() and len(forked.embeds) == 2
