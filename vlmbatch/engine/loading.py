"""Where both engines start: the device, the dtype, and the checkpoint's `transformers` model."""

from __future__ import annotations

import logging
from typing import Any

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
                  skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """`AutoModelForImageTextToText` in eval mode with SDPA attention, on `device`.

    `skip`: modules (dotted names, e.g. `("model.language_model", "lm_head")`) that
    transformers builds on the "meta" device and never reads from the checkpoint, for a
    pre-quantized FP8 checkpoint whose language model our decoder streams from its
    safetensors itself (`weight_loading.CheckpointTensors`): transformers would otherwise
    build that language model in the compute dtype first (146 GB for a 72B model). The
    rest (vision tower, projector, rotary buffers) is loaded as usual, straight onto
    `device`; the checkpoint's `quantization_config` is dropped (the FP8 releases leave
    those modules unquantized)."""
    from transformers import AutoModelForImageTextToText

    config = load_config(str(model), trust_remote_code)  # the clear "model not found" error first
    if not skip:
        hf_model = AutoModelForImageTextToText.from_pretrained(
            model, config=config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
        )
        return hf_model.to(device).eval()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cls = _without(_model_class(config, str(model), trust_remote_code), skip)
    # Its load report would list every skipped key as unexpected: its warnings are dropped
    # here (a filter, not a level: transformers checks that logger's level for other output).
    report = logging.getLogger("transformers.modeling_utils")
    quiet = _BelowWarningsOnly()
    report.addFilter(quiet)
    try:
        hf_model, info = cls.from_pretrained(
            model, config=config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code,
            device_map={"": device}, output_loading_info=True,
        )  # fmt: skip
    finally:
        report.removeFilter(quiet)
    missing = sorted(set(info.get("missing_keys") or ()) | set(info.get("mismatched_keys") or ()))
    if missing:
        raise JobError(f"cannot load {model}: the checkpoint lacks (or has other shapes for) {', '.join(missing[:5])}")
    return hf_model.eval()


class _BelowWarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING


def _model_class(config: Any, model: str, trust_remote_code: bool) -> type:
    """The class `AutoModelForImageTextToText` would build for `config`."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForImageTextToText" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForImageTextToText"], model)
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise JobError(f"cannot load {model}: transformers has no image-text-to-text model for {type(config).__name__}")
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


def _without(cls: type, skip: tuple[str, ...]) -> type:
    """`cls` whose `state_dict` leaves out the parameters and buffers under `skip`.
    transformers loads exactly the keys of the model's state dict: the skipped ones are
    neither read (the checkpoint's keys for them are "unexpected") nor allocated (not
    "missing"), so they stay on the "meta" device the model is built on. The subclass takes
    `cls`'s name and module, so transformers applies `cls`'s checkpoint key conversions."""
    prefixes = tuple(name + "." for name in skip)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        full = cls.state_dict(self, *args, **kwargs)
        return type(full)((key, value) for key, value in full.items() if not key.startswith(prefixes))

    return type(cls.__name__, (cls,), {"state_dict": state_dict, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def quantization_scheme(model: str, quantization: str = "none", quantize_vision: bool = False,
                        trust_remote_code: bool = False) -> Fp8Scheme | None:
    """The FP8 scheme a model runs in: the checkpoint's own `quantization_config` if it has
    one (an unsupported one is refused here, naming it), else `quantization` online."""
    config = load_config(str(model), trust_remote_code)
    own = checkpoint_scheme(quantization_config(config), str(model))
    return own or online_scheme(quantization, quantize_vision)
