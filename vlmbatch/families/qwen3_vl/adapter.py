"""Qwen3-VL: Qwen2-VL's ChatML prompts and placeholders; each temporal pair of a video's
frames is preceded by its timestamp as text (`<1.5 seconds>`), as the processor writes it.

The processor computes a timestamp as `frame index / fps`; handing it the frames' real
presentation times as the indices with fps 1 makes it write those (a variable-frame-rate
file keeps its true times), averaged over each temporal pair exactly as it averages.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vlmbatch.families.qwen2_vl.adapter import Qwen2VLAdapter
from vlmbatch.media.types import VideoFrames


class Qwen3VLAdapter(Qwen2VLAdapter):
    @staticmethod
    def _video_metadata(video: VideoFrames, frames: np.ndarray | torch.Tensor) -> dict[str, Any]:
        return dict(total_num_frames=len(frames), fps=1.0, width=frames.shape[2], height=frames.shape[1],
                    duration=video.duration, frames_indices=list(video.timestamps))


ADAPTER = Qwen3VLAdapter
