"""`vlmbatch.config`: flags over `VLMBATCH_*` variables over defaults, every mistake named."""

from __future__ import annotations

import os

import pytest

from vlmbatch.config import (
    ConfigError,
    EngineConfig,
    MediaConfig,
    QueueConfig,
    WorkerConfig,
    describe,
    from_json,
    to_json,
)


def test_flags_win_over_variables_which_win_over_defaults() -> None:
    env = {"VLMBATCH_IMAGE_FETCH_TIMEOUT": "2.5", "VLMBATCH_VIDEO_FETCH_TIMEOUT": "40"}
    media = MediaConfig.from_env(env, video_fetch_timeout=5.0)
    assert media.video_fetch_timeout == 5.0  # the flag
    assert media.image_fetch_timeout == 2.5  # the variable
    assert media.media_loading_thread_count == 8  # the default
    assert MediaConfig.from_env(env, video_fetch_timeout=None).video_fetch_timeout == 40.0  # None: no flag given


def test_each_variable_is_read_with_its_type() -> None:
    env = {
        "VLMBATCH_QUEUE_VISIBILITY_TIMEOUT": "4.5",
        "VLMBATCH_QUEUE_POISON_CRASHES": "2",
        "VLMBATCH_PREPROCESS_WORKERS": "0",
        "VLMBATCH_WORKER_CPUS": "0-2,8",
        "VLMBATCH_PIN_WORKER_CPUS": "off",
        "VLMBATCH_GPU_MEDIA_BUDGET_MB": "16",
    }
    assert QueueConfig.from_env(env) == QueueConfig(visibility_timeout=4.5, poison_crashes=2)
    worker = WorkerConfig.from_env(env)
    assert worker == WorkerConfig(preprocess_workers=0, worker_cpus=frozenset({0, 1, 2, 8}), pin_worker_cpus=False,
                                  gpu_media_budget_mb=16)
    assert worker.gpu_media_budget_bytes == 16 * 2**20
    assert WorkerConfig.from_env({"VLMBATCH_PREPROCESS_WORKERS": "auto"}).preprocess_workers is None
    assert WorkerConfig.from_env({"VLMBATCH_PREPROCESS_WORKERS": " "}).preprocess_workers is None  # blank: unset


def test_an_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown media option\(s\) \['image_timeout'\]"):
        MediaConfig.from_env({}, image_timeout=3)
    with pytest.raises(ConfigError, match="max_num_seq"):
        EngineConfig().updated(max_num_seq=8)


def test_a_bad_value_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="VLMBATCH_QUEUE_POISON_CRASHES='three'"):
        QueueConfig.from_env({"VLMBATCH_QUEUE_POISON_CRASHES": "three"})
    with pytest.raises(ConfigError, match="VLMBATCH_PIN_WORKER_CPUS='maybe'"):
        WorkerConfig.from_env({"VLMBATCH_PIN_WORKER_CPUS": "maybe"})
    with pytest.raises(ConfigError, match="VLMBATCH_WORKER_CPUS='0-x'"):
        WorkerConfig.from_env({"VLMBATCH_WORKER_CPUS": "0-x"})


def test_choices_are_checked_for_flags_and_variables_alike() -> None:
    with pytest.raises(ConfigError, match=r"attention_backend='nope' \(VLMBATCH_ATTENTION_BACKEND\): choose one of auto, triton"):
        EngineConfig.from_env({}, attention_backend="nope")
    with pytest.raises(ConfigError, match="gpu_image_decode='sometimes'"):
        EngineConfig.from_env({"VLMBATCH_GPU_IMAGE_DECODE": "sometimes"})
    assert EngineConfig.from_env({"VLMBATCH_GPU_IMAGE_DECODE": " Off "}).gpu_image_decode == "off"  # as read before
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_a_configuration_crosses_a_command_line_as_json() -> None:
    engine = EngineConfig.from_env({"VLMBATCH_ATTENTION_BACKEND": "torch"}, engine="hf", max_num_seqs=4)
    assert from_json(EngineConfig, to_json(engine)) == engine
    media = MediaConfig(image_fetch_timeout=1.5, video_options={"backend": "pyav", "num_frames": 8})
    assert from_json(MediaConfig, to_json(media)) == media
    worker = WorkerConfig(worker_cpus=frozenset({3, 1}), pin_worker_cpus=False)
    assert from_json(WorkerConfig, to_json(worker)) == worker  # a core list travels as a list
    # unset (None) options come from the receiving side's environment
    assert from_json(WorkerConfig, to_json(WorkerConfig()), {"VLMBATCH_WORKER_CPUS": "4,5"}).worker_cpus == {4, 5}
    with pytest.raises(ConfigError, match=r"unknown queue option\(s\) \['retries'\]"):
        from_json(QueueConfig, '{"retries": 3}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        from_json(QueueConfig, "{visibility")


def test_every_option_is_documented_with_its_variable() -> None:
    for cls in (EngineConfig, MediaConfig, QueueConfig, WorkerConfig):
        for name, variable, _default, help_text in describe(cls):
            assert help_text, f"{cls.__name__}.{name} has no help"
            assert variable is None or variable.startswith("VLMBATCH_"), variable
    assert ("image_fetch_timeout", "VLMBATCH_IMAGE_FETCH_TIMEOUT", 10.0) == describe(MediaConfig)[0][:3]


def test_mask_fill_threads_auto_takes_half_the_cores_at_most_eight() -> None:
    cores = len(os.sched_getaffinity(0))
    assert EngineConfig.from_env({}).mask_fill_threads == max(1, min(8, cores // 2))
    assert EngineConfig.from_env({"VLMBATCH_GRAMMAR_FILL_THREADS": "3"}).mask_fill_threads == 3
    with pytest.raises(ConfigError, match="grammar_fill_threads"):
        EngineConfig.from_env({"VLMBATCH_GRAMMAR_FILL_THREADS": "-1"})
