"""Our decoder's weights, one tensor at a time: from the checkpoint's files, or from transformers' model.

A source hands out the language model's tensors by their names in transformers' text
model (`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`,
`lm_head.weight`), each once:

- `CheckpointTensors`: the safetensors shards themselves, each tensor read when the
  decoder asks for it. Pre-quantized FP8 checkpoints load this way: transformers builds
  only the vision tower and projector (`loading.load_hf_model(skip=...)`), so its language
  model never exists (146 GB in bf16 for Qwen2.5-VL-72B, more than an H200 holds), the
  host holds about one layer of the checkpoint at a time, and the device only the final
  weights;
- `ModuleTensors`: transformers' loaded text model (bf16/fp32 checkpoints, which keep
  transformers' own key conversions, e.g. of fused MoE experts), each layer dropped once
  taken.

`WeightLoader` puts them into a decoder built on the "meta" device (`Decoder.load_weights`
and its modules' `load_weights` name the tensors each of our fused modules takes): every
tensor is made on the device in its final form (q/k/v and gate/up fused; FP8 projections
as FP8 via `fp8_loading.py`, from the checkpoint's fp8 values and scales or quantized
online), and one already in its final dtype and device is adopted, not copied.
"""

from __future__ import annotations

import logging
import re
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmbatch.engine.fp8_loading import experts_in_fp8, fp8_parts, projection_in_fp8
from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.quantization import Fp8Scheme, UnsupportedQuantization

log = logging.getLogger(__name__)

# A checkpoint key of the language model: its prefix differs by family and by the version
# that saved it (Qwen2.5-VL `model.layers.0...`, Qwen3-VL `model.language_model.layers.0...`,
# LLaVA and Gemma 3 `language_model.model.layers.0...` and `language_model.lm_head.weight`,
# Idefics3 `model.text_model...`); what follows it is transformers' text-model name. Vision
# keys (`visual.`, `model.visual.`, `vision_tower.`, `multi_modal_projector.`) never match.
_LANGUAGE_MODEL_KEY = re.compile(
    r"^(?:model\.)?(?:language_model\.|text_model\.)?(?:model\.)?(?=(?:layers\.\d+|embed_tokens|norm|lm_head)\.)"
)
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def language_model_name(key: str) -> str | None:
    """The text-model name of a checkpoint key (`model.layers.0.mlp.up_proj.weight` ->
    `layers.0.mlp.up_proj.weight`), or None for the vision tower's and projector's keys."""
    match = _LANGUAGE_MODEL_KEY.match(key)
    return key[match.end() :] if match else None


def checkpoint_files(model: str) -> list[Path]:
    """The safetensors files of a local folder or of a hub model's cached snapshot."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedQuantization(f"checkpoint {model}: no .safetensors files (only safetensors checkpoints are streamed)")
    return files


class CheckpointTensors:
    """The language model's tensors in a checkpoint's safetensors files, read one at a time.

    Only the files' headers are read up front; a file is opened (memory-mapped) at its first
    tensor taken and closed after its last, so its pages leave the process as the load moves
    on. `host_bytes` / `peak_host_bytes` count the bytes of the tensors handed out that are
    still alive (the loader drops each once it is on the device in its final form), so a
    load can show it held about one layer."""

    fused_experts = False  # a checkpoint's fused expert tensors are stored transposed or not, by the version that saved it

    def __init__(self, model: str):
        from safetensors import safe_open

        self.model = model
        self._index: dict[str, tuple[Path, str]] = {}
        self._files: dict[Path, Any] = {}  # open files
        self._untaken: dict[Path, int] = {}  # tensors of each file not taken yet
        self.files = checkpoint_files(model)
        for path in self.files:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    name = language_model_name(key)
                    quantized = key.endswith(_SCALE_SUFFIXES)
                    if quantized and (name is None or not name.startswith("layers.")):
                        raise UnsupportedQuantization(
                            f"FP8 checkpoint {model}: {key.rsplit('.', 1)[0]} is quantized; only the language model's decoder "
                            "layers may be (the vision tower, projector, embeddings and lm_head must be in the ignore list)"
                        )
                    if name is not None:
                        self._index[name] = (path, key)
                        self._untaken[path] = self._untaken.get(path, 0) + 1
        self.read_bytes = self.host_bytes = self.peak_host_bytes = 0

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor `name` on the CPU as stored (None if the checkpoint has none); each once."""
        entry = self._index.pop(name, None)
        if entry is None:
            return None
        path, key = entry
        if path not in self._files:
            from safetensors import safe_open

            self._files[path] = safe_open(str(path), "pt")
        tensor = self._files[path].get_tensor(key)
        self._untaken[path] -= 1
        if not self._untaken[path]:
            del self._files[path]
        size = tensor.numel() * tensor.element_size()
        self.read_bytes += size
        self.host_bytes += size
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.host_bytes -= size

    def release_layer(self, index: int) -> None:
        """Nothing to drop: the loader holds a layer's tensors only while it converts them."""

    def leftover(self) -> list[str]:
        """The language-model tensors no part of the decoder took."""
        return sorted(self._index)

    def close(self) -> None:
        self._files.clear()


class ModuleTensors:
    """The tensors of transformers' loaded text model (and its `lm_head`), by name."""

    fused_experts = True  # transformers' fused expert tensors, gate_up [E, 2I, H] and down [E, H, I]

    def __init__(self, language_model: nn.Module, lm_head: nn.Module | None):
        self.language_model, self.lm_head = language_model, lm_head

    def take(self, name: str) -> torch.Tensor | None:
        if name == "lm_head.weight":
            return self.lm_head.weight.detach() if self.lm_head is not None else None
        try:
            return self.language_model.get_parameter(name).detach()
        except AttributeError:
            return None

    def release_layer(self, index: int) -> None:
        """Drop transformers' layer once ours holds its weights, so the two never coexist whole."""
        self.language_model.layers[index] = nn.Identity()

    def leftover(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class WeightLoader:
    """Fills a decoder built on "meta" from a source: plain tensors as parameters on
    `device` in `dtype`, projections through `fp8_loading` where `scheme` quantizes them."""

    def __init__(self, source: CheckpointTensors | ModuleTensors, device: torch.device, dtype: torch.dtype,
                 kernels: KernelSet, scheme: Fp8Scheme | None = None):  # fmt: skip
        self.source, self.device, self.dtype, self.kernels, self.scheme = source, device, dtype, kernels, scheme
        self.num_fp8 = 0  # projections and expert sets loaded in FP8 (or as their dequantized values, on the CPU)

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        tensor = self.source.take(name)
        if tensor is None and required:
            raise UnsupportedQuantization(f"checkpoint {getattr(self.source, 'model', '')}: no tensor {name} for the decoder")
        return tensor

    def placed(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the device in the compute dtype (the same tensor when it already is)."""
        return tensor.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def param(self, module: nn.Module, attr: str, name: str, required: bool = True) -> bool:
        """`module.<attr>` = the source's `name`; False if the source has none (and not `required`)."""
        tensor = self.take(name, required)
        if tensor is None:
            return False
        self.set_param(module, attr, tensor, name)
        return True

    def set_param(self, module: nn.Module, attr: str, tensor: torch.Tensor, name: str) -> None:
        current = getattr(module, attr)
        if current is not None and tuple(current.shape) != tuple(tensor.shape):
            raise UnsupportedQuantization(f"checkpoint tensor {name} is {tuple(tensor.shape)}, the decoder's {tuple(current.shape)}")
        setattr(module, attr, nn.Parameter(self.placed(tensor), requires_grad=False))

    def linear(self, linear: nn.Linear, names: list[str]) -> nn.Module:
        """Our `linear` with the projections `names` stacked by output rows (q/k/v, gate/up),
        their biases too: in FP8 when the checkpoint has their scales or `scheme` quantizes
        online, else as they are."""
        weights = [self.take(f"{name}.weight") for name in names]
        bias = None
        if linear.bias is not None:
            bias = self.placed(torch.cat([self.take(f"{name}.bias") for name in names]))
        scales = [self._scale(name) for name in names]
        parts = fp8_parts(names, weights, scales, self.scheme, self.device, self.dtype)
        if parts is None:
            self.set_param(linear, "weight", torch.cat(weights) if len(weights) > 1 else weights[0], "/".join(names))
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            return linear
        self.num_fp8 += 1
        return projection_in_fp8(linear, parts, bias, self.kernels, self.device, self.dtype)

    def experts(self, moe: nn.Module, prefix: str) -> None:
        """A `FusedMoE`'s router and experts: transformers' fused expert tensors (adopted or
        quantized online), or a checkpoint's one tensor per expert (FP8 as stored, or plain)."""
        self.param(moe.gate, "weight", f"{prefix}.gate.weight")
        num_experts, rows = moe.gate_up.shape[0], moe.gate_up.shape[1] // 2
        gate_up, down = self.take(f"{prefix}.experts.gate_up_proj", False), self.take(f"{prefix}.experts.down_proj", False)
        if gate_up is not None and not self.source.fused_experts:
            raise UnsupportedQuantization(
                f"checkpoint {self.source.model}: {prefix}.experts are stored fused and unquantized; an FP8 checkpoint is read "
                "with one tensor per expert (mlp.experts.{e}.gate_proj/up_proj/down_proj), as the published FP8 releases store them"
            )  # fmt: skip
        names = [[f"{prefix}.experts.{e}.{p}_proj" for p in ("gate", "up", "down")] for e in range(num_experts)]
        if gate_up is not None and down is not None:
            weights = [[gate_up[e][:rows], gate_up[e][rows:], down[e]] for e in range(num_experts)]
            scales = [[None] * 3] * num_experts
        else:
            weights = [[self.take(f"{name}.weight") for name in expert] for expert in names]
            scales = [[self._scale(name) for name in expert] for expert in names]
        parts = [fp8_parts(n, w, s, self.scheme, self.device, self.dtype) for n, w, s in zip(names, weights, scales)]
        if all(p is None for p in parts):
            if gate_up is None:
                gate_up = torch.stack([torch.cat(w[:2]) for w in weights])
                down = torch.stack([w[2] for w in weights])
            moe.set_experts(gate_up, down, self.device, self.dtype)
            return
        if any(p is None for p in parts):
            raise UnsupportedQuantization(f"checkpoint {getattr(self.source, 'model', '')}: {prefix}.experts are quantized only in part")
        experts_in_fp8(moe, parts, self.kernels, self.device, self.dtype)
        self.num_fp8 += 1

    def _scale(self, name: str) -> torch.Tensor | None:
        if self.scheme is None or not self.scheme.prequantized:
            return None
        return self.source.take(f"{name}.{self.scheme.scale_name}")

    def finish(self, decoder: nn.Module) -> None:
        """Every decoder tensor loaded and every checkpoint tensor of the language model used."""
        empty = [name for name, t in [*decoder.named_parameters(), *decoder.named_buffers()] if t.is_meta]
        if empty:
            raise UnsupportedQuantization(f"checkpoint {getattr(self.source, 'model', '')}: no weights for the decoder's {', '.join(empty[:5])}")
        left = self.source.leftover()
        unused = [name for name in left if name.endswith((".weight", ".bias", *_SCALE_SUFFIXES))]
        if unused:
            raise UnsupportedQuantization(f"checkpoint {self.source.model}: tensors our decoder has no place for, e.g. {unused[:3]}")
        if left:
            log.debug("checkpoint tensors not used by the decoder: %s", left)
        self.source.close()
