"""FP8 weights into our decoder: a checkpoint's own, or quantized online at load time.

`weight_loading.WeightLoader` hands each of our fused projections (q/k/v, o, gate/up,
down) and each set of MoE experts here with the tensors it took for them. A checkpoint's
weight is quantized exactly when the checkpoint has a scale for it (`weight_scale_inv` /
`weight_scale`, read as stored: fp8 values, float32/bf16 scales); the modules of its
ignore list (vision tower, projector, `lm_head`, MoE router) have none and load as they
are. Online quantization (`--quantization fp8|fp8-block`) quantizes each projection of
the compute-dtype weights on its own, as a checkpoint stores them, then fuses them alike.

Where FP8 GEMMs run (`KernelSet.fp8`) a projection becomes an `Fp8Linear` and MoE
experts stay in FP8 for the fused MoE kernels; where they do not (the CPU) the dequantized
weight goes into the plain layer, so CI runs the same quantized weights the GPU runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.fp8_linear import GROUP, Fp8Linear, dequantize, fuse, quantize_online
from vlmbatch.engine.layers.linear import Linear
from vlmbatch.quantization import BLOCK, Fp8Scheme, UnsupportedQuantization

Part = tuple[torch.Tensor, torch.Tensor]  # (float8_e4m3fn weight, float32 scales)


def fp8_parts(names: Sequence[str], weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
              scheme: Fp8Scheme | None, device: torch.device, dtype: torch.dtype) -> list[Part] | None:  # fmt: skip
    """Each projection of `names` as (fp8 weight, float32 scales): the checkpoint's when it
    has their scales (all or none of a fused group), quantized online when `scheme` says
    so, else None (the projections load as they are)."""
    if any(s is not None for s in scales):
        if any(s is None for s in scales):
            raise UnsupportedQuantization(f"FP8 checkpoint: {'/'.join(names)} are quantized only in part")
        for name, w in zip(names, weights):
            if w.dtype != torch.float8_e4m3fn:
                raise UnsupportedQuantization(f"FP8 checkpoint: {name}.weight is {w.dtype}, expected float8_e4m3fn")
        return [(w, s.float()) for w, s in zip(weights, scales)]
    if scheme is not None and not scheme.prequantized:
        return [quantize_online(w.to(device=device, dtype=dtype), blocks=scheme.format == BLOCK) for w in weights]
    return None


def projection_in_fp8(linear: Linear, parts: list[Part], bias: torch.Tensor | None, kernels: KernelSet,
                      device: torch.device, dtype: torch.dtype) -> nn.Module:  # fmt: skip
    """The projections `parts` stacked by output rows: an `Fp8Linear` where FP8 GEMMs run,
    else `linear` holding their dequantized weight."""
    w, s = fuse(parts)
    w, s = w.to(device), s.to(device)
    if kernels.fp8 is not None:
        return Fp8Linear(w, s, bias, kernels.fp8)
    linear.weight = nn.Parameter(dequantize(w, s, dtype), requires_grad=False)
    linear.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
    return linear


def _as_blocks(w: torch.Tensor, s: torch.Tensor) -> Part:
    """Per-channel scales [N, 1] as per-row block scales [N, ceil(K/128)] (the layout the
    fused MoE kernels read); block scales as they are."""
    if s.shape == (w.shape[0], 1):
        s = s.expand(-1, -(-w.shape[1] // GROUP)).contiguous()
    return w, s


def experts_in_fp8(moe: nn.Module, parts: list[list[Part]], kernels: KernelSet, device: torch.device, dtype: torch.dtype) -> None:
    """A `FusedMoE`'s experts from each expert's (gate, up, down) in FP8, stacked in our
    layout: held in FP8 where the fused MoE kernels run on a GPU with FP8 GEMMs, else
    dequantized into the block's experts one expert at a time."""
    gate_up = [fuse([_as_blocks(*gate), _as_blocks(*up)]) for gate, up, _ in parts]
    down = [_as_blocks(*d) for _, _, d in parts]
    if kernels.fp8 is not None and moe.takes_fp8:  # the fused MoE kernels read the fp8 experts as they are
        moe.use_fp8(torch.stack([w for w, _ in gate_up]).to(device), torch.stack([s for _, s in gate_up]).to(device),
                    torch.stack([w for w, _ in down]).to(device), torch.stack([s for _, s in down]).to(device))
        return
    moe.set_experts(torch.empty(moe.gate_up.shape, device=device, dtype=dtype), torch.empty(moe.down.shape, device=device, dtype=dtype))
    for expert, ((gw, gs), (dw, ds)) in enumerate(zip(gate_up, down)):
        moe.gate_up[expert].copy_(dequantize(gw.to(device), gs.to(device), dtype))
        moe.down[expert].copy_(dequantize(dw.to(device), ds.to(device), dtype))


def quantize_vision_modules(roots: list[nn.Module], kernels: KernelSet, dtype: torch.dtype) -> int:
    """`quantize_vision`: the towers' linear layers in FP8 (`quantize_linears`), and the
    blocks that can (Qwen2.5-VL's) taking their FP8 inputs quantized by the norms and the
    activation before them; returns how many layers were converted."""
    converted = quantize_linears(roots, kernels, dtype)
    for block in (m for root in roots for m in root.modules() if hasattr(m, "emit_fp8_inputs")):
        block.emit_fp8_inputs()
    return converted


@torch.no_grad()
def quantize_linears(roots: list[nn.Module], kernels: KernelSet, dtype: torch.dtype) -> int:
    """Online per-channel FP8 for every `nn.Linear` under `roots` (the vision tower with
    `quantize_vision`) but patch embeddings, which see raw pixels; returns how many."""
    converted = 0
    for root in roots:
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if type(child) in (nn.Linear, Linear) and "patch_embed" not in name:
                    bias = child.bias.detach() if child.bias is not None else None
                    setattr(parent, name, projection_in_fp8(child, [quantize_online(child.weight)], bias, kernels,
                                                            child.weight.device, dtype))
                    converted += 1
    return converted
