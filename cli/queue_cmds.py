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
    engine_config,
    parse_json_option,
    resolve_job_dir,
)

JobArgument = typer.Argument(
    ..., help="Job id (found under --output, or through the broker wherever it lies) or its folder (a path or an s3:// URL)."
)


def _located(job: str, output: str, broker: str | None, storage_options: str | None) -> tuple[Any, str | None]:
    """The job's folder and its broker: the flag or VLMBATCH_BROKER_URL, else the one it was
    submitted to; None for a job that ran in-process (the embedded default)."""
    from vlmbatch.io.manifest import Manifest

    job_dir = resolve_job_dir(job, output, parse_json_option(storage_options, "--storage-options"), broker)
    return job_dir, broker or Manifest.load(job_dir).broker


def _job(job: str, output: str, broker: str | None, storage_options: str | None) -> tuple[Any, str]:
    """`_located`, for the commands that follow or stop a queued job."""
    job_dir, broker = _located(job, output, broker, storage_options)
    if not broker:
        raise typer.BadParameter(
            f"job {job} ran in-process (no broker): it runs and stops with the `vlmbatch submit` that started it "
            f"(Ctrl-C stops it), and `vlmbatch resume {job}` runs what is left of it here", param_hint="JOB",
        )  # fmt: skip
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

    job_dir, broker = _located(job, output, broker, storage_options)
    console = Console()
    if broker:
        console.print(status_table(job_status(job_dir, broker)))
        return
    from vlmbatch.job.report import print_summary

    summary = print_summary(job_dir, console)  # an in-process job: what its committed parts hold
    if summary.parts_committed < summary.parts_planned:
        console.print(f"ran in-process; {summary.parts_planned - summary.parts_committed} shards left: `vlmbatch resume {job}` runs them here")


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
    """Run what is left of JOB: re-queue its shards without a committed part, or run them here.

    A queued job's shards go back on its broker (Redis state is rebuilt from the folder).
    A job that ran in-process (no broker) runs them in this process, its model loaded
    with the engine options `submit` was given.
    """
    import os

    from vlmbatch.config import MediaConfig, WorkerConfig
    from vlmbatch.errors import JobError
    from vlmbatch.io.manifest import Manifest
    from vlmbatch.job.local import ENGINE_FLAGS_KEY, run_in_process
    from vlmbatch.job.queue import resume_job
    from vlmbatch.job.report import print_summary

    job_dir, broker = _located(job, output, broker, storage_options)
    console = Console(stderr=True)
    if broker:
        queued = resume_job(job_dir, broker, retry_errors=retry_errors)
        console.print(f"queued {queued} shards of {job}")
        return
    manifest = Manifest.load(job_dir)
    config = engine_config(**manifest.extra.get(ENGINE_FLAGS_KEY, {}))
    try:
        elapsed = run_in_process(manifest, job_dir, config, WorkerConfig.from_env(os.environ), MediaConfig.from_env(os.environ),
                                 console=console, retry_errors=retry_errors)  # fmt: skip
    except JobError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    print_summary(job_dir, console)  # the whole job's rows: a rate over them would count the rows run before
    console.print(f"resumed {job} in {elapsed:,.1f} s")


def register(app: typer.Typer) -> None:
    for command in (worker, status, wait, cancel, resume):
        app.command()(command)
