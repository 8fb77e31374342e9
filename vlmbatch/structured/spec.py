"""Structured-output specs: what the user asked the generated text to look like, as one value.

Users say it in several forms, and every entry point (a dataset row, an OpenAI Batch body,
a `serve` request, `SamplingParams`, `submit` flags, a job file) parses it here into one
frozen, hashable `StructuredOutput(kind, text)`:

- OpenAI's `response_format`: `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`, `{"type": "json_object"}` and `{"type": "text"}` (explicitly unconstrained);
- vLLM's names: `guided_json` (a schema), `guided_choice` (a list of strings),
  `guided_regex` and `guided_grammar` (xgrammar EBNF with a `root` rule).

`text` is canonical (a schema as compact JSON with its key order kept, because property
order is the order fields are generated in), so equal specs compile once and give the
same typed result column. Only one of the keys may be set in one place; the precedence
row > job > default is `resolve`.

`strict` is accepted and ignored: the grammar always enforces the schema, and properties
a schema does not list are not generated (xgrammar's strict mode), as OpenAI's strict mode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vlmbatch.errors import ErrorType, JobError, RowError

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
CHOICE = "choice"
REGEX = "regex"
GRAMMAR = "grammar"
TEXT = "text"  # said explicitly: no constraint (a row's way to opt out of the job's schema)
KINDS = (JSON_SCHEMA, JSON_OBJECT, CHOICE, REGEX, GRAMMAR, TEXT)

# The keys users write, in the order an error lists them.
GUIDED_KEYS = ("guided_json", "guided_choice", "guided_regex", "guided_grammar")
STRUCTURED_KEYS = ("response_format", *GUIDED_KEYS)

_RESPONSE_FORMAT_KEYS = frozenset({"type", "json_schema"})
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint. Equality and hash are (kind, text): `source` (the key the user wrote,
    named in error messages) does not make two equal specs compile twice."""

    kind: str
    text: str = ""
    source: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured-output kind {self.kind!r}; expected one of {KINDS}")

    @property
    def constrained(self) -> bool:
        return self.kind != TEXT

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a `json_schema` spec (a fresh dict each call)."""
        return json.loads(self.text) if self.kind == JSON_SCHEMA else None

    @property
    def choices(self) -> list[str] | None:
        return json.loads(self.text) if self.kind == CHOICE else None

    def to_dict(self) -> dict[str, str]:
        """For manifests and JSON transports (the dataclass also pickles as is)."""
        return {"kind": self.kind, "text": self.text, "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StructuredOutput":
        return cls(kind=data["kind"], text=data.get("text", ""), source=data.get("source", "response_format"))


UNCONSTRAINED = StructuredOutput(TEXT)


def resolve(*candidates: StructuredOutput | None) -> StructuredOutput | None:
    """The spec that applies, given them in precedence order (row, job, default): the first
    one said wins, and a winning `{"type": "text"}` means unconstrained (None)."""
    for spec in candidates:
        if spec is not None:
            return spec if spec.constrained else None
    return None


def _invalid(message: str, param: str) -> RowError:
    return RowError(ErrorType.INVALID_ROW, f"{param}: {message}", param)


def _json_value(value: Any, param: str) -> Any:
    """Rows from Parquet/CSV-minded exports may hold objects as JSON text."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise _invalid(f"not valid JSON: {exc}", param) from None
    return value


def _schema_text(schema: Any, param: str) -> str:
    if hasattr(schema, "model_json_schema"):  # a pydantic model class, as vLLM's guided_json takes
        schema = schema.model_json_schema()
    schema = _json_value(schema, param)
    if not isinstance(schema, dict):
        raise _invalid(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _invalid(f"schema is not JSON-serialisable: {exc}", param) from None


def _unknown_keys(value: Mapping[str, Any], allowed: frozenset[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _invalid(f"unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(sorted(allowed))}", param)


def _response_format(value: Any, param: str) -> StructuredOutput:
    value = _json_value(value, param)
    if not isinstance(value, dict):
        raise _invalid(f"must be an object like {{\"type\": \"json_object\"}}, got {type(value).__name__}", param)
    _unknown_keys(value, _RESPONSE_FORMAT_KEYS, param)
    kind = value.get("type")
    if kind == TEXT:
        return StructuredOutput(TEXT, source=param)
    if kind == JSON_OBJECT:
        return StructuredOutput(JSON_OBJECT, source=param)
    if kind != JSON_SCHEMA:
        raise _invalid(f"type must be 'json_schema', 'json_object' or 'text', got {kind!r}", f"{param}.type")
    wrapper = value.get("json_schema")
    inner = f"{param}.json_schema"
    if not isinstance(wrapper, dict):
        raise _invalid("must be an object with a 'schema'", inner)
    _unknown_keys(wrapper, _JSON_SCHEMA_KEYS, inner)
    if "name" in wrapper and not isinstance(wrapper["name"], str):
        raise _invalid("name must be a string", f"{inner}.name")
    if "strict" in wrapper and not isinstance(wrapper["strict"], (bool, type(None))):
        raise _invalid("strict must be a boolean", f"{inner}.strict")
    if wrapper.get("schema") is None:
        raise _invalid("a schema is required", f"{inner}.schema")
    return StructuredOutput(JSON_SCHEMA, _schema_text(wrapper["schema"], f"{inner}.schema"), source=param)


def _guided_json(value: Any, param: str) -> StructuredOutput:
    return StructuredOutput(JSON_SCHEMA, _schema_text(value, param), source=param)


def _guided_choice(value: Any, param: str) -> StructuredOutput:
    value = _json_value(value, param) if isinstance(value, str) and value.lstrip().startswith("[") else value
    if not isinstance(value, (list, tuple)) or not value:
        raise _invalid("must be a non-empty list of strings", param)
    if not all(isinstance(choice, str) and choice for choice in value):
        raise _invalid("every choice must be a non-empty string", param)
    return StructuredOutput(CHOICE, json.dumps(list(value), ensure_ascii=False), source=param)


def _text_spec(kind: str):
    def parse(value: Any, param: str) -> StructuredOutput:
        if not isinstance(value, str) or not value:
            raise _invalid("must be a non-empty string", param)
        return StructuredOutput(kind, value, source=param)

    return parse


_PARSERS = {
    "response_format": _response_format,
    "guided_json": _guided_json,
    "guided_choice": _guided_choice,
    "guided_regex": _text_spec(REGEX),
    "guided_grammar": _text_spec(GRAMMAR),
}


def parse_structured_output(fields: Mapping[str, Any], prefix: str = "") -> StructuredOutput | None:
    """The spec `fields` (a row, a request body, a job file) sets under `STRUCTURED_KEYS`, or
    None when it sets none. `prefix` goes before the key in `param` (e.g. "body.").
    Raises `RowError(INVALID_ROW, ..., param=<key>)` for a malformed one or for two at once."""
    given = [key for key in STRUCTURED_KEYS if fields.get(key) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RowError(ErrorType.INVALID_ROW, f"set only one of {', '.join(given)}", prefix + given[1])
    key = given[0]
    return _PARSERS[key](fields[key], prefix + key)


def job_structured_output(fields: Mapping[str, Any], where: str) -> StructuredOutput | None:
    """A job-level spec (flags or job file): the same parsing, but a bad one is a `JobError`
    naming `where` (e.g. "--response-format", "job.yaml"), raised at submit."""
    try:
        return parse_structured_output(fields)
    except RowError as exc:
        raise JobError(f"{where}: {exc.message}") from None
