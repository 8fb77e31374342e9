"""Model name → family adapter, and the Hugging Face model loader both engines start from.

Families are recognised from `config.json`'s `model_type`, so a local folder, a hub id and
a tiny test checkpoint all take the same path; anything unknown fails at submit time with
a `JobError` instead of failing every row later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlmbatch.errors import JobError
from vlmbatch.models.base import ModelAdapter
from vlmbatch.models.llava import LlavaAdapter
from vlmbatch.models.qwen2_vl import Qwen2_5_VLAdapter, Qwen2VLAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    "qwen2_5_vl": Qwen2_5_VLAdapter,
    "qwen2_vl": Qwen2VLAdapter,
    "llava": LlavaAdapter,
}


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or Path(model).expanduser().exists()


def load_config(model: str, trust_remote_code: bool = False) -> Any:
    """`AutoConfig` for `model`, or `JobError("model not found: ...")`."""
    from transformers import AutoConfig

    if _looks_local(model) and not Path(model).expanduser().is_dir():
        raise JobError(f"model not found: {model} (no such folder)")
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise JobError(f"model not found: {model} ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from exc


def _adapter_class(config: Any, model: str) -> type[ModelAdapter]:
    if config.model_type not in ADAPTERS:
        supported = ", ".join(sorted(ADAPTERS))
        raise JobError(f"unsupported model type {config.model_type!r} for {model}; supported: {supported}")
    return ADAPTERS[config.model_type]


def model_family(model: str, trust_remote_code: bool = False) -> str:
    """The supported family (`model_type`) of `model`, or a `JobError` saying why not."""
    return _adapter_class(load_config(str(model), trust_remote_code), str(model)).family


def _read_chat_template(chat_template: str) -> str:
    """A chat template given as a file path or as the template text itself."""
    path = Path(chat_template).expanduser()
    if "{" not in chat_template and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in chat_template:
        raise JobError(f"chat template not found: {chat_template}")
    return chat_template


def load_adapter(model: str, chat_template: str | None = None, trust_remote_code: bool = False) -> ModelAdapter:
    """The family adapter for `model` (hub id or local folder), with its own processor."""
    from transformers import AutoProcessor

    model = str(model)
    config = load_config(model, trust_remote_code)
    adapter_cls = _adapter_class(config, model)
    try:
        processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot load the processor of {model}: {str(exc).splitlines()[0]}") from exc
    if chat_template is not None:
        processor.chat_template = _read_chat_template(chat_template)
    return adapter_cls(model, processor, config)


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
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise JobError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(names)}")
    return names[dtype]


def load_hf_model(
    model: str, dtype: str | torch.dtype = "auto", device: str = "auto", trust_remote_code: bool = False
) -> torch.nn.Module:
    """`AutoModelForImageTextToText` in eval mode with SDPA attention, on `device`."""
    from transformers import AutoModelForImageTextToText

    load_config(str(model), trust_remote_code)  # the clear "model not found" error first
    target = resolve_device(device)
    hf_model = AutoModelForImageTextToText.from_pretrained(
        model,
        dtype=resolve_dtype(dtype, target),
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )
    return hf_model.to(target).eval()
