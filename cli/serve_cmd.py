"""`vlmbatch serve`: the OpenAI-compatible chat endpoint (FastAPI + uvicorn)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from vlmbatch.cli.options import (
    KvCacheDtypeOption,
    QuantizationOption,
    QuantizeVisionOption,
    AttentionBackendOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    MediaIoKwargsOption,
    ModelOption,
    StorageOptionsOption,
    engine_config,
    parse_json_option,
)
from vlmbatch.server.settings import DEFAULT_LIMIT_MM_PER_PROMPT, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_MEDIA_BYTES


def _items(values: list[str] | None) -> tuple[str, ...]:
    """Repeated flags and comma-separated lists both work: `--allowed-media-domains a.com,b.org`."""
    return tuple(d.strip().lower() for value in values or () for d in value.split(",") if d.strip())


def _networks(values: list[str] | None) -> tuple[str, ...]:
    networks = _items(values)
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--allowed-media-networks")
    return networks


def _limits(value: str | None) -> dict[str, int]:
    limits = dict(DEFAULT_LIMIT_MM_PER_PROMPT)
    for modality, limit in parse_json_option(value, "--limit-mm-per-prompt").items():
        if modality not in DEFAULT_LIMIT_MM_PER_PROMPT or not isinstance(limit, int) or limit < 0:
            raise typer.BadParameter(
                f"expected non-negative integers for {', '.join(DEFAULT_LIMIT_MM_PER_PROMPT)}, got {modality!r}: {limit!r}",
                param_hint="--limit-mm-per-prompt",
            )
        limits[modality] = limit
    return limits


def serve(
    model: str = ModelOption,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(2242, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="VLMBATCH_API_KEY", help="Require 'Authorization: Bearer KEY' on every /v1 route."
    ),
    chat_template: Optional[Path] = typer.Option(
        None, "--chat-template", exists=True, dir_okay=False, help="Jinja chat template file (required when the model has none)."
    ),
    media_io_kwargs: Optional[str] = MediaIoKwargsOption,
    limit_mm_per_prompt: Optional[str] = typer.Option(
        None, "--limit-mm-per-prompt", help='Most media per request, e.g. \'{"image": 4, "video": 1}\' (the default).'
    ),
    allowed_local_media_path: Optional[Path] = typer.Option(
        None, "--allowed-local-media-path", exists=True, file_okay=False,
        help="Folder that file:// media URLs may read from (nothing local is readable without it).",
    ),
    allowed_media_domains: Optional[list[str]] = typer.Option(
        None, "--allowed-media-domains", help="Only fetch media from these hosts (repeatable or comma-separated)."
    ),
    allow_private_media_urls: bool = typer.Option(
        False, "--allow-private-media-urls",
        help="Allow media URLs that resolve to loopback, private, link-local or metadata addresses.",
    ),
    allowed_media_networks: Optional[list[str]] = typer.Option(
        None, "--allowed-media-networks",
        help="CIDRs exempt from the private-address guard, e.g. an internal image store (repeatable or comma-separated).",
    ),
    allowed_media_buckets: Optional[list[str]] = typer.Option(
        None, "--allowed-media-buckets",
        help="Object-storage buckets whose s3:// media URLs may be read (repeatable or comma-separated); none by default.",
    ),
    storage_options: Optional[str] = StorageOptionsOption,
    max_media_bytes: int = typer.Option(DEFAULT_MAX_MEDIA_BYTES, "--max-media-bytes", min=1, help="Size cap of one media download."),
    max_image_pixels: int = typer.Option(
        DEFAULT_MAX_IMAGE_PIXELS, "--max-image-pixels", min=1, help="Images with more pixels are refused before decoding."
    ),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Model id clients use (default: --model)."),
    engine: str = EngineOption,
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    attention_backend: Optional[str] = AttentionBackendOption,
    quantization: Optional[str] = QuantizationOption,
    quantize_vision: Optional[bool] = QuantizeVisionOption,
    kv_cache_dtype: Optional[str] = KvCacheDtypeOption,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve MODEL behind an OpenAI-compatible /v1/chat/completions (images and videos)."""
    import os

    import uvicorn

    from vlmbatch.config import MediaConfig
    from vlmbatch.engine.factory import create_engine
    from vlmbatch.errors import JobError
    from vlmbatch.families.registry import load_adapter
    from vlmbatch.media.video import default_video_options, parse_video_options, prepare_video_backend
    from vlmbatch.server.app import create_app, require_chat_template
    from vlmbatch.server.settings import ServerSettings

    console = Console(stderr=True)
    config = engine_config(engine=engine, dtype=dtype, device=device, attention_backend=attention_backend,
                           quantization=quantization, quantize_vision=quantize_vision, kv_cache_dtype=kv_cache_dtype)
    try:
        media = MediaConfig.from_env(os.environ)
    except JobError as exc:  # a bad VLMBATCH_* value, named
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    settings = ServerSettings(
        model=model,
        served_model_name=served_model_name,
        api_key=api_key,
        chat_template=str(chat_template) if chat_template else None,
        media_io_kwargs=parse_json_option(media_io_kwargs, "--media-io-kwargs"),
        limit_mm_per_prompt=_limits(limit_mm_per_prompt),
        allowed_local_media_path=allowed_local_media_path,
        allowed_media_domains=_items(allowed_media_domains),
        allow_private_media_urls=allow_private_media_urls,
        allowed_media_networks=_networks(allowed_media_networks),
        max_media_bytes=max_media_bytes,
        max_image_pixels=max_image_pixels,
        media=media,
        object_media=_object_media(allowed_media_buckets, storage_options),
    )
    try:
        prepare_video_backend(parse_video_options(settings.media_io_kwargs.get("video"), default_video_options(media)))
        adapter = load_adapter(model, chat_template=settings.chat_template, trust_remote_code=config.trust_remote_code)
        require_chat_template(adapter)  # before the weights load: a refusal should be quick
        app = create_app(adapter, create_engine(adapter, config), settings)
    except (JobError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _object_media(buckets: list[str] | None, storage_options: str | None) -> Any:
    """The s3:// media reader of the allowed buckets (None: no bucket allowed)."""
    from vlmbatch.io.storage import ObjectMedia

    allowed = _items(buckets)
    return ObjectMedia(parse_json_option(storage_options, "--storage-options"), allowed) if allowed else None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
