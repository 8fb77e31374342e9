"""SmolVLM and SmolVLM2: Idefics3's tiled images, and videos as timestamped frames.

The processor writes a video as "You are provided the following series of N frames from a
H:MM:SS video." and one `\\nFrame from MM:SS:` + a single-tile image per frame. Frames
arrive sampled (`VideoFrames`), so the processor must not sample again; the timestamps it
writes are the frames' real presentation times, passed as Qwen3-VL's are (indices with
fps 1, see `qwen3_vl/adapter.py`), so a variable-frame-rate file keeps its true times.

One prompt takes images or videos, not both: the processor's image and video outputs share
the `pixel_values` key, so it keeps only the videos' (a row with both is refused).
"""

from __future__ import annotations

from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.idefics3.adapter import Idefics3Adapter
from vlmbatch.families.qwen2_vl.adapter import Qwen2VLAdapter
from vlmbatch.families.qwen3_vl.adapter import Qwen3VLAdapter
from vlmbatch.media.types import VideoFrames


class SmolVLMAdapter(Idefics3Adapter):
    video_token = "<video>"
    video_placeholder = "<video>"
    # Already-sampled frames with their real timestamps, handed over as the Qwen-VL adapters do.
    _video_inputs = Qwen2VLAdapter._video_inputs
    _video_metadata = staticmethod(Qwen3VLAdapter._video_metadata)

    def _validate(self, prompt: str, images: list[Any], videos: list[VideoFrames],
                  processor_kwargs: dict[str, Any] | None = None) -> None:
        super()._validate(prompt, images, videos, processor_kwargs)
        if images and videos:
            raise RowError(ErrorType.UNSUPPORTED_MEDIA,
                           f"{self.family.name} prompts take images or videos, not both (got {len(images)} and {len(videos)})",
                           param="video")


ADAPTER = SmolVLMAdapter
