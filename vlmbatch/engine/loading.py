"""Where both engines start: the device, the dtype, and the checkpoint's `transformers` model."""

from __future__ import annotations

import torch

from vlmbatch.errors import JobError
from vlmbatch.families.registry import load_config

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


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False) -> torch.nn.Module:
    """`AutoModelForImageTextToText` in eval mode with SDPA attention, on `device`."""
    from transformers import AutoModelForImageTextToText

    load_config(str(model), trust_remote_code)  # the clear "model not found" error first
    hf_model = AutoModelForImageTextToText.from_pretrained(
        model, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
    )
    return hf_model.to(device).eval()
