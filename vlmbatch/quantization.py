"""Which FP8 format a model runs in: the checkpoint's own `quantization_config`, or online.

Two published formats are read as they are released, and anything else is refused when
the model is loaded (at submit, as other model errors), naming what was found:

- block-wise FP8 (`quant_method: "fp8"`, Qwen's and DeepSeek's `-FP8` releases): e4m3
  weights with one `weight_scale_inv` per 128x128 block (the dequantized weight is
  `weight * weight_scale_inv`, whatever the name says), activations quantized
  dynamically per token and group of 128 channels.
- compressed-tensors FP8 (`quant_method: "compressed-tensors"`, `format: float-quantized`,
  the `-FP8-dynamic` releases of llm-compressor): e4m3 weights with one `weight_scale` per
  output channel, activations dynamic per token.

In both, a weight is quantized exactly when the checkpoint stores a scale for it
(`fp8_loading.py`): the modules of its ignore list (`modules_to_not_convert`, `ignore`)
have none and load as they are, so the list itself is not consulted.

Online quantization builds either format at load time from bf16 weights:
`EngineConfig.quantization == "fp8"` per output channel with dynamic per-token
activations, `"fp8-block"` in 128x128 blocks with 1x128 activation groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlmbatch.errors import JobError

BLOCK = "fp8-block"  # 128x128 weight blocks, 1x128 activation groups
CHANNEL = "fp8-channel"  # per output channel weights, per token activations
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION_CHOICES = ("none", "fp8", "fp8-block")


class UnsupportedQuantization(JobError):
    """A checkpoint's `quantization_config` names a format or scheme we do not run."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are quantized."""

    format: str  # BLOCK or CHANNEL
    block: tuple[int, int] | None = None  # (rows, columns) of a weight block; BLOCK only
    prequantized: bool = True  # the checkpoint holds fp8 weights and scales (False: online)
    quantize_vision: bool = False  # online only: the vision tower's linear layers too

    @property
    def scale_name(self) -> str:
        """The checkpoint's name of a weight's scale tensor."""
        return "weight_scale_inv" if self.format == BLOCK else "weight_scale"

    def describe(self) -> str:
        where = "checkpoint" if self.prequantized else "online"
        if self.format == BLOCK:
            return f"fp8 e4m3, {self.block[0]}x{self.block[1]} weight blocks, dynamic 1x{self.block[1]} activation groups ({where})"
        return f"fp8 e4m3, per-channel weights, dynamic per-token activations ({where})"


def online_scheme(quantization: str, quantize_vision: bool = False) -> Fp8Scheme | None:
    """The scheme of `--quantization` for a checkpoint without its own (None: `none`)."""
    if quantization in ("", "none"):
        return None
    if quantization not in QUANTIZATION_CHOICES:
        raise UnsupportedQuantization(f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATION_CHOICES)}")
    block = (128, 128) if quantization == "fp8-block" else None
    return Fp8Scheme(BLOCK if block else CHANNEL, block=block, prequantized=False, quantize_vision=quantize_vision)


def checkpoint_scheme(quantization_config: Mapping[str, Any] | None, model: str = "") -> Fp8Scheme | None:
    """The scheme of a checkpoint's `quantization_config` (None: not quantized), or an
    `UnsupportedQuantization` naming what it found."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    where = f" in {model}" if model else ""
    if method == "fp8":
        return _block_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    raise UnsupportedQuantization(
        f"unsupported quantization{where}: quant_method {method!r}; supported: 'fp8' (block-wise, weight_block_size "
        "[128, 128], dynamic activations) and 'compressed-tensors' (float-quantized, per-channel weights, dynamic per-token activations)"
    )


def _block_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    block = qc.get("weight_block_size")
    found = f"weight_block_size {block!r}, activation_scheme {qc.get('activation_scheme')!r}, fmt {qc.get('fmt', 'e4m3')!r}"
    if block is None or list(block) != [128, 128] or qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantization(
            f"unsupported fp8 checkpoint{where}: {found}; supported: weight_block_size [128, 128], "
            "activation_scheme 'dynamic', fmt 'e4m3'"
        )
    return Fp8Scheme(BLOCK, block=(128, 128))


def _compressed_tensors_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    problems = [] if fmt == "float-quantized" else [f"format {fmt!r} (supported: 'float-quantized')"]
    if not groups:
        problems.append("no config_groups")
    for name, group in groups.items():
        weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
        w = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"), bool(weights.get("dynamic")))
        if w != ("float", 8, "channel", False):
            problems.append(f"{name} weights type {w[0]!r} num_bits {w[1]!r} strategy {w[2]!r} dynamic {w[3]} "
                            "(supported: float, 8, channel, static)")  # fmt: skip
        a = (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("dynamic"))
        if a != ("float", 8, "token", True):
            problems.append(f"{name} input_activations type {a[0]!r} num_bits {a[1]!r} strategy {a[2]!r} dynamic {a[3]!r} "
                            "(supported: float, 8, token, dynamic)")  # fmt: skip
        if group.get("output_activations"):
            problems.append(f"{name} output_activations (supported: none)")
    if qc.get("kv_cache_scheme"):
        problems.append("kv_cache_scheme (supported: none; use --kv-cache-dtype fp8 for a dynamic one)")
    if problems:
        raise UnsupportedQuantization(f"unsupported compressed-tensors checkpoint{where}: " + "; ".join(problems))
    return Fp8Scheme(CHANNEL)
