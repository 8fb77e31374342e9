"""Pure pieces of the queue: queue names per model, GPU slots, poison-range splitting."""

from __future__ import annotations

import pytest

from vlmbatch.workers.app import queue_name
from vlmbatch.workers.poison import split
from vlmbatch.workers.store import RowRange
from vlmbatch.workers.supervisor import gpu_slots


def test_queue_names_keep_models_apart_and_ignore_a_trailing_slash() -> None:
    assert queue_name("org/model") != queue_name("org_model")  # same readable part, different models
    assert queue_name("/ckpt/tiny/") == queue_name("/ckpt/tiny")
    assert queue_name("Qwen/Qwen2.5-VL-3B-Instruct").startswith("vlmbatch.Qwen2.5-VL-3B-Instruct-")


def test_gpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_slots("0,1") == ["0", "1"]
    assert gpu_slots(" 3 ") == ["3"]
    with pytest.raises(ValueError, match="twice"):
        gpu_slots("cpu,cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")  # `all` means the GPUs this machine lets us see
    assert gpu_slots("all") == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_slots("all") == ["cpu"]


@pytest.mark.parametrize("size", [1, 2, 4, 5, 9, 1000])
def test_split_covers_every_row_once_in_at_most_four_parts(size: int) -> None:
    rows = RowRange(100, 100 + size)
    parts = split(rows)
    assert 1 <= len(parts) <= 4 and all(len(p) >= 1 for p in parts)
    assert [r for p in parts for r in range(p.start, p.end)] == list(range(rows.start, rows.end))
