"""Frame choice: Qwen2.5-VL's convention, on real (possibly uneven) timestamps."""

from __future__ import annotations

import pytest

from vlmbatch.media.video.options import VideoOptions
from vlmbatch.media.video.sampling import FrameConvention, nearest_frame, plan_frames


def constant_rate(count: int, fps: float) -> list[float]:
    return [i / fps for i in range(count)]


def test_qwen_default_two_frames_per_second_even_count():
    plan = plan_frames(constant_rate(300, 30.0), VideoOptions())  # 10 s at 30 fps
    assert len(plan.indices) == 20
    assert plan.sampled_fps == pytest.approx(2.0)
    assert plan.duration == pytest.approx(10.0)
    assert plan.indices[0] == 0 and plan.indices[-1] == 299
    odd = plan_frames(constant_rate(165, 30.0), VideoOptions())  # 5.5 s -> 11 frames, rounded down to 10
    assert len(odd.indices) == 10


def test_matches_qwen_vl_utils_indices_on_constant_rate():
    # qwen-vl-utils: torch.linspace(0, total - 1, n).round()
    total, n = 97, 8
    plan = plan_frames(constant_rate(total, 24.0), VideoOptions(num_frames=n))
    assert plan.indices == [round(i * (total - 1) / (n - 1)) for i in range(n)]


def test_num_frames_is_rounded_to_the_temporal_patch_and_capped():
    assert len(plan_frames(constant_rate(100, 10.0), VideoOptions(num_frames=7)).indices) == 8
    assert len(plan_frames(constant_rate(100, 10.0), VideoOptions(num_frames=64, max_frames=16)).indices) == 16
    assert len(plan_frames(constant_rate(10, 10.0), VideoOptions(num_frames=64)).indices) == 10


def test_min_frames_and_short_clips():
    plan = plan_frames(constant_rate(30, 30.0), VideoOptions())  # 1 s -> 2 by fps, raised to the minimum 4
    assert len(plan.indices) == 4
    single = plan_frames([0.0], VideoOptions())  # one frame: repeated to fill a temporal patch
    assert single.indices == [0, 0]


def test_max_duration_keeps_the_beginning():
    plan = plan_frames(constant_rate(600, 30.0), VideoOptions(max_duration=4.0))
    assert max(plan.timestamps) < 4.0
    assert len(plan.indices) == 8


def test_variable_frame_rate_is_uniform_in_time_not_in_index():
    timestamps = constant_rate(30, 30.0) + [1.0 + i * 0.5 for i in range(19)]  # 1 s dense, then 2 fps for 9 s
    plan = plan_frames(timestamps, VideoOptions(num_frames=10))
    by_index = [round(i * (len(timestamps) - 1) / 9) for i in range(10)]
    assert sum(timestamps[i] < 1.0 for i in by_index) > 3  # what index-uniform sampling would do
    assert sum(t < 1.0 for t in plan.timestamps) == 1
    gaps = [b - a for a, b in zip(plan.timestamps, plan.timestamps[1:])]
    assert max(gaps) - min(gaps) <= 0.5


def test_other_conventions():
    llava_like = FrameConvention(fps=1.0, frame_factor=1, min_frames=1, max_frames=8)
    plan = plan_frames(constant_rate(50, 10.0), VideoOptions(), llava_like)
    assert len(plan.indices) == 5


def test_nearest_frame_prefers_the_earlier_on_ties():
    assert nearest_frame([0.0, 1.0, 2.0], 0.5) == 0
    assert nearest_frame([0.0, 1.0, 2.0], 0.51) == 1
    assert nearest_frame([0.0, 1.0, 2.0], 9.0) == 2
    assert nearest_frame([0.0, 1.0, 2.0], -1.0) == 0


def test_empty_stream_is_refused():
    with pytest.raises(ValueError):
        plan_frames([], VideoOptions())


def test_single_frame_reports_the_convention_rate():
    plan = plan_frames([0.0], VideoOptions())
    assert plan.duration == 0.0 and plan.sampled_fps == 2.0
