"""Job files: YAML and TOML, every key checked, relative paths from the file, flags win."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vlmbatch.errors import JobError
from vlmbatch.job.jobfile import apply_job_file, is_job_file, load_job_file

YAML = """
dataset: data/rows.jsonl
model: ./models/tiny
output: out
shard_size: 10
wait: true
sampling: {max_tokens: 32, temperature: 0.5, top_p: 0.9, top_k: 5, seed: 3, stop: "###"}
columns: {id: key, image: picture}
media_io_kwargs: {video: {num_frames: 4}}
engine: {name: hf, dtype: float32, device: cpu, gpu_image_decode: "off"}
json_schema: schema.json
"""

TOML = """
dataset = "rows.jsonl"
model = "Qwen/Qwen2.5-VL-3B-Instruct"
guided_choice = ["yes", "no"]

[sampling]
max_tokens = 4
stop = ["a", "b"]
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_keys_map_to_submit_options_with_paths_from_the_file(tmp_path: Path) -> None:
    job = _write(tmp_path, "job.yaml", YAML)
    base = tmp_path.resolve()
    assert load_job_file(job) == {
        "dataset": str(base / "data/rows.jsonl"), "model": str(base / "models/tiny"), "output": str(base / "out"), "shard_size": 10,
        "wait": True, "max_tokens": 32, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["###"],
        "id_column": "key", "image_column": "picture", "media_io_kwargs": '{"video": {"num_frames": 4}}',
        "engine": "hf", "dtype": "float32", "device": "cpu", "gpu_image_decode": "off", "json_schema": str(base / "schema.json"),
    }  # fmt: skip


def test_urls_stay_as_written(tmp_path: Path) -> None:
    options = load_job_file(_write(tmp_path, "s3.yaml", "dataset: s3://bucket/rows.parquet\noutput: s3://bucket/out\n"))
    assert options["dataset"] == "s3://bucket/rows.parquet" and options["output"] == "s3://bucket/out"


def test_toml_and_a_vllm_key_become_the_response_format_option(tmp_path: Path) -> None:
    options = load_job_file(_write(tmp_path, "job.toml", TOML))
    assert options["model"] == "Qwen/Qwen2.5-VL-3B-Instruct"  # a Hub id is not a path
    assert json.loads(options["response_format"]) == {"guided_choice": ["yes", "no"]}
    assert options["stop"] == ["a", "b"] and options["max_tokens"] == 4
    response = load_job_file(_write(tmp_path, "r.yml", "dataset: d.jsonl\nresponse_format: {type: json_object}\n"))
    assert json.loads(response["response_format"]) == {"type": "json_object"}


def test_flags_given_on_the_command_line_win(tmp_path: Path) -> None:
    job = _write(tmp_path, "job.toml", TOML)
    params = {"dataset": job, "model": "cli-model", "max_tokens": 128, "temperature": 0.0, "stop": None}
    merged = apply_job_file(job, params, given={"model", "dataset"})
    assert merged["model"] == "cli-model"  # given: kept
    assert merged["max_tokens"] == 4 and merged["stop"] == ["a", "b"]  # defaults: the file's
    assert merged["temperature"] == 0.0 and merged["dataset"] == str(tmp_path.resolve() / "rows.jsonl")


@pytest.mark.parametrize(
    "text, message",
    [
        ("dataset: d.jsonl\nsampling: {max_tokns: 3}\n", "unknown key 'sampling.max_tokns'"),
        ("dataset: d.jsonl\nshard_sise: 3\n", "unknown key 'shard_sise'"),
        ("dataset: d.jsonl\nsampling: {max_tokens: '3'}\n", "sampling.max_tokens must be an integer"),
        ("dataset: d.jsonl\nsampling: {max_tokens: true}\n", "sampling.max_tokens must be an integer"),
        ("dataset: d.jsonl\nwait: 1\n", "wait must be true or false"),
        ("dataset: d.jsonl\nsampling: 3\n", "sampling must be a mapping"),
        ("dataset: d.jsonl\nmedia_io_kwargs: [1]\n", "media_io_kwargs must be a mapping"),
        ("dataset: d.jsonl\nsampling: {stop: [1]}\n", "sampling.stop must be a string or a list of strings"),
        ("dataset: d.jsonl\nguided_regex: a\nguided_choice: [a]\n", "set only one of guided_regex, guided_choice"),
        ("model: m\n", "needs a 'dataset' key"),
        ("dataset: other.yaml\n", "is itself a job file"),
        ("- a list\n", "holds a mapping"),
        ("dataset: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_job_files_are_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(JobError, match=rf"job\.yaml: .*{re.escape(message)}"):
        load_job_file(_write(tmp_path, "job.yaml", text))


def test_bad_toml_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not valid TOML"):
        load_job_file(_write(tmp_path, "job.toml", "dataset = \n"))
    with pytest.raises(JobError, match="absent.yaml: cannot read this job file"):
        load_job_file(tmp_path / "absent.yaml")
    assert is_job_file("a/job.YML") and is_job_file("x.toml") and not is_job_file("rows.jsonl")


def test_submit_structured_output_options(tmp_path: Path) -> None:
    from vlmbatch.job.plan import structured_output_option
    from vlmbatch.structured.spec import CHOICE, JSON_OBJECT, JSON_SCHEMA

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert structured_output_option(None, schema).kind == JSON_SCHEMA
    assert structured_output_option({"type": "json_object"}, None).kind == JSON_OBJECT
    assert structured_output_option({"guided_choice": ["a", "b"]}, None).kind == CHOICE
    assert structured_output_option(None, None) is None and structured_output_option({}, None) is None
    (tmp_path / "bad.json").write_text("{type: object")
    for response_format, json_schema, message in [
        ({"type": "json_object"}, schema, "give one of them"),
        (None, tmp_path / "bad.json", "not valid JSON"),
        (None, tmp_path / "absent.json", "cannot read it"),
        ({"type": "xml"}, None, "--response-format: response_format.type: type must be"),
        ({"guided_choice": ["a"], "type": "text"}, None, "must be the only key"),
        ({"guided_json": {"type": "object", "minProperties": 2}}, None, "cannot compile this json_schema"),
    ]:
        with pytest.raises(JobError, match=re.escape(message)):
            structured_output_option(response_format, json_schema)


def test_every_submit_flag_has_a_key() -> None:
    import inspect

    from vlmbatch.cli.submit_cmd import submit
    from vlmbatch.job.jobfile import KEYS

    flags = set(inspect.signature(submit).parameters) - {"ctx"}
    keyed = {parameter for parameter, _ in KEYS.values()} | {"response_format"}  # the structured-output keys
    assert flags == keyed, f"flags without a key: {sorted(flags - keyed)}; keys without a flag: {sorted(keyed - flags)}"
