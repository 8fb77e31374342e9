"""Packed vision attention: the Qwen-VL tower gives the same features as with transformers' SDPA loop."""

import torch

from vlmbatch.engine.layers.segment_attention import NAME, use_packed_attention
from vlmbatch.engine.loading import load_hf_model


def test_packed_attention_reproduces_sdpa_features(tiny_qwen):
    model = load_hf_model(str(tiny_qwen), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    grids = torch.tensor([[1, 8, 8], [1, 4, 6], [2, 4, 4]])  # windows of several lengths, one 2-frame item
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = model.model.get_image_features(pixels, grids).pooler_output
        assert use_packed_attention(model.model.visual)
        assert model.model.visual.blocks[0].attn.config._attn_implementation == NAME
        packed = model.model.get_image_features(pixels, grids).pooler_output
    for ours, theirs in zip(packed, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
