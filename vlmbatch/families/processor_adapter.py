"""What every family adapter shares: checks and tokenisation through the model's own HF processor.

Going through the checkpoint's processor (not a re-implementation) is what makes our token
ids and pixel tensors identical to what `transformers` feeds the model, so the reference
engine matches `generate()` exactly and the fast engine can be checked against it. Each
family only declares its placeholders, how it passes videos and how its processor batch
splits into media items.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any

import numpy as np
import torch

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import MediaItem, PreparedPrompt
from vlmbatch.media.image import content_hash
from vlmbatch.media.types import EncodedImage, VideoFrames

# Processor outputs that are per token, not per image: engines rebuild them from the ids.
_PER_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def media_hash(media: Any) -> str:
    """A digest of an image's or video's pixels, so equal content shares cache entries
    whatever its source (images use the media layer's own digest).

    Frames on the GPU are copied to the host whole for this: one device-to-host copy of
    the clip (64 frames of 720p: 177 MB, ~10-30 ms) on top of the sha256 the CPU path pays
    too. Cheaper keys were rejected because the key decides whether a row reuses another
    row's cached encoder output and KV blocks, so a collision silently answers about the
    wrong video: a strided subsample cannot tell apart clips that differ between sampled
    pixels (burnt-in captions, a small moving object on a fixed camera), and a float
    reduction on the device changes with the reduction order."""
    if not isinstance(media, VideoFrames):
        return content_hash(media)
    frames = media.frames
    pixels = frames.cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    digest = hashlib.sha256(f"video:{pixels.shape}:{media.sampled_fps}:".encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


def sampled_video_inputs(videos: list[VideoFrames]) -> dict[str, Any]:
    """The processor's arguments for already-sampled videos (so it must not sample again):
    (T, H, W, 3) uint8 frames, GPU decoders' CUDA tensors kept as they are with `device=`
    their GPU (the processor's torch code resizes and normalises them there, no host round
    trip), anything else as numpy (the processor's usual CPU path)."""
    arrays = [v.frames if isinstance(v.frames, torch.Tensor) else np.asarray(v.frames) for v in videos]
    kwargs: dict[str, Any] = {"videos": arrays, "do_sample_frames": False}
    # a row's videos share one backend, so one device; its images keep the CPU path
    device = next((a.device for a in arrays if isinstance(a, torch.Tensor) and a.device.type != "cpu"), None)
    if device is not None:
        kwargs["videos_kwargs"] = {"device": device}
    return kwargs
def _keyed(content_hash: str, processor_kwargs: dict[str, Any]) -> str:
    """A media item's cache key under per-row processor options: the same pixels tiled
    differently (InternVL's `max_patches`) give other encoder outputs."""
    if not processor_kwargs:
        return content_hash
    options = json.dumps(processor_kwargs, sort_keys=True, default=str)
    return hashlib.sha256(f"{content_hash}:{options}".encode()).hexdigest()


class ProcessorAdapter(ModelAdapter):
    """A `ModelAdapter` over an HF processor; subclasses set the placeholders below and say
    how the processor's batch splits into one `MediaItem` per image or video."""

    image_placeholder: str  # what a raw prompt must contain once per image
    video_placeholder: str | None = None
    image_token: str  # the token the processor expands into the image's patches
    video_token: str | None = None
    extra_eos_tokens: tuple[str, ...] = ()  # turn terminators that also end generation
    # What a row's `mm_processor_kwargs` may set, and the type of each (ints must be positive).
    processor_options: dict[str, type] = {}

    @cached_property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        text_config = getattr(self.config, "text_config", self.config)
        return int(text_config.max_position_embeddings)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        from transformers import GenerationConfig

        ids: list[int] = []
        try:
            eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's EOS is all we know
            eos = None
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        vocab = self.tokenizer.get_vocab()
        ids.extend(vocab[t] for t in self.extra_eos_tokens if t in vocab)
        return sorted(set(ids))

    @cached_property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    @cached_property
    def video_token_id(self) -> int | None:
        return self.tokenizer.convert_tokens_to_ids(self.video_token) if self.video_token else None

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-token modality (0 text, 1 image, 2 video) as HF processors build it; Qwen's
        M-RoPE needs it, and it is cheaper to rebuild from the ids than to carry per request."""
        types = torch.zeros_like(input_ids)
        types[input_ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[input_ids == self.video_token_id] = 2
        return types

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        from vlmbatch.chat import parse_chat_messages

        template_messages, _, _ = parse_chat_messages(messages)
        if not getattr(self.processor, "chat_template", None):
            raise RowError(
                ErrorType.INVALID_ROW,
                f"model {self.model_path} has no chat template: pass one (--chat-template) or send raw prompts",
                param="messages",
            )
        return self.processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)

    def _check_placeholders(self, prompt: str, token: str | None, placeholder: str | None, count: int, kind: str):
        """Every media token must sit in its full placeholder, and there must be one per item."""
        if token is None or placeholder is None:
            return
        wrapped = prompt.count(placeholder)
        bare = prompt.count(token)
        if bare != wrapped:
            raise RowError(
                ErrorType.PLACEHOLDER_MISMATCH,
                f"each {token} must appear as {placeholder!r}; found {bare} {token} in {wrapped} placeholders",
                param="prompt",
            )
        if wrapped != count:
            raise RowError(
                ErrorType.PLACEHOLDER_MISMATCH,
                f"prompt has {wrapped} {kind} placeholder(s) ({placeholder!r}) but {count} {kind}(s) were given",
                param="prompt",
            )

    def _image_inputs(self, images: list[Any]) -> Any:
        """The processor's `images=` argument for one prompt's images."""
        return images or None

    def _video_inputs(self, videos: list[VideoFrames]) -> dict[str, Any]:
        """Processor arguments (`videos=...` and metadata) for already-sampled frames."""
        return {}

    def _validate(self, prompt: str, images: list[Any], videos: list[VideoFrames],
                  processor_kwargs: dict[str, Any] | None = None) -> None:
        """The checks that need no preprocessing: prompt text, supported media, placeholders,
        the row's processor options."""
        self._check_processor_kwargs(processor_kwargs or {})
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowError(ErrorType.PROMPT_EMPTY, "the prompt is empty", param="prompt")
        if videos and not self.supports_video:
            raise RowError(ErrorType.UNSUPPORTED_MEDIA, f"{self.family.name} models do not accept videos", param="video")
        self._check_placeholders(prompt, self.image_token, self.image_placeholder, len(images), "image")
        self._check_placeholders(prompt, self.video_token, self.video_placeholder, len(videos), "video")

    def _check_processor_kwargs(self, processor_kwargs: dict[str, Any]) -> None:
        for key, value in processor_kwargs.items():
            kind = self.processor_options.get(key)
            if kind is None:
                known = ", ".join(sorted(self.processor_options)) or "none"
                raise RowError(ErrorType.INVALID_ROW, f"unknown mm_processor_kwargs key {key!r} for {self.family.name} "
                               f"models (they take: {known})", param="mm_processor_kwargs")
            if type(value) is not kind or (kind is int and value < 1):
                raise RowError(ErrorType.INVALID_ROW, f"mm_processor_kwargs {key!r} must be a "
                               f"{'positive int' if kind is int else kind.__name__}, got {value!r}", param="mm_processor_kwargs")

    def _check_length(self, num_tokens: int, max_tokens: int) -> None:
        if num_tokens + max_tokens > self.max_model_len:
            raise RowError(
                ErrorType.PROMPT_TOO_LONG,
                f"prompt is {num_tokens} tokens (media included) + max_tokens {max_tokens} > "
                f"max_model_len {self.max_model_len}",
                param="prompt",
            )

    def check(self, prompt: str, images: list[Any] | None = None, videos: list[VideoFrames] | None = None,
              max_tokens: int = 0, processor_kwargs: dict[str, Any] | None = None) -> int:
        """`prepare`'s checks and token count without pixel preprocessing (dry runs): each
        image's token count comes from its size, through the processor's own formula."""
        images, videos = list(images or []), list(videos or [])
        if videos:  # frame counts and per-frame caps: let the processor decide
            return self.prepare(prompt, images, videos, max_tokens, processor_kwargs).num_tokens
        self._validate(prompt, images, [], processor_kwargs)
        num_tokens = self._count_text_tokens(prompt)
        # each placeholder token becomes the image's tokens
        sizes = [(image.height, image.width) for image in images]
        num_tokens += sum(self._image_token_counts(sizes, processor_kwargs)) - len(images)
        self._check_length(num_tokens, max_tokens)
        return num_tokens

    def _count_text_tokens(self, prompt: str) -> int:
        """The tokenizer's own count, through the Rust tokenizer directly when there is one
        (the Python wrapper costs more than the tokenisation for short prompts)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return len(self.tokenizer(prompt)["input_ids"])
        return len(backend.encode(prompt, add_special_tokens=True).ids)

    def _image_token_counts(self, sizes: list[tuple[int, int]], processor_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Tokens of each image of one prompt, from the (height, width) of all of them
        (LLaVA-OneVision counts an image differently when the prompt has several)."""
        return [self._image_tokens(height, width, processor_kwargs) for height, width in sizes]

    def _image_tokens(self, height: int, width: int, processor_kwargs: dict[str, Any] | None = None) -> int:
        """Tokens of one image of this size, memoised: datasets repeat sizes, the formula is slow."""
        cache = self.__dict__.setdefault("_image_token_cache", {})
        key = (height, width, json.dumps(processor_kwargs or {}, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = self._count_image_tokens(height, width, processor_kwargs or {})
        return cache[key]

    def _count_image_tokens(self, height: int, width: int, processor_kwargs: dict[str, Any]) -> int:
        """What one image's placeholder expands to, in tokens (the processor's own formula)."""
        return self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)], **processor_kwargs).num_image_tokens[0]

    def prepare_encoded(self, prompt: str, images: list[EncodedImage], max_tokens: int = 0) -> PreparedPrompt:
        """`prepare` for images the engine will decode: the same token ids, counted from each
        image's size through the processor's own formula and expanded as the processor
        expands them; each item carries its bytes and what the engine needs before the
        pixels exist (`_encoded_tensors`)."""
        self._validate(prompt, images, [])
        counts = self._image_token_counts([(image.height, image.width) for image in images])
        pieces = prompt.split(self.image_token)
        expanded = pieces[0] + "".join(self.image_token * count + piece for count, piece in zip(counts, pieces[1:]))
        token_ids: list[int] = self.tokenizer([expanded])["input_ids"][0]
        self._check_length(len(token_ids), max_tokens)
        media = [
            MediaItem("image", self._encoded_tensors(image), count, image.content_hash, encoded=image)
            for image, count in zip(images, counts)
        ]
        return PreparedPrompt(prompt_token_ids=list(token_ids), media=media, prompt=prompt)

    def _encoded_tensors(self, image: EncodedImage) -> dict[str, torch.Tensor]:
        """Processor outputs the engine needs before an encoded image's pixels exist (Qwen: its grid)."""
        return {}

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """The processor's batch as one item per image, then per video, each in prompt order."""
        raise NotImplementedError

    def _media(self, processed: dict[str, torch.Tensor], token_ids: list[int], prompt: str, images: list[Any],
               videos: list[VideoFrames], hashes: list[str]) -> list[MediaItem]:
        """The prompt's media items; families whose processor batch cannot be split without
        the token ids (InternVL: tiles per image, images and videos in prompt order)
        override this instead of `media_items`."""
        return self.media_items(processed, hashes)

    def prepare(self, prompt: str, images: list[Any] | None = None, videos: list[VideoFrames] | None = None,
                max_tokens: int = 0, processor_kwargs: dict[str, Any] | None = None) -> PreparedPrompt:
        images, videos, processor_kwargs = list(images or []), list(videos or []), dict(processor_kwargs or {})
        self._validate(prompt, images, videos, processor_kwargs)
        try:
            processed = self.processor(
                text=[prompt], images=self._image_inputs(images), return_tensors="pt", **self._video_inputs(videos),
                **processor_kwargs,
            )
        except (ValueError, TypeError) as exc:  # e.g. an image below the minimum size or of odd shape
            raise RowError(ErrorType.UNSUPPORTED_MEDIA, f"the processor rejected the media: {exc}") from exc
        token_ids: list[int] = processed["input_ids"][0].tolist()
        self._check_length(len(token_ids), max_tokens)
        tensors = {
            key: value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            for key, value in processed.items()
            if key not in _PER_TOKEN_KEYS
        }
        hashes = [_keyed(media_hash(m), processor_kwargs) for m in [*images, *videos]]
        media = self._media(tensors, token_ids, prompt, images, videos, hashes) if images or videos else []
        return PreparedPrompt(prompt_token_ids=token_ids, media=media, prompt=prompt)
