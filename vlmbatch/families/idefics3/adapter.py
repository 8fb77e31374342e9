"""Idefics3 and SmolVLM: each `<image>` of a prompt is split into tiles plus a global image.

The processor writes every image as `<fake_token_around_image><row_r_col_c><image>...` per
tile, a `\\n` after each row of tiles, then `\\n<fake_token_around_image><global-img>
<image>...<fake_token_around_image>` (an image no larger than one tile is the global image
alone). Every tile is a square of the tower's size, so one image's item is its tiles'
pixels, and its token count is the tiles times `image_seq_len`. How many tiles an image
has comes from its size through the image processor's own `get_number_of_image_patches`,
and what its placeholder expands to through the processor's own `replace_image_token`,
so the dry run counts exactly what `prepare` builds without resizing any pixels.

The tiling needs the pixels, so JPEGs are decoded on the CPU (no `prepare_encoded`).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.processor_adapter import ProcessorAdapter
from vlmbatch.families.prompt import IMAGE, MediaItem
from vlmbatch.media.types import VideoFrames


class Idefics3Adapter(ProcessorAdapter):
    image_token = "<image>"
    image_placeholder = "<image>"
    extra_eos_tokens = ("<end_of_utterance>",)
    prepare_encoded = ModelAdapter.prepare_encoded  # the tiling needs the pixels: the job decodes on the CPU

    def _tiles(self, height: int, width: int) -> tuple[int, int, int]:
        """(tiles with the global image, rows, columns) of an image of this size; (1, 0, 0) unsplit."""
        tiles, rows, cols = self.processor.image_processor.get_number_of_image_patches(height, width, {})
        return max(tiles, 1), rows, cols

    def _count_image_tokens(self, height: int, width: int, processor_kwargs: dict[str, Any]) -> int:
        _, rows, cols = self._tiles(height, width)
        expanded = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        return len(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

    def _media(self, tensors: dict[str, torch.Tensor], token_ids: list[int], prompt: str, images: list[Any],
               videos: list[VideoFrames], hashes: list[str]) -> list[MediaItem]:
        """One item per image (its tiles and the global image) or per video (its frames)."""
        pixels = tensors.get("pixel_values")
        if videos:  # [videos, frames (padded to the longest), 3, S, S]: each video's own frames
            parts = [pixels[i, : video.num_frames] for i, video in enumerate(videos)]
        else:  # [1, tiles of all images, 3, S, S]
            parts = list(pixels[0].split([self._tiles(image.height, image.width)[0] for image in images])) if images else []
        seq_len = self.processor.image_seq_len
        # A video is a run of frame images to the tower and the decoder: it fills `<image>` tokens too.
        return [MediaItem(IMAGE, {"pixel_values": part}, len(part) * seq_len, h) for part, h in zip(parts, hashes)]

    def hf_media_inputs(self, items: list[MediaItem]) -> dict[str, Any]:
        """All tiles as one sample of `pixel_values` [1, tiles, 3, S, S]: the model runs the
        tower on each tile alone and scatters the features over the `<image>` tokens of the
        whole batch in order, so this is the processor's padded batch without its padding."""
        if not items:
            return {}
        return {"pixel_values": torch.cat([item.tensors["pixel_values"] for item in items]).unsqueeze(0)}


ADAPTER = Idefics3Adapter
