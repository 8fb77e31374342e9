"""The shared frame walk: which frames get decoded, how seeks are chosen, what fills gaps.

The decoder here is a plain Python stream over frame numbers that behaves like a
real one: a seek restarts at the keyframe before `target - margin` and decodes
forward. It records every frame it "decodes", so the tests can count work.
"""

from __future__ import annotations

import pytest

from vlmbatch.errors import RowError
from vlmbatch.media.video.base import walk_frames
from vlmbatch.media.video.probe import StreamIndex


def make_stream(num_frames: int, gop: int, margin: int = 0, undecodable: frozenset[int] = frozenset()):
    index = StreamIndex(timestamps=[i / 30 for i in range(num_frames)], keyframes=list(range(0, num_frames, gop)))
    decoded: list[int] = []
    seeks: list[int] = []

    def seek(keyframe: int, target: int):
        start = index.keyframe_before(max(0, target - margin)) if seeks or keyframe else 0
        seeks.append(start)
        for frame in range(start, num_frames):
            decoded.append(frame)
            yield frame, (lambda frame=frame: None if frame in undecodable else f"pixels of {frame}")

    return index, seek, decoded, seeks


@pytest.mark.parametrize("margin", [0, 16])
@pytest.mark.parametrize("gop", [10, 30, 250])
@pytest.mark.parametrize("wanted", [[0, 120, 240, 359], list(range(0, 360, 7)), [5, 6, 7, 300]])
def test_no_frame_is_decoded_twice(gop, margin, wanted):
    index, seek, decoded, _ = make_stream(360, gop, margin)
    frames = walk_frames(wanted, index, seek, seek_margin=margin)
    assert frames == {i: f"pixels of {i}" for i in wanted}
    assert len(decoded) == len(set(decoded))


def test_sparse_targets_seek_over_whole_gops():
    index, seek, decoded, seeks = make_stream(1800, 30)
    walk_frames([0, 600, 1200], index, seek)
    assert seeks == [0, 600, 1200]
    assert len(decoded) == 3  # every target is a keyframe: nothing else decoded
    index, seek, decoded, _ = make_stream(1800, 30)
    walk_frames([0, 615], index, seek)
    assert decoded == [0, *range(600, 616)]  # from the target's keyframe only


def test_dense_targets_decode_forward_without_seeking():
    index, seek, decoded, seeks = make_stream(100, 10)
    walk_frames(list(range(0, 100, 3)), index, seek)
    assert seeks == [0]
    assert decoded == list(range(100))[: decoded[-1] + 1]


def test_opencv_margin_avoids_seeking_back_into_decoded_frames():
    # Targets 28 apart, keyframes every 30: a margin-blind walk would seek to
    # target - 16, i.e. often into a GOP it already decoded.
    index, seek, decoded, _ = make_stream(400, 30, margin=16)
    walk_frames(list(range(0, 400, 28)), index, seek, seek_margin=16)
    assert len(decoded) == len(set(decoded))


def test_undecodable_frames_take_the_next_good_one_and_the_end_repeats_the_last():
    index, seek, _, _ = make_stream(20, 10, undecodable=frozenset({5, 6}))
    frames = walk_frames([5, 8, 19], index, seek)
    assert frames == {5: "pixels of 7", 8: "pixels of 8", 19: "pixels of 19"}
    index, seek, _, _ = make_stream(20, 10, undecodable=frozenset(range(15, 20)))
    assert walk_frames([3, 17], index, seek) == {3: "pixels of 3", 17: "pixels of 3"}


def test_nothing_decodable_is_a_row_error():
    index, seek, _, _ = make_stream(10, 10, undecodable=frozenset(range(10)))
    with pytest.raises(RowError):
        walk_frames([0, 5], index, seek)
