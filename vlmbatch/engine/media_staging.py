"""The next step's pixels uploaded while the GPU runs this one.

Each encode copies its prompts' pixels from pageable host memory before the tower can
start, and such a copy waits for the work queued before it: on the H200 one W1 step's 56
images of processor pixels (448², 135 MB in bf16) take 26 ms at ~5 GB/s with the GPU
idle, 19 times in a pre-decoded W1 (BENCHMARKS.md, session 16). With staging on
(`EngineConfig.stage_media`), once a step's media are encoded the engine hands the media
of the prompts the scheduler would admit next (`Scheduler.upcoming`) to
`MediaStager.stage`, whose thread uploads their pixels on a copy stream of its own while
the step computes; the next encode takes them from there (`take`), making the compute
stream wait for that stream first. The copies block that thread, not the engine's.

What is staged is a guess, bounded by `budget_bytes` of device memory: each `stage` call
keeps what is still upcoming, drops the rest and uploads what is new, so a prompt that
waits many steps is uploaded once and a guess that missed costs one upload. Items not in
host memory (JPEGs the GPU decodes, frames of GPU video decoders) are left alone, and an
upload that runs out of memory leaves its items to the plain copy. A staged tensor is
allocated on the copy stream and marked as used by the compute stream when taken, so the
caching allocator never hands its memory out while the tower reads it. On the CPU (tests)
the thread makes plain copies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vlmbatch.families.prompt import MediaItem

log = logging.getLogger(__name__)

STAGE_BYTES = 512 << 20  # device memory staged pixels may hold beside the KV cache (a W1 step of 3B: 135 MB)

Uploaded = dict[str, torch.Tensor] | None  # an item's pixels on the device; None: the upload ran out of memory


def pixel_tensors(item: MediaItem) -> dict[str, torch.Tensor]:
    """The item's host tensors a tower uploads (`pixel_values*`); grids and sizes stay on the host."""
    return {key: t for key, t in item.tensors.items() if key.startswith("pixel_values") and t.device.type == "cpu"}


class MediaStager:
    """Every encode's uploads go through `take`; only an engine with staging on calls `stage`."""

    def __init__(self, device: torch.device, budget_bytes: int = STAGE_BYTES):
        self.device = device
        self.budget_bytes = budget_bytes
        self.staged: dict[int, tuple[MediaItem, int, Future[Uploaded]]] = {}  # id(item) -> (item, bytes, its upload)
        self.num_staged = 0  # items uploaded ahead of their step
        self.num_taken = 0  # staged tensors an encode used
        self._thread: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    def stage(self, items: Iterable[MediaItem]) -> None:
        """Upload `items`' pixels (those of the next step, most likely first) up to the budget."""
        keep: dict[int, tuple[MediaItem, int, Future[Uploaded]]] = {}
        room = self.budget_bytes
        for item in items:
            if id(item) in keep:
                continue
            entry = self.staged.get(id(item))
            if entry is not None and entry[0] is item:
                if entry[1] > room:
                    break
            else:
                pixels = pixel_tensors(item)
                size = sum(t.nbytes for t in pixels.values())
                if not size:
                    continue
                if size > room:
                    break
                entry = (item, size, self._start(pixels))
                self.num_staged += 1
            room -= entry[1]
            keep[id(item)] = entry
        self.staged = keep

    def _start(self, pixels: dict[str, torch.Tensor]) -> Future[Uploaded]:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="vlmbatch-media-upload")
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        return self._thread.submit(self._upload, pixels)

    def _upload(self, pixels: dict[str, torch.Tensor]) -> Uploaded:
        try:
            if self._stream is None:
                return {key: t.to(self.device, copy=True) for key, t in pixels.items()}
            with torch.cuda.stream(self._stream):
                return {key: t.to(self.device, non_blocking=True) for key, t in pixels.items()}
        except torch.OutOfMemoryError:
            log.warning("no device memory to stage %.1f MiB of pixels: they are copied when encoded",
                        sum(t.nbytes for t in pixels.values()) / 2**20)
            return None

    def take(self, items: list[MediaItem], key: str) -> torch.Tensor:
        """The items' `key` tensors concatenated on the device: staged ones as uploaded (the
        compute stream waits for the copies), the others copied now."""
        parts, waited = [], False
        for item in items:
            entry = self.staged.get(id(item))
            uploaded = entry[2].result() if entry is not None and entry[0] is item else None
            staged = uploaded.pop(key, None) if uploaded is not None else None
            if staged is None:
                parts.append(item.tensors[key].to(self.device, non_blocking=True))
                continue
            if self._stream is not None:
                compute = torch.cuda.current_stream(self.device)
                if not waited:
                    compute.wait_stream(self._stream)
                    waited = True
                staged.record_stream(compute)
            parts.append(staged)
            self.num_taken += 1
        return torch.cat(parts)
