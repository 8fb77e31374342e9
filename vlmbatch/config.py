"""Settings read from `VLMBATCH_*` environment variables (flags override them)."""

from __future__ import annotations

import os


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_str(name: str, default: str | None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def image_fetch_timeout() -> float:
    """Seconds before an image download is abandoned (`VLMBATCH_IMAGE_FETCH_TIMEOUT`)."""
    return env_float("VLMBATCH_IMAGE_FETCH_TIMEOUT", 10.0)


def video_fetch_timeout() -> float:
    """Seconds before a video download is abandoned (`VLMBATCH_VIDEO_FETCH_TIMEOUT`)."""
    return env_float("VLMBATCH_VIDEO_FETCH_TIMEOUT", 30.0)


def video_loader_backend() -> str:
    """Default video decoder (`VLMBATCH_VIDEO_LOADER_BACKEND`)."""
    return env_str("VLMBATCH_VIDEO_LOADER_BACKEND", "opencv") or "opencv"


def media_loading_thread_count() -> int:
    """Parallelism of media loading (`VLMBATCH_MEDIA_LOADING_THREAD_COUNT`)."""
    return env_int("VLMBATCH_MEDIA_LOADING_THREAD_COUNT", 8)


def broker_url() -> str | None:
    """The Celery broker; None means run jobs in-process (`VLMBATCH_BROKER_URL`)."""
    return env_str("VLMBATCH_BROKER_URL", None)


def api_key() -> str | None:
    """Bearer token the server requires on /v1 routes (`VLMBATCH_API_KEY`)."""
    return env_str("VLMBATCH_API_KEY", None)


def queue_visibility_timeout() -> float:
    """Seconds a running shard may go without a heartbeat before its message is delivered
    again (`VLMBATCH_QUEUE_VISIBILITY_TIMEOUT`). Workers renew it while a shard runs, so it
    bounds how long a `kill -9`-ed worker's shard waits, not how long a shard may take."""
    return env_float("VLMBATCH_QUEUE_VISIBILITY_TIMEOUT", 20.0)


def queue_poison_crashes() -> int:
    """Crashes of the same row range after which a shard is split to isolate a poison row
    (`VLMBATCH_QUEUE_POISON_CRASHES`)."""
    return env_int("VLMBATCH_QUEUE_POISON_CRASHES", 3)


def preprocess_workers() -> int | None:
    """Processes that prepare rows (media decoding, the model's processor) for the engine
    (`VLMBATCH_PREPROCESS_WORKERS`); 0 prepares them in the engine's thread, unset (None)
    sizes the pool from the usable cores."""
    value = env_str("VLMBATCH_PREPROCESS_WORKERS", None)
    return int(value) if value is not None else None


def worker_cpus() -> set[int] | None:
    """The cores of this host that `vlmbatch worker` gave this GPU worker process
    (`VLMBATCH_WORKER_CPUS`, e.g. "0-7" or "0,2,4"): its preprocessing pool is sized from
    them. Set by the supervisor for each process it starts; None elsewhere."""
    value = env_str("VLMBATCH_WORKER_CPUS", None)
    if value is None:
        return None
    cores: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def gpu_media_budget_bytes() -> int:
    """How many bytes of media tensors already on the GPU (frames from GPU video decoders)
    the rows in flight may hold together (`VLMBATCH_GPU_MEDIA_BUDGET_MB`, default 4096):
    they wait there until the engine encodes them, outside the KV cache's memory plan."""
    return env_int("VLMBATCH_GPU_MEDIA_BUDGET_MB", 4096) * 2**20


def pin_worker_cpus() -> bool:
    """Whether each `vlmbatch worker` GPU process (engine and preprocessing pool) runs only
    on its own share of the cores (`VLMBATCH_PIN_WORKER_CPUS`, default 1), so two engines'
    host threads never compete for a core; 0 only sizes the pools from the share."""
    return env_int("VLMBATCH_PIN_WORKER_CPUS", 1) != 0
