"""Rows → engine-ready prompts: parse, load media, build the prompt, tokenise.

Each row either becomes a `PreparedPrompt` or carries the `RowError` that explains why
not; nothing here raises for a bad row. The media loading and model preprocessing is
the CPU-heavy part of a job, so it sits behind one iterator that a parallel pool can
replace without the shard runner noticing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmbatch.config import MediaConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import RowError
from vlmbatch.job.rows import RowRequest, parse_row
from vlmbatch.media.loader import MediaLoader
from vlmbatch.media.types import EncodedImage
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import PreparedPrompt


@dataclass
class PreparedRow:
    row_id: int
    raw: Any
    request: RowRequest | None = None
    prepared: PreparedPrompt | None = None
    error: RowError | None = None

    @property
    def sampling(self) -> SamplingParams:
        assert self.request is not None
        return self.request.sampling


def media_loader_for(dataset: str | Path, media_io_kwargs: dict[str, Any] | None, config: MediaConfig,
                     storage_options: dict[str, Any] | None = None) -> MediaLoader:
    """Media options of a job: relative paths resolve next to the dataset file; `s3://`
    media are read with the job's storage options (batch jobs may read any bucket they can)."""
    from vlmbatch.io.storage import ObjectMedia

    return MediaLoader(config, base_dir=Path(dataset).resolve().parent, media_io_kwargs=media_io_kwargs or {},
                       objects=ObjectMedia(dict(storage_options or {})))


def prepare_row(
    row_id: int,
    raw: Any,
    columns: Any,
    defaults: SamplingParams,
    adapter: ModelAdapter | None,
    media: MediaLoader,
    check_only: bool = False,
    defer_jpegs: bool = False,
) -> PreparedRow:
    """Everything one row needs before the engine; errors are captured, not raised.

    `check_only` (dry-run) validates without building pixel tensors; `defer_jpegs` leaves
    JPEG decoding to the engine (`engine.gpu_images`).
    """
    item = PreparedRow(row_id=row_id, raw=raw)
    try:
        if isinstance(raw, RowError):
            raise raw
        item.request = parse_row(row_id, raw, columns, defaults)
        item.prepared = build_prompt(item.request, adapter, media, check_only, defer_jpegs)
    except RowError as error:
        item.error = error
    return item


def build_prompt(
    request: RowRequest,
    adapter: ModelAdapter | None,
    media: MediaLoader,
    check_only: bool = False,
    defer_jpegs: bool = False,
) -> PreparedPrompt | None:
    """Load the row's media and let the model's adapter build and tokenise the prompt.

    Without an adapter (queue benchmark) only the media are checked. With `defer_jpegs` a
    row whose images are all GPU-decodable JPEGs (and which has no video) keeps their bytes
    for the engine to decode; any other row, or any other image, takes the CPU path whole.
    """
    prompt = request.prompt
    image_refs, video_refs = list(request.image_refs), list(request.video_refs)
    if adapter is not None:
        request.sampling.check_vocabulary(len(adapter.tokenizer))
    if request.messages is not None:
        from vlmbatch.chat import parse_chat_messages

        messages, message_images, message_videos = parse_chat_messages(request.messages)
        if adapter is not None:
            messages = _with_column_media(messages, len(image_refs), len(video_refs))
            prompt = adapter.apply_chat_template(messages)
        image_refs = image_refs + message_images
        video_refs = video_refs + message_videos
    options = request.mm_processor_kwargs
    # The engine decodes JPEGs with the image processor's defaults: rows with options, and
    # families whose images the engine cannot decode, keep the CPU path.
    if (defer_jpegs and adapter is not None and adapter.accepts_encoded_images and image_refs and not video_refs
            and not check_only and not options):
        return _prepare_encoded(prompt or "", image_refs, adapter, media, request.sampling.max_tokens)
    load_image = media.image_size if check_only else media.image
    images = [load_image(ref, f"image[{i}]") for i, ref in enumerate(image_refs)]
    convention = {"convention": adapter.frame_convention} if adapter is not None else {}
    videos = [media.video(ref, f"video[{i}]", request.media_io_kwargs, **convention) for i, ref in enumerate(video_refs)]
    if adapter is None:
        return None
    if check_only:
        adapter.check(prompt or "", images, videos, max_tokens=request.sampling.max_tokens, processor_kwargs=options)
        return None
    return adapter.prepare(prompt or "", images, videos, max_tokens=request.sampling.max_tokens, processor_kwargs=options)


def _prepare_encoded(
    prompt: str, image_refs: list[Any], adapter: ModelAdapter, media: MediaLoader, max_tokens: int
) -> PreparedPrompt:
    """Encoded JPEGs for the engine when every image is one; otherwise the CPU path, from the bytes already read."""
    from vlmbatch.media.gpu_image import load_encoded_or_image
    from vlmbatch.media.image import load_image

    loaded = [load_encoded_or_image(ref, media.image_context, f"image[{i}]") for i, ref in enumerate(image_refs)]
    if all(isinstance(image, EncodedImage) for image in loaded):
        return adapter.prepare_encoded(prompt, loaded, max_tokens=max_tokens)
    images = [
        load_image(image.data, media.image_context, f"image[{i}]") if isinstance(image, EncodedImage) else image
        for i, image in enumerate(loaded)
    ]
    return adapter.prepare(prompt, images, [], max_tokens=max_tokens)


def _with_column_media(messages: list[dict[str, Any]], num_images: int, num_videos: int) -> list[dict[str, Any]]:
    """Media given in columns next to `messages` go first in the first user turn."""
    if not num_images and not num_videos:
        return messages
    parts = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos
    out = [dict(m) for m in messages]
    for message in out:
        if message.get("role") == "user":
            content = message.get("content")
            text_parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            message["content"] = parts + text_parts
            break
    return out
