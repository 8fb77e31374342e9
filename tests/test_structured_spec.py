"""Structured-output specs: every user-facing form parses into one canonical, hashable value."""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import BaseModel

from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.structured.spec import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    StructuredOutput,
    job_structured_output,
    parse_structured_output,
    resolve,
)

SCHEMA = {"type": "object", "properties": {"vendor": {"type": "string"}, "total": {"type": "number"}}, "required": ["vendor"]}


def _openai(schema=SCHEMA, **extra):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "invoice", "schema": schema, "strict": True, **extra}}}


def test_openai_json_schema_and_guided_json_are_one_value():
    openai = parse_structured_output(_openai())
    guided = parse_structured_output({"guided_json": SCHEMA})
    as_text = parse_structured_output({"guided_json": json.dumps(SCHEMA, indent=2)})
    assert openai.kind == JSON_SCHEMA and openai == guided == as_text
    assert hash(openai) == hash(guided) and len({openai, guided, as_text}) == 1
    assert openai.source == "response_format" and guided.source == "guided_json"  # named in errors, not compared
    assert openai.schema == SCHEMA
    assert list(openai.schema["properties"]) == ["vendor", "total"]  # generation order is kept, not sorted


def test_key_order_of_properties_makes_a_different_spec():
    reordered = {**SCHEMA, "properties": {"total": {"type": "number"}, "vendor": {"type": "string"}}}
    assert parse_structured_output({"guided_json": reordered}) != parse_structured_output({"guided_json": SCHEMA})


def test_pydantic_model_class_as_guided_json():
    class Invoice(BaseModel):
        vendor: str
        total: float

    spec = parse_structured_output({"guided_json": Invoice})
    assert spec.kind == JSON_SCHEMA and spec.schema["required"] == ["vendor", "total"]


def test_other_kinds():
    assert parse_structured_output({"response_format": {"type": "json_object"}}) == StructuredOutput(JSON_OBJECT)
    choice = parse_structured_output({"guided_choice": ["yes", "no"]})
    assert choice.kind == CHOICE and choice.choices == ["yes", "no"]
    assert parse_structured_output({"guided_choice": '["yes", "no"]'}) == choice  # a JSON-text column
    assert parse_structured_output({"guided_regex": r"\d+"}) == StructuredOutput(REGEX, r"\d+")
    assert parse_structured_output({"guided_grammar": 'root ::= "a"'}).kind == GRAMMAR
    assert parse_structured_output({"prompt": "hi"}) is None
    assert parse_structured_output({"response_format": None, "guided_json": None}) is None


def test_response_format_as_json_text_from_a_string_column():
    text = json.dumps(_openai()["response_format"])
    assert parse_structured_output({"response_format": text}) == parse_structured_output(_openai())


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "not json"}, "response_format"),
        ({"response_format": ["json_object"]}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "nmae": "typo"}}}, "response_format.json_schema"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": 7}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ],
)
def test_bad_specs_are_row_errors_naming_the_param(fields, param):
    with pytest.raises(RowError) as caught:
        parse_structured_output(fields, prefix="")
    assert caught.value.error_type == ErrorType.INVALID_ROW
    assert caught.value.param == param
    assert param.split(".")[0] in caught.value.message


def test_prefix_names_the_place_in_a_batch_body():
    with pytest.raises(RowError) as caught:
        parse_structured_output({"response_format": {"type": "xml"}}, prefix="body.")
    assert caught.value.param == "body.response_format.type"


def test_precedence_row_then_job_then_default():
    row, job, default = (StructuredOutput(REGEX, p) for p in ("row", "job", "default"))
    assert resolve(row, job, default) is row
    assert resolve(None, job, default) is job
    assert resolve(None, None, default) is default
    assert resolve(None, None, None) is None
    text = parse_structured_output({"response_format": {"type": "text"}})
    assert resolve(text, job, default) is None  # a row may opt out of the job's schema


def test_job_level_errors_are_job_errors_naming_where():
    with pytest.raises(JobError, match=r"--response-format: response_format.type: type must be"):
        job_structured_output({"response_format": {"type": "xml"}}, "--response-format")
    assert job_structured_output({"guided_choice": ["a", "b"]}, "job.yaml").kind == CHOICE


def test_round_trips_through_dict_and_pickle():
    spec = parse_structured_output(_openai())
    assert StructuredOutput.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and clone.source == spec.source
    with pytest.raises(ValueError):
        StructuredOutput("yaml")
