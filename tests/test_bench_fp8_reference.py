"""The FP8 logit reference of `bench engine --quantization`: transformers' layers made to
compute what our FP8 kernels compute (round-tripped weights, e4m3-rounded inputs)."""

from __future__ import annotations

import pytest
import torch

from vlmbatch.bench.fp8 import round_trip_fp8_layers, simulate_fp8_activations
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.kernels.reference import fp8_gemm_ref, quantize_fp8_blocks_ref, quantize_fp8_ref


@pytest.mark.parametrize("quantization", ["fp8", "fp8-block"])
def test_a_simulated_projection_computes_the_fp8_kernels_function(tiny_model_dir, quantization):
    """After the round trip and the input hooks, a decoder projection of the tiny model gives
    exactly `fp8_gemm_ref` (the reference our Triton and cuBLAS FP8 GEMMs are tested against)
    of the quantized input and weight, and not the unrounded product."""
    hf_model = load_hf_model(str(tiny_model_dir("qwen2_5_vl")), torch.float32, torch.device("cpu"))
    weight = hf_model.model.language_model.layers[0].mlp.down_proj.weight.detach().clone()
    assert round_trip_fp8_layers(hf_model, quantization) > 0
    assert simulate_fp8_activations(hf_model, quantization) is True
    projection = hf_model.model.language_model.layers[0].mlp.down_proj
    x = torch.randn(5, projection.in_features, generator=torch.Generator().manual_seed(3))
    group = 128 if quantization == "fp8-block" else None
    w_q, w_s = quantize_fp8_blocks_ref(weight) if quantization == "fp8-block" else quantize_fp8_ref(weight, None)
    x_q, x_s = quantize_fp8_ref(x, group)
    expected = fp8_gemm_ref(x_q, x_s, w_q, w_s)
    with torch.no_grad():
        got = projection(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - x @ projection.weight.T).abs().max() > 1e-4  # the inputs really were rounded


def test_moe_experts_are_reported_as_not_simulated(tiny_model_dir):
    """The experts' inner activation is out of a hook's reach: the bench keeps the FP8 floor."""
    hf_model = load_hf_model(str(tiny_model_dir("qwen3_vl_moe")), torch.float32, torch.device("cpu"))
    round_trip_fp8_layers(hf_model, "fp8-block")
    assert simulate_fp8_activations(hf_model, "fp8-block") is False


def test_with_vision_the_tower_is_rounded_per_channel_and_without_it_untouched(tiny_model_dir):
    """`--quantize-vision`: the tower's linear layers compute per-channel w8a8 (what online
    vision quantization runs) even under fp8-block, whose decoder stays block-wise; without
    the flag the tower keeps its weights."""
    plain = load_hf_model(str(tiny_model_dir("qwen2_5_vl")), torch.float32, torch.device("cpu"))
    tower_weight = plain.model.visual.blocks[0].mlp.down_proj.weight.detach().clone()
    without = round_trip_fp8_layers(plain, "fp8-block")
    torch.testing.assert_close(plain.model.visual.blocks[0].mlp.down_proj.weight, tower_weight, rtol=0, atol=0)

    hf_model = load_hf_model(str(tiny_model_dir("qwen2_5_vl")), torch.float32, torch.device("cpu"))
    assert round_trip_fp8_layers(hf_model, "fp8-block", vision=True) > without
    assert simulate_fp8_activations(hf_model, "fp8-block", vision=True) is True
    projection = hf_model.model.visual.blocks[0].mlp.down_proj
    x = torch.randn(7, projection.in_features, generator=torch.Generator().manual_seed(5))
    w_q, w_s = quantize_fp8_ref(tower_weight, None)
    x_q, x_s = quantize_fp8_ref(x, None)
    expected = fp8_gemm_ref(x_q, x_s, w_q, w_s, projection.bias)
    with torch.no_grad():
        got = projection(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_block_fp8_folder_for_vllm_names_every_unquantized_layer_in_full(tiny_model_dir, tmp_path):
    """vLLM matches `modules_to_not_convert` entries against whole module names: a short name
    such as "visual" leaves the tower quantized (and a 4304-wide MLP then fails to start)."""
    import json
    import shutil

    from vlmbatch.bench.fp8 import vllm_model_folder

    folder = shutil.copytree(tiny_model_dir("qwen3_vl_moe"), tmp_path / "model")
    target = vllm_model_folder(folder, "fp8-block")
    config = json.loads((target / "config.json").read_text())["quantization_config"]
    names = set(config["modules_to_not_convert"])
    model = load_hf_model(str(folder), torch.float32, torch.device("cpu"))
    tower = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name.startswith("model.visual.")}
    routers = {f"model.language_model.layers.{i}.mlp.gate" for i in range(model.config.text_config.num_hidden_layers)}
    assert tower and tower | routers | {"lm_head"} == names
    assert config["weight_block_size"] == [128, 128] and config["quant_method"] == "fp8"
