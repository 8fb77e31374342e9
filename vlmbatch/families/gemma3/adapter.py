"""Gemma 3: `<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n` prompts, one
`<start_of_image>` per image, which the processor expands into `\\n\\n<start_of_image>`,
`mm_tokens_per_image` soft tokens, `<end_of_image>\\n\\n`; images only.

Pan-and-scan: when the checkpoint's image processor config sets `do_pan_and_scan` (with
its crop settings), or a row's `mm_processor_kwargs` do, each image also gets up to
`pan_and_scan_max_num_crops` crops, each its own begin/end-of-image run of soft tokens
after the thumbnail's. The processor's own defaults would override the config's values,
so the adapter hands them to the processor as its image defaults. Each thumbnail and crop
is then its own media item (keyed by its pixels); the dry run counts crops from each
image's size by the image processor's own rule, so it needs no pixels.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Any

import torch

from vlmbatch.families.processor_adapter import ProcessorAdapter
from vlmbatch.families.prompt import IMAGE, MediaItem, PreparedPrompt
from vlmbatch.media.types import EncodedImage, VideoFrames

PAN_AND_SCAN_KEYS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                     "pan_and_scan_min_ratio_to_activate")


class Gemma3Adapter(ProcessorAdapter):
    image_token = "<start_of_image>"  # what a prompt carries once per image (the processor's `image_token`)
    image_placeholder = "<start_of_image>"
    extra_eos_tokens = ("<end_of_turn>",)
    processor_options = {"do_pan_and_scan": bool, "pan_and_scan_min_crop_size": int, "pan_and_scan_max_num_crops": int}

    def __init__(self, model_path: str, processor: Any, config: Any, family: Any):
        super().__init__(model_path, processor, config, family)
        image_processor = processor.image_processor
        settings = {k: getattr(image_processor, k) for k in PAN_AND_SCAN_KEYS if getattr(image_processor, k, None) is not None}
        if settings:
            processor.images_kwargs = {**getattr(processor, "images_kwargs", {}), **settings}

    @property
    def pan_and_scan(self) -> bool:
        """Whether the checkpoint's config turns pan-and-scan on (a row may still ask for it)."""
        return bool(getattr(self.processor, "images_kwargs", {}).get("do_pan_and_scan"))

    @cached_property
    def soft_token_id(self) -> int:
        return int(self.config.image_token_id)

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on the soft tokens only (not on begin/end-of-image), as Gemma3Processor marks
        them: `transformers` groups each run of them into one bidirectional block."""
        return (input_ids == self.soft_token_id).to(input_ids.dtype)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The template opens with `<bos>` and so does the tokenizer: keep one."""
        text = super().apply_chat_template(messages)
        bos = self.tokenizer.bos_token
        adds_bos = bos is not None and self.tokenizer("", add_special_tokens=True)["input_ids"][:1] == [self.tokenizer.bos_token_id]
        return text[len(bos):] if adds_bos and text.startswith(bos) else text

    def _pan_and_scan(self, processor_kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The pan-and-scan settings in force for a row (the processor's, the row's over them), or None when off."""
        settings = {**getattr(self.processor, "images_kwargs", {}), **processor_kwargs}
        return settings if settings.get("do_pan_and_scan") else None

    def _num_crops(self, height: int, width: int, settings: dict[str, Any] | None) -> int:
        """Crops of an image of this size, by the image processor's own rule (its crops are
        views, so a stride-0 stand-in of that size is enough: no pixels needed)."""
        if settings is None:
            return 0
        stand_in = torch.zeros(()).expand(3, height, width)
        return len(self.processor.image_processor.pan_and_scan_batched(
            stand_in, settings["pan_and_scan_min_crop_size"], settings["pan_and_scan_max_num_crops"],
            settings["pan_and_scan_min_ratio_to_activate"]))

    def _expanded(self, prompt: str, crops: list[int]) -> str:
        """The prompt as the processor expands it, each image with its crops."""
        pieces = prompt.split(self.image_token)
        return pieces[0] + "".join(self.processor.replace_image_token({"num_crops": crops}, i) + piece
                                   for i, piece in enumerate(pieces[1:]))

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """One item per image of `mm_tokens_per_image` tokens; with pan-and-scan crops (the
        pixel rows outnumber the images, and which rows are whose is not known here) one
        per thumbnail and per crop, in prompt order, each keyed by its own pixels."""
        tokens = int(self.config.mm_tokens_per_image)
        pixels = processed["pixel_values"]
        if len(pixels) == len(hashes):
            return [MediaItem(IMAGE, {"pixel_values": p.unsqueeze(0)}, tokens, h) for p, h in zip(pixels, hashes)]
        return [MediaItem(IMAGE, {"pixel_values": p.unsqueeze(0)}, tokens, _pixels_hash(p)) for p in pixels]

    def check(self, prompt: str, images: list[Any] | None = None, videos: list[VideoFrames] | None = None,
              max_tokens: int = 0, processor_kwargs: dict[str, Any] | None = None) -> int:
        """Exact token count from the expanded text (its newlines tokenise with their
        neighbours, so counting per image would be off), crops counted from each size."""
        images, processor_kwargs = list(images or []), dict(processor_kwargs or {})
        if videos:
            return self.prepare(prompt, images, videos, max_tokens, processor_kwargs).num_tokens
        self._validate(prompt, images, [], processor_kwargs)
        settings = self._pan_and_scan(processor_kwargs)
        crops = [self._num_crops(image.height, image.width, settings) for image in images]
        num_tokens = self._count_text_tokens(self._expanded(prompt, crops))
        self._check_length(num_tokens, max_tokens)
        return num_tokens

    @property
    def accepts_encoded_images(self) -> bool:
        return not self.pan_and_scan

    def prepare_encoded(self, prompt: str, images: list[EncodedImage], max_tokens: int = 0) -> PreparedPrompt:
        """Every image is `mm_tokens_per_image` tokens whatever its size, so the ids come
        from the text alone; the engine decodes the JPEGs (not with pan-and-scan)."""
        if self.pan_and_scan:
            raise NotImplementedError("pan-and-scan crops depend on the pixels: images are decoded on the CPU")
        self._validate(prompt, images, [])
        token_ids: list[int] = self.tokenizer([self._expanded(prompt, [0] * len(images))])["input_ids"][0]
        self._check_length(len(token_ids), max_tokens)
        tokens = int(self.config.mm_tokens_per_image)
        media = [MediaItem(IMAGE, {}, tokens, image.content_hash, encoded=image) for image in images]
        return PreparedPrompt(prompt_token_ids=list(token_ids), media=media, prompt=prompt)


ADAPTER = Gemma3Adapter


def _pixels_hash(pixels: torch.Tensor) -> str:
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).hexdigest()
