"""Turn one raw dataset row into a validated request description.

This is the single place that knows the input-row contract (ARCHITECTURE.md): `id`,
`prompt` or `messages`, media in `image` / `images` / `video`, per-row sampling
overrides, `media_io_kwargs` and `mm_processor_kwargs`. Everything here is cheap and pure (no media I/O),
so the dry-run, the shard runner and the preprocessing pool all share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from vlmbatch.chat import checked_text
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.structured.spec import parse_structured_output, resolve

# A row's own sampling columns, over the job's defaults (submit flags / the job file's
# `sampling` keys, which take the same names). `logprobs` is OpenAI's boolean or, as in
# vLLM, the number of top logprobs; `top_logprobs` (OpenAI) sets that number too.
SAMPLING_OVERRIDE_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "presence_penalty",
                          "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "logprobs", "top_logprobs")


@dataclass
class RowRequest:
    """A row after validation: text or chat messages, media references, sampling."""

    row_id: int
    id: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    image_refs: list[Any] = field(default_factory=list)
    video_refs: list[Any] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # the model's processor options (the family checks them)


def _text(value: Any, column: str) -> str:
    """Accept str, or bytes that are valid UTF-8; anything else is a row error."""
    if isinstance(value, str):
        return checked_text(value, column)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowError(ErrorType.INVALID_ROW, f"column {column!r} is not valid UTF-8: {exc}", column)
    raise RowError(ErrorType.INVALID_ROW, f"column {column!r} must be text, got {type(value).__name__}", column)


def _json_value(value: Any, column: str) -> Any:
    """Columns holding lists/dicts may arrive as JSON strings (CSV-minded exports)."""
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise RowError(ErrorType.INVALID_ROW, f"column {column!r} is not valid JSON: {exc}", column)
    return value


def _media_list(value: Any, column: str, many: bool) -> list[Any]:
    if value is None:
        return []
    if many:
        if isinstance(value, (list, tuple)):
            return [v for v in value if v is not None]
        raise RowError(ErrorType.INVALID_ROW, f"column {column!r} must be a list of media", column)
    return [value]


def sampling_for_row(raw: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """Apply the row's own sampling columns on top of the job defaults."""
    overrides = {k: raw.get(k) for k in SAMPLING_OVERRIDE_KEYS if raw.get(k) is not None}
    if not overrides:
        return defaults
    if "stop" in overrides and isinstance(overrides["stop"], str):
        overrides["stop"] = (overrides["stop"],)
    if "logit_bias" in overrides:
        overrides["logit_bias"] = _json_value(overrides["logit_bias"], "logit_bias")
    overrides.update(logprobs_override(overrides.pop("logprobs", None), overrides.pop("top_logprobs", None)))
    try:
        return defaults.updated(**overrides)
    except TypeError as exc:
        raise RowError(ErrorType.INVALID_ROW, f"bad sampling override: {exc}")


def structured_for_row(raw: dict[str, Any], sampling: SamplingParams) -> SamplingParams:
    """The row's own `response_format` / `guided_*` over the job's spec (`defaults`' one):
    row > job > default; a row's `{"type": "text"}` runs it unconstrained."""
    row_spec = parse_structured_output(raw)
    if row_spec is None:
        return sampling
    return replace(sampling, structured_output=resolve(row_spec, sampling.structured_output))


def logprobs_override(logprobs: Any, top_logprobs: Any) -> dict[str, Any]:
    """OpenAI's `logprobs: true` + `top_logprobs: k`, or vLLM's `logprobs: k`, as `SamplingParams.logprobs`
    ({} when neither asks for them; a bad value is left for `SamplingParams` to refuse)."""
    if logprobs is False or (logprobs is None and top_logprobs is None):
        return {}
    if top_logprobs is not None:
        return {"logprobs": top_logprobs}
    return {"logprobs": 0 if logprobs is True else logprobs}


def parse_row(row_id: int, raw: dict[str, Any], columns: Any, defaults: SamplingParams) -> RowRequest:
    """Validate `raw` against the column mapping `columns` (an `io.readers.ColumnMap`)."""
    if not isinstance(raw, dict):
        raise RowError(ErrorType.INVALID_ROW, f"row must be an object, got {type(raw).__name__}")
    row_key = raw.get(columns.id)
    prompt_value = raw.get(columns.prompt)
    messages_value = raw.get(columns.messages)
    prompt = messages = None
    if messages_value is not None:
        messages = _json_value(messages_value, columns.messages)
        if not isinstance(messages, list) or not messages:
            raise RowError(ErrorType.INVALID_ROW, "messages must be a non-empty list", columns.messages)
    elif prompt_value is not None:
        prompt = _text(prompt_value, columns.prompt)
        if not prompt.strip():
            raise RowError(ErrorType.PROMPT_EMPTY, "prompt is empty", columns.prompt)
    else:
        raise RowError(ErrorType.PROMPT_EMPTY, f"row has neither {columns.prompt!r} nor {columns.messages!r}")

    images = _media_list(raw.get(columns.image), columns.image, many=False)
    images += _media_list(_json_value_if_text_list(raw.get(columns.images)), columns.images, many=True)
    videos = _media_list(raw.get(columns.video), columns.video, many=False)

    media_io_kwargs, mm_processor_kwargs = _object(raw, "media_io_kwargs"), _object(raw, "mm_processor_kwargs")

    return RowRequest(
        row_id=row_id,
        id=None if row_key is None else str(row_key),
        prompt=prompt,
        messages=messages,
        image_refs=images,
        video_refs=videos,
        sampling=structured_for_row(raw, sampling_for_row(raw, defaults)),
        media_io_kwargs=media_io_kwargs,
        mm_processor_kwargs=mm_processor_kwargs,
    )


def _object(raw: dict[str, Any], column: str) -> dict[str, Any] | None:
    """An optional mapping column (a dict, or a JSON object in a string column)."""
    value = raw.get(column)
    if value is None:
        return None
    value = _json_value(value, column)
    if not isinstance(value, dict):
        raise RowError(ErrorType.INVALID_ROW, f"{column} must be an object", column)
    return value


def _json_value_if_text_list(value: Any) -> Any:
    """`images` may be a JSON array in a string column; a plain path string is one image."""
    if isinstance(value, str):
        stripped = value.lstrip()
        if stripped.startswith("["):
            return _json_value(value, "images")
        return [value]
    return value
