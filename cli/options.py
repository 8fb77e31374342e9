"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from vlmbatch.config import ConfigError, EngineConfig

ModelOption = typer.Option(..., "--model", "-m", envvar="VLMBATCH_MODEL", help="Hugging Face model id or local checkpoint folder.")
EngineOption = typer.Option(
    "auto", "--engine", envvar="VLMBATCH_ENGINE", help="Generation engine: paged (fast), hf (transformers generate, the reference) or auto."
)
OutputOption = typer.Option(
    Path("vlmbatch-out"),
    "--output",
    "-o",
    envvar="VLMBATCH_OUTPUT_DIR",
    help="Folder that holds one sub-folder per job; submit and results also take an object-storage prefix (s3://bucket/prefix).",
)
BrokerOption = typer.Option(
    None, "--broker", envvar="VLMBATCH_BROKER_URL", help="Celery broker URL (redis://...). Without one the job runs in this process."
)
DtypeOption = typer.Option("auto", "--dtype", envvar="VLMBATCH_DTYPE", help="Model dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
DeviceOption = typer.Option("auto", "--device", envvar="VLMBATCH_DEVICE", help="auto, cpu, cuda or cuda:N.")
GpuImageDecodeOption = typer.Option(
    None,
    "--gpu-image-decode",
    help="JPEG decoding on the engine's GPU (nvJPEG), in batches: auto (on for the paged engine on CUDA), on, off. "
    "Unset: the worker's VLMBATCH_GPU_IMAGE_DECODE, else auto. See docs/preprocessing.md.",
)
AttentionBackendOption = typer.Option(
    None, "--attention-backend",
    help="Paged attention kernels: auto (triton on CUDA, torch on the CPU), triton, torch or flash-attn. "
    "Unset: VLMBATCH_ATTENTION_BACKEND, else auto.",
)
QuantizationOption = typer.Option(
    None, "--quantization",
    help="fp8: quantize the language model's bf16 weights at load (per output channel, dynamic per-token activations); "
    "none. A checkpoint's own FP8 quantization_config always applies. Unset: VLMBATCH_QUANTIZATION, else none.",
)
QuantizeVisionOption = typer.Option(
    None, "--quantize-vision",
    help="With --quantization fp8: the vision tower's linear layers too. Unset: VLMBATCH_QUANTIZE_VISION, else off.",
)
KvCacheDtypeOption = typer.Option(
    None, "--kv-cache-dtype",
    help="KV-cache element type: auto (the compute dtype) or fp8 (e4m3, per-tensor scale 1: twice the tokens of bf16). "
    "Unset: VLMBATCH_KV_CACHE_DTYPE, else auto.",
)
StorageOptionsOption = typer.Option(
    None,
    "--storage-options",
    envvar="VLMBATCH_STORAGE_OPTIONS",
    help='JSON options for s3:// (or other fsspec) URLs, over the AWS environment and config files, e.g. '
    '\'{"endpoint_url": "http://minio:9000", "profile": "lab"}\'; s3:// knows endpoint_url, region, key, secret, token, profile, anon.',
)
MediaIoKwargsOption = typer.Option(
    None,
    "--media-io-kwargs",
    envvar="VLMBATCH_MEDIA_IO_KWARGS",
    help='JSON options per media kind, e.g. \'{"video": {"backend": "torchcodec", "num_frames": 16}}\'.',
)


def parse_json_option(value: str | None, flag: str) -> dict[str, Any]:
    """Parse a JSON-object flag or exit with a one-line message naming the flag."""
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=flag)
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=flag)
    return parsed


def resolve_job_dir(job: str, output: str | Path, storage_options: dict[str, Any] | None = None,
                    broker: str | None = None) -> Any:
    """A job is named by its folder's path or URL, by its id under --output, or, with a
    broker, by its bare id wherever it lies (submit recorded its folder in Redis). Returns a
    `Path` or an `ObjectPath` (`vlmbatch.io.storage`); the error says every place it looked."""
    import redis

    from vlmbatch.errors import JobError
    from vlmbatch.io.storage import resolve
    from vlmbatch.job.queue import recorded_job_dir

    looked = []
    try:
        for folder in (resolve(job, storage_options), resolve(output, storage_options) / job):
            looked.append(f"{folder}/manifest.json")
            if (folder / "manifest.json").exists():
                return folder
        if broker:
            recorded = recorded_job_dir(job, broker)
            if recorded is None:
                looked.append(f"the broker {broker} (it has no job {job!r})")
            else:
                folder = resolve(recorded, storage_options)
                looked.append(f"{folder}/manifest.json (the folder the broker {broker} recorded)")
                if (folder / "manifest.json").exists():
                    return folder
    except redis.RedisError as exc:
        raise typer.BadParameter(f"cannot look up job {job!r} on the broker {broker}: {exc}", param_hint="JOB")
    except (JobError, OSError) as exc:
        raise typer.BadParameter(f"cannot look for job {job!r}: {exc}", param_hint="JOB")
    hint = "" if broker else "; with --broker (or VLMBATCH_BROKER_URL) a bare job id is looked up there too"
    raise typer.BadParameter(f"no job {job!r}: looked for {'; '.join(looked)}{hint}", param_hint="JOB")


def engine_config(**flags: Any) -> EngineConfig:
    """The engine configuration of this command: its flags (None = not given) over
    `VLMBATCH_*` variables over defaults; a bad value exits with a message naming it."""
    try:
        return EngineConfig.from_env(os.environ, **flags)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
