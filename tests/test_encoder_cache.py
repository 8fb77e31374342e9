"""The vision tower's output cache: reuse by content, bounded by items and by bytes, and off.

A video's tower output is large (a 16-frame 720p clip of Qwen3-VL-8B: 189 MB in bf16), so
the cache is bounded by the GPU memory it holds, not only by its item count; with
`encoder_cache_size` 0 nothing is reused, not even two equal items of one step (what a
benchmark that repeats its clips needs so as not to share their encoding).
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from vlmbatch.config import ConfigError, EngineConfig
from vlmbatch.engine.vision_language import VisionLanguageModel
from vlmbatch.families.prompt import MediaItem


class CountingTower(VisionLanguageModel):
    """Only the cache logic of `VisionLanguageModel.encode`: each item's rows are 4 floats
    (16 bytes) per token, valued by the item's key, and every tower call is recorded."""

    placeholder_token_ids = {}

    def __init__(self, size: int = 256, max_bytes: int = 1 << 30):  # no weights, no decoder
        self.encoder_cache, self.encoder_cache_size, self.encoder_cache_bytes = OrderedDict(), size, max_bytes
        self.num_encoded_items = self.num_encoder_cache_hits = 0
        self.decoder = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)))
        self.calls: list[list[str]] = []

    def encode_batch(self, kind, items):
        self.calls.append([item.content_hash for item in items])
        return torch.cat([torch.full((item.num_tokens, 4), float(ord(item.content_hash))) for item in items])


def item(key: str, tokens: int = 2) -> MediaItem:
    return MediaItem("image", {}, tokens, key)


def test_equal_items_are_encoded_once_and_served_from_the_cache_later():
    tower = CountingTower()
    first = tower.encode([[item("a"), item("b")], [item("a")]])
    assert tower.calls == [["a", "b"]] and first[1].tolist() == [[97.0] * 4] * 2
    tower.encode([[item("a")]])
    assert tower.calls == [["a", "b"]] and tower.num_encoder_cache_hits == 1 and tower.num_encoded_items == 2


def test_size_zero_reuses_nothing_not_even_within_one_step():
    tower = CountingTower(size=0)
    out = tower.encode([[item("a"), item("a")], [item("a")]])
    assert tower.calls == [["a", "a", "a"]] and [o.shape[0] for o in out] == [4, 2]
    tower.encode([[item("a")]])
    assert tower.num_encoded_items == 4 and tower.num_encoder_cache_hits == 0 and not tower.encoder_cache


def test_the_cache_keeps_within_its_bytes_dropping_the_oldest():
    tower = CountingTower(max_bytes=100)  # items of 2 tokens are 32 bytes: three fit
    tower.encode([[item("a")], [item("b")], [item("c")]])
    assert list(tower.encoder_cache) == ["a", "b", "c"]
    tower.encode([[item("d")]])  # 128 bytes: the oldest goes
    assert list(tower.encoder_cache) == ["b", "c", "d"]
    tower.encode([[item("e", tokens=8)]])  # 128 bytes alone: over the budget by itself, kept by nobody
    assert not tower.encoder_cache and tower.encode([[item("e", tokens=8)]])[0].shape == (8, 4)


def test_the_engine_options_are_checked():
    assert EngineConfig().encoder_cache_size == 256 and EngineConfig().encoder_cache_mb == 2048
    with pytest.raises(ConfigError, match="encoder_cache_size"):
        EngineConfig(encoder_cache_size=-1)
