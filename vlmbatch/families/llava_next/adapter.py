"""LLaVA-NeXT (llava-v1.6): `<image>` placeholders, each image tiled by its aspect ratio.

The processor resizes an image to the best of the config's `image_grid_pinpoints`, cuts it
into tower-sized tiles plus one downscaled base view, and pads every image of the batch to
the most tiles; an item keeps only its own tiles (their count follows from its size, as
the model derives it) and its `image_sizes` row, which the model needs to unpad the grid.

JPEG decoding stays on the CPU: the GPU decoder's batch pads tiles across images and knows
nothing of OneVision's multi-image rule, so `prepare_encoded` is not offered.
"""

from __future__ import annotations

import torch

from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.processor_adapter import ProcessorAdapter
from vlmbatch.families.prompt import IMAGE, MediaItem


class LlavaNextAdapter(ProcessorAdapter):
    image_token = "<image>"
    image_placeholder = "<image>"
    prepare_encoded = ModelAdapter.prepare_encoded  # see the module docstring

    @property
    def max_model_len(self) -> int:
        """Mistral's sliding window, where one is set, bounds the context too: the paged
        engine attends over the whole prompt, so longer prompts would not be the model's."""
        text_config = self.config.get_text_config()
        longest = int(text_config.max_position_embeddings)
        return min(longest, int(getattr(text_config, "sliding_window", None) or longest))

    def tiles_images(self, num_images: int) -> bool:
        """Whether the images of a prompt with `num_images` of them are tiled (always here)."""
        return True

    def num_tiles(self, image_size: list[int]) -> int:
        """Tiles of an image of `image_size` (h, w), base view included, as the model counts them."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return image_size_to_num_patches(image_size, self.config.image_grid_pinpoints, self.config.vision_config.image_size)

    def image_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """One item per image: its own tiles (the base view alone when the prompt's images are
        not tiled) and its size. A base-only item is keyed apart from the same image tiled:
        its embeddings differ."""
        sizes = [size.tolist() for size in processed["image_sizes"]]
        tiled = self.tiles_images(len(sizes))
        counts = self._image_token_counts([tuple(size) for size in sizes])
        items = []
        for pixels, size, count, content_hash in zip(processed["pixel_values"], sizes, counts, hashes):
            tensors = {"pixel_values": pixels[: self.num_tiles(size) if tiled else 1],
                       "image_sizes": torch.tensor([size], dtype=torch.int64)}
            items.append(MediaItem(IMAGE, tensors, count, content_hash if tiled else f"{content_hash}:base"))
        return items

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        return self.image_items(processed, hashes)


ADAPTER = LlavaNextAdapter
