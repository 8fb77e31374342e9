"""JSON Schema → Arrow type of the `output` column (the documented mapping), and generated text
fitted to it; anything Arrow cannot type makes the whole output a JSON string column."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from pydantic import BaseModel

from structured_harness import NESTED_SCHEMA
from vlmbatch.io.output_schema import (
    ENUM_TYPE,
    OUTPUT,
    OUTPUT_JSON,
    OutputMismatch,
    arrow_type_for_schema,
    job_output_column,
    manifest_entry,
    output_column,
)
from vlmbatch.structured.spec import parse_structured_output


def _struct(*fields: pa.Field) -> pa.StructType:
    return pa.struct(list(fields))


def test_nested_schema_maps_to_structs_lists_and_dictionary_enums():
    element = pa.field("element", _struct(pa.field("name", pa.string(), nullable=False), pa.field("qty", pa.int64(), nullable=False)), nullable=False)
    assert arrow_type_for_schema(NESTED_SCHEMA) == _struct(
        pa.field("vendor", pa.string(), nullable=False),
        pa.field("total", pa.float64(), nullable=False),
        pa.field("currency", ENUM_TYPE, nullable=False),
        pa.field("paid", pa.bool_()),  # not required: nullable
        pa.field("address", _struct(pa.field("city", pa.string(), nullable=False), pa.field("zip", pa.int64()))),
        pa.field("items", pa.list_(element), nullable=False),
        pa.field("note", pa.string()),  # ["string", "null"]
    )


@pytest.mark.parametrize(
    "schema, expected",
    [
        ({"type": "string", "format": "date"}, pa.string()),
        ({"type": "integer"}, pa.int64()),
        ({"enum": [1, 2, 3]}, pa.int64()),
        ({"enum": [1, 2.5]}, pa.float64()),
        ({"const": "x"}, ENUM_TYPE),
        ({"enum": ["a", None]}, ENUM_TYPE),
        ({"type": "array", "items": {"type": ["number", "null"]}}, pa.list_(pa.field("element", pa.float64()))),
        ({"properties": {"a": {"type": "boolean"}}}, _struct(pa.field("a", pa.bool_()))),  # object implied
        (
            {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}},
            _struct(pa.field("p", _struct(pa.field("x", pa.float64(), nullable=False)))),
        ),
        ({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["a"]}, _struct(pa.field("a", pa.int64()))),
        ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}, _struct(pa.field("a", pa.string()))),
    ],
)
def test_mapping(schema, expected):
    assert arrow_type_for_schema(schema) == expected


@pytest.mark.parametrize(
    "schema",
    [
        {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
        {"type": ["integer", "string"]},
        {"type": "object"},  # free-form
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
        {"type": "object", "properties": {}},
        {"type": "array"},
        {"type": "array", "prefixItems": [{"type": "integer"}]},
        {"enum": ["a", 1]},
        {"type": "null"},
        {},
        {"$ref": "https://example.com/schema.json"},
        {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"},
        {"type": "object", "properties": {"deep": {"type": "object", "properties": {"any": {}}}}},  # one untypable leaf
    ],
)
def test_untypable_schemas_fall_back_to_json_text_for_the_whole_output(schema):
    assert arrow_type_for_schema(schema) is None
    column = output_column(parse_structured_output({"guided_json": schema}), per_row=False)
    assert column.field == pa.field(OUTPUT, pa.string()) and column.json_text
    assert column.convert('{"a": 1}') == '{"a": 1}'
    with pytest.raises(OutputMismatch):
        column.convert('{"a": ')


def test_pydantic_optional_fields_are_nullable():
    class Invoice(BaseModel):
        vendor: str
        total: float | None = None

    assert arrow_type_for_schema(Invoice.model_json_schema()) == _struct(pa.field("vendor", pa.string(), nullable=False), pa.field("total", pa.float64()))


def test_convert_fits_values_and_refuses_what_does_not_fit():
    column = output_column(parse_structured_output({"guided_json": NESTED_SCHEMA}), per_row=False)
    text = json.dumps({"vendor": "Acme", "total": 3, "currency": "EUR", "items": [{"name": "nut", "qty": 2}], "note": None})
    assert column.convert(text) == {
        "vendor": "Acme", "total": 3.0, "currency": "EUR", "paid": None, "address": None,
        "items": [{"name": "nut", "qty": 2}], "note": None,
    }  # fmt: skip
    base = {"vendor": "Acme", "total": 1.5, "currency": "EUR", "items": []}
    for bad, reason in [
        ({**base, "vendor": None}, "vendor is null"),
        ({k: v for k, v in base.items() if k != "total"}, "total is null"),
        ({**base, "items": [{"name": "nut", "qty": 2**70}]}, r"items\[0\].qty"),
        ({**base, "items": [{"name": "nut", "qty": True}]}, r"items\[0\].qty"),
        ({**base, "paid": "yes"}, "paid"),
        ({**base, "extra": 1}, "unexpected keys"),
        ([base], "not an object"),
    ]:
        with pytest.raises(OutputMismatch, match=reason):
            column.convert(json.dumps(bad))
    with pytest.raises(OutputMismatch, match="not valid JSON"):
        column.convert('{"vendor": "Ac')


def test_columns_per_kind_and_per_row():
    choice = output_column(parse_structured_output({"guided_choice": ["yes", "no"]}), per_row=False)
    assert choice.field.type == ENUM_TYPE and choice.convert("yes") == "yes"
    with pytest.raises(OutputMismatch):
        choice.convert("maybe")
    free = output_column(parse_structured_output({"response_format": {"type": "json_object"}}), per_row=False)
    assert free.field.type == pa.string() and free.json_text
    assert output_column(parse_structured_output({"guided_regex": "a+"}), per_row=False) is None
    assert output_column(None, per_row=False) is None
    per_row = output_column(parse_structured_output({"guided_json": NESTED_SCHEMA}), per_row=True)
    assert per_row.name == OUTPUT_JSON and per_row.field.type == pa.string()
    spec = parse_structured_output({"guided_json": NESTED_SCHEMA})
    extra = json.loads(json.dumps({"structured_output": manifest_entry(spec, per_row=False)}))  # as the manifest stores it
    assert job_output_column(extra) == output_column(spec, per_row=False)
    assert job_output_column({}) is None
