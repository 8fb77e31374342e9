"""The scheduler's limits: configured values win; unset ones take the device's defaults."""

import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.paged import SMALL_LIMITS, scheduler_limits


def test_unset_limits_on_a_cpu_take_the_small_device_defaults():
    assert scheduler_limits(EngineConfig(), torch.device("cpu")) == SMALL_LIMITS == (256, 8192)


def test_configured_limits_win_over_the_device_defaults():
    config = EngineConfig(max_num_seqs=7, max_num_batched_tokens=300)
    assert scheduler_limits(config, torch.device("cpu")) == (7, 300)
    assert scheduler_limits(EngineConfig(max_num_seqs=3), torch.device("cpu")) == (3, 8192)
