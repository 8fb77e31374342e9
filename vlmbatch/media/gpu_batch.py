"""JPEGs decoded on the GPU in the engine process, in batches, just before the vision tower.

Why here and not in the preprocessing pool: decoding and resizing a JPEG is most of a row's
CPU cost, and nvJPEG plus the processor on the device does it in a fraction of that, for a
whole prefill step's images at once. So when the paged engine runs on CUDA, pool workers
stop short of pixels for JPEGs that nvJPEG shows exactly as the CPU path would
(`gpu_decodable`): they read the header for the size, validate the file cheaply (a 1/8-scale
PIL draft decode: all entropy data is parsed, so corrupt and truncated files still fail as
that row's `media_decode_error`, but the IDCT and colour work is skipped), compute the
processor's grid from the size, tokenise, and pass the raw bytes on (`PendingJpeg`, under
`PENDING_KEY` in `mm_inputs`). The engine turns pending items into the processor's tensors in
`VisionLanguageModel.encode` (`materialize_pending`), and keeps only the bytes between steps:
pixels of a 12-megapixel Qwen image are ~75 MB, a running request may wait many steps, and a
re-encode (encoder-cache eviction) just decodes again.

Per item, a JPEG nvJPEG rejects takes the CPU decoder in the engine process
(`gpu_image.preprocess_images`); the tensors equal the CPU path's within
`GPU_MAX_ABS_DIFF`/`GPU_MEAN_ABS_DIFF` (decoders round the IDCT differently), the grid and
the token ids exactly. `VLMBATCH_GPU_IMAGE_DECODE` = auto (default: on for the paged engine
on CUDA), on (refused with a `JobError` where it cannot run), off.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlmbatch.config import env_str
from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.media.gpu_image import gpu_decodable, preprocess_images
from vlmbatch.media.image import load_image, opened_image
from vlmbatch.media.refs import MediaContext, resolve_media

if TYPE_CHECKING:
    from vlmbatch.engine.models.vlm import MediaItem, VisionLanguageModel

PENDING_KEY = "pending_jpegs"  # mm_inputs key: list[PendingJpeg], one per image, in prompt order
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class PendingJpeg:
    """A validated JPEG still to be decoded, with what the engine needs to do it: the model
    whose image processor makes its tensors, and its upright size (tokens were counted from it)."""

    data: bytes
    width: int
    height: int
    model_path: str

    @property
    def content_hash(self) -> str:
        """Keyed on the encoded bytes (the pixels are not known yet); encoder caches use it."""
        return "jpeg:" + hashlib.blake2b(self.data, digest_size=16).hexdigest()


def gpu_image_decode_mode(value: str | None = None) -> str:
    """`value` (a flag) or `VLMBATCH_GPU_IMAGE_DECODE`, checked: auto, on or off."""
    mode = (value or env_str("VLMBATCH_GPU_IMAGE_DECODE", "auto") or "auto").strip().lower()
    if mode not in MODES:
        raise JobError(f"VLMBATCH_GPU_IMAGE_DECODE / --gpu-image-decode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def defer_jpegs_for(engine: Any, mode: str | None = None) -> bool:
    """Whether rows for `engine` should carry JPEG bytes instead of pixels.

    Only the paged engine on CUDA decodes them (it owns the vision tower's batch). The HF
    reference engine never receives them: it is the parity oracle, so it keeps the exact CPU
    path, and `generate()` would need every image materialised up front anyway.
    """
    from vlmbatch.engine.models.vlm import VisionLanguageModel

    mode = gpu_image_decode_mode(mode)
    device = getattr(engine, "device", None)
    capable = isinstance(getattr(engine, "model", None), VisionLanguageModel) and getattr(device, "type", None) == "cuda"
    if mode == "on" and not capable:
        raise JobError(
            f"GPU image decoding is on (VLMBATCH_GPU_IMAGE_DECODE / --gpu-image-decode) but the engine "
            f"({type(engine).__name__} on {device}) cannot run it: it needs the paged engine on a CUDA device; "
            "use auto or off"
        )
    return mode != "off" and capable


def load_image_or_jpeg(ref: Any, ctx: MediaContext, model_path: str, param: str = "image") -> Any:
    """A `PendingJpeg` for a GPU-decodable JPEG, else the CPU path's PIL image (from the same
    bytes, so a URL is fetched once). Both raise the CPU path's `RowError`s for bad files."""
    source = resolve_media(ref, ctx, "image", param)
    try:
        data = source.data if source.data is not None else Path(source.path or "").read_bytes()
    except OSError as exc:
        raise RowError(ErrorType.MEDIA_NOT_FOUND, f"cannot read image {source.name}: {exc}", param) from exc
    if not gpu_decodable(data):
        return load_image(data, ctx, param)
    with opened_image(io.BytesIO(data), source.name, ctx, param) as image:
        width, height = image.size
        image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))
        image.load()  # entropy-decodes every block at 1/8 scale: truncation and corruption show
    return PendingJpeg(data, width, height, model_path)


@lru_cache(maxsize=4)
def image_processor_for(model_path: str) -> Any:
    """The model's own image processor (torchvision backend, so it runs on the device),
    loaded once per engine process."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_path)


def split_media(model: VisionLanguageModel, mm_inputs: dict[str, Any], hashes: list[str]) -> list[MediaItem]:
    """`model.split_media`, also for prompts whose images are pending: the family's own split
    runs on zero-width stand-in pixel rows (it only counts them: one per patch with a grid,
    one per image without), and each image item then carries its `PendingJpeg`."""
    pending: list[PendingJpeg] | None = mm_inputs.get(PENDING_KEY)
    if not pending:
        return model.split_media(mm_inputs, hashes)
    grids = mm_inputs.get("image_grid_thw")
    rows = int(grids.prod(-1).sum()) if grids is not None else len(pending)
    stand_in = {k: v for k, v in mm_inputs.items() if k != PENDING_KEY} | {"pixel_values": torch.empty(rows, 0)}
    items = model.split_media(stand_in, hashes)
    jpegs = iter(pending)
    for item in items:
        if item.kind == "image":
            item.inputs = {k: v for k, v in item.inputs.items() if k != "pixel_values"} | {PENDING_KEY: next(jpegs)}
    return items


def materialize_pending(
    requests: list[list[MediaItem]], encoder_cache: Any, device: torch.device
) -> list[list[MediaItem]]:
    """`requests` with every pending item that the tower will run on (not in `encoder_cache`)
    replaced by a copy holding the processor's tensors, decoded in one batch on `device`.

    The originals keep only their bytes. A file neither decoder can read raises its
    `RowError` (preparation validated it, so this is rare); the shard runner then isolates
    the row that failed.
    """
    todo: dict[str, MediaItem] = {}
    for items in requests:
        for item in items:
            if PENDING_KEY in item.inputs and item.content_hash not in encoder_cache:
                todo.setdefault(item.content_hash, item)
    if not todo:
        return requests
    ready: dict[str, MediaItem] = {}
    by_model: dict[str, list[MediaItem]] = {}
    for item in todo.values():
        by_model.setdefault(item.inputs[PENDING_KEY].model_path, []).append(item)
    for model_path, group in by_model.items():
        datas = [item.inputs[PENDING_KEY].data for item in group]
        for item, tensors in zip(group, preprocess_images(datas, image_processor_for(model_path), device)):
            ready[item.content_hash] = replace(item, inputs=_decoded_inputs(item, tensors))
    return [[ready.get(item.content_hash, item) if PENDING_KEY in item.inputs else item for item in items] for items in requests]


def _decoded_inputs(item: MediaItem, tensors: dict[str, torch.Tensor] | RowError) -> dict[str, torch.Tensor]:
    """The item's inputs with pixels in place of the bytes; the grid must be the one the
    prompt's tokens were counted for."""
    if isinstance(tensors, RowError):
        raise tensors
    inputs = {k: v for k, v in item.inputs.items() if k != PENDING_KEY}
    grid = inputs.get("image_grid_thw")
    if grid is not None and grid.tolist() != tensors["image_grid_thw"].tolist():
        raise RowError(
            ErrorType.ENGINE,
            f"GPU image preprocessing gave grid {tensors['image_grid_thw'].tolist()}, the prompt was built for {grid.tolist()}",
            "image",
        )
    return inputs | {"pixel_values": tensors["pixel_values"]}


def materialize_prompt_inputs(mm_inputs: dict[str, Any], device: torch.device | str = "cpu") -> dict[str, Any]:
    """A prompt's `mm_inputs` with pending images turned into the CPU path's tensor layout,
    for engines without a per-step media batch (the HF reference engine); raises the
    `RowError` of a file neither decoder reads."""
    pending: list[PendingJpeg] | None = mm_inputs.get(PENDING_KEY)
    if not pending:
        return mm_inputs
    outputs = preprocess_images([p.data for p in pending], image_processor_for(pending[0].model_path), device)
    for output in outputs:
        if isinstance(output, RowError):
            raise output
    rest = {k: v for k, v in mm_inputs.items() if k not in (PENDING_KEY, "image_grid_thw")}
    merged = {"pixel_values": torch.cat([o["pixel_values"] for o in outputs])}  # type: ignore[index]
    if "image_grid_thw" in mm_inputs:
        merged["image_grid_thw"] = torch.cat([o["image_grid_thw"] for o in outputs])  # type: ignore[index]
    return rest | merged
