"""Every CPU backend returns the sampled frames of a plain sequential decode, pixel for pixel.

Videos are made once per session with ffmpeg (h264/mp4, hevc/mkv, vp9/webm,
mpeg4/avi, variable frame rate, display-matrix rotation, damaged packets) with a
keyframe every second, so both the seeking and the grab-forward paths run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video import load_video, parse_video_options
from vlmbatch.media.video.probe import probe_stream
from vlmbatch.media.refs import MediaSource
from vlmbatch.testing.videos import decode_every_frame, ffmpeg_available, make_video_set

pytestmark = pytest.mark.skipif(not ffmpeg_available(), reason="needs the ffmpeg command line to make test videos")

CPU_BACKENDS = ["opencv", "pyav", "torchcodec"]
DECODABLE = ["h264_mp4", "hevc_mkv", "vp9_webm", "mpeg4_avi", "vfr_mp4", "rotated_mp4"]
TOLERANCE = 1.0  # mean absolute difference, in 1/255 steps


@pytest.fixture(scope="session")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_video_set(tmp_path_factory.mktemp("videos"))


@pytest.fixture(scope="session")
def reference(videos: dict[str, Path]):
    cache: dict[str, list] = {}

    def get(kind: str) -> list:
        if kind not in cache:
            cache[kind] = decode_every_frame(videos[kind])
        return cache[kind]

    return get


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", DECODABLE)
# 2 frames (the first and the last, GOPs apart) make every backend seek; 16 and 44 decode forward
@pytest.mark.parametrize("sampling", [{}, {"num_frames": 2}, {"num_frames": 16}, {"num_frames": 44}])
def test_backend_matches_sequential_decode(videos, reference, backend, kind, sampling):
    result = load_video(videos[kind], parse_video_options({"backend": backend, **sampling}))
    expected = reference(kind)
    assert result.backend == backend
    assert result.frames.dtype == np.uint8 and result.frames.ndim == 4 and result.frames.shape[-1] == 3
    assert len(result.frame_indices) == result.frames.shape[0] == len(result.timestamps)
    for position, index in enumerate(result.frame_indices):
        assert mean_abs_diff(result.frames[position], expected[index]) <= TOLERANCE, (kind, backend, index)


@pytest.mark.parametrize("kind", DECODABLE)
def test_backends_pick_the_same_frames(videos, kind):
    picks = {b: load_video(videos[kind], parse_video_options({"backend": b})) for b in CPU_BACKENDS}
    indices = {b: tuple(v.frame_indices) for b, v in picks.items()}
    assert len(set(indices.values())) == 1, indices
    assert len({tuple(v.timestamps) for v in picks.values()}) == 1


def test_variable_frame_rate_is_sampled_evenly_in_time(videos):
    # First second at 15 fps, the rest at 5 fps: index-uniform sampling would put
    # a third of the frames into the first second.
    result = load_video(videos["vfr_mp4"], parse_video_options({"backend": "opencv", "num_frames": 8}))
    gaps = np.diff(result.timestamps)
    assert result.timestamps[0] == 0.0
    assert gaps.max() - gaps.min() <= 0.2 + 1e-9  # at most one 5-fps frame apart
    assert result.duration == pytest.approx(7.0, abs=0.01)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rotation_is_applied(videos, backend):
    # rotated_mp4 is h264_mp4 stream-copied with a 90-degree display matrix.
    options = parse_video_options({"backend": backend, "num_frames": 4})
    plain = load_video(videos["h264_mp4"], options)
    rotated = load_video(videos["rotated_mp4"], options)
    assert plain.frames.shape[1:3] == (120, 160) and rotated.frames.shape[1:3] == (160, 120)
    expected = reference_turn = None
    for turns in (1, 3):
        candidate = np.rot90(plain.frames, turns, axes=(1, 2))
        if mean_abs_diff(candidate, rotated.frames) == 0:
            expected, reference_turn = candidate, turns
    assert expected is not None, "rotated frames are not a quarter turn of the plain ones"
    assert reference_turn == 1  # FFmpeg's display matrix rotates counter-clockwise


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_damaged_packets_do_not_fail_the_row(videos, reference, backend):
    """Undamaged GOPs match exactly; frames of the damaged GOP are error-concealed
    differently by each FFmpeg build (and by seek vs. sequential decode), so they
    are only required to be there."""
    expected = reference("corrupt_mp4")
    damaged = [i for i, frame in enumerate(expected) if frame is None]
    assert damaged, "the test file should contain a packet the decoder rejects"
    index = probe_stream(MediaSource(name="corrupt", path=str(videos["corrupt_mp4"])))
    bad_gops = {index.keyframe_before(i) for i in damaged}
    for sampling in ({}, {"num_frames": 44}):
        result = load_video(videos["corrupt_mp4"], parse_video_options({"backend": backend, **sampling}))
        assert result.frames.shape[0] == len(result.frame_indices)
        for position, i in enumerate(result.frame_indices):
            if index.keyframe_before(i) not in bad_gops:
                assert mean_abs_diff(result.frames[position], expected[i]) <= TOLERANCE, (backend, i)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["audio_only", "empty"])
def test_files_without_frames_are_row_errors(videos, backend, kind):
    with pytest.raises(RowError) as caught:
        load_video(videos[kind], parse_video_options({"backend": backend}))
    assert caught.value.error_type == ErrorType.MEDIA_DECODE


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_garbage_bytes_are_row_errors(backend):
    with pytest.raises(RowError) as caught:
        load_video(b"\x00\x01 definitely not a video " * 50, parse_video_options({"backend": backend}))
    assert caught.value.error_type == ErrorType.MEDIA_DECODE


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bytes_input_matches_path_input(videos, backend):
    options = parse_video_options({"backend": backend, "num_frames": 8})
    from_path = load_video(videos["h264_mp4"], options)
    from_bytes = load_video(videos["h264_mp4"].read_bytes(), options)
    assert from_bytes.frame_indices == from_path.frame_indices
    assert mean_abs_diff(from_bytes.frames, from_path.frames) == 0


def test_opencv_packet_probe_agrees_with_pyav(videos):
    """The probe used where PyAV is missing (the GPU machine) indexes intact files identically."""
    from vlmbatch.media.video.probe import _probe_with_opencv, _probe_with_pyav

    for kind in DECODABLE:
        source = MediaSource(name=kind, path=str(videos[kind]))
        by_opencv, by_pyav = _probe_with_opencv(source), _probe_with_pyav(source)
        assert by_opencv.keyframes == by_pyav.keyframes, kind
        assert np.allclose(by_opencv.timestamps, by_pyav.timestamps, atol=1e-3), kind


def test_torchcodec_approximate_mode_on_constant_rate(videos, reference):
    """`approximate` skips torchcodec's scan; right on constant-rate files (not on VFR: see docs/video.md)."""
    options = parse_video_options({"backend": "torchcodec", "seek_mode": "approximate", "num_frames": 16})
    result = load_video(videos["h264_mp4"], options)
    expected = reference("h264_mp4")
    for position, index in enumerate(result.frame_indices):
        assert mean_abs_diff(result.frames[position], expected[index]) <= TOLERANCE


def test_resize_cap_is_identical_for_every_backend(videos):
    shrunk = {
        b: load_video(videos["rotated_mp4"], parse_video_options({"backend": b, "num_frames": 4, "max_side": 80}))
        for b in CPU_BACKENDS
    }
    shapes = {v.frames.shape for v in shrunk.values()}
    assert shapes == {(4, 80, 60, 3)}
    first = shrunk["opencv"].frames
    assert all(mean_abs_diff(v.frames, first) <= TOLERANCE for v in shrunk.values())
