"""The contract between media, model families and engines.

A `ModelAdapter` turns (prompt text or chat messages, decoded images, sampled video
frames) into a `PreparedPrompt`: token ids plus the processor's tensors. Engines only
ever see `PreparedPrompt`s, so they stay independent of how each family builds its
prompts, and per-row problems surface here as `RowError`s before any GPU work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from vlmbatch.media.types import VideoFrames


def cast_pixels(inputs: dict[str, Any], dtype: Any, on_device_only: bool = False) -> None:
    """Cast the floating `pixel_values*` tensors of `inputs` to `dtype` (a torch dtype or its
    name), in place: the vision towers cast pixels to their weights' dtype first thing, so
    doing it earlier changes no result and halves what bf16/fp16 engines copy and hold.
    `on_device_only` leaves host tensors alone (the engine's thread should not spend CPU
    on them)."""
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    for key, value in inputs.items():
        if key.startswith("pixel_values") and isinstance(value, torch.Tensor) and value.is_floating_point():
            if not on_device_only or value.device.type != "cpu":
                inputs[key] = value.to(dtype)


@dataclass
class PreparedPrompt:
    """One request, ready for an engine.

    `mm_inputs` holds the processor outputs other than `input_ids`/`attention_mask`
    for this request alone (e.g. `pixel_values`, `image_grid_thw`,
    `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`), with the batch
    dimension being images/patches so that collating requests is a concatenation
    along dim 0. `mm_hashes` identify each image/video by content (prefix and
    encoder caches key on them).
    """

    prompt_token_ids: list[int]
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None
    mm_hashes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class ModelAdapter(ABC):
    """Family-specific prompt building and preprocessing around an HF processor."""

    family: str  # "qwen2_5_vl", "qwen2_vl", "llava"
    supports_video: bool = False

    def __init__(self, model_path: str, processor: Any, config: Any):
        self.model_path = model_path
        self.processor = processor
        self.config = config

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Context length: prompt tokens (media included) plus generated tokens."""

    @property
    def eos_token_ids(self) -> list[int]:
        """Tokens that end generation (EOS and the chat turn terminator)."""
        raise NotImplementedError

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render OpenAI-style messages into the model's prompt text, with media placeholders."""

    @abstractmethod
    def prepare(
        self,
        prompt: str,
        images: list[Any] | None = None,
        videos: list[VideoFrames] | None = None,
        max_tokens: int = 0,
    ) -> PreparedPrompt:
        """Tokenise `prompt` with its media; raise `RowError` for an empty prompt,
        placeholder/media count mismatch, unsupported media, or a prompt that leaves
        fewer than `max_tokens` of context."""

    def prepare_pending(self, prompt: str, jpegs: list[Any], max_tokens: int = 0) -> PreparedPrompt:
        """`prepare` for JPEGs the engine decodes itself (`media.gpu_batch.PendingJpeg`):
        identical token ids, bytes instead of pixels."""
        raise NotImplementedError

    def check(
        self,
        prompt: str,
        images: list[Any] | None = None,
        videos: list[VideoFrames] | None = None,
        max_tokens: int = 0,
    ) -> int:
        """Validate like `prepare` and return the prompt's token count; families override it
        with a path that skips pixel preprocessing (the dry-run checks 5,000+ rows/s)."""
        return self.prepare(prompt, images, videos, max_tokens).num_tokens
