"""Engine selection: `hf` (reference, `generate()`), `paged` (the fast engine), `auto`."""

from __future__ import annotations

import inspect
from typing import Any

from vlmbatch.engine.base import Engine
from vlmbatch.errors import JobError
from vlmbatch.models.base import ModelAdapter

ENGINES = ("auto", "paged", "hf")


def _paged_engine_class() -> tuple[type[Engine] | None, str]:
    """The fast engine's class, or None and why it cannot be imported (it is optional:
    its kernels or dependencies may be missing on some machines)."""
    try:
        from vlmbatch.engine.paged import PagedEngine
    except ImportError as exc:
        return None, f"{exc.__class__.__name__}: {exc}"
    return PagedEngine, ""


def _paged_usable(engine_cls: type[Engine], adapter: ModelAdapter) -> bool:
    """`PagedEngine.is_supported(adapter)` decides when it defines it; otherwise it needs CUDA."""
    is_supported = getattr(engine_cls, "is_supported", None)
    if is_supported is not None:
        return bool(is_supported(adapter))
    import torch

    return torch.cuda.is_available()


def _accepted(engine_cls: type[Engine], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options `engine_cls` takes: with `auto` the caller cannot know which engine it gets."""
    params = inspect.signature(engine_cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def create_engine(
    name: str,
    adapter: ModelAdapter,
    *,
    dtype: str = "auto",
    device: str = "auto",
    max_batch_size: int | None = None,
    seed: int = 0,
    model: Any = None,
    **engine_kwargs: Any,
) -> Engine:
    """Build engine `name` for `adapter`'s model.

    `max_batch_size` caps the requests in one batch (the paged engine's `max_num_seqs`);
    `seed` seeds torch so unseeded sampling repeats run to run, as in vLLM; `model` is an
    already loaded HF model, which only the hf engine can use; the other options go to
    the engine as they are.
    """
    import torch

    if name not in ENGINES:
        raise JobError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    torch.manual_seed(seed)
    if name in ("paged", "auto") and model is None:
        paged_cls, why = _paged_engine_class()
        if paged_cls is not None and (name == "paged" or _paged_usable(paged_cls, adapter)):
            options = dict(engine_kwargs, dtype=dtype, device=device)
            if max_batch_size is not None:
                options["max_num_seqs"] = max_batch_size
            if name == "auto":
                options = _accepted(paged_cls, options)
            return paged_cls(adapter, adapter.model_path, **options)
        if name == "paged":
            raise JobError(f"the paged engine is not available here ({why}); use --engine hf")
    if name == "paged":
        raise ValueError("a preloaded `model` can only be used by the hf engine")
    from vlmbatch.engine.hf import HFEngine

    options = dict(engine_kwargs, dtype=dtype, device=device, model=model)
    if max_batch_size is not None:
        options["max_batch_size"] = max_batch_size
    if name == "auto":
        options = _accepted(HFEngine, options)
    return HFEngine(adapter, **options)
