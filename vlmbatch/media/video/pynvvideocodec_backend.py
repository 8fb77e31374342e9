"""PyNvVideoCodec: NVDEC hardware decoding, frames left on the GPU.

The library's own RGB output differed from OpenCV's by ~8.8/255 on every frame
of an untagged 720p h264 clip: it converts with BT.709 coefficients, while
FFmpeg (so OpenCV, PyAV and torchcodec) uses BT.601 for streams that do not
say otherwise. So frames are taken in NVDEC's native NV12 and converted here
with the matrix and range FFmpeg would pick from the stream's tags
(`gpu.nv12_to_rgb`), which makes the GPU frames agree with the CPU backends.

`hw_decoders` is the number of decoder sessions the process keeps (concurrent
decodes beyond it wait); it is fixed by the first video decoded, so a
request asking for another count is refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vlmbatch.media.video.base import fill_missing
from vlmbatch.media.video.gpu import DeviceFramesBackend, ProcessResource, display_rotation, nv12_to_rgb, rotate_frame
from vlmbatch.media.video.options import VideoOptions
from vlmbatch.media.video.probe import StreamIndex, open_container
from vlmbatch.media.refs import MediaSource


class DecoderSlots:
    """At most `count` NVDEC sessions at once; idle ones are reused for the next file."""

    def __init__(self, count: int):
        self._free = threading.BoundedSemaphore(count)
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    @contextmanager
    def decoder_for(self, source: MediaSource, gpu_id: int) -> Iterator[Any]:
        import PyNvVideoCodec as nvc

        with self._free:
            with self._lock:
                reusable = self._idle.pop() if self._idle and source.path is not None else None
            if reusable is not None:
                reusable.reconfigure_decoder(source.path)
                decoder = reusable
            else:
                decoder = nvc.SimpleDecoder(
                    source.path if source.path is not None else source.data,
                    gpu_id=gpu_id,
                    use_device_memory=True,
                    output_color_type=nvc.OutputColorType.NATIVE,
                )
            yield decoder
            with self._lock:
                self._idle.append(decoder)


logger = logging.getLogger(__name__)
UNTAGGED = ("bt601", False)  # FFmpeg's reading of a stream that does not say
_SLOTS: ProcessResource[DecoderSlots] = ProcessResource("hw_decoders", strict=True)


def stream_colour(source: MediaSource) -> tuple[str, bool]:
    """(matrix, full_range) as FFmpeg reads them from the stream's tags.

    PyAV reports them when installed; otherwise PyNvVideoCodec's demuxer does
    (`ColorSpace()` / `ColorRange()`, paths only). Untagged means BT.601, limited.
    """
    try:
        import av  # noqa: F401
    except ImportError:
        return _colour_from_nvdemuxer(source)
    with open_container(source) as container:
        context = container.streams.video[0].codec_context
        full = context.color_range == 2 or context.pix_fmt in ("yuvj420p", "yuvj422p", "yuvj444p")
        return ("bt709" if context.colorspace == 1 else "bt601"), bool(full)


def _colour_from_nvdemuxer(source: MediaSource) -> tuple[str, bool]:
    if source.path is None:
        return UNTAGGED
    import PyNvVideoCodec as nvc

    try:
        demuxer = nvc.CreateDemuxer(source.path)
        space, colour_range = str(demuxer.ColorSpace()), str(demuxer.ColorRange())
    except (AttributeError, RuntimeError) as exc:  # the method names come from the docs, unverified on 2.2.4
        logger.warning("cannot read colour tags of %s (%r); assuming BT.601 limited range", source.name, exc)
        return UNTAGGED
    return ("bt709" if "709" in space else "bt601"), "JPEG" in colour_range.upper()


class PyNvVideoCodecBackend(DeviceFramesBackend):
    name = "pynvvideocodec"

    def reserve(self, options: VideoOptions) -> DecoderSlots:
        return _SLOTS.get(options.hw_decoders, DecoderSlots)

    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        import torch

        slots = self.reserve(options)
        matrix, full_range = stream_colour(source)
        rotation = display_rotation(source)
        with slots.decoder_for(source, torch.cuda.current_device()) as decoder:
            available = [i for i in wanted if i < len(decoder)]
            surfaces = decoder.get_batch_frames_by_index(available)
            frames = {
                i: rotate_frame(nv12_to_rgb(torch.from_dlpack(surface), matrix, full_range), rotation)
                for i, surface in zip(available, surfaces)
            }
        return fill_missing(frames, wanted)
