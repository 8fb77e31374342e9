"""The structured-output result column: its Arrow type from the job's spec, and values fitted to it.

A job with one JSON schema gets a column `output` typed from the schema, the same in every
part (so DuckDB, Polars and `results --merge` read `output.total` directly). The mapping:

| JSON schema | Arrow |
| --- | --- |
| `object` with `properties` (`additionalProperties` absent or false) | struct, fields in `properties` order |
| `array` with one `items` schema | list<element> |
| `string` (any `format`/`pattern`) | string |
| `integer` / `number` / `boolean` | int64 / float64 / bool |
| `enum` (or `const`) of strings | dictionary<int32, string> |
| `enum` of integers / numbers / booleans | int64 / float64 / bool |
| `type: [T, "null"]`, `anyOf`/`oneOf` of `[S, {"type": "null"}]` | S's type, nullable |
| `$ref` to `#/$defs/...` or `#/definitions/...` (not recursive) | the referenced schema's type |
| `allOf` of one schema | that schema's type |

A property is nullable unless it is `required` (and its own schema does not allow null).
Anything else anywhere in the schema (unions of other types, free-form objects: no
`properties`, or extra properties allowed; empty objects; tuples (`prefixItems`); other
`$ref`s or recursion; `null` alone; a schema without a type) makes the whole `output` a
JSON string column, since Arrow has no type for it. `json_object` jobs get the JSON string
column too, `guided_choice` jobs a dictionary string of the choice, and regex/grammar jobs
no `output` (their text is `generated_text`). Jobs whose rows may set their own spec (the
dataset has a `response_format` or `guided_*` column) get `output_json` instead: the JSON
text of each JSON-constrained row.

The shard runner puts the generated text of each constrained row under the column's name;
the writer (`OutputColumn.convert`) parses and fits it. Text that is not JSON, or JSON that
does not fit the type (e.g. an integer past int64), gives null and, unless the row already
failed (`structured_output_incomplete`), `error_type = structured_output_invalid`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from vlmbatch.structured.spec import CHOICE, JSON_OBJECT, JSON_SCHEMA, StructuredOutput

OUTPUT = "output"
OUTPUT_JSON = "output_json"
MANIFEST_KEY = "structured_output"  # manifest.extra[MANIFEST_KEY] = manifest_entry(...)

ENUM_TYPE = pa.dictionary(pa.int32(), pa.string())
_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
_LOCAL_REF_PREFIXES = ("#/$defs/", "#/definitions/")


class Untypable(Exception):
    """A schema construct Arrow cannot type; the whole output becomes JSON text."""


class OutputMismatch(ValueError):
    """Generated text that is not JSON or does not fit the column's type."""


def _is_null_schema(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null" and len(node) == 1


class _SchemaTyper:
    """One walk over a schema; `$defs` are looked up from its root."""

    def __init__(self, root: Mapping[str, Any]):
        self.root = root
        self.resolving: list[str] = []

    def type_of(self, node: Any) -> tuple[pa.DataType, bool]:
        """(Arrow type, whether the schema itself allows null)."""
        if not isinstance(node, dict):
            raise Untypable("a boolean schema")
        if "$ref" in node:
            return self._ref(node["$ref"])
        for union in ("anyOf", "oneOf"):
            if union in node:
                options = node[union]
                others = [option for option in options if not _is_null_schema(option)]
                if len(options) != 2 or len(others) != 1:
                    raise Untypable(f"{union} other than [S, null]")
                return self.type_of(others[0])[0], True
        if "allOf" in node:
            if len(node["allOf"]) != 1:
                raise Untypable("allOf of several schemas")
            return self.type_of(node["allOf"][0])
        if "enum" in node or "const" in node:
            return self._values(node["enum"] if "enum" in node else [node["const"]])
        kind = node.get("type", "object" if "properties" in node else None)
        nullable = False
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            if len(kinds) != 1:
                raise Untypable(f"type {kind}")
            kind, nullable = kinds[0], len(kinds) < len(kind)
        if kind in _SCALARS:
            return _SCALARS[kind], nullable
        if kind == "array":
            return self._array(node), nullable
        if kind == "object":
            return self._object(node), nullable
        raise Untypable(f"type {kind!r}")

    def _ref(self, ref: str) -> tuple[pa.DataType, bool]:
        prefix = next((p for p in _LOCAL_REF_PREFIXES if isinstance(ref, str) and ref.startswith(p)), None)
        if prefix is None or ref in self.resolving:
            raise Untypable(f"$ref {ref!r}")
        target = self.root.get(prefix[2:-1], {}).get(ref[len(prefix):])
        if target is None:
            raise Untypable(f"$ref {ref!r} not found")
        self.resolving.append(ref)
        try:
            return self.type_of(target)
        finally:
            self.resolving.pop()

    @staticmethod
    def _values(values: list[Any]) -> tuple[pa.DataType, bool]:
        present = [v for v in values if v is not None]
        nullable = len(present) < len(values)
        if present and all(isinstance(v, str) for v in present):
            return ENUM_TYPE, nullable
        if present and all(isinstance(v, bool) for v in present):
            return pa.bool_(), nullable
        if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            return pa.int64(), nullable
        if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            return pa.float64(), nullable
        raise Untypable("an enum of mixed or nested values")

    def _array(self, node: Mapping[str, Any]) -> pa.DataType:
        if "prefixItems" in node or not isinstance(node.get("items"), dict):
            raise Untypable("an array without one items schema")
        item_type, item_nullable = self.type_of(node["items"])
        return pa.list_(pa.field("element", item_type, nullable=item_nullable))

    def _object(self, node: Mapping[str, Any]) -> pa.DataType:
        properties = node.get("properties")
        if not properties or node.get("additionalProperties", False) is not False or "patternProperties" in node:
            raise Untypable("a free-form object")
        required = set(node.get("required", ()))
        fields = []
        for name, child in properties.items():
            child_type, child_nullable = self.type_of(child)
            fields.append(pa.field(name, child_type, nullable=child_nullable or name not in required))
        return pa.struct(fields)


def arrow_type_for_schema(schema: Mapping[str, Any]) -> pa.DataType | None:
    """The typed Arrow type of `schema`, or None when its outputs must be stored as JSON text."""
    try:
        return _SchemaTyper(schema).type_of(dict(schema))[0]
    except Untypable:
        return None


def _fit(value: Any, arrow_type: pa.DataType, nullable: bool, where: str) -> Any:
    """`value` (parsed JSON) as the Python value pyarrow stores in `arrow_type`."""
    if value is None:
        if not nullable:
            raise OutputMismatch(f"{where or 'output'} is null")
        return None
    if pa.types.is_struct(arrow_type):
        if not isinstance(value, dict):
            raise OutputMismatch(f"{where or 'output'} is not an object")
        extra = set(value) - {f.name for f in arrow_type}
        if extra:
            raise OutputMismatch(f"{where or 'output'} has unexpected keys {sorted(extra)}")
        return {f.name: _fit(value.get(f.name), f.type, f.nullable, f"{where}.{f.name}".lstrip(".")) for f in arrow_type}
    if pa.types.is_list(arrow_type):
        if not isinstance(value, list):
            raise OutputMismatch(f"{where or 'output'} is not an array")
        item = arrow_type.value_field
        return [_fit(v, item.type, item.nullable, f"{where}[{i}]") for i, v in enumerate(value)]
    if pa.types.is_boolean(arrow_type):
        ok = isinstance(value, bool)
    elif pa.types.is_integer(arrow_type):
        ok = isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    elif pa.types.is_floating(arrow_type):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:  # string or dictionary<string>
        ok = isinstance(value, str)
    if not ok:
        raise OutputMismatch(f"{where or 'output'} = {json.dumps(value)[:40]} does not fit {arrow_type}")
    return value


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise OutputMismatch(f"not valid JSON: {exc}") from None


@dataclass(frozen=True)
class OutputColumn:
    """The structured-output column of one job: its field and how generated text becomes its value."""

    field: pa.Field
    json_text: bool  # the column holds the JSON text itself (no Arrow type for the schema, or per-row schemas)
    choices: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.field.name

    def convert(self, text: str) -> Any:
        """The column's value for one constrained row's generated text; raises `OutputMismatch`."""
        if self.choices:
            if text not in self.choices:
                raise OutputMismatch(f"{text[:40]!r} is not one of the choices")
            return text
        value = _parse(text)
        return text if self.json_text else _fit(value, self.field.type, True, "")


@functools.lru_cache(maxsize=64)
def output_column(spec: StructuredOutput | None, per_row: bool) -> OutputColumn | None:
    """The column a job gets (None: none). `per_row`: rows may set their own spec. Cached: the
    writer asks for every row, and a spec is hashable."""
    if per_row:
        return OutputColumn(pa.field(OUTPUT_JSON, pa.string()), json_text=True)
    if spec is None:
        return None
    if spec.kind == CHOICE:
        return OutputColumn(pa.field(OUTPUT, ENUM_TYPE), json_text=False, choices=tuple(spec.choices))
    if spec.kind == JSON_OBJECT:
        return OutputColumn(pa.field(OUTPUT, pa.string()), json_text=True)
    if spec.kind == JSON_SCHEMA:
        typed = arrow_type_for_schema(spec.schema)
        return OutputColumn(pa.field(OUTPUT, typed or pa.string()), json_text=typed is None)
    return None


def manifest_entry(spec: StructuredOutput | None, per_row: bool) -> dict[str, Any]:
    """What `plan_job` stores in `manifest.extra[MANIFEST_KEY]` (the workers' and the writer's source)."""
    return {"spec": spec.to_dict() if spec is not None else None, "per_row": per_row}


def job_spec(extra: Mapping[str, Any]) -> StructuredOutput | None:
    """The job-level spec of a job, from its manifest's `extra` (None: none)."""
    entry = extra.get(MANIFEST_KEY) or {}
    return StructuredOutput.from_dict(entry["spec"]) if entry.get("spec") else None


def job_output_column(extra: Mapping[str, Any]) -> OutputColumn | None:
    """The output column of a job, from its manifest's `extra`."""
    entry = extra.get(MANIFEST_KEY)
    if not entry:
        return None
    return output_column(job_spec(extra), bool(entry.get("per_row")))


def structured_text(column: OutputColumn | None, spec: StructuredOutput | None, text: str) -> dict[str, str]:
    """What the shard runner puts in a result row for the output column: the generated text
    of a constrained row (`output_json` holds JSON-kind rows only), else nothing."""
    if column is None or spec is None:
        return {}
    if column.name == OUTPUT_JSON and spec.kind not in (JSON_SCHEMA, JSON_OBJECT):
        return {}
    return {column.name: text}
