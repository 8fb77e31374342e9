"""Grammar compilation (once per spec, off the caller's thread) and per-sequence matchers on the
tiny model's real tokenizer: random logits under the masks give valid outputs, and the matcher
state is exact after a rebuild (preemption), a rollback and a refused token."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch
import xgrammar as xgr

from structured_harness import NESTED_SCHEMA, decode_one, tiny_grammar  # noqa: F401  (fixture)
from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.structured.grammar import build_grammar, check_job_spec
from vlmbatch.structured.matcher import StructuredMatcher
from vlmbatch.structured.spec import parse_structured_output

NESTED = parse_structured_output({"guided_json": NESTED_SCHEMA})


def _mask(matcher: StructuredMatcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill(bitmask, 0)
    return bitmask[0].clone()


def test_each_distinct_spec_compiles_once_off_the_callers_thread(tiny_grammar):
    compiler = tiny_grammar.compiler
    before = compiler.num_compiles
    a = compiler.submit(parse_structured_output({"guided_json": NESTED_SCHEMA}))
    b = compiler.submit(parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED_SCHEMA}}}))
    assert isinstance(a, Future) and a is b
    a.result(timeout=60)
    assert compiler.num_compiles == before + 1
    names = []
    compiler._pool.submit(lambda: names.append(threading.current_thread().name)).result()
    assert names[0].startswith("vlmbatch-grammar") and names[0] != threading.current_thread().name
    compiler.submit(parse_structured_output({"guided_regex": "[ab]+"})).result(timeout=60)
    assert compiler.num_compiles == before + 2


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_under_the_mask_give_valid_json(tiny_grammar, seed):
    tokens = decode_one(tiny_grammar, tiny_grammar.matcher(NESTED), seed)
    assert tokens[-1] == tiny_grammar.eos  # the grammar ended it, not max_tokens
    value = json.loads(tiny_grammar.text(tokens))
    jsonschema.validate(value, NESTED_SCHEMA)
    assert list(value)[:3] == ["vendor", "total", "currency"]  # schema order
    assert tiny_grammar.text(tokens).startswith('{"vendor": "')  # one layout: json.dumps separators, no free whitespace


def test_choice_regex_grammar_and_json_object(tiny_grammar):
    choices = ["a cat", "two dogs", 'say "hi"', "naïve"]
    seen = set()
    for seed in range(12):
        spec = parse_structured_output({"guided_choice": choices})
        seen.add(tiny_grammar.text(decode_one(tiny_grammar, tiny_grammar.matcher(spec), seed)))
    assert seen <= set(choices) and len(seen) >= 2
    regex = parse_structured_output({"guided_regex": r"[A-Z]{3}-\d{2}"})
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", tiny_grammar.text(decode_one(tiny_grammar, tiny_grammar.matcher(regex), 0)))
    grammar = parse_structured_output({"guided_grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'})
    assert re.fullmatch(r"yes|no|maybe [0-9]", tiny_grammar.text(decode_one(tiny_grammar, tiny_grammar.matcher(grammar), 1)))
    free = parse_structured_output({"response_format": {"type": "json_object"}})
    tokens = decode_one(tiny_grammar, tiny_grammar.matcher(free), 2, max_tokens=2000)
    assert tokens[0] == tiny_grammar.tokenizer.convert_tokens_to_ids("{")


def test_length_bounded_strings_admit_no_control_characters(tiny_grammar):
    """xgrammar#800: its maxLength path admits raw control characters; ours goes through a pattern."""
    bounded = parse_structured_output({"guided_json": {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}}, "required": ["s"]}})
    for text, ok in (('{"s": "abc"}', True), ('{"s": "abcd"}', False), ('{"s": ""}', False), ('{"s": "a\x01"}', False), ('{"s": "\t"}', False)):
        matcher = xgr.GrammarMatcher(tiny_grammar.compiler.compiled(bounded))
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


def test_state_after_preemption_is_exact(tiny_grammar):
    """A matcher rebuilt from the generated tokens at any point (what a recompute needs) gives
    the same masks as the one that never stopped, at every later step; syncing the live one
    to the tokens it already has (our engine's preemption keeps them) changes nothing."""
    compiled = tiny_grammar.compiler.compiled(NESTED)
    tokens = decode_one(tiny_grammar, tiny_grammar.matcher(NESTED), seed=3)
    vocab = tiny_grammar.vocab_size
    for cut in (0, 1, len(tokens) // 2, len(tokens) - 2):
        live = StructuredMatcher(compiled)
        rebuilt = None
        for step, token in enumerate(tokens[:-1]):
            if step == cut:
                assert live.sync(tokens[:cut]) and live.accepted == tokens[:cut]
                rebuilt = StructuredMatcher.replay(compiled, tokens[:cut])
            if rebuilt is not None:
                assert torch.equal(_mask(rebuilt, vocab), _mask(live, vocab)), (cut, step)
                assert rebuilt.accept(token)
            assert live.accept(token)
        assert rebuilt.accepted == live.accepted == tokens[:-1]
        assert rebuilt.is_completed and rebuilt.accept(tiny_grammar.eos) and rebuilt.is_terminated


def test_sync_rolls_back_to_the_common_prefix(tiny_grammar):
    compiled = tiny_grammar.compiler.compiled(NESTED)
    first = decode_one(tiny_grammar, tiny_grammar.matcher(NESTED), seed=4)
    other = decode_one(tiny_grammar, tiny_grammar.matcher(NESTED), seed=5)
    common = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
    assert common > 0  # both start with {"vendor": "
    matcher = StructuredMatcher.replay(compiled, first[:-1])
    assert matcher.sync(other[:-1])
    assert matcher.accepted == other[:-1]
    fresh = StructuredMatcher.replay(compiled, other[:-1])
    assert torch.equal(_mask(matcher, tiny_grammar.vocab_size), _mask(fresh, tiny_grammar.vocab_size))
    assert matcher.accept(tiny_grammar.eos) and matcher.is_terminated


def test_rollback_and_refused_tokens_leave_the_state_exact(tiny_grammar):
    matcher = tiny_grammar.matcher(NESTED)
    tokens = decode_one(tiny_grammar, tiny_grammar.matcher(NESTED), seed=6)
    for token in tokens[:5]:
        matcher.accept(token)
    before = _mask(matcher, tiny_grammar.vocab_size)
    matcher.accept(tokens[5])
    matcher.rollback(1)
    assert torch.equal(_mask(matcher, tiny_grammar.vocab_size), before)
    assert not matcher.accept(tiny_grammar.eos)  # EOS is not allowed inside an open object
    assert matcher.rejected_token == tiny_grammar.eos and matcher.accepted == tokens[:5]
    assert torch.equal(_mask(matcher, tiny_grammar.vocab_size), before)
    with pytest.raises(ValueError):
        matcher.rollback(6)
    with pytest.raises(ValueError, match="breaks the grammar"):
        StructuredMatcher.replay(tiny_grammar.compiler.compiled(NESTED), [tiny_grammar.eos])


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"guided_json": {"type": "object", "minProperties": 1}}, "minProperties"),
        ({"guided_json": {"type": "strange"}}, "Unsupported type"),
        ({"guided_regex": "(unclosed"}, "parenthesis is not closed"),
        ({"guided_grammar": "root ::= missing_rule"}, 'Rule "missing_rule" is not defined'),
    ],
)
def test_uncompilable_specs_give_clear_errors(tiny_grammar, fields, reason):
    spec = parse_structured_output(fields)
    with pytest.raises(RowError) as caught:
        build_grammar(spec)
    assert caught.value.error_type == ErrorType.INVALID_ROW and caught.value.param == spec.source
    assert reason in caught.value.message and "/project/cpp" not in caught.value.message and "Check failed" not in caught.value.message
    future = tiny_grammar.compiler.submit(spec)  # the engine's path: the future carries the row error
    assert isinstance(future.exception(timeout=60), RowError)
    assert tiny_grammar.compiler.submit(spec) is future  # a failure is cached too
    with pytest.raises(JobError, match=r"--json-schema: .*cannot compile"):
        check_job_spec(spec, "--json-schema")


def test_job_check_accepts_good_and_unconstrained_specs():
    check_job_spec(NESTED, "job.yaml")
    check_job_spec(None, "job.yaml")
    check_job_spec(parse_structured_output({"response_format": {"type": "text"}}), "job.yaml")
