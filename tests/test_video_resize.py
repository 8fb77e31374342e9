"""The post-decode size cap: aspect ratio kept, the same result for numpy and torch frames."""

from __future__ import annotations

import numpy as np
import torch

from vlmbatch.media.video.resize import resize_frames, target_size


def test_target_size_respects_both_caps():
    assert target_size(720, 1280, None, None) == (720, 1280)
    assert target_size(720, 1280, None, 640) == (360, 640)
    height, width = target_size(720, 1280, 320 * 180, None)
    assert height * width <= 320 * 180 and abs(width / height - 16 / 9) < 0.02
    assert target_size(720, 1280, 10**9, 2000) == (720, 1280)


def test_numpy_and_torch_frames_resize_alike():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(2, 48, 64, 3), dtype=np.uint8)
    from_numpy = resize_frames(frames, None, 32)
    from_torch = resize_frames(torch.from_numpy(frames), None, 32)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.shape == (2, 24, 32, 3) and from_numpy.dtype == np.uint8
    assert isinstance(from_torch, torch.Tensor) and np.array_equal(from_torch.numpy(), from_numpy)
    assert resize_frames(frames, None, None) is frames


def test_downscaling_averages_instead_of_skipping_pixels():
    stripes = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    stripes[:, :, ::2] = 255  # one-pixel stripes: point sampling would give all 0 or all 255
    halved = resize_frames(stripes, None, 4).astype(int)
    assert np.all(np.abs(halved[:, :, 1:3] - 128) <= 1)  # interior: the exact average
    assert np.all((halved > 64) & (halved < 192))  # borders: still a blend, not a skipped stripe
