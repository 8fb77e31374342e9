"""`vlmbatch submit`: validate a dataset, plan its shards, then run or queue them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from vlmbatch.cli.options import (
    KvCacheDtypeOption,
    QuantizationOption,
    QuantizeVisionOption,
    AttentionBackendOption,
    BrokerOption,
    DeviceOption,
    DtypeOption,
    GpuImageDecodeOption,
    EngineOption,
    MediaIoKwargsOption,
    OutputOption,
    engine_config,
    StorageOptionsOption,
    parse_json_option,
)


def submit(
    ctx: typer.Context,
    dataset: str = typer.Argument(
        ..., help="JSONL, OpenAI Batch JSONL or Parquet file of prompts and media (a path or an s3:// URL); or a job "
        "file (.yaml, .yml, .toml) whose keys set these options (docs/jobs.md; flags given here win)."
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="VLMBATCH_MODEL", help="Hugging Face model id or local checkpoint folder (required here or in the job file)."),
    output: str = OutputOption,
    broker: Optional[str] = BrokerOption,
    engine: str = EngineOption,
    shard_size: int = typer.Option(1000, "--shard-size", envvar="VLMBATCH_SHARD_SIZE", help="Rows per shard (the unit of work and of retry)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Default maximum generated tokens per row (a row's max_tokens column wins)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Default sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Default nucleus-sampling probability mass."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k; 0 disables it."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Default sampling seed (rows may set their own)."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    n: int = typer.Option(1, "--n", help="Samples per row; results get one row per sample, numbered by `sample_index`."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="OpenAI's presence penalty, in [-2, 2]."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="OpenAI's frequency penalty, in [-2, 2]."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="transformers' repetition penalty (prompt and output tokens); 1 is off."),
    min_tokens: int = typer.Option(0, "--min-tokens", help="Tokens to generate before EOS or a stop string may end a row."),
    logit_bias: Optional[str] = typer.Option(None, "--logit-bias", help='JSON object of token id -> bias in [-100, 100], e.g. \'{"151643": -100}\'.'),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Write each token's logprob and the N most likely (0..20) to a `logprobs` column."),
    id_column: str = typer.Option("id", "--id-column", help="Column that identifies a row (row number when absent)."),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="Column with the raw prompt text."),
    messages_column: str = typer.Option("messages", "--messages-column", help="Column with OpenAI chat messages."),
    image_column: str = typer.Option("image", "--image-column", help="Column with one image (path, URL, data: URL, bytes or {bytes, path})."),
    images_column: str = typer.Option("images", "--images-column", help="Column with a list of images."),
    video_column: str = typer.Option("video", "--video-column", help="Column with one video."),
    media_io_kwargs: Optional[str] = MediaIoKwargsOption,
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="Jinja chat template file for models without one."),
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    wait: bool = typer.Option(False, "--wait", help="With --broker: follow the job with a progress bar until it ends."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate every row (media open, prompt fits) without generating; writes nothing."),
    gpu_image_decode: Optional[str] = GpuImageDecodeOption,
    attention_backend: Optional[str] = AttentionBackendOption,
    quantization: Optional[str] = QuantizationOption,
    quantize_vision: Optional[bool] = QuantizeVisionOption,
    kv_cache_dtype: Optional[str] = KvCacheDtypeOption,
    storage_options: Optional[str] = StorageOptionsOption,
    response_format: Optional[str] = typer.Option(
        None, "--response-format",
        help='Constrain every row\'s output (rows may set their own): an OpenAI response_format, e.g. \'{"type": "json_object"}\' '
        'or \'{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}\', or one vLLM key, e.g. \'{"guided_choice": ["yes", "no"]}\'.',
    ),
    json_schema: Optional[Path] = typer.Option(
        None, "--json-schema", help="JSON schema file every row's output must follow; results get a typed `output` column (docs/structured.md)."
    ),
) -> None:
    """Run DATASET through MODEL; results land in OUTPUT/JOB/results/*.parquet.

    Without a broker the job runs here, in-process, with a progress bar. With --broker
    (or VLMBATCH_BROKER_URL) its shards are queued for `vlmbatch worker` processes.
    """
    import os

    from vlmbatch.config import MediaConfig, WorkerConfig
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.errors import JobError
    from vlmbatch.io.readers import ColumnMap
    from vlmbatch.job.jobfile import apply_job_file, is_job_file
    from vlmbatch.job.local import ENGINE_FLAGS_KEY
    from vlmbatch.job.plan import structured_output_option
    from vlmbatch import job as jobs

    console = Console(stderr=True)
    if is_job_file(dataset):  # run again with the file's values for every option not on the command line
        # By name: Typer >= 0.29 ships its own copy of click, whose enum is not click's.
        given = {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}
        try:
            options = apply_job_file(dataset, {name: value for name, value in ctx.params.items()}, given)
        except JobError as exc:
            console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(2)
        return submit(ctx, **options)
    if model is None:
        raise typer.BadParameter("a model is required: --model, VLMBATCH_MODEL or the job file's `model`", param_hint="--model")
    columns = ColumnMap(
        id=id_column, prompt=prompt_column, messages=messages_column, image=image_column, images=images_column, video=video_column
    )
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop or ()), n=n,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
            min_tokens=min_tokens, logit_bias=parse_json_option(logit_bias, "--logit-bias") or {}, logprobs=logprobs,
        )
    except Exception as exc:  # RowError from validation: a flag is out of range
        raise typer.BadParameter(str(exc))
    media = parse_json_option(media_io_kwargs, "--media-io-kwargs")
    storage = parse_json_option(storage_options, "--storage-options")
    template = Path(chat_template).read_text() if chat_template else None
    engine_flags = dict(engine=engine, dtype=dtype, device=device, attention_backend=attention_backend,
                        gpu_image_decode=gpu_image_decode, quantization=quantization, quantize_vision=quantize_vision,
                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    config = engine_config(**engine_flags)  # checked before anything is written (a typo in --gpu-image-decode fails here)
    try:
        structured = structured_output_option(parse_json_option(response_format, "--response-format"), json_schema)
        media_config, worker_config = MediaConfig.from_env(os.environ), WorkerConfig.from_env(os.environ)
        if dry_run:
            report = jobs.dry_run(dataset, model, columns=columns, sampling=sampling, media_io_kwargs=media,
                                  chat_template=template, storage_options=storage, media=media_config)
            jobs.print_dry_run(report, console)
            raise typer.Exit(0 if report.rows_failed == 0 else 1)
        manifest, job_dir = jobs.plan_job(
            dataset, model, output, engine=engine, columns=columns, sampling=sampling,
            media_io_kwargs=media, shard_size=shard_size, broker=broker, chat_template=template,
            storage_options=storage, structured_output=structured, media=media_config,
        )
    except JobError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    if gpu_image_decode is not None:  # the job's own choice; workers without it use their own default
        manifest.extra["gpu_image_decode"] = gpu_image_decode
    if not broker:  # `resume` of an in-process job loads the model as this run did
        manifest.extra[ENGINE_FLAGS_KEY] = {name: value for name, value in engine_flags.items() if value is not None}
    manifest.save()
    print(manifest.job_id, flush=True)
    if manifest.num_rows == 0:
        console.print(f"dataset is empty: wrote an empty typed result to {job_dir}")
    if broker:
        from vlmbatch.job.queue import enqueue_job, follow_job

        enqueue_job(manifest, job_dir, broker)
        console.print(f"queued {manifest.num_shards} shards of {manifest.num_rows} rows on {broker}; results: {job_dir / 'results'}")
        if wait:
            raise typer.Exit(follow_job(job_dir, broker, console=console))
        return
    try:
        elapsed = jobs.run_in_process(manifest, job_dir, config, worker_config, media_config, console=console)
    except JobError as exc:  # e.g. GPU image decoding forced on without CUDA: refused before any row runs
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:  # committed shards stay; the running one is dropped
        console.print(f"interrupted: `vlmbatch resume {manifest.job_id} --output {output}` runs what is left of it")
        raise typer.Exit(130)
    jobs.print_summary(job_dir, console, elapsed_s=elapsed)


def register(app: typer.Typer) -> None:
    app.command()(submit)
