"""What `vlmbatch serve` was started with; one frozen object the app and its parts share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from vlmbatch.config import MediaConfig

DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 4, "video": 1}
DEFAULT_MAX_MEDIA_BYTES = 64 * 1024 * 1024  # one download (a short video fits)
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # about 8K x 5K; larger headers are refused before decoding


@dataclass(frozen=True)
class ServerSettings:
    """Server options. Media defaults are safe: no private addresses, no local files."""

    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None  # a template file or the template text
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))
    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allow_private_media_urls: bool = False
    allowed_media_networks: tuple[str, ...] = ()  # CIDRs exempt from the private-address guard
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    media: MediaConfig = field(default_factory=MediaConfig)  # fetch timeouts, decoder defaults, loading threads
    # Reads s3:// media of the buckets `--allowed-media-buckets` names (`io.storage.ObjectMedia`,
    # built by the CLI); None: s3:// media URLs are refused.
    object_media: Callable[[str, int], bytes] | None = None

    @property
    def model_id(self) -> str:
        """The id `/v1/models` reports and requests must name."""
        return self.served_model_name or self.model

    def limit_for(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_MM_PER_PROMPT.get(modality, 1))
