"""media_io_kwargs["video"]: what is accepted, what is refused, and how it is reported."""

from __future__ import annotations

import pytest

from vlmbatch.config import MediaConfig
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.options import (
    VideoOptions,
    default_video_options,
    override_video_options,
    parse_video_options,
)


def test_defaults_follow_the_processs_media_configuration():
    env = {"VLMBATCH_VIDEO_LOADER_BACKEND": "pyav", "VLMBATCH_MEDIA_LOADING_THREAD_COUNT": "40"}
    options = default_video_options(MediaConfig.from_env(env))
    assert options.backend == "pyav"
    assert options.pool_size == 16  # clamped to [1, 16]
    options = default_video_options(MediaConfig.from_env({}))
    assert (options.backend, options.pool_size, options.seek_mode, options.num_ffmpeg_threads, options.hw_decoders) == (
        "opencv", 8, "exact", 0, 2,
    )
    assert VideoOptions() == options  # no configuration: the same built-in defaults
    with pytest.raises(ValueError, match="VLMBATCH_VIDEO_LOADER_BACKEND.*'ffmpeg'"):
        default_video_options(MediaConfig.from_env({"VLMBATCH_VIDEO_LOADER_BACKEND": "ffmpeg"}))


def test_backend_options_for_their_backend():
    options = parse_video_options({"backend": "torchcodec", "num_ffmpeg_threads": 4, "seek_mode": "approximate"})
    assert (options.backend, options.num_ffmpeg_threads, options.seek_mode) == ("torchcodec", 4, "approximate")
    assert parse_video_options({"backend": "pynvvideocodec", "hw_decoders": 3}).hw_decoders == 3
    assert parse_video_options({"backend": "deepstream", "pool_size": 0}).pool_size == 1
    assert parse_video_options({"backend": "deepstream", "pool_size": 99}).pool_size == 16


@pytest.mark.parametrize(
    "kwargs, owner",
    [
        ({"backend": "opencv", "seek_mode": "exact"}, "torchcodec"),
        ({"backend": "pyav", "num_ffmpeg_threads": 2}, "torchcodec"),
        ({"backend": "torchcodec", "hw_decoders": 2}, "pynvvideocodec"),
        ({"backend": "pynvvideocodec", "pool_size": 4}, "deepstream"),
        ({"pool_size": 4}, "deepstream"),  # default backend opencv
    ],
)
def test_option_of_another_backend_names_both(kwargs, owner):
    with pytest.raises(ValueError) as caught:
        parse_video_options(kwargs, VideoOptions())
    name = next(k for k in kwargs if k != "backend")
    message = str(caught.value)
    assert repr(name) in message and repr(owner) in message and repr(kwargs.get("backend", "opencv")) in message


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"backend": "ffmpeg"}, "'backend'"),
        ({"backend": "torchcodec", "seek_mode": "fast"}, "'seek_mode'"),
        ({"backend": "torchcodec", "num_ffmpeg_threads": -1}, "'num_ffmpeg_threads'"),
        ({"backend": "pynvvideocodec", "hw_decoders": 0}, "'hw_decoders'"),
        ({"backend": "pynvvideocodec", "hw_decoders": "2"}, "'hw_decoders'"),
        ({"num_frames": 0}, "'num_frames'"),
        ({"fps": -1}, "'fps'"),
        ({"num_frames": 8, "fps": 1.0}, "exclude"),
        ({"max_duration": "long"}, "'max_duration'"),
        ({"frames": 8}, "'frames'"),
    ],
)
def test_bad_values_are_refused_with_the_option_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_video_options(kwargs, VideoOptions())


def test_num_frames_and_fps_replace_each_other():
    job = parse_video_options({"fps": 1.0}, VideoOptions())
    row = override_video_options(job, {"num_frames": 8})
    assert (row.num_frames, row.fps) == (8, None)
    back = override_video_options(row, {"fps": 4})
    assert (back.num_frames, back.fps) == (None, 4.0)


def test_row_override_keeps_job_settings_it_does_not_mention():
    job = parse_video_options({"backend": "torchcodec", "seek_mode": "approximate", "max_frames": 32}, VideoOptions())
    row = override_video_options(job, {"num_frames": 16})
    assert (row.backend, row.seek_mode, row.max_frames, row.num_frames) == ("torchcodec", "approximate", 32, 16)
    switched = override_video_options(job, {"backend": "pyav"})  # job's torchcodec options simply stop applying
    assert switched.backend == "pyav"


def test_row_override_errors_are_row_errors():
    with pytest.raises(RowError) as caught:
        override_video_options(VideoOptions(), {"backend": "opencv", "seek_mode": "exact"}, param="media_io_kwargs")
    assert caught.value.error_type == ErrorType.INVALID_ROW
    assert caught.value.param == "media_io_kwargs"
    assert "'seek_mode'" in caught.value.message


def test_missing_decoder_library_is_reported_at_start_up():
    from vlmbatch.media.video import ensure_backend_available

    ensure_backend_available("opencv")
    ensure_backend_available("pyav")
    with pytest.raises(ValueError, match="nvidia-deepstream-videodecode"):
        ensure_backend_available("deepstream")


def test_hw_decoders_cannot_change_per_request():
    job = parse_video_options({"backend": "pynvvideocodec", "hw_decoders": 4}, VideoOptions())
    assert override_video_options(job, {"hw_decoders": 4, "num_frames": 8}).num_frames == 8
    with pytest.raises(RowError) as caught:
        override_video_options(job, {"hw_decoders": 2})
    assert caught.value.error_type == ErrorType.INVALID_ROW and "'hw_decoders'" in caught.value.message


def test_prepare_video_backend_at_start_up():
    from vlmbatch.media.video import prepare_video_backend

    prepare_video_backend(parse_video_options({"backend": "pyav"}, VideoOptions()))
    with pytest.raises(ValueError, match="deepstream"):
        prepare_video_backend(parse_video_options({"backend": "deepstream", "pool_size": 4}, VideoOptions()))


def test_a_workers_own_options_are_its_defaults_under_job_options():
    """A worker's --media-io-kwargs set its defaults (over its variables); a job's own options win."""
    media = MediaConfig.from_env({"VLMBATCH_VIDEO_LOADER_BACKEND": "torchcodec"},
                                 video_options={"backend": "pyav", "num_frames": 8})
    defaults = default_video_options(media)
    assert (defaults.backend, defaults.num_frames) == ("pyav", 8)
    job = parse_video_options({"num_frames": 4}, defaults)
    assert (job.backend, job.num_frames) == ("pyav", 4)
    assert parse_video_options({"num_frames": 4}).backend == "opencv"  # nothing else changed: no process state
    with pytest.raises(ValueError, match="'seek_mode'"):
        default_video_options(MediaConfig(video_options={"seek_mode": "exact"}))  # opencv has none


def test_cpu_decoder_threads_reach_opencv(tmp_path):
    """Preprocessing workers set one decoder thread; OpenCV's capture is opened with it."""
    cv2 = pytest.importorskip("cv2")
    from vlmbatch.media.refs import MediaSource
    from vlmbatch.media.video.opencv_capture import open_capture
    from vlmbatch.media.video.options import set_cpu_decoder_threads
    from vlmbatch.testing.videos import ffmpeg_available, make_video

    if not ffmpeg_available():
        pytest.skip("needs the ffmpeg command line to make a test video")
    source = MediaSource(name="clip", path=str(make_video(tmp_path, "h264_mp4")))
    try:
        set_cpu_decoder_threads(1)
        with open_capture(source) as capture:
            assert capture.get(cv2.CAP_PROP_N_THREADS) == 1
    finally:
        set_cpu_decoder_threads(0)
    plain = cv2.VideoCapture(source.path, cv2.CAP_FFMPEG)
    with open_capture(source) as capture:  # 0: OpenCV chooses, as for a plain capture
        assert capture.get(cv2.CAP_PROP_N_THREADS) == plain.get(cv2.CAP_PROP_N_THREADS)
    plain.release()
