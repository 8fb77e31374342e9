"""Penalties, logit bias, min_tokens and logprobs: both engines against transformers' own
logits processors inside `generate()` (greedy, fp32, CPU, token-exact).

The reference builds its processors here, from transformers (`SequenceBiasLogitsProcessor`,
`RepetitionPenaltyLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`) and, for OpenAI's
presence and frequency penalties that transformers lacks, from the formula written out
below, and never uses our engines' code.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import single_thread, WORDS, make_image, qwen_prompt, run_to_completion
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from vlmbatch.config import EngineConfig
from vlmbatch.engine.hf import HFEngine, generate_inputs
from vlmbatch.engine.loading import load_hf_model
from vlmbatch.engine.paged import PagedEngine
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.registry import load_adapter

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tiny_qwen):
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    hf_model = load_hf_model(path, torch.float32, torch.device("cpu"))
    prompts = [
        adapter.prepare(qwen_prompt(" ".join(WORDS[:7]), 0, False), max_tokens=MAX_TOKENS),
        adapter.prepare(qwen_prompt("the dog runs", 1, False), [make_image(3, (56, 40))], max_tokens=MAX_TOKENS),
        adapter.prepare(qwen_prompt(" ".join(WORDS[5:20]), 0, False), max_tokens=MAX_TOKENS),
    ]
    return adapter, hf_model, prompts


class ReferenceOpenAIPenalties(LogitsProcessor):
    """OpenAI's definition: logit[t] -= count[t] * frequency + (count[t] > 0) * presence,
    counting only the generated tokens, one row at a time."""

    def __init__(self, prompt_length: int, frequency: float, presence: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token, count in zip(*torch.unique(input_ids[row, self.prompt_length :], return_counts=True)):
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def reference_processors(params: SamplingParams, prompt_length: int, eos: list[int]) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(ReferenceOpenAIPenalties(prompt_length, params.frequency_penalty, params.presence_penalty))
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, eos))
    return processors


def hf_reference(hf_model, adapter, prompt, params: SamplingParams):
    """(token ids up to and including EOS, log_softmax of the processed scores of each)."""
    inputs = generate_inputs(hf_model, adapter, [prompt], adapter.tokenizer.pad_token_id or 0)
    eos = sorted(adapter.eos_token_ids)
    with torch.inference_mode():
        out = hf_model.generate(**inputs, max_new_tokens=params.max_tokens, do_sample=False, eos_token_id=eos,
                                logits_processor=reference_processors(params, prompt.num_tokens, eos),
                                output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.num_tokens :].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1) for score in out.scores]
    return tokens, logprobs


EOS_BIAS = "eos+100"
CASES = {
    "repetition": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=1.8),
    "frequency_presence": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, frequency_penalty=1.5, presence_penalty=0.7),
    "bias": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logit_bias={"9": 6.0, "33": 4.0, "100": -50.0}),
    "min_tokens": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=4),  # with EOS pushed up below
    "all": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                          presence_penalty=0.5, logit_bias={"9": 2.0}, min_tokens=3, logprobs=3),
}


def _case(name: str, adapter) -> SamplingParams:
    """The case with logprobs on: they show the adjusted logits themselves, not only their argmax."""
    params = CASES[name].updated(logprobs=2)
    if name in ("min_tokens", "all"):  # without min_tokens this bias ends every row at once
        params = params.updated(logit_bias={**dict(params.logit_bias), min(adapter.eos_token_ids): 100.0})
    return params


@pytest.mark.parametrize("name", list(CASES))
def test_paged_and_hf_engines_match_transformers_processors(name, setup):
    adapter, hf_model, prompts = setup
    params = _case(name, adapter)
    paged = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=3))
    assert paged.async_decode  # the newest token of each row is counted from the device
    hf_engine = HFEngine(adapter, EngineConfig(dtype="float32", device="cpu"), model=hf_model)
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    changed = False
    for engine in (paged, hf_engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{i}", prompt, params)
            engine.add_request(f"plain-{i}", prompt, plain)  # a row without adjustments in the same batch
        outputs = run_to_completion(engine)
        for i, prompt in enumerate(prompts):
            expected, reference = hf_reference(hf_model, adapter, prompt, params)
            got = outputs[f"{i}"].outputs[0].token_ids
            assert got == expected, (engine.name, i)
            for token, entry, logprobs in zip(got, outputs[f"{i}"].outputs[0].logprobs, reference):
                assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-5), (engine.name, i)
                assert [v for _, v in entry.top] == pytest.approx(logprobs.topk(2).values.tolist(), abs=1e-5)
            plain_tokens = outputs[f"plain-{i}"].outputs[0].token_ids
            assert plain_tokens == hf_reference(hf_model, adapter, prompt, plain)[0], (engine.name, i)
            changed |= plain_tokens != got
        assert paged.stats.num_async_decode_steps > 0 or engine is hf_engine
    assert changed, "the setting changed no row's tokens: the test would not see it ignored"
    if name in ("min_tokens", "all"):
        for output in outputs.values():
            if not output.request_id.startswith("plain"):
                assert len(output.outputs[0].token_ids) == params.min_tokens + 1  # EOS as soon as it may come
                assert output.outputs[0].finish_reason == "stop"


def test_adjustments_on_the_static_decode_buffers(setup):
    """The CUDA-graph decode path run eagerly on the CPU (static buffers, padded batch, the
    graph's logits buffer adjusted in place), asynchronous: tokens and logprobs as transformers'."""
    adapter, hf_model, prompts = setup
    params = _case("all", adapter)
    engine = PagedEngine(adapter, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=5))
    engine.runner.prepare_static_decode(5, capture=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{i}", prompt, params)
    outputs = run_to_completion(engine)
    assert engine.stats.num_graph_replays == engine.stats.num_decode_steps > engine.stats.num_async_decode_steps > 0
    for i, prompt in enumerate(prompts):
        tokens, reference = hf_reference(hf_model, adapter, prompt, params)
        completion = outputs[f"{i}"].outputs[0]
        assert completion.token_ids == tokens
        assert [e.logprob for e in completion.logprobs] == pytest.approx([r[t].item() for t, r in zip(tokens, reference)], abs=1e-5)


@pytest.mark.parametrize("engine_name", ["paged", "hf"])
def test_logprobs_are_log_softmax_of_the_processed_logits(engine_name, setup):
    adapter, hf_model, prompts = setup
    k = 4
    cases = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=k),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, repetition_penalty=1.5)]
    config = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    engine = PagedEngine(adapter, config) if engine_name == "paged" else HFEngine(adapter, config, model=hf_model)
    for i, prompt in enumerate(prompts):
        for j, params in enumerate(cases):
            engine.add_request(f"{i}-{j}", prompt, params)
    engine.add_request("none", prompts[0], SamplingParams(max_tokens=3, temperature=0))
    outputs = run_to_completion(engine)
    assert outputs["none"].outputs[0].logprobs is None
    for i, prompt in enumerate(prompts):
        for j, params in enumerate(cases):
            completion = outputs[f"{i}-{j}"].outputs[0]
            tokens, reference = hf_reference(hf_model, adapter, prompt, params)
            assert completion.token_ids == tokens
            assert len(completion.logprobs) == len(tokens)
            for token, entry, logprobs in zip(tokens, completion.logprobs, reference):
                assert entry.token_id == token
                assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-5)
                assert len(entry.top) == params.logprobs
                best = logprobs.topk(params.logprobs) if params.logprobs else None
                if best is not None:
                    assert [t for t, _ in entry.top] == best.indices.tolist()
                    assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
                    assert entry.top[0][0] == token  # greedy: the chosen token is the best one


@pytest.mark.gpu
def test_adjustments_and_logprobs_on_cuda_graphs_with_asynchronous_decoding(tiny_qwen):
    """On the GPU, in fp32: CUDA-graph replays with asynchronous decoding (the newest token
    counted from the device) give the tokens of transformers' processors in `generate()`,
    and the logprobs of an eager, synchronous run of the same engine."""
    path = str(tiny_qwen)
    adapter = load_adapter(path)
    cuda = torch.device("cuda")
    hf_model = load_hf_model(path, torch.float32, cuda)
    prompts = [adapter.prepare(qwen_prompt(" ".join(WORDS[i : i + 9]), 0, False), max_tokens=MAX_TOKENS) for i in range(4)]
    params = [_case(name, adapter) for name in CASES]
    config = dict(dtype="float32", device="cuda", num_kv_blocks=256, block_size=16, max_num_seqs=32)
    graphs = PagedEngine(adapter, EngineConfig(**config))
    eager = PagedEngine(adapter, EngineConfig(**config, enforce_eager=True, async_decode=False))
    results = []
    for engine in (graphs, eager):
        for i, prompt in enumerate(prompts):
            for j, p in enumerate(params):
                engine.add_request(f"{i}-{j}", prompt, p)
            engine.add_request(f"{i}-plain", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        results.append(run_to_completion(engine))
    assert graphs.stats.num_graph_replays > 0 and graphs.stats.num_async_decode_steps > 0
    for i, prompt in enumerate(prompts):
        for j, p in enumerate(params):
            ours, reference = results[0][f"{i}-{j}"].outputs[0], results[1][f"{i}-{j}"].outputs[0]
            assert ours.token_ids == hf_reference(hf_model, adapter, prompt, p)[0] == reference.token_ids, (i, j)
            assert [e.logprob for e in ours.logprobs] == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-4)
