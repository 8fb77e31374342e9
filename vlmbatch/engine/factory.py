"""Engine selection: `hf` (reference, `generate()`), `paged` (the fast engine), `auto`."""

from __future__ import annotations

import logging

import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.base import Engine
from vlmbatch.errors import JobError
from vlmbatch.families.adapter import ModelAdapter

log = logging.getLogger(__name__)


def create_engine(adapter: ModelAdapter, config: EngineConfig, hf_model: torch.nn.Module | None = None) -> Engine:
    """The engine `config.engine` names for `adapter`'s model. `auto` is the paged engine
    unless it cannot be imported here (its kernels' dependencies are optional), then hf.
    `hf_model`: an already loaded `transformers` model of the checkpoint on the target
    device (benchmarks); the paged engine takes its language model over.

    torch is seeded with `config.seed`, so unseeded sampling repeats run to run, as in vLLM.
    """
    torch.manual_seed(config.seed)
    if config.engine in ("paged", "auto"):
        try:
            from vlmbatch.engine.paged import PagedEngine
        except ImportError as exc:
            if config.engine == "paged":
                raise JobError(f"the paged engine is not available here ({exc.__class__.__name__}: {exc}); use --engine hf") from exc
            log.info("engine: hf (auto: the paged engine cannot be imported: %s)", exc)
        else:
            return PagedEngine(adapter, config, hf_model)
    from vlmbatch.engine.hf import HFEngine

    return HFEngine(adapter, config, hf_model)
