"""Job files: `vlmbatch submit job.yaml` (or `.yml`, `.toml`), every `submit` flag as a key.

```yaml
dataset: invoices.jsonl        # paths are relative to this file
model: Qwen/Qwen2.5-VL-3B-Instruct   # "./..." or "../..." is a path relative to this file
output: out
shard_size: 100                # also: broker, wait, dry_run, chat_template (a file)
sampling: {max_tokens: 256, temperature: 0, top_p: 1, top_k: 0, seed: 1, stop: ["\\n\\n"]}
# also sampling: n, presence_penalty, frequency_penalty, repetition_penalty, min_tokens,
# logit_bias ({token id: bias}), logprobs (how many top logprobs; 0: the chosen token's only)
columns: {id: id, prompt: prompt, messages: messages, image: image, images: images, video: video}
media_io_kwargs: {video: {num_frames: 8}}
engine: {name: paged, dtype: auto, device: auto, gpu_image_decode: auto}
json_schema: schema.json       # or response_format: {...}, or guided_json / guided_choice / guided_regex / guided_grammar
```

The file gives the value of each option the command line does not: command-line flags win
over the file, and the file over `VLMBATCH_*` variables and defaults. Values are checked
here (Typer checks only flags); an unknown key is refused with its name, before anything
is written. The structured-output keys become the `--response-format` value (an OpenAI
`response_format` object, or `{"guided_choice": [...]}` and the like), `json_schema`
the `--json-schema` file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vlmbatch.errors import JobError
from vlmbatch.structured.spec import STRUCTURED_KEYS

JOB_FILE_SUFFIXES = (".yaml", ".yml", ".toml")


def is_job_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() in JOB_FILE_SUFFIXES


def _expect(kinds: tuple[type, ...], label: str) -> Callable[[Any, str, Path], Any]:
    """A check that the value is of `kinds` (booleans only where bool is one: YAML's `yes` is not 1)."""

    def check(value: Any, key: str, base: Path) -> Any:
        if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
            raise JobError(f"{key} must be {label}, got {value!r}")
        return value

    return check


_text = _expect((str,), "a string")
_integer = _expect((int,), "an integer")
_number = _expect((int, float), "a number")
_flag = _expect((bool,), "true or false")


def _path(value: Any, key: str, base: Path) -> str:
    """Relative paths are taken from the file's folder; URLs (s3://...) stay as written."""
    value = _text(value, key, base)
    return value if "://" in value else str(base / value)


def _model(value: Any, key: str, base: Path) -> str:
    """A Hub id stays as written; an explicitly relative path is taken from the file's folder."""
    value = _text(value, key, base)
    return str(base / value) if value.startswith(("./", "../")) else value


def _stop(value: Any, key: str, base: Path) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise JobError(f"{key} must be a string or a list of strings, got {value!r}")
    return values


def _json_object(value: Any, key: str, base: Path) -> str:
    if not isinstance(value, Mapping):
        raise JobError(f"{key} must be a mapping, got {value!r}")
    return json.dumps(value)


# Key in the file → (submit parameter, check-and-convert); sections hold nested keys. Every
# `submit` flag has one (tests/test_jobfile.py holds the two lists together).
KEYS: dict[str, tuple[str, Callable[[Any, str, Path], Any]]] = {
    "dataset": ("dataset", _path),
    "model": ("model", _model),
    "output": ("output", _path),
    "broker": ("broker", _text),
    "shard_size": ("shard_size", _integer),
    "wait": ("wait", _flag),
    "dry_run": ("dry_run", _flag),
    "chat_template": ("chat_template", _path),
    "media_io_kwargs": ("media_io_kwargs", _json_object),
    "json_schema": ("json_schema", _path),
    "sampling.max_tokens": ("max_tokens", _integer),
    "sampling.temperature": ("temperature", _number),
    "sampling.top_p": ("top_p", _number),
    "sampling.top_k": ("top_k", _integer),
    "sampling.seed": ("seed", _integer),
    "sampling.stop": ("stop", _stop),
    "sampling.n": ("n", _integer),
    "sampling.presence_penalty": ("presence_penalty", _number),
    "sampling.frequency_penalty": ("frequency_penalty", _number),
    "sampling.repetition_penalty": ("repetition_penalty", _number),
    "sampling.min_tokens": ("min_tokens", _integer),
    "sampling.logit_bias": ("logit_bias", _json_object),
    "sampling.logprobs": ("logprobs", _integer),
    **{f"columns.{name}": (f"{name}_column", _text) for name in ("id", "prompt", "messages", "image", "images", "video")},
    "engine.name": ("engine", _text),
    "engine.dtype": ("dtype", _text),
    "engine.device": ("device", _text),
    "engine.gpu_image_decode": ("gpu_image_decode", _text),
    "engine.attention_backend": ("attention_backend", _text),
    "engine.quantization": ("quantization", _text),
    "engine.quantize_vision": ("quantize_vision", _flag),
    "engine.kv_cache_dtype": ("kv_cache_dtype", _text),
    "storage_options": ("storage_options", _json_object),
}
_SECTIONS = frozenset(key.split(".")[0] for key in KEYS if "." in key)


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobError(f"cannot read this job file: {exc.strerror or exc}") from None
    if path.suffix.lower() == ".toml":
        import tomllib  # Python 3.11+

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise JobError(f"not valid TOML: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise JobError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobError(f"a job file holds a mapping of options, got {type(data).__name__}")
    return data


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """{"sampling": {"max_tokens": 8}} → {"sampling.max_tokens": 8}; structured-output keys and
    `media_io_kwargs` stay whole (their values are mappings themselves)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise JobError(f"{key} must be a mapping, got {value!r}")
            flat.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            flat[key] = value
    return flat


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The submit options a job file sets, by submit parameter name (unset keys are absent)."""
    path = Path(path)
    try:
        return _options(_read(path), path.resolve().parent)
    except JobError as exc:
        raise JobError(f"{path}: {exc}") from None


def _options(data: Mapping[str, Any], base: Path) -> dict[str, Any]:
    options: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    for key, value in _flatten(data).items():
        if value is None:
            continue
        if key in STRUCTURED_KEYS:
            structured[key] = value
            continue
        if key not in KEYS:
            raise JobError(f"unknown key {key!r}; known keys: {', '.join([*KEYS, *STRUCTURED_KEYS])}")
        parameter, convert = KEYS[key]
        options[parameter] = convert(value, key, base)
    if len(structured) > 1:
        raise JobError(f"set only one of {', '.join(structured)}")
    if "response_format" in structured:
        options["response_format"] = json.dumps(structured["response_format"])
    elif structured:
        options["response_format"] = json.dumps(structured)  # {"guided_choice": [...]}, as the flag takes it
    if "dataset" not in options:
        raise JobError("needs a 'dataset' key")
    if is_job_file(options["dataset"]):
        raise JobError(f"dataset {options['dataset']} is itself a job file")
    return options


def apply_job_file(path: str | Path, params: Mapping[str, Any], given: set[str]) -> dict[str, Any]:
    """`params` (submit's arguments) with the file's values for every option not in `given`
    (those set on the command line); the dataset is the file's."""
    merged = dict(params)
    for name, value in load_job_file(path).items():
        if name == "dataset" or name not in given:
            merged[name] = value
    return merged
