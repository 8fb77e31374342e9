"""vlmbatch: batch-offline inference for vision-language models.

`LLM` and `SamplingParams` are imported lazily, so `import vlmbatch` stays cheap for the
CLI, the workers and tools that never load a model.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("vlmbatch")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from vlmbatch.engine.llm import LLM
    from vlmbatch.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]

_LAZY = {"LLM": "vlmbatch.engine.llm", "SamplingParams": "vlmbatch.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlmbatch' has no attribute {name!r}")
