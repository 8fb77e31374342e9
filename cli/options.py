"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

ModelOption = typer.Option(..., "--model", "-m", envvar="VLMBATCH_MODEL", help="Hugging Face model id or local checkpoint folder.")
EngineOption = typer.Option(
    "auto", "--engine", envvar="VLMBATCH_ENGINE", help="Generation engine: paged (fast), hf (transformers generate, the reference) or auto."
)
OutputOption = typer.Option(
    Path("vlmbatch-out"), "--output", "-o", envvar="VLMBATCH_OUTPUT_DIR", help="Folder that holds one sub-folder per job."
)
BrokerOption = typer.Option(
    None, "--broker", envvar="VLMBATCH_BROKER_URL", help="Celery broker URL (redis://...). Without one the job runs in this process."
)
DtypeOption = typer.Option("auto", "--dtype", envvar="VLMBATCH_DTYPE", help="Model dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
DeviceOption = typer.Option("auto", "--device", envvar="VLMBATCH_DEVICE", help="auto, cpu, cuda or cuda:N.")
AttentionBackendOption = typer.Option(
    None,
    "--attention-backend",
    help="Paged attention kernels: auto (triton on CUDA, torch elsewhere), triton, torch, flash-attn. "
    "Unset: VLMBATCH_ATTENTION_BACKEND, else auto.",
)
GpuImageDecodeOption = typer.Option(
    None,
    "--gpu-image-decode",
    help="JPEG decoding on the engine's GPU (nvJPEG), in batches: auto (on for the paged engine on CUDA), on, off. "
    "Unset: the worker's VLMBATCH_GPU_IMAGE_DECODE, else auto. See docs/preprocessing.md.",
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


def resolve_job_dir(job: str, output: Path) -> Path:
    """A job is named by its id (under --output) or by the path of its folder."""
    candidate = Path(job)
    if (candidate / "manifest.json").exists():
        return candidate
    if (output / job / "manifest.json").exists():
        return output / job
    raise typer.BadParameter(f"no job {job!r} (looked for {candidate}/manifest.json and {output / job}/manifest.json)", param_hint="JOB")
