"""What a family's adapter promises the rest of vlmbatch.

A `ModelAdapter` turns (prompt text or chat messages, decoded images, sampled video
frames) into a `PreparedPrompt`. Per-row problems surface here as `RowError`s before any
GPU work: an empty prompt, placeholders that do not match the media, media the family
cannot take, a prompt that leaves no room for `max_tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from vlmbatch.families.prompt import MediaItem, PreparedPrompt, collate
from vlmbatch.families.registry import Family
from vlmbatch.media.types import EncodedImage, VideoFrames
from vlmbatch.media.video.sampling import QWEN2_5_VL, FrameConvention


class ModelAdapter(ABC):
    """Family-specific prompt building and preprocessing around an HF processor."""

    frame_convention: FrameConvention = QWEN2_5_VL  # how its videos are sampled (media/video/sampling.py)

    def __init__(self, model_path: str, processor: Any, config: Any, family: Family):
        self.model_path = model_path
        self.processor = processor
        self.config = config
        self.family = family

    @property
    def supports_video(self) -> bool:
        return self.family.supports("video")

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Context length: prompt tokens (media included) plus generated tokens."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        """Tokens that end generation (EOS and the chat turn terminator)."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render OpenAI-style messages into the model's prompt text, with media placeholders."""

    @abstractmethod
    def prepare(self, prompt: str, images: list[Any] | None = None, videos: list[VideoFrames] | None = None,
                max_tokens: int = 0, processor_kwargs: dict[str, Any] | None = None) -> PreparedPrompt:
        """Tokenise `prompt` with its media into token ids and media items; raise `RowError`.
        `processor_kwargs` (a row's `mm_processor_kwargs`) go to the processor, e.g. InternVL's
        `max_patches`; keys the family does not take are a `RowError`."""

    def prepare_encoded(self, prompt: str, images: list[EncodedImage], max_tokens: int = 0) -> PreparedPrompt:
        """`prepare` for JPEGs the engine decodes itself: identical token ids, items that
        carry the encoded bytes instead of pixels. Families that cannot count an image's
        tokens from its size alone do not override it (the job then decodes on the CPU)."""
        raise NotImplementedError(f"{self.family.name} cannot defer image decoding to the engine")

    def hf_media_inputs(self, items: list[MediaItem]) -> dict[str, Any]:
        """Decoded items of a batch of prompts as `transformers`' forward takes them (the hf
        engine and the reference): their tensors concatenated in order, unless the family's
        model wants another layout."""
        return collate(items)

    @property
    def accepts_encoded_images(self) -> bool:
        return type(self).prepare_encoded is not ModelAdapter.prepare_encoded

    def check(self, prompt: str, images: list[Any] | None = None, videos: list[VideoFrames] | None = None,
              max_tokens: int = 0, processor_kwargs: dict[str, Any] | None = None) -> int:
        """Validate like `prepare` and return the prompt's token count; families override it
        with a path that skips pixel preprocessing (the dry-run checks 5,000+ rows/s)."""
        return self.prepare(prompt, images, videos, max_tokens, processor_kwargs).num_tokens
