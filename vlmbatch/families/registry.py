"""The model families vlmbatch runs: one record each, and the loaders that start from them.

A family is recognised from `config.json`'s `model_type`, so a local folder, a hub id and
a tiny test checkpoint all take the same path; anything unknown fails at submit time with
a `JobError` instead of failing every row later. Each record names the package that holds
everything specific to the family (`vlmbatch/families/<name>/`), which exports:

- `ADAPTER`: the `ModelAdapter` subclass (prompts, chat template, processor, media items);
- `ENGINE_MODEL`: the `VisionLanguageModel` subclass of the paged engine (vision tower
  hookup, prompt positions, decoder specifics);
- `make_tiny_checkpoint(dir, seed)`: a tiny random-weight checkpoint in Hugging Face layout.

The package is imported only when the family is used, so `import vlmbatch` stays light.
Adding a family is its folder, one line in `FAMILIES`, its tests and docs
(docs/adding-a-family.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from vlmbatch.errors import JobError
from vlmbatch.quantization import checkpoint_scheme

IMAGES, VIDEO, MOE = "images", "video", "moe"


@dataclass(frozen=True)
class Family:
    """One model family: its name, the `model_type`s it covers, what it can do, and its package."""

    name: str
    model_types: tuple[str, ...]
    capabilities: frozenset[str]
    package: str

    def supports(self, capability: str) -> bool:
        return capability in self.capabilities

    def parts(self) -> ModuleType:
        """The family's package (`ADAPTER`, `ENGINE_MODEL`, `make_tiny_checkpoint`), imported now."""
        return importlib.import_module(self.package)


def _family(name: str, capabilities: set[str], model_types: tuple[str, ...] | None = None) -> Family:
    return Family(name, model_types or (name,), frozenset(capabilities), f"vlmbatch.families.{name}")


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("qwen2_5_vl", {IMAGES, VIDEO}),
        _family("qwen2_vl", {IMAGES, VIDEO}),
        _family("llava", {IMAGES}),
        _family("qwen3_vl", {IMAGES, VIDEO}),
        _family("qwen3_vl_moe", {IMAGES, VIDEO, MOE}),
        _family("internvl", {IMAGES, VIDEO}),
        _family("idefics3", {IMAGES}),
        _family("smolvlm", {IMAGES, VIDEO}),
        _family("gemma3", {IMAGES}),
        _family("llava_next", {IMAGES}),
        _family("llava_onevision", {IMAGES, VIDEO}),
    )
}
_BY_MODEL_TYPE = {model_type: f for f in FAMILIES.values() for model_type in f.model_types}


def family_of(config: Any, model: str = "") -> Family:
    """The family of a loaded HF config, or a `JobError` listing the supported ones."""
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        supported = ", ".join(sorted(_BY_MODEL_TYPE))
        raise JobError(f"unsupported model type {config.model_type!r}{f' for {model}' if model else ''}; supported: {supported}")
    return family


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or Path(model).expanduser().exists()


def load_config(model: str, trust_remote_code: bool = False) -> Any:
    """`AutoConfig` for `model`, or `JobError("model not found: ...")`, or an
    `UnsupportedQuantization` (a `JobError`) for a quantization format we do not run."""
    from transformers import AutoConfig

    if _looks_local(model) and not Path(model).expanduser().is_dir():
        raise JobError(f"model not found: {model} (no such folder)")
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise JobError(f"model not found: {model} ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from exc
    checkpoint_scheme(quantization_config(config), model)  # an FP8 format we do not run is refused here, named
    return config


def quantization_config(config: Any) -> dict | None:
    """A loaded config's `quantization_config` as a dict (transformers may hold an object)."""
    qc = getattr(config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def model_family(model: str, trust_remote_code: bool = False) -> Family:
    """The supported family of `model`, or a `JobError` saying why not."""
    return family_of(load_config(str(model), trust_remote_code), str(model))


def _read_chat_template(chat_template: str) -> str:
    """A chat template given as a file path or as the template text itself."""
    path = Path(chat_template).expanduser()
    if "{" not in chat_template and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in chat_template:
        raise JobError(f"chat template not found: {chat_template}")
    return chat_template


def load_adapter(model: str, chat_template: str | None = None, trust_remote_code: bool = False) -> Any:
    """The family adapter (a `ModelAdapter`) for `model` (hub id or local folder), with its own processor."""
    from transformers import AutoProcessor

    model = str(model)
    config = load_config(model, trust_remote_code)
    family = family_of(config, model)
    try:
        processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a package the processor needs (SmolVLM: num2words)
        raise JobError(f"cannot load the processor of {model}: {str(exc).splitlines()[0]}") from exc
    if chat_template is not None:
        processor.chat_template = _read_chat_template(chat_template)
    return family.parts().ADAPTER(model, processor, config, family)
