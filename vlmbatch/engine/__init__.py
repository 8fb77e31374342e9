"""Engine selection: `hf` (reference, `generate()`), `paged` (the fast engine), `auto`."""

from __future__ import annotations

from typing import Any

from vlmbatch.engine.base import Engine
from vlmbatch.errors import JobError
from vlmbatch.models.base import ModelAdapter

ENGINES = ("auto", "paged", "hf")


def _paged_engine_class() -> tuple[type[Engine] | None, str]:
    """The fast engine's class, or None and why it cannot be imported (it is optional:
    it needs kernels and pieces that are still being written or absent on some machines)."""
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


def create_engine(name: str, adapter: ModelAdapter, model: Any = None, **kwargs: Any) -> Engine:
    """Build engine `name` for `adapter`'s model; `model` is an already loaded HF model (optional)."""
    if name not in ENGINES:
        raise JobError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if name in ("paged", "auto"):
        paged_cls, why = _paged_engine_class()
        if paged_cls is not None and (name == "paged" or _paged_usable(paged_cls, adapter)):
            return paged_cls(adapter, model=model, **kwargs)
        if name == "paged":
            raise JobError(f"the paged engine is not available here ({why}); use --engine hf")
    from vlmbatch.engine.hf import HFEngine

    return HFEngine(adapter, model=model, **kwargs)
