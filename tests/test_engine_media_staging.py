"""Staging media ahead (`EngineConfig.stage_media`, `engine/media_staging.py`): the pixels of
the prompts the next admission would take are uploaded while the current step runs.

What it promises, on the CPU (the copy stream and its waits run on the GPU only, checked
there by the benchmark's logit check): the same greedy tokens as transformers with the
engine's preemption, chunked prefill and cache hits all happening; each item uploaded once
while it stays upcoming; the device budget kept; guesses that missed dropped; items not in
host memory left alone; and the scheduler's guess of the next admission.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from engine_harness import single_thread, build_requests, hf_greedy, run_greedy  # noqa: F401  (single_thread: autouse)

from vlmbatch.config import EngineConfig
from vlmbatch.engine.block_manager import BlockManager
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.media_staging import MediaStager
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.scheduler import Scheduler
from vlmbatch.engine.sequence import Sequence
from vlmbatch.engine.vision_language import VisionLanguageModel
from vlmbatch.families.prompt import MediaItem
from vlmbatch.families.registry import load_adapter


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_staged_media_give_transformers_greedy_tokens(arch, tiny_model_dir):
    path = str(tiny_model_dir(arch))
    adapter = load_adapter(path)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_seqs=6,
                                               max_num_batched_tokens=40, min_admission_batch=1, stage_media=True))
    prepared, outputs = run_greedy(engine, adapter, build_requests(adapter, arch, 14, seed=1))
    hf_model = load_hf_model(path, torch.float32, torch.device("cpu"))
    for request_id, (prompt, max_tokens) in prepared.items():
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf_model, adapter, prompt, max_tokens), request_id
    stats = engine.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0 and stats.num_encoder_cache_hits > 0
    assert 0 < stats.num_staged_media_used <= stats.num_staged_media


def test_media_are_not_staged_unless_asked(tiny_qwen):
    adapter = load_adapter(str(tiny_qwen))
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=40))
    run_greedy(engine, adapter, build_requests(adapter, "qwen2_5_vl", 6, seed=2))
    assert engine.stats.num_encoded_media > 0 and engine.stats.num_staged_media == 0


def item(key: str, floats: int, device: str = "cpu") -> MediaItem:
    pixels = torch.arange(floats, dtype=torch.float32, device=device) + sum(map(ord, key))
    return MediaItem("image", {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]])}, 1, key)


def test_the_stager_uploads_each_upcoming_item_once_within_its_budget():
    a, b, c, d = item("a", 8), item("b", 8), item("c", 8), item("d", 8)  # 32 bytes of pixels each
    stager = MediaStager(torch.device("cpu"), budget_bytes=80)
    stager.stage([a, b, c])  # c would pass the budget: staging stops there, oldest first
    assert [entry[0] for entry in stager.staged.values()] == [a, b] and stager.num_staged == 2
    stager.stage([b, c])  # b is kept as uploaded, a (not upcoming any more) dropped, c uploaded
    assert [entry[0] for entry in stager.staged.values()] == [b, c] and stager.num_staged == 3
    taken = stager.take([d, b, c], "pixel_values")  # d was never staged: copied now
    assert torch.equal(taken, torch.cat([d.tensors["pixel_values"], b.tensors["pixel_values"], c.tensors["pixel_values"]]))
    assert stager.num_taken == 2
    assert torch.equal(stager.take([b], "pixel_values"), b.tensors["pixel_values"]) and stager.num_taken == 2  # taken once


def test_items_not_in_host_memory_are_left_to_the_encode():
    on_device, plain = item("g", 8, device="meta"), item("h", 8)  # "meta": any tensor not in host memory
    stager = MediaStager(torch.device("cpu"), budget_bytes=1 << 20)
    stager.stage([on_device, plain])
    assert [entry[0] for entry in stager.staged.values()] == [plain]


class StagingOnly(VisionLanguageModel):
    """`VisionLanguageModel.stage`'s choice of items alone: no tower, no decoder."""

    placeholder_token_ids = {}

    def __init__(self, cache_size: int):
        self.encoder_cache, self.encoder_cache_size = OrderedDict(cached=torch.zeros(1)), cache_size
        self.media = MediaStager(torch.device("cpu"))

    def encode_batch(self, kind, items):
        raise NotImplementedError


def test_only_items_the_tower_will_run_are_staged():
    """With reuse on, encode runs one item per content and none the encoder cache holds."""
    first, same, cached, other = item("a", 4), item("a", 4), item("cached", 4), item("b", 4)
    model = StagingOnly(cache_size=8)
    model.stage([first, same, cached, other])
    assert [entry[0] for entry in model.media.staged.values()] == [first, other]
    unshared = StagingOnly(cache_size=0)  # nothing reused: every item goes through the tower
    unshared.stage([first, same, cached])
    assert [entry[0] for entry in unshared.media.staged.values()] == [first, same, cached]


def test_the_next_admission_is_guessed_from_free_slots_and_the_token_budget():
    """Free slots and the token budget bound the guess; with no slot free, the budget alone."""
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [Sequence(str(i), list(range(n)), SamplingParams()) for i, n in enumerate([6, 6, 2, 2])]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.upcoming() == seqs[:2]  # 12 tokens reach the budget of 10 with the second
    scheduler.running = [seqs[0], seqs[1]]
    scheduler.waiting.popleft(), scheduler.waiting.popleft()
    assert scheduler.upcoming() == [seqs[2]]  # one slot free
    scheduler.running.append(seqs[2])
    scheduler.waiting.popleft()
    assert scheduler.upcoming() == [seqs[3]]  # every slot taken: the oldest waiting within the token budget


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava"])
def test_staged_uploads_on_the_copy_stream_give_the_plain_uploads_tokens(arch, device, tiny_model_dir):
    """On CUDA the uploads run on the stager's own stream in its thread; the compute stream
    must wait for them, and their memory must not be reused while the tower reads it. The
    engine is bound by its slots, not its token budget, as the H200 run of session 20 found
    staging nothing there (`Scheduler.upcoming`); the CPU run checks that it stages."""
    path = str(tiny_model_dir(arch))
    adapter = load_adapter(path)
    tokens = []
    for stage_media in (False, True):
        engine = PagedEngine(adapter, EngineConfig(dtype="float32", device=device, num_kv_blocks=64, block_size=16, max_num_seqs=4,
                                                   max_num_batched_tokens=256, min_admission_batch=1, stage_media=stage_media))
        _, outputs = run_greedy(engine, adapter, build_requests(adapter, arch, 24, seed=4))
        tokens.append({request_id: output.outputs[0].token_ids for request_id, output in outputs.items()})
    assert tokens[0] == tokens[1]
    assert engine.stats.num_staged_media_used > 0
