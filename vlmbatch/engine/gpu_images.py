"""JPEGs decoded on the GPU in the engine process, in batches, just before the vision tower.

Why here and not in the preprocessing pool: decoding and resizing a JPEG is most of a row's
CPU cost, and nvJPEG plus the processor on the device does it in a fraction of that, for a
whole prefill step's images at once. So when the paged engine runs on CUDA, pool workers
stop short of pixels for JPEGs that nvJPEG shows exactly as the CPU path would
(`media.gpu_image.load_encoded_or_image`): they validate the file cheaply, count its tokens
from its size, tokenise, and pass the bytes on in a media item (`MediaItem.encoded`). The
engine decodes the items its tower is about to run on (`EncodedImageDecoder`) and keeps
only the bytes between steps: pixels of a 12-megapixel Qwen image are ~75 MB, a running
request may wait many steps, and a re-encode (encoder-cache eviction) just decodes again.

Per item, a JPEG nvJPEG rejects takes the CPU decoder in the engine process; the tensors
equal the CPU path's within `GPU_MAX_ABS_DIFF`/`GPU_MEAN_ABS_DIFF` (decoders round the IDCT
differently), the grid and the token ids exactly. `gpu_image_decode` (EngineConfig, or a
job's own `submit --gpu-image-decode`) = auto (on for the paged engine on CUDA), on
(refused with a `JobError` where it cannot run), off.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.families.prompt import MediaItem
from vlmbatch.media.gpu_image import preprocess_images


def defers_image_decoding(engine: Any, mode: str) -> bool:
    """Whether rows for `engine` should carry JPEG bytes instead of pixels (`mode`: auto, on, off).

    Only the paged engine on CUDA decodes them (it owns the vision tower's batch). The HF
    reference engine never receives them: it is the parity oracle, so it keeps the exact CPU
    path, and `generate()` would need every image materialised up front anyway.
    """
    capable = bool(getattr(engine, "decodes_images_on_gpu", False))
    if mode == "on" and not capable:
        raise JobError(
            f"GPU image decoding is on (VLMBATCH_GPU_IMAGE_DECODE / --gpu-image-decode) but the engine "
            f"({type(engine).__name__} on {getattr(engine, 'device', '?')}) cannot run it: it needs the paged "
            "engine on a CUDA device; use auto or off"
        )
    return mode != "off" and capable


class EncodedImageDecoder:
    """Turns encoded media items into decoded ones on `device`, with the model's own image
    processor (its torchvision backend, so it runs on the device), loaded once."""

    def __init__(self, model_path: str, device: torch.device):
        self.model_path = model_path
        self.device = device

    @cached_property
    def image_processor(self) -> Any:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.model_path)

    def decode(self, items: list[MediaItem]) -> list[MediaItem]:
        """Decoded copies of `items` (all encoded), in one batch. A file neither decoder can
        read raises its `RowError` (preparation validated it, so this is rare); the shard
        runner then isolates the row that failed."""
        if not items:
            return []
        outputs = preprocess_images([item.encoded.data for item in items], self.image_processor, self.device)
        return [item.with_tensors(_checked(item, tensors)) for item, tensors in zip(items, outputs)]


def _checked(item: MediaItem, tensors: dict[str, torch.Tensor] | RowError) -> dict[str, torch.Tensor]:
    """The decoded tensors; their grid must be the one the prompt's tokens were counted for."""
    if isinstance(tensors, RowError):
        raise tensors
    grid = item.tensors.get("image_grid_thw")
    if grid is not None and grid.tolist() != tensors["image_grid_thw"].tolist():
        raise RowError(
            ErrorType.ENGINE,
            f"GPU image preprocessing gave grid {tensors['image_grid_thw'].tolist()}, the prompt was built for {grid.tolist()}",
            "image",
        )
    return {"pixel_values": tensors["pixel_values"]}
