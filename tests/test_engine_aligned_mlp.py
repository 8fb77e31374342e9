"""Zero-padding a vision MLP to an aligned intermediate size leaves its output unchanged."""

import torch
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

from vlmbatch.engine.models.aligned_mlp import ALIGNMENT, align_gated_mlps


def test_padded_mlp_gives_the_same_output():
    config = AutoConfig.for_model("qwen2_5_vl").vision_config
    config.hidden_size, config.intermediate_size, config.hidden_act = 48, 90, "silu"
    torch.manual_seed(0)
    mlp = Qwen2_5_VLMLP(config, bias=True)
    x = torch.randn(5, 48)
    expected = mlp(x)
    assert align_gated_mlps(mlp) == 1
    assert mlp.gate_proj.out_features == mlp.down_proj.in_features == ALIGNMENT * 2
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-6)
    assert align_gated_mlps(mlp) == 0  # already aligned
