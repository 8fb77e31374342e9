"""Constrained decoding in both engines on the tiny random-weight Qwen2.5-VL checkpoint (CPU, fp32).

The grammar alone must make random weights emit valid JSON. The paged engine runs with a
small KV cache (preemption), a small token budget (chunked prefill), asynchronous decoding
and the CUDA-graph decode path's static buffers (run eagerly here); free rows beside
constrained ones must keep exactly their tokens, and the hf reference engine must give
the same constrained greedy tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from engine_harness import qwen_prompt, run_to_completion
from structured_harness import NESTED_SCHEMA, single_torch_thread  # noqa: F401  (autouse fixture)

from vlmbatch.config import EngineConfig
from vlmbatch.engine.hf import HFEngine
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType
from vlmbatch.families.registry import load_adapter
from vlmbatch.structured.spec import parse_structured_output

NESTED = parse_structured_output({"guided_json": NESTED_SCHEMA})
CHOICE = parse_structured_output({"guided_choice": ["yes", "no", "maybe"]})
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def adapter(tiny_qwen):
    return load_adapter(str(tiny_qwen))


def paged_engine(adapter, *, graphs: bool = False, async_decode: bool = True, device: str = "cpu") -> PagedEngine:
    """Small enough that a batch of ~250-token JSON rows preempts and prompts are chunked. On
    CUDA the decode CUDA graphs are captured; `graphs` runs their static buffers eagerly on the CPU."""
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device=device, num_kv_blocks=130, block_size=4, max_num_seqs=6,
                                               max_num_batched_tokens=32, min_admission_batch=1))
    engine.async_decode = async_decode
    if graphs and device == "cpu":
        engine.runner.prepare_static_decode(6, capture=False)
    return engine


def run(engine, adapter, rows: dict[str, SamplingParams]) -> dict:
    for request_id, params in rows.items():
        prompt = adapter.prepare(qwen_prompt(f"describe row {request_id} as JSON", 0, False), [], [], params.max_tokens)
        engine.add_request(request_id, prompt, params)
    return run_to_completion(engine)


def mixed_rows() -> dict[str, SamplingParams]:
    """Constrained rows (greedy and seeded sampling, schema and choice) among free ones."""
    rows = {}
    for i in range(10):
        spec = NESTED if i % 2 == 0 else CHOICE if i == 3 else None
        sampled = i in (2, 6, 7)
        rows[f"r{i}"] = SamplingParams(max_tokens=MAX_TOKENS if spec is not None else 24, temperature=1.0 if sampled else 0,
                                       seed=i if sampled else None, structured_output=spec)
    return rows


def assert_valid(outputs: dict, rows: dict[str, SamplingParams]) -> None:
    for request_id, params in rows.items():
        completion = outputs[request_id].outputs[0]
        if params.structured_output is NESTED:
            assert completion.finish_reason == "stop" and completion.error is None, (request_id, completion)
            jsonschema.validate(json.loads(completion.text), NESTED_SCHEMA)
        elif params.structured_output is CHOICE:
            assert completion.text in ("yes", "no", "maybe")


@pytest.mark.parametrize(("graphs", "async_decode"), [(True, True), (False, False)])
def test_mixed_batch_with_preemption(adapter, graphs, async_decode):
    """Every constrained row ends valid; every free row gets the tokens it gets alone."""
    check_mixed_batch(adapter, graphs, async_decode, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_batch_on_cuda_with_graphs_and_async_decoding(adapter):
    """The device path: pinned bitmask, non-blocking copy, xgrammar's Triton kernel on the
    logits of captured decode graphs, masks filled while the forward runs."""
    check_mixed_batch(adapter, True, True, "cuda")


def check_mixed_batch(adapter, graphs: bool, async_decode: bool, device: str) -> None:
    rows = mixed_rows()
    engine = paged_engine(adapter, graphs=graphs, async_decode=async_decode, device=device)
    outputs = run(engine, adapter, rows)
    assert_valid(outputs, rows)
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0
    assert engine.structured.stats.num_masked_steps > 0
    if async_decode:
        assert stats.num_async_decode_steps > 0
    if graphs:
        assert stats.num_graph_replays > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    if device != "cpu":  # GPU matmuls may round differently at another batch size: exact only on the CPU
        return
    free = {request_id: params for request_id, params in rows.items() if params.structured_output is None}
    alone = run(paged_engine(adapter), adapter, free)
    for request_id in free:
        assert outputs[request_id].outputs[0].token_ids == alone[request_id].outputs[0].token_ids, request_id


def test_hf_engine_gives_the_paged_constrained_tokens(adapter, tiny_qwen):
    rows = {f"r{i}": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=spec)
            for i, spec in enumerate([NESTED, None, CHOICE, NESTED])}
    rows["r1"] = SamplingParams(max_tokens=20, temperature=0)
    paged = run(paged_engine(adapter), adapter, rows)
    hf = run(HFEngine(adapter, EngineConfig(dtype="float32", device="cpu")), adapter, rows)
    assert_valid(hf, rows)
    for request_id in rows:
        assert hf[request_id].outputs[0].token_ids == paged[request_id].outputs[0].token_ids, request_id
        assert hf[request_id].outputs[0].text == paged[request_id].outputs[0].text


@pytest.mark.parametrize("engine_name", ["paged", "hf"])
def test_length_cut_dead_end_and_uncompilable_rows(adapter, engine_name):
    """A row cut by max_tokens keeps its text with `structured_output_incomplete`; a grammar
    the vocabulary cannot continue (an empty character class after "a") gets the stop token on
    its empty mask and ends `structured_output_dead_end`; a spec xgrammar refuses fails its row
    alone (`invalid_row`, the key named); the others run as usual."""
    bad = parse_structured_output({"guided_regex": "(unclosed"})
    dead = parse_structured_output({"guided_grammar": r'root ::= "a" [^\x00-\U0010FFFF]'})
    rows = {
        "dead": SamplingParams(max_tokens=12, temperature=0, structured_output=dead),
        "cut": SamplingParams(max_tokens=12, temperature=0, structured_output=NESTED),
        "bad": SamplingParams(max_tokens=12, temperature=0, structured_output=bad),
        "ok": SamplingParams(max_tokens=8, temperature=0, structured_output=CHOICE),
        "free": SamplingParams(max_tokens=8, temperature=0),
    }
    engine = paged_engine(adapter) if engine_name == "paged" else HFEngine(adapter, EngineConfig(dtype="float32", device="cpu"))
    outputs = run(engine, adapter, rows)
    cut = outputs["cut"].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 12
    assert cut.error.error_type == ErrorType.STRUCTURED_OUTPUT_INCOMPLETE
    assert cut.text.startswith('{"vendor": "')
    failed = outputs["bad"].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == [] and failed.text == ""
    assert failed.error.error_type == ErrorType.INVALID_ROW and failed.error.param == "guided_regex"
    assert outputs["ok"].outputs[0].text in ("yes", "no", "maybe") and outputs["ok"].outputs[0].error is None
    assert outputs["free"].outputs[0].error is None and len(outputs["free"].outputs[0].token_ids) == 8
    stuck = outputs["dead"].outputs[0]
    assert stuck.error.error_type == ErrorType.STRUCTURED_OUTPUT_DEAD_END and stuck.finish_reason == "stop"
    assert stuck.text == "a" and stuck.token_ids[-1] == adapter.eos_token_ids[0] and len(stuck.token_ids) == 2


def test_ignore_eos_does_not_run_past_the_grammar(adapter):
    """A constrained row ends when its grammar does, even with ignore_eos (benchmarks set it)."""
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, structured_output=CHOICE)
    output = run(paged_engine(adapter), adapter, {"a": params})["a"].outputs[0]
    assert output.text in ("yes", "no", "maybe") and output.finish_reason == "stop"
    assert output.token_ids[-1] in adapter.eos_token_ids


def test_llm_generate_and_chat_take_specs(tiny_qwen):
    """`SamplingParams(structured_output=...)` and the vLLM-like keywords (a pydantic model
    for `guided_json`); a bad spec raises its RowError before anything runs."""
    from typing import Literal

    from pydantic import BaseModel, Field

    from vlmbatch.engine.llm import LLM
    from vlmbatch.errors import RowError

    class Pet(BaseModel):
        name: str = Field(pattern="^[a-z]{1,5}$")
        kind: Literal["cat", "dog"]

    llm = LLM(str(tiny_qwen), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    [by_params] = llm.generate("a pet:", SamplingParams(max_tokens=100, temperature=0, structured_output=CHOICE), use_tqdm=False)
    assert by_params.outputs[0].text in ("yes", "no", "maybe")
    [pet] = llm.chat([{"role": "user", "content": "a pet as JSON"}], greedy, use_tqdm=False, guided_json=Pet)
    assert Pet.model_validate_json(pet.outputs[0].text).kind in ("cat", "dog")
    formatted = llm.generate(["x", "y"], greedy, use_tqdm=False, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NESTED_SCHEMA}})
    for output in formatted:
        jsonschema.validate(json.loads(output.outputs[0].text), NESTED_SCHEMA)
    with pytest.raises(RowError) as bad:
        llm.generate("x", greedy, use_tqdm=False, guided_regex="(unclosed")
    assert bad.value.param == "guided_regex"
    with pytest.raises(TypeError, match="guided_jsn"):
        llm.generate("x", greedy, use_tqdm=False, guided_jsn={})
