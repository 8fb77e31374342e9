"""InternVL3 / InternVL3.5: ChatML prompts with `<IMG_CONTEXT>` per image and `<video>` per video.

The processor tiles each image by its aspect ratio (up to `max_patches` tiles plus a
thumbnail when there is more than one) and writes `<img>` + `image_seq_length` context
tokens per tile + `</img>` in place of its `<IMG_CONTEXT>`; a video's frames become one
tile each, `Frame{i}: <img>...</img>` on their own lines. Its pixel batch holds every tile
of the prompt in prompt order, images and videos interleaved, and does not say how many
tiles each image took: the token ids do (one `<img>` run per image and per frame).

Both images and video frames fill the same context token, so every item is of kind image
to the engine (one tower batch, one placeholder id); a video is one item of all its frames.
A row's `mm_processor_kwargs` may set `max_patches`, `min_patches` and `crop_to_patches`.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

import torch

from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.processor_adapter import ProcessorAdapter, sampled_video_inputs
from vlmbatch.families.prompt import IMAGE, MediaItem
from vlmbatch.media.types import VideoFrames


class InternVLAdapter(ProcessorAdapter):
    image_token = "<IMG_CONTEXT>"
    image_placeholder = "<IMG_CONTEXT>"
    video_token = "<video>"
    video_placeholder = "<video>"
    extra_eos_tokens = ("<|im_end|>", "<|endoftext|>")
    processor_options = {"max_patches": int, "min_patches": int, "crop_to_patches": bool}
    # The engine's GPU JPEG decoder runs the image processor alone, without the processor's
    # tiling defaults: InternVL rows decode on the CPU (`accepts_encoded_images` is False).
    prepare_encoded = ModelAdapter.prepare_encoded

    def _count_image_tokens(self, height: int, width: int, processor_kwargs: dict[str, Any]) -> int:
        """`<img>`, `image_seq_length` context tokens per tile, `</img>`: what the processor
        writes. Its own count included the two markers up to transformers 5.24 and leaves
        them out from 5.25, so only its tile count is taken from it."""
        data = self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)], **processor_kwargs)
        return 2 + self.processor.image_seq_length * data.num_image_patches[0]

    def _video_inputs(self, videos: list[VideoFrames]) -> dict[str, Any]:
        """Frames as sampled: the video processor resizes each to one tile and samples nothing."""
        return sampled_video_inputs(videos) if videos else {}

    def _media(self, processed: dict[str, torch.Tensor], token_ids: list[int], prompt: str, images: list[Any],
               videos: list[VideoFrames], hashes: list[str]) -> list[MediaItem]:
        """One item per image and per video, in prompt order: its tiles (an image's run of
        context tokens / `image_seq_length`; a video's frames) and its context tokens."""
        per_tile = self.processor.image_seq_length
        runs = [len(list(group)) for token, group in groupby(token_ids) if token == self.image_token_id]
        kinds = [match.lastgroup for match in self.processor.multimodal_pattern.finditer(prompt)]
        image_hashes, video_hashes = iter(hashes[: len(images)]), iter(hashes[len(images) :])
        frames = iter(len(v.frames) for v in videos)
        pixels, items, run, row = processed["pixel_values"], [], 0, 0
        for kind in kinds:
            blocks = 1 if kind == "image" else next(frames)
            tokens = sum(runs[run : run + blocks])
            tiles = tokens // per_tile
            content_hash = next(image_hashes) if kind == "image" else next(video_hashes)
            items.append(MediaItem(IMAGE, {"pixel_values": pixels[row : row + tiles]}, tokens, content_hash))
            run, row = run + blocks, row + tiles
        return items


ADAPTER = InternVLAdapter
