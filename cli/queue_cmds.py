"""`vlmbatch worker | status | wait | cancel | resume`: the queue, from the command line."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.console import Console

from vlmbatch.cli.options import (
    KvCacheDtypeOption,
    QuantizationOption,
    QuantizeVisionOption,
    AttentionBackendOption,
    BrokerOption,
    DtypeOption,
    EngineOption,
    GpuImageDecodeOption,
    MediaIoKwargsOption,
    ModelOption,
    OutputOption,
    StorageOptionsOption,
    parse_json_option,
    resolve_job_dir,
)

JobArgument = typer.Argument(
    ..., help="Job id (found under --output, or through the broker wherever it lies) or its folder (a path or an s3:// URL)."
)


def _job(job: str, output: str, broker: str | None, storage_options: str | None) -> tuple[Any, str]:
    """The job's folder and its broker: the flag or VLMBATCH_BROKER_URL, else the one it was submitted to."""
    from vlmbatch.io.manifest import Manifest

    job_dir = resolve_job_dir(job, output, parse_json_option(storage_options, "--storage-options"), broker)
    broker = broker or Manifest.load(job_dir).broker
    if not broker:
        raise typer.BadParameter("this job was not queued on a broker; pass --broker", param_hint="--broker")
    return job_dir, broker


def worker(
    model: str = ModelOption,
    broker: Optional[str] = BrokerOption,
    gpus: str = typer.Option("all", "--gpus", help="GPUs to use, one worker process each (on its own share of the cores): all, a list such as 0,1, or cpu (one CPU process)."),
    engine: str = EngineOption,
    dtype: str = DtypeOption,
    attention_backend: Optional[str] = AttentionBackendOption,
    quantization: Optional[str] = QuantizationOption,
    quantize_vision: Optional[bool] = QuantizeVisionOption,
    kv_cache_dtype: Optional[str] = KvCacheDtypeOption,
    media_io_kwargs: Optional[str] = MediaIoKwargsOption,
    dry_run: bool = typer.Option(False, "--dry-run", hidden=True, help="Validate rows without a model (queue benchmark)."),
    gpu_image_decode: Optional[str] = GpuImageDecodeOption,
    storage_options: Optional[str] = StorageOptionsOption,
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", help="Prometheus /metrics of the first GPU process on this port, the next GPUs' on the next "
        "ports (docs/queue.md lists the metrics). Unset: VLMBATCH_METRICS_PORT, else none."),
) -> None:
    """Serve MODEL's queue: one process per GPU (one CPU process without GPUs), model loaded once each.

    --media-io-kwargs sets this worker's media defaults (e.g. a GPU video decoder and its
    hw_decoders, reserved at start-up); each job's and row's own options apply on top.
    --gpu-image-decode is this worker's default too (a job's `submit --gpu-image-decode` wins).
    --storage-options (or the AWS configuration) reach jobs whose folders are s3:// prefixes.
    Its processes never outlive it, whatever signal ends it (docs/queue.md).
    """
    import os

    from vlmbatch.config import EngineConfig, MediaConfig, QueueConfig, WorkerConfig
    from vlmbatch.errors import JobError
    from vlmbatch.media.video import default_video_options, ensure_backend_available
    from vlmbatch.workers.process import ProcessConfigs
    from vlmbatch.workers.supervisor import Supervisor, gpu_slots

    if not broker:
        raise typer.BadParameter("a worker needs a broker", param_hint="--broker")
    media = parse_json_option(media_io_kwargs, "--media-io-kwargs")
    try:  # every process of this worker gets these; a wrong flag or variable is named here, once
        configs = ProcessConfigs(
            engine=EngineConfig.from_env(os.environ, engine=engine, dtype=dtype, attention_backend=attention_backend,
                                         gpu_image_decode=gpu_image_decode, quantization=quantization,
                                         quantize_vision=quantize_vision, kv_cache_dtype=kv_cache_dtype),
            media=MediaConfig.from_env(os.environ, video_options=media.get("video")),
            queue=QueueConfig.from_env(os.environ),
            worker=WorkerConfig.from_env(os.environ, storage_options=parse_json_option(storage_options, "--storage-options") or None,
                                         metrics_port=metrics_port),
        )
    except JobError as exc:
        raise typer.BadParameter(str(exc))
    try:
        ensure_backend_available(default_video_options(configs.media).backend)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--media-io-kwargs")
    try:
        slots = gpu_slots(gpus)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpus")
    raise typer.Exit(Supervisor(model, broker, slots, configs, dry_run=dry_run).run())


def status(job: str = JobArgument, output: str = OutputOption, broker: Optional[str] = BrokerOption,
           storage_options: Optional[str] = StorageOptionsOption) -> None:
    """Rows done and failed, shards by state, rows/s, ETA and the workers running it."""
    from vlmbatch.job.queue import job_status, status_table

    Console().print(status_table(job_status(*_job(job, output, broker, storage_options))))


def wait(job: str = JobArgument, output: str = OutputOption, broker: Optional[str] = BrokerOption,
         storage_options: Optional[str] = StorageOptionsOption) -> None:
    """Follow JOB with a progress bar; exit 0 when it completes, 1 if it failed, 3 if cancelled."""
    from vlmbatch.job.queue import follow_job

    raise typer.Exit(follow_job(*_job(job, output, broker, storage_options)))


def cancel(job: str = JobArgument, output: str = OutputOption, broker: Optional[str] = BrokerOption,
           storage_options: Optional[str] = StorageOptionsOption) -> None:
    """Start no new shard of JOB; running shards stop at their next step without committing."""
    from vlmbatch.job.queue import cancel_job

    cancel_job(*_job(job, output, broker, storage_options))
    Console(stderr=True).print(f"cancelled {job}; `vlmbatch resume {job}` continues it")


def resume(
    job: str = JobArgument,
    output: str = OutputOption,
    broker: Optional[str] = BrokerOption,
    storage_options: Optional[str] = StorageOptionsOption,
    retry_errors: bool = typer.Option(False, "--retry-errors", help="Also re-run the rows that ended in an error."),
) -> None:
    """Re-queue every shard of JOB without a committed part (rebuilding Redis state from the folder)."""
    from vlmbatch.job.queue import resume_job

    queued = resume_job(*_job(job, output, broker, storage_options), retry_errors=retry_errors)
    Console(stderr=True).print(f"queued {queued} shards of {job}")


def register(app: typer.Typer) -> None:
    for command in (worker, status, wait, cancel, resume):
        app.command()(command)
