"""The fixed part of the result schema and how input scalars are fitted to it.

Kept apart from `readers` and `writer` because both need it: readers must not pick
passthrough columns whose names collide with result columns, and the writer must fit
every input-derived value (id, passthrough scalars) to a declared type.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

ROW_ID_FIELD = pa.field("row_id", pa.int64(), nullable=False)

# The columns every result part ends with, in the order ARCHITECTURE.md promises; a
# structured job's `output` / `output_json` column goes right after `generated_text`.
GENERATED_TEXT_FIELD = pa.field("generated_text", pa.string())
RESULT_STATUS_FIELDS: tuple[pa.Field, ...] = (
    pa.field("finish_reason", pa.string()),
    pa.field("num_input_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("error_type", pa.string()),
    pa.field("error", pa.string()),
    pa.field("model", pa.string()),
    pa.field("shard_id", pa.int32()),
    pa.field("attempt", pa.int32()),
    pa.field("finished_at", pa.timestamp("us", tz="UTC")),
)
RESULT_TAIL_FIELDS: tuple[pa.Field, ...] = (GENERATED_TEXT_FIELD, *RESULT_STATUS_FIELDS)

# Columns of jobs that ask for them (`sampling_columns`): a job with n > 1 has one row per
# sample, numbered by `sample_index` (after the id); a job with logprobs has `logprobs`
# (after the generated text and any structured output).
SAMPLE_INDEX_FIELD = pa.field("sample_index", pa.int32())
_TOKEN_LOGPROB = [pa.field("token", pa.string()), pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())]
LOGPROBS_FIELD = pa.field(
    "logprobs", pa.list_(pa.struct([*_TOKEN_LOGPROB, pa.field("top_logprobs", pa.list_(pa.struct(_TOKEN_LOGPROB)))]))
)
SAMPLING_COLUMNS_KEY = "sampling_columns"  # manifest.extra[...]: the names of these columns the job has

# Input columns with these names are not passed through: they would shadow result columns.
RESERVED_NAMES = frozenset({"row_id", "id", "custom_id", SAMPLE_INDEX_FIELD.name, LOGPROBS_FIELD.name,
                            *(f.name for f in RESULT_TAIL_FIELDS)})


def sampling_columns(sampling: dict[str, Any], dataset_columns: list[str]) -> list[str]:
    """Which of `sample_index` / `logprobs` a job's parts have: the job's defaults ask for them,
    or its rows may (the dataset has an `n`, `logprobs` or `top_logprobs` column). Decided once,
    at submit, so every part of the job has the same schema."""
    names = []
    if (sampling.get("n") or 1) > 1 or "n" in dataset_columns:
        names.append(SAMPLE_INDEX_FIELD.name)
    if sampling.get("logprobs") is not None or {"logprobs", "top_logprobs"} & set(dataset_columns):
        names.append(LOGPROBS_FIELD.name)
    return names


def is_passthrough_type(arrow_type: pa.DataType) -> bool:
    """Flat scalars only: nested values and binary blobs (usually media) stay out of results."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return (
        pa.types.is_boolean(arrow_type)
        or pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
        or pa.types.is_decimal(arrow_type)
        or pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or pa.types.is_temporal(arrow_type)
    )


def infer_scalar_type(values: list[Any]) -> pa.DataType | None:
    """The Arrow type for a JSON column seen in a sample, or None when it is not a flat scalar.

    bool-only → bool; int-only → int64; int/float → float64; anything else that is
    scalar (strings, or a mix of strings and numbers) → string.
    """
    present = [v for v in values if v is not None]
    if any(isinstance(v, (dict, list)) for v in present):
        return None
    if not present:
        return pa.string()
    if all(isinstance(v, bool) for v in present):
        return pa.bool_()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pa.int64()
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.float64()
    return pa.string()


def coerce_scalar(value: Any, arrow_type: pa.DataType) -> Any:
    """Fit one input value to its column type; what does not fit becomes null.

    The policy, the same for every row and every part: string columns take any value
    (numbers and booleans as their JSON text, nested values as compact JSON); numeric
    and boolean columns take only values of their kind (ints widen to float), anything
    else becomes null. Types from a Parquet input already fit and pass unchanged.
    """
    if value is None:
        return None
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        if isinstance(value, str):
            return value
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    if pa.types.is_boolean(arrow_type):
        return value if isinstance(value, bool) else None
    if pa.types.is_integer(arrow_type):
        fits = isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
        return value if fits else None
    if pa.types.is_floating(arrow_type):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None
    return value
