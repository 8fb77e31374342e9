"""Where both engines start: the device, the dtype, and the checkpoint's `transformers` model."""

from __future__ import annotations

import torch

from vlmbatch.errors import JobError
from vlmbatch.families.registry import load_config, quantization_config
from vlmbatch.quantization import Fp8Scheme, checkpoint_scheme, online_scheme

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """fp32 on the CPU (exact and fast enough for tiny models), bf16 on CUDA, or as named."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise JobError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
                  raw_fp8: bool = False) -> torch.nn.Module:
    """`AutoModelForImageTextToText` in eval mode with SDPA attention, on `device`.
    `raw_fp8`: load an FP8 checkpoint without its `quantization_config`, so transformers
    builds plain modules (its quantized weights then hold the raw fp8 values, unscaled)
    and our loader reads the fp8 weights and scales itself (`fp8_loading.py`)."""
    from transformers import AutoModelForImageTextToText

    config = load_config(str(model), trust_remote_code)  # the clear "model not found" error first
    if raw_fp8 and hasattr(config, "quantization_config"):
        del config.quantization_config
    hf_model = AutoModelForImageTextToText.from_pretrained(
        model, config=config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
    )
    return hf_model.to(device).eval()


def quantization_scheme(model: str, quantization: str = "none", quantize_vision: bool = False,
                        trust_remote_code: bool = False) -> Fp8Scheme | None:
    """The FP8 scheme a model runs in: the checkpoint's own `quantization_config` if it has
    one (an unsupported one is refused here, naming it), else `quantization` online."""
    config = load_config(str(model), trust_remote_code)
    own = checkpoint_scheme(quantization_config(config), str(model))
    return own or online_scheme(quantization, quantize_vision)
