"""Random weights built where they run (`EngineConfig.load_format == "dummy"`), for benchmarks.

A model whose compute-dtype copy does not fit beside its FP8 one (Qwen2.5-VL-72B: 146 GB
in bf16 on a 141 GB H200) cannot be built by transformers and then converted; a
pre-quantized checkpoint streams its real weights instead (`weight_loading.py`). Without
weights, for benchmarks, transformers builds only what the engine keeps of it (the vision tower and
the position rules) with a one-layer language model (`dummy_hf_model`), our decoder of the
full depth is built on the "meta" device, and every tensor is then created on the device
in its final form: FP8 projections directly as random e4m3 values with their scales (no
bf16 copy ever exists), the rest random in the compute dtype, norms at one. As vLLM's
`load_format="dummy"`: the numbers are meaningless, the shapes, bytes and kernels real.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.embedding import ScaledEmbedding
from vlmbatch.engine.layers.fp8_linear import GROUP, Fp8Linear
from vlmbatch.engine.layers.linear import Linear
from vlmbatch.families.registry import load_config
from vlmbatch.quantization import BLOCK, Fp8Scheme

STD = 0.02  # of the random weights, as transformers' initializer_range


def dummy_hf_model(model: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False) -> nn.Module:
    """transformers' model of `model`'s config with random weights and its language model cut
    to one layer (the engine builds its own decoder of the full depth), on `device`; the
    config it carries keeps the full depth."""
    from transformers import AutoModelForImageTextToText

    config = load_config(str(model), trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    text = config.get_text_config()
    layers, layer_types = text.num_hidden_layers, getattr(text, "layer_types", None)
    text.num_hidden_layers = 1
    if layer_types is not None:
        text.layer_types = layer_types[:1]
    with torch.device(device):
        hf_model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    text.num_hidden_layers = layers
    if layer_types is not None:
        text.layer_types = layer_types
    return hf_model.eval()


@torch.no_grad()
def materialize(decoder: nn.Module, device: torch.device, dtype: torch.dtype, scheme: Fp8Scheme | None, kernels: KernelSet) -> None:
    """Create every tensor of a decoder built on "meta": its projections as FP8 layers when
    `scheme` is set and FP8 GEMMs run here, the rest random (norms at one)."""
    fp8 = scheme is not None and kernels.fp8 is not None
    for parent in list(decoder.modules()):
        if fp8 and getattr(parent, "takes_fp8", False):  # MoE experts, as the fused kernels take them
            parent.use_fp8(*_random_fp8_experts(parent.gate_up.shape, scheme, device, dtype),
                           *_random_fp8_experts(parent.down.shape, scheme, device, dtype))
        for name, child in list(parent.named_children()):
            if type(child) is Linear and name != "lm_head" and fp8:
                setattr(parent, name, _random_fp8(child, scheme, device, dtype, kernels))
    for module in decoder.modules():
        if isinstance(module, ScaledEmbedding):
            module.place_scale(device, dtype)
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                value = torch.empty(param.shape, device=device, dtype=dtype)
                value.fill_(1.0) if "norm" in type(module).__name__.lower() else value.normal_(0.0, STD)
                module._parameters[name] = nn.Parameter(value, requires_grad=False)


def _random_e4m3(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal values rounded to e4m3, made a slice at a time (a few MB of bf16
    temporary, not a copy of the whole tensor)."""
    out = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
    flat = out.view(-1, shape[-1])
    for start in range(0, flat.shape[0], 4096):
        rows = min(4096, flat.shape[0] - start)
        flat[start : start + rows] = torch.randn(rows, shape[-1], device=device, dtype=dtype).to(torch.float8_e4m3fn)
    return out


def _random_fp8_experts(shape: torch.Size, scheme: Fp8Scheme, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 experts [E, N, K], float32 scales): 128x128 blocks, or per row for per-channel schemes."""
    experts, n, k = shape
    rows = -(-n // GROUP) if scheme.format == BLOCK else n
    return _random_e4m3((experts, n, k), device, dtype), torch.full((experts, rows, -(-k // GROUP)), STD, device=device)


def _random_fp8(linear: Linear, scheme: Fp8Scheme, device: torch.device, dtype: torch.dtype, kernels: KernelSet) -> Fp8Linear:
    """Random e4m3 values (standard normal, rounded) times a scale that gives them STD."""
    n, k = linear.out_features, linear.in_features
    weight = _random_e4m3((n, k), device, dtype)
    shape = (-(-n // GROUP), -(-k // GROUP)) if scheme.format == BLOCK else (n, 1)
    bias = torch.empty(n, device=device, dtype=dtype).normal_(0.0, STD) if linear.bias is not None else None
    return Fp8Linear(weight, torch.full(shape, STD, device=device), bias, kernels.fp8)
