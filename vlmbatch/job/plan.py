"""Submit-time work: refuse bad jobs early, plan shards, write the manifest.

Everything that can make a whole job fail (missing file, unknown format, missing
columns, unknown model, bad media options) is checked here, before anything is
queued or written, and reported as a one-line `JobError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.config import EngineConfig, MediaConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import JobError


def check_model(model: str) -> str:
    """Fail fast on a model that cannot be resolved or is of no supported family (no weights load)."""
    from vlmbatch.models.registry import ADAPTERS, load_config

    family = load_config(model).model_type
    if family not in ADAPTERS:
        raise JobError(f"unsupported model type {family!r} for {model}; supported: {', '.join(sorted(ADAPTERS))}")
    return family


def check_media_io_kwargs(media_io_kwargs: dict[str, Any], media: MediaConfig) -> None:
    """Job-level media options are validated once, at submit (a typo must not fail every
    row), over the defaults of the submitting process's `media` configuration."""
    unknown = set(media_io_kwargs) - {"image", "video"}
    if unknown:
        raise JobError(f"--media-io-kwargs: unknown media kind(s) {sorted(unknown)}; expected 'image' and/or 'video'")
    if "video" in media_io_kwargs:
        from vlmbatch.media.video.options import default_video_options, parse_video_options

        try:
            parse_video_options(media_io_kwargs["video"], default_video_options(media))
        except ValueError as exc:
            raise JobError(f"--media-io-kwargs: {exc}") from exc


def plan_job(
    dataset: str | Path,
    model: str,
    output: str | Path,
    *,
    engine: str = "auto",
    columns: Any = None,
    sampling: SamplingParams | None = None,
    media_io_kwargs: dict[str, Any] | None = None,
    shard_size: int = 1000,
    broker: str | None = None,
    chat_template: str | None = None,
    media: MediaConfig | None = None,
) -> tuple[Any, Path]:
    """Validate the job and write `OUTPUT/JOB/manifest.json`; nothing runs yet. Its media
    options are checked over `media` (the submitting process's; default: the built-in one)."""
    from vlmbatch.io.manifest import Manifest
    from vlmbatch.io.readers import ShardPlan, open_dataset

    reader = open_dataset(dataset, columns)
    check_model(model)
    check_media_io_kwargs(media_io_kwargs or {}, media or MediaConfig())
    manifest = Manifest.for_dataset(
        reader,
        output_dir=output,
        model=model,
        engine=engine,
        sampling=(sampling or SamplingParams()).to_dict(),
        media_io_kwargs=media_io_kwargs or {},
        shard_size=shard_size,
        broker=broker,
    )
    if not manifest.shards:  # an empty dataset completes with one empty, typed part
        manifest.shards = [ShardPlan(shard_id=0, row_start=0, row_end=0, byte_start=0, byte_end=0, row_groups=[])]
    if chat_template:
        manifest.extra["chat_template"] = chat_template
    manifest.save()
    return manifest, manifest.job_dir


def load_llm(model: str, config: EngineConfig, chat_template: str | None = None) -> Any:
    """Load the model once (the expensive part of a worker's start-up; start the
    preprocessing pool's fork server first, `RowPreparer.start_fork_server`, so its
    imports overlap the model load)."""
    from vlmbatch.engine.llm import LLM

    # Until `LLM` takes the whole `EngineConfig` (the lead's refactor), the options it takes today.
    options: dict[str, Any] = {} if config.attention_backend == "auto" else {"attention_backend": config.attention_backend}
    return LLM(model=model, engine=config.engine, dtype=config.dtype, device=config.device, chat_template=chat_template,
               **options)
