"""Chat media parts → decoded images and sampled videos, under the server's safety rules.

The loaders (`vlmbatch.media`) do the fetching and decoding for batch jobs and the server
alike; this module adds what only a server facing untrusted clients needs: URLs only
(no bare paths), `file://` only inside `--allowed-local-media-path`, the private-address
guard and domain list on every fetch, the size and pixel caps, the fetch timeouts, and
a thread pool so slow downloads never block the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from vlmbatch import config
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.server.settings import ServerSettings


class ServerMedia:
    """Loads one request's media in parallel; each failure is a `RowError` naming its part."""

    def __init__(self, settings: ServerSettings):
        self._settings = settings
        self._pool = ThreadPoolExecutor(config.media_loading_thread_count(), thread_name_prefix="vlmbatch-media")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_scheme(self, ref: Any, param: str) -> None:
        if not isinstance(ref, str):
            return  # a PIL image handed over in-process; nothing to fetch
        scheme = urlparse(ref).scheme.lower()
        if scheme in ("http", "https", "data"):
            return
        if scheme == "file":
            if self._settings.allowed_local_media_path is None:
                raise RowError(
                    ErrorType.MEDIA_FORBIDDEN,
                    "file:// URLs are disabled; start the server with --allowed-local-media-path DIR to allow them",
                    param,
                )
            return
        raise RowError(ErrorType.INVALID_ROW, "media URLs must be http(s)://, data: or file:// URLs", param)

    async def load(
        self, image_refs: list[Any], video_refs: list[Any], request_kwargs: dict[str, dict[str, Any]] | None
    ) -> tuple[list[Any], list[Any]]:
        if not image_refs and not video_refs:
            return [], []
        raise NotImplementedError
