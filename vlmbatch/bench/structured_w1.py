"""W1 under a JSON schema (`vlmbatch bench engine --structured extraction6` or `--json-schema FILE`).

What it answers: how much of W1's requests/s a schema costs, and what masking costs per
decode step at fixed batch sizes (host fill + the host time to queue the copy and kernel).

Comparable lengths. W1 forces 128 output tokens (`ignore_eos`); a constrained row ends when
its grammar does, which a random-weight model may reach early. `extraction6` is therefore
five short typed fields (a patterned id and date, an enum, a bounded integer, a boolean:
the grammar states a real extraction walks through) and a sixth, unbounded `notes` string
last, so rows keep going until max_tokens = 128 like unconstrained W1 (JSON left open: the
rows end `length` with `structured_output_incomplete`, which the run ignores). Each run
reports its actual generated tokens, so a row that did close early shows in tokens/s.

Realistic masks. A random-weight shape carries the tiny checkpoint's tokenizer (~600 tokens)
under 151,936-wide logits; grammars over it would make the host fill almost free. On such a
shape the grammars are compiled against a byte-level BPE as large as the logits instead
(`vlmbatch.testing.vocab`, built here, ~10 s), so fill time is what a real vocabulary costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmbatch.bench.timing import RunResult, run_engine

EXTRACTION6_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "total_cents": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "paid": {"type": "boolean"},
        "notes": {"type": "string"},
    },
    "required": ["invoice_number", "date", "currency", "total_cents", "paid", "notes"],
    "additionalProperties": False,
}
BUILT_IN = {"extraction6": EXTRACTION6_SCHEMA}


def bench_schema(structured: str | None, json_schema: Path | None) -> dict[str, Any] | None:
    """The schema of `--structured NAME` or `--json-schema FILE` (ValueError naming the problem)."""
    if structured and json_schema:
        raise ValueError("give --structured or --json-schema, not both")
    if structured:
        if structured not in BUILT_IN:
            raise ValueError(f"unknown built-in schema {structured!r}; choose from {', '.join(BUILT_IN)}")
        return BUILT_IN[structured]
    if json_schema is not None:
        return json.loads(json_schema.read_text(encoding="utf-8"))
    return None


def _spec(schema: dict[str, Any]):
    from vlmbatch.structured.spec import parse_structured_output

    return parse_structured_output({"guided_json": schema})


def use_full_size_vocab(engine) -> int:
    """Give the engine grammars over a BPE as wide as its logits when its tokenizer is far
    smaller (random-weight shapes); returns the grammar vocabulary's size."""
    from vlmbatch.engine.structured_decoding import StructuredDecoding
    from vlmbatch.testing.vocab import make_large_tokenizer

    current = engine.structured
    if len(engine.tokenizer) * 2 > current.vocab_size:
        return len(engine.tokenizer)
    engine.structured = StructuredDecoding(make_large_tokenizer(current.vocab_size), current.vocab_size, current.stop_token_ids,
                                           current.device, current.max_rows, current.fill_threads)
    return current.vocab_size


def warm_compile(engine, schema: dict[str, Any]) -> float:
    """Compile the schema before timing (the tokenizer tables and the grammar, once per engine)."""
    import time

    started = time.perf_counter()
    engine.structured.submit(_spec(schema)).future.result()
    return time.perf_counter() - started


def mask_ms(stats: dict[str, Any]) -> dict[str, float]:
    """Per masked step: host fill, host apply (copy + kernel queued), and rows masked."""
    steps = max(1, stats.get("mask_num_masked_steps", 0))
    return {"mask_fill_ms_per_step": 1000 * stats.get("mask_fill_s", 0.0) / steps,
            "mask_apply_ms_per_step": 1000 * stats.get("mask_apply_s", 0.0) / steps,
            "mask_rows_per_step": stats.get("mask_num_masked_rows", 0) / steps}


def structured_run(engine, prompts: list, lengths: list[int], workload: str, schema: dict[str, Any]) -> RunResult:
    """One run of `prompts` constrained by `schema`, mask times in `extra`."""
    result = run_engine(engine, prompts, lengths, workload, _spec(schema))
    result.extra.update(mask_ms(result.extra))
    return result


def mask_at_batches(engine, prompts: list, lengths: list[int], batches: tuple[int, ...], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """At each batch size: that many W1 requests (one decode batch) free, then constrained;
    their median decode step and the mask's cost per step."""
    rows = []
    for batch in batches:
        head, head_lengths = prompts[:batch], lengths[:batch]
        free = run_engine(engine, head, head_lengths, f"w1-b{batch}")
        constrained = run_engine(engine, head, head_lengths, f"w1-b{batch}", _spec(schema))
        rows.append({"batch": len(head), "free_decode_step_ms": free.decode_step_ms,
                     "structured_decode_step_ms": constrained.decode_step_ms,
                     "free_output_tokens": free.output_tokens, "structured_output_tokens": constrained.output_tokens,
                     **mask_ms(constrained.extra)})
    return rows


def mask_row(row: dict[str, Any]) -> str:
    """One line of `mask_at_batches`."""
    return (f"mask at batch {row['batch']:4d}: fill {row['mask_fill_ms_per_step']:.3f} ms + apply {row['mask_apply_ms_per_step']:.3f} ms "
            f"per step ({row['mask_rows_per_step']:.0f} rows); decode step {row['free_decode_step_ms'] or 0:.2f} ms free, "
            f"{row['structured_decode_step_ms'] or 0:.2f} ms constrained; tokens {row['free_output_tokens']} free / "
            f"{row['structured_output_tokens']} constrained")
