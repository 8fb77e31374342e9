"""FP8 weights into our decoder: a checkpoint's own, or quantized online at load time.

transformers loads the checkpoint with its `quantization_config` removed (`loading.py`),
so it builds plain modules and leaves the scale tensors unread; the quantized language
model weights and their scales are read here from the checkpoint's safetensors files as
they are stored (fp8 values, float32/bf16 scales). A weight is quantized exactly when the
checkpoint has a scale for it: the modules of its ignore list (vision tower, projector,
`lm_head`, MoE router) have none and keep what transformers loaded.

`apply_fp8` then turns each of our decoder's linear layers (and MoE experts) that has
FP8 weights into an `Fp8Linear` where FP8 GEMMs run (`KernelSet.fp8`), or writes the
dequantized weight into the plain layer where they do not (the CPU), so CI runs the
same quantized weights the GPU runs.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.fp8_linear import GROUP, Fp8Linear, dequantize, fuse, quantize_online
from vlmbatch.engine.layers.linear import Linear
from vlmbatch.quantization import BLOCK, Fp8Scheme, UnsupportedQuantization

log = logging.getLogger(__name__)

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<module>.+)$")
_VISION = ("visual", "vision", "multi_modal_projector")


@dataclass
class Fp8Weights:
    """The checkpoint's quantized language-model weights: `"layers.{i}.{module}"` ->
    (float8_e4m3fn weight, float32 scale), on the CPU until `apply_fp8` places them."""

    scheme: Fp8Scheme
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.tensors.pop(name, None)


def checkpoint_files(model: str) -> list[Path]:
    """The safetensors files of a local folder or of a hub model's cached snapshot."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedQuantization(f"FP8 checkpoint {model}: no .safetensors files (only safetensors checkpoints are read)")
    return files


def read_fp8_weights(model: str, scheme: Fp8Scheme) -> Fp8Weights:
    """Every weight of `model` that has a scale (`weight_scale_inv` / `weight_scale`)."""
    from safetensors import safe_open

    suffix = "." + scheme.scale_name
    weights = Fp8Weights(scheme)
    for path in checkpoint_files(model):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if not key.endswith(suffix):
                    continue
                base = key.removesuffix(suffix)
                match = _LAYER_KEY.search(base)
                if match is None or any(part in base for part in _VISION):
                    raise UnsupportedQuantization(
                        f"FP8 checkpoint {model}: {base} is quantized; only the language model's decoder layers may be "
                        "(the vision tower, projector, embeddings and lm_head must be in the ignore list)"
                    )
                weight = f.get_tensor(base + ".weight")
                if weight.dtype != torch.float8_e4m3fn:
                    raise UnsupportedQuantization(f"FP8 checkpoint {model}: {base}.weight is {weight.dtype}, expected float8_e4m3fn")
                weights.tensors[f"layers.{match['layer']}.{match['module']}"] = (weight, f.get_tensor(key).float())
    if not weights.tensors:
        raise UnsupportedQuantization(f"FP8 checkpoint {model}: its quantization_config names {scheme.format} but no {scheme.scale_name} tensors were found")
    return weights


@dataclass(frozen=True)
class Fp8Load:
    """What `VisionLanguageModel.build` quantizes with: the scheme and, for a pre-quantized
    checkpoint, its FP8 weights."""

    scheme: Fp8Scheme
    weights: Fp8Weights | None = None


# Our fused projections and the checkpoint modules they stack, in order.
_ATTENTION = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",)}
_MLP = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@torch.no_grad()
def apply_fp8(decoder: nn.Module, scheme: Fp8Scheme, weights: Fp8Weights | None, kernels: KernelSet, dtype: torch.dtype) -> int:
    """Quantize `decoder`'s linear layers as `scheme` says (checkpoint weights from
    `weights`, or online from the layers' own weights); returns how many were converted."""
    converted = 0
    weights = weights if weights is not None else Fp8Weights(scheme)  # online: experts pass through it
    for index, layer in enumerate(decoder.layers):
        groups = [(layer.self_attn, f"layers.{index}.self_attn", _ATTENTION)]
        if hasattr(layer.mlp, "gate_up_proj") and isinstance(layer.mlp.gate_up_proj, Linear):
            groups.append((layer.mlp, f"layers.{index}.mlp", _MLP))
        elif hasattr(layer.mlp, "copy_experts"):
            converted += _apply_experts(layer.mlp, f"layers.{index}.mlp.experts", scheme, weights, kernels, dtype)
        for module, prefix, fused in groups:
            for ours, theirs in fused.items():
                linear = getattr(module, ours)
                if scheme.prequantized:
                    parts = [weights.get(f"{prefix}.{name}") for name in theirs]
                    if all(p is None for p in parts):
                        continue
                    if any(p is None for p in parts):
                        raise UnsupportedQuantization(f"FP8 checkpoint: {prefix}.{'/'.join(theirs)} are quantized only in part")
                    w, s = fuse(parts)
                else:  # online: each projection on its own, then fused, as a checkpoint's would be
                    rows = _part_rows(module, ours, linear.weight.shape[0])
                    w, s = fuse([quantize_online(part, blocks=scheme.format == BLOCK) for part in linear.weight.split(rows)])
                setattr(module, ours, _converted(linear, w, s, kernels, dtype))
                converted += 1
    if weights is not None and weights.tensors:
        left = sorted(weights.tensors)[:3]
        raise UnsupportedQuantization(f"FP8 checkpoint: quantized weights our decoder has no place for, e.g. {left}")
    return converted


def _as_blocks(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales [N, 1] as per-row block scales [N, ceil(K/128)] (the layout the
    fused MoE kernels read); block scales as they are."""
    if s.shape == (w.shape[0], 1):
        s = s.expand(-1, -(-w.shape[1] // GROUP)).contiguous()
    return w, s


def _part_rows(module: nn.Module, fused: str, rows: int) -> list[int]:
    """The output rows of each projection stacked in `module.<fused>` (q/k/v, gate/up)."""
    if fused == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    if fused == "gate_up_proj":
        return [rows // 2, rows // 2]
    return [rows]


def _converted(linear: Linear, w: torch.Tensor, s: torch.Tensor, kernels: KernelSet, dtype: torch.dtype) -> nn.Module:
    device = linear.weight.device
    if kernels.fp8 is None:
        linear.weight.copy_(dequantize(w.to(device), s.to(device), dtype))
        return linear
    bias = linear.bias.detach() if linear.bias is not None else None
    return Fp8Linear(w.to(device), s.to(device), bias, kernels.fp8)


def _apply_experts(moe: nn.Module, prefix: str, scheme: Fp8Scheme, weights: Fp8Weights | None, kernels: KernelSet,
                   dtype: torch.dtype) -> int:  # fmt: skip
    """A checkpoint's per-expert FP8 weights, stacked in our layout: held in FP8 where the
    fused MoE kernels run on a GPU with FP8 GEMMs, else dequantized into the block's experts."""
    num_experts = moe.gate_up.shape[0]
    if not scheme.prequantized:  # online: each expert's gate, up and down on their own, as a checkpoint stores them
        blocks = scheme.format == BLOCK
        for expert in range(num_experts):
            w = moe.gate_up[expert]
            weights.tensors[f"{prefix}.{expert}.gate_proj"] = _as_blocks(*quantize_online(w[: w.shape[0] // 2], blocks))
            weights.tensors[f"{prefix}.{expert}.up_proj"] = _as_blocks(*quantize_online(w[w.shape[0] // 2 :], blocks))
            weights.tensors[f"{prefix}.{expert}.down_proj"] = _as_blocks(*quantize_online(moe.down[expert], blocks))
    gate_up, down = [], []
    for expert in range(num_experts):
        parts = [weights.get(f"{prefix}.{expert}.{name}") for name in ("gate_proj", "up_proj", "down_proj")]
        if all(p is None for p in parts):
            return 0
        if any(p is None for p in parts):
            raise UnsupportedQuantization(f"FP8 checkpoint: {prefix}.{expert} is quantized only in part")
        gate_up.append(fuse(parts[:2]))
        down.append(parts[2])
    device = moe.gate_up.device
    if kernels.fp8 is not None and moe.takes_fp8:  # the fused MoE kernels read the fp8 experts as they are
        moe.use_fp8(torch.stack([w for w, _ in gate_up]).to(device), torch.stack([s for _, s in gate_up]).to(device),
                    torch.stack([w for w, _ in down]).to(device), torch.stack([s for _, s in down]).to(device))
        return num_experts
    if moe.gate_up.is_meta:
        raise UnsupportedQuantization(f"FP8 checkpoint: {prefix} has no loaded expert tensors to dequantize into")
    for expert in range(num_experts):
        moe.gate_up[expert].copy_(dequantize(gate_up[expert][0].to(device), gate_up[expert][1].to(device), dtype))
        moe.down[expert].copy_(dequantize(down[expert][0].to(device), down[expert][1].to(device), dtype))
    return num_experts


@torch.no_grad()
def quantize_linears(roots: list[nn.Module], kernels: KernelSet, dtype: torch.dtype) -> int:
    """Online per-channel FP8 for every `nn.Linear` under `roots` (the vision tower with
    `quantize_vision`) but patch embeddings, which see raw pixels; returns how many."""
    converted = 0
    for root in roots:
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if type(child) in (nn.Linear, Linear) and "patch_embed" not in name:
                    w, s = quantize_online(child.weight)
                    setattr(parent, name, _converted(child, w, s, kernels, dtype))
                    converted += 1
    return converted
