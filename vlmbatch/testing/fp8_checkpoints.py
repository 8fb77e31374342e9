"""Tiny FP8 checkpoints in the two published layouts, made from a tiny bf16/fp32 one.

`make-tiny-model --quantization fp8-block|fp8-dynamic` rewrites the language model's
linear weights of a freshly built tiny checkpoint the way the released FP8 models store
them, so the loader reads exactly what it would read from the hub:

- `fp8-block` (Qwen's `-FP8`): `quantization_config {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [128, 128], modules_to_not_convert}`,
  each weight float8_e4m3fn with a float32 `weight_scale_inv` [ceil(N/128), ceil(K/128)];
- `fp8-dynamic` (llm-compressor's `-FP8-dynamic`, compressed-tensors): `quant_method:
  compressed-tensors, format: float-quantized`, one config group (weights float 8-bit
  static per channel, input activations float 8-bit dynamic per token), an `ignore` list,
  each weight float8_e4m3fn with a bf16 `weight_scale` [N, 1].

The vision tower, the projector, `lm_head`, the MoE router and embeddings stay as they
were (both formats' ignore lists name them), in every family: a SigLIP tower's layers,
named like the language model's, too. Mixture-of-experts weights are written one
expert per tensor (`mlp.experts.{e}.{gate,up,down}_proj.weight`), the layout of both
Qwen3-VL-30B-A3B-Instruct-FP8 and llm-compressor's linearised experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from vlmbatch.kernels.reference import quantize_fp8_blocks_ref, quantize_fp8_ref

FORMATS = ("fp8-block", "fp8-dynamic")
BLOCK = 128
# The language model's dense linear weights (attention and MLP projections).
_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# The vision tower's and projector's keys, which both formats' ignore lists name (a SigLIP
# tower's encoder layers have the same q/k/v/o and MLP names as the language model's).
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|connector)\.")
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def quantizes(key: str) -> bool:
    """Whether both formats store this checkpoint key's weight in FP8 (a language-model
    projection; fused expert tensors are split per expert first)."""
    return bool(_LINEAR.search(key)) and not _VISION.search(key)


def quantized_tensors(fmt: str, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """`weight` under `key` as format `fmt` stores it: the e4m3 weight and its scale."""
    base = key.removesuffix(".weight")
    if fmt == "fp8-block":
        q, s = quantize_fp8_blocks_ref(weight, BLOCK)
        return {key: q, f"{base}.weight_scale_inv": s.float()}
    q, s = quantize_fp8_ref(weight.float(), None)
    return {key: q, f"{base}.weight_scale": s.to(torch.bfloat16)}


def _loaded_experts(directory: Path, key: str) -> torch.Tensor:
    """A fused expert tensor as transformers holds it (gate_up [E, 2I, hidden], down
    [E, hidden, I]): the stored layout is transposed or not depending on the version
    that saved it, and a square one cannot tell by its shape."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    return model.get_parameter(key).detach()


def quantization_config(fmt: str) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": ["lm_head", "visual", "model.visual", "model.vision_tower", "model.vision_model",
                                           "model.multi_modal_projector", "model.connector", "mlp.gate"]}
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None, "actorder": None}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**scheme, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**scheme, "strategy": "token", "dynamic": True, "observer": None},
        }},
        "ignore": ["lm_head", "re:.*visual.*", "re:.*vision_tower.*", "re:.*vision_model.*", "re:.*multi_modal_projector.*",
                   "re:.*connector.*", "re:.*mlp.gate$"],
        "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
    }  # fmt: skip


def quantize_checkpoint(directory: str | Path, fmt: str) -> Path:
    """Rewrite the tiny checkpoint in `directory` in FP8 layout `fmt` (FORMATS), in place."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {', '.join(FORMATS)}")
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    for path in files:
        tensors = load_file(str(path))
        out: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            fused = FUSED_EXPERTS.match(key)
            if quantizes(key):
                out.update(quantized_tensors(fmt, key, tensor))
            elif fused:  # one tensor per expert, from transformers' own reading of the fused tensor
                for expert, weight in enumerate(_loaded_experts(directory, key)):
                    names = ("gate_proj", "up_proj") if fused["name"] == "gate_up_proj" else ("down_proj",)
                    for name, part in zip(names, weight.chunk(len(names))):
                        out.update(quantized_tensors(fmt, f"{fused['prefix']}.{expert}.{name}.weight", part.contiguous()))
            else:
                out[key] = tensor
        save_file(out, str(path), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(fmt)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory
