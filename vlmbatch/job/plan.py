"""Submit-time work: refuse bad jobs early, plan shards, write the manifest.

Everything that can make a whole job fail (missing file, unknown format, missing
columns, unknown model, bad media options) is checked here, before anything is
queued or written, and reported as a one-line `JobError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmbatch.config import EngineConfig, MediaConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import JobError
from vlmbatch.structured.spec import StructuredOutput


def check_model(model: str) -> str:
    """Fail fast on a model that cannot be resolved or is of no supported family (no weights load)."""
    from vlmbatch.families.registry import model_family

    return model_family(model).name


def check_media_io_kwargs(media_io_kwargs: dict[str, Any], media: MediaConfig) -> None:
    """Job-level media options are validated once, at submit (a typo must not fail every
    row), over the defaults of the submitting process's `media` configuration."""
    unknown = set(media_io_kwargs) - {"image", "video"}
    if unknown:
        raise JobError(f"--media-io-kwargs: unknown media kind(s) {sorted(unknown)}; expected 'image' and/or 'video'")
    if "video" in media_io_kwargs:
        from vlmbatch.media.video.options import default_video_options, parse_video_options

        try:
            parse_video_options(media_io_kwargs["video"], default_video_options(media))
        except ValueError as exc:
            raise JobError(f"--media-io-kwargs: {exc}") from exc


def structured_output_option(response_format: dict[str, Any] | None, json_schema: str | Path | None) -> StructuredOutput | None:
    """The job-level `StructuredOutput` of `--response-format` / `--json-schema` (or None),
    refused with a `JobError` if malformed or not compilable: at submit, before anything is written.

    `--response-format` takes an OpenAI `response_format` object or one vLLM key
    (`{"guided_choice": [...]}`, `guided_json`, `guided_regex`, `guided_grammar`);
    `--json-schema` a file holding a bare JSON schema."""
    from vlmbatch.structured.grammar import check_job_spec
    from vlmbatch.structured.spec import GUIDED_KEYS, job_structured_output

    if response_format and json_schema is not None:
        raise JobError("--response-format and --json-schema: give one of them")
    if json_schema is not None:
        where = f"--json-schema {json_schema}"
        try:
            fields = {"guided_json": json.loads(Path(json_schema).read_text(encoding="utf-8"))}
        except OSError as exc:
            raise JobError(f"{where}: cannot read it: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise JobError(f"{where}: not valid JSON: {exc}") from None
    elif response_format:
        where = "--response-format"
        guided = set(response_format) & set(GUIDED_KEYS)
        if guided and len(response_format) > 1:
            raise JobError(f"{where}: a vLLM key ({', '.join(sorted(guided))}) must be the only key")
        fields = response_format if guided else {"response_format": response_format}
    else:
        return None
    spec = job_structured_output(fields, where)
    check_job_spec(spec, where)
    return spec


def plan_job(
    dataset: str | Path,
    model: str,
    output: str | Path,
    *,
    engine: str = "auto",
    columns: Any = None,
    sampling: SamplingParams | None = None,
    media_io_kwargs: dict[str, Any] | None = None,
    shard_size: int = 1000,
    broker: str | None = None,
    chat_template: str | None = None,
    storage_options: dict[str, Any] | None = None,
    structured_output: StructuredOutput | None = None,
    media: MediaConfig | None = None,
) -> tuple[Any, Any]:
    """Validate the job and write `OUTPUT/JOB/manifest.json`; nothing runs yet. DATASET and
    OUTPUT may be object-storage URLs (`storage_options` apply to both); the job folder is
    then an `ObjectPath`. Its media options are checked over `media` (the submitting
    process's; default: the built-in one).

    `structured_output` is the job's `StructuredOutput` (from `structured_output_option`); a
    dataset with a `response_format` or `guided_*` column may set one per row, which fixes
    the result schema to `output_json` (io/output_schema.py)."""
    from vlmbatch.io.manifest import Manifest
    from vlmbatch.io.output_schema import MANIFEST_KEY, manifest_entry
    from vlmbatch.io.readers import ShardPlan, open_dataset
    from vlmbatch.io.schema import SAMPLING_COLUMNS_KEY, sampling_columns
    from vlmbatch.structured.spec import STRUCTURED_KEYS

    reader = open_dataset(dataset, columns, storage_options=storage_options)
    check_model(model)
    check_media_io_kwargs(media_io_kwargs or {}, media or MediaConfig())
    manifest = Manifest.for_dataset(
        reader,
        output_dir=output,
        model=model,
        engine=engine,
        sampling=(sampling or SamplingParams()).to_dict(),
        media_io_kwargs=media_io_kwargs or {},
        shard_size=shard_size,
        broker=broker,
        storage_options=storage_options,
    )
    if not manifest.shards:  # an empty dataset completes with one empty, typed part
        manifest.shards = [ShardPlan(shard_id=0, row_start=0, row_end=0, byte_start=0, byte_end=0, row_groups=[])]
    if chat_template:
        manifest.extra["chat_template"] = chat_template
    asked = sampling_columns(manifest.sampling, list(reader.column_names))
    if asked:
        manifest.extra[SAMPLING_COLUMNS_KEY] = asked
    per_row = any(key in reader.column_names for key in STRUCTURED_KEYS)
    if structured_output is not None or per_row:
        manifest.extra[MANIFEST_KEY] = manifest_entry(structured_output, per_row)
    try:
        manifest.save()
    except OSError as exc:  # an output that cannot be written (no such bucket, no permission)
        raise JobError(f"cannot write the job's manifest to {manifest.job_dir}: {exc}") from exc
    return manifest, manifest.job_dir


def load_llm(model: str, config: EngineConfig, chat_template: str | None = None) -> Any:
    """Load the model once (the expensive part of a worker's start-up; start the
    preprocessing pool's fork server first, `RowPreparer.start_fork_server`, so its
    imports overlap the model load)."""
    from vlmbatch.engine.llm import LLM

    return LLM(model, config, chat_template=chat_template)
