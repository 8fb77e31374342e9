"""Rows whose media already sit on a GPU are admitted within a byte budget (shard feeding)."""

import torch

from vlmbatch.families.prompt import MediaItem, PreparedPrompt
from vlmbatch.job.shard import GpuMediaBudget


def test_device_media_bytes_counts_only_tensors_off_the_host():
    # "meta" stands in for a GPU here: a tensor with a size and no host memory
    video = MediaItem("video", {"pixel_values_videos": torch.empty(100, 10, device="meta"), "video_grid_thw": torch.ones(1, 3)}, 25, "v")
    image = MediaItem("image", {"pixel_values": torch.zeros(5, 5)}, 1, "i")
    assert PreparedPrompt([1, 2], [video, image]).device_media_bytes == 100 * 10 * 4
    assert PreparedPrompt([1], [image]).device_media_bytes == 0


def test_budget_holds_back_rows_past_the_limit_and_frees_them_when_rows_finish():
    budget = GpuMediaBudget(limit=1000)
    assert budget.admits(0) and budget.admits(5000)  # host-only rows always; an oversized row when none is held
    budget.hold("a", 600)
    budget.hold("cpu-row", 0)
    assert budget.held == {"a": 600}
    assert budget.admits(400) and not budget.admits(401)
    assert budget.admits(0)  # host-memory rows never wait for it
    budget.hold("b", 400)
    assert not budget.admits(1)
    budget.release("a")
    assert budget.admits(600) and not budget.admits(601)
    budget.release("b")
    assert budget.admits(5000)
