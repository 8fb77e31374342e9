"""The reference engine: static batches through Hugging Face `generate()`.

It is deliberately plain, because it is the oracle the fast engine is checked against and
its peer in benchmarks. Each `step()` runs one static batch of requests that share their
sampling settings, then cuts every request at its own end (max_tokens, EOS, stop string).
Structured outputs are a logits processor (`_GrammarMasks`) over the same matchers and
bitmasks as the paged engine's, so both give the same constrained greedy tokens.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)

from vlmbatch.config import EngineConfig
from vlmbatch.engine.base import Engine
from vlmbatch.engine.gpu_images import EncodedImageDecoder
from vlmbatch.engine.loading import load_hf_model, resolve_device, resolve_dtype
from vlmbatch.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.stopping import find_stop
from vlmbatch.engine.structured_decoding import GrammarState, StructuredDecoding
from vlmbatch.errors import RowError
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import PreparedPrompt

DEFAULT_MAX_BATCH_SIZE = 64


@dataclass
class _Request:
    request_id: str
    prompt: PreparedPrompt
    params: SamplingParams


@dataclass
class _Ending:
    """Where one generated sequence ends and why."""

    length: int
    finish_reason: str
    stop_reason: str | int | None = None
    text: str | None = None  # set when a stop string cut the text mid-token


def _batch_key(params: SamplingParams, request: "_Request") -> tuple:
    """Requests in one `generate()` call must share these settings. A seeded sampling
    request runs alone, so its tokens do not depend on what it was batched with. Requests
    with a repetition penalty batch only with prompts of their length: transformers'
    processor would count a padded row's padding as seen tokens."""
    adjustments = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_tokens,
                   params.logit_bias, request.prompt.num_tokens if params.repetition_penalty != 1.0 else None)
    if params.greedy:
        return ("greedy", params.ignore_eos, params.n, adjustments)
    if params.seed is not None:
        return ("seeded", request.request_id)
    return ("sample", params.temperature, params.top_p, params.top_k, params.ignore_eos, params.n, adjustments)


class OpenAIPenaltiesLogitsProcessor(LogitsProcessor):
    """OpenAI's `frequency_penalty` x count + `presence_penalty` over the generated tokens
    (those past `prompt_length`); transformers has no processor for them."""

    def __init__(self, prompt_length: int, frequency_penalty: float, presence_penalty: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency_penalty, presence_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def logits_processors(params: SamplingParams, prompt_length: int, eos_token_ids: list[int],
                      device: torch.device) -> LogitsProcessorList:
    """`params`' logit adjustments as transformers processors, in `SamplingParams`' order, for scores on `device`."""
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(token,): bias for token, bias in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(OpenAIPenaltiesLogitsProcessor(prompt_length, params.frequency_penalty, params.presence_penalty))
    if params.min_tokens > 0 and eos_token_ids:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, eos_token_ids, str(device)))
    return processors


def generate_inputs(hf_model: torch.nn.Module, adapter: ModelAdapter, prompts: list[PreparedPrompt],
                    pad_token_id: int) -> dict[str, torch.Tensor]:
    """What `hf_model.generate()` takes for decoded `prompts`: left-padded ids (generation
    appends on the right) and the media in the processor's batch layout, on the model's
    device, pixels in its dtype. `mm_token_type_ids` (Qwen's M-RoPE needs the per-token
    modality) or `token_type_ids` (Gemma 3's image mask) only where the forward takes it."""
    longest = max(p.num_tokens for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - prompt.num_tokens :] = torch.tensor(prompt.prompt_token_ids, dtype=torch.long)
        attention_mask[row, longest - prompt.num_tokens :] = 1
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
    accepted = inspect.signature(hf_model.forward).parameters
    for key in ("mm_token_type_ids", "token_type_ids"):  # Gemma 3's bidirectional image mask reads token_type_ids
        if key in accepted:
            inputs[key] = adapter.mm_token_type_ids(input_ids)
    inputs.update(adapter.hf_media_inputs([item for p in prompts for item in p.media]))
    device, dtype = next(hf_model.parameters()).device, hf_model.dtype
    return {k: v.to(device, dtype=dtype) if k.startswith("pixel_values") else v.to(device) for k, v in inputs.items()}


class _RequestsDone(StoppingCriteria):
    """Per-row stop test, so `generate()` ends the batch as soon as every row has ended
    (HF's own criteria apply one max length and one stop-string list to the whole batch).
    Only the newest token is looked at, except for rows with stop strings."""

    def __init__(self, engine: "HFEngine", params: list[SamplingParams], prompt_len: int):
        device = engine.device
        self.engine, self.prompt_len = engine, prompt_len
        self.eos = torch.tensor(sorted(engine.eos_token_ids), device=device)
        self.honours_eos = torch.tensor([not p.ignore_eos for p in params], device=device)
        self.max_tokens = torch.tensor([p.max_tokens for p in params], device=device)
        self.stops = {row: p.stop for row, p in enumerate(params) if p.stop}
        self.min_tokens = [p.min_tokens for p in params]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_len
        done = (torch.isin(input_ids[:, -1], self.eos) & self.honours_eos) | (generated >= self.max_tokens)
        for row, stops in self.stops.items():
            if generated >= self.min_tokens[row] and self.engine.find_stop(input_ids[row, self.prompt_len :].tolist(), stops, self.min_tokens[row]):
                done[row] = True
        return done


class _GrammarMasks(LogitsProcessor):
    """Masks the constrained rows' scores each step (before HF's temperature / top-k / top-p
    warpers, as the paged engine masks before sampling); each row's matcher first accepts the
    token generated last. A row whose matcher refused a token (a dead end, or padding after
    its end) is left alone from then on; `HFEngine._completion` re-checks the kept tokens."""

    def __init__(self, structured: StructuredDecoding, states: list[GrammarState | None], prompt_len: int):
        self.structured, self.prompt_len = structured, prompt_len
        self.live = {row: state for row, state in enumerate(states) if state is not None}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            last = input_ids[:, -1].tolist()
            for row, state in list(self.live.items()):
                if not state.accept(last[row]) or state.is_terminated:
                    del self.live[row]
        self.structured.mask(list(self.live.items()), scores)
        return scores


class HFEngine(Engine):
    name = "hf"

    def __init__(self, adapter: ModelAdapter, config: EngineConfig, model: torch.nn.Module | None = None):
        """`model`: an already loaded `transformers` model of the checkpoint (benchmarks, tests)."""
        super().__init__(adapter, config)
        if model is None:
            device = resolve_device(config.device)
            model = load_hf_model(adapter.model_path, resolve_dtype(config.dtype, device), device, config.trust_remote_code)
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch_size = config.max_num_seqs or DEFAULT_MAX_BATCH_SIZE
        self._image_decoder = EncodedImageDecoder(adapter.model_path, self.device)
        self.tokenizer = adapter.processor.tokenizer
        self.eos_token_ids = set(adapter.eos_token_ids)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
        self.structured = StructuredDecoding(self.tokenizer, model.get_output_embeddings().weight.shape[0],
                                             list(adapter.eos_token_ids), self.device, self.max_batch_size,
                                             config.mask_fill_threads)
        self._waiting: OrderedDict[str, _Request] = OrderedDict()

    def add_request(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams) -> None:
        """A constrained request ends when its grammar does, so it honours EOS (as in the paged engine)."""
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} is already queued")
        if params.structured_output is not None and params.ignore_eos:
            params = replace(params, ignore_eos=False)
        self._waiting[request_id] = _Request(request_id, prompt, params)

    def abort_request(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[RequestOutput]:
        """Run the oldest waiting request with up to `max_batch_size - 1` others that share its
        sampling settings; return all of them finished."""
        if not self._waiting:
            return []
        first = next(iter(self._waiting.values()))
        key = _batch_key(first.params, first)
        batch = [r for r in self._waiting.values() if _batch_key(r.params, r) == key]
        batch = batch[: self.max_batch_size]
        for request in batch:
            del self._waiting[request.request_id]
        return self._run_batch(batch)

    def _collate(self, batch: list[_Request]) -> dict[str, torch.Tensor]:
        # Jobs never defer JPEGs for this engine (gpu_images.py); prompts built that way elsewhere are decoded here.
        prompts = []
        for request in batch:
            encoded = [item for item in request.prompt.media if item.encoded is not None]
            decoded = dict(zip(map(id, encoded), self._image_decoder.decode(encoded)))
            prompts.append(replace(request.prompt, media=[decoded.get(id(item), item) for item in request.prompt.media]))
        return generate_inputs(self.model, self.adapter, prompts, self.pad_token_id)

    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        """Every knob set explicitly: `generate()` would otherwise fill unset ones from the
        checkpoint's generation_config.json (e.g. Qwen's repetition_penalty 1.05)."""
        sampling = {} if params.greedy else {
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": max(params.top_k, 0),  # 0 turns HF's default top-k of 50 off
        }
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not params.greedy,
            repetition_penalty=1.0,
            num_beams=1,
            num_return_sequences=params.n,
            # An empty list keeps generate() from stopping at EOS: `_RequestsDone` decides.
            eos_token_id=[] if params.ignore_eos else sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            **sampling,
        )

    def _grammar_states(self, batch: list[_Request]) -> tuple[list[_Request], list[GrammarState | None], list[RequestOutput]]:
        """Each row's started grammar (None: free), waiting for its compile; requests whose
        spec cannot be compiled come back as finished outputs with their error instead."""
        kept, states, failed = [], [], []
        for request in batch:
            spec, n = request.params.structured_output, request.params.n
            row_states = [self.structured.submit(spec) for _ in range(n)] if spec is not None else [None] * n
            error = next((e for e in (state.start() for state in row_states if state is not None) if e is not None), None)
            if error is not None:
                failed.append(self._output(request, [CompletionOutput(i, "", [], "error", error=error) for i in range(n)]))
                continue
            kept.append(request)
            states.extend(row_states)
        return kept, states, failed

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> list[RequestOutput]:
        batch, states, results = self._grammar_states(batch)
        if not batch:
            return results
        params = batch[0].params
        inputs = self._collate(batch)
        prompt_len = inputs["input_ids"].shape[1]
        row_params = [r.params for r in batch for _ in range(params.n)]
        config = self._generation_config(params, max(r.params.max_tokens for r in batch))
        stopping = StoppingCriteriaList([_RequestsDone(self, row_params, prompt_len)])
        masks = [_GrammarMasks(self.structured, states, prompt_len)] if any(states) else []
        processors = logits_processors(params, prompt_len, sorted(self.eos_token_ids), self.device)
        want_logprobs = any(p.logprobs is not None for p in row_params)
        seeded = params.seed is not None and not params.greedy
        # A seeded request gets its own RNG stream and leaves the shared one untouched.
        rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [], enabled=seeded)
        with rng:
            if seeded:
                torch.manual_seed(params.seed)
            out = self.model.generate(**inputs, generation_config=config, stopping_criteria=stopping,
                                      logits_processor=LogitsProcessorList([*processors, *masks]),
                                      output_logits=want_logprobs, return_dict_in_generate=want_logprobs)
        sequences = out.sequences if want_logprobs else out
        # logprobs as the paged engine defines them: after the adjustments, before the grammar's mask
        logprobs = self._logprobs(sequences, out.logits, processors, prompt_len, row_params) if want_logprobs else None
        rows = sequences[:, prompt_len:].tolist()
        for i, request in enumerate(batch):
            row = i * params.n
            completions = [
                self._completion(index, rows[row + index], request.params, states[row + index],
                                 logprobs[row + index] if logprobs else None)
                for index in range(params.n)
            ]
            results.append(self._output(request, completions))
        return results

    @staticmethod
    def _output(request: _Request, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(request_id=request.request_id, prompt=request.prompt.prompt,
                             prompt_token_ids=list(request.prompt.prompt_token_ids), outputs=completions, finished=True)

    def _logprobs(self, sequences: torch.Tensor, logits: tuple[torch.Tensor, ...], processors: LogitsProcessorList,
                  prompt_len: int, row_params: list[SamplingParams]) -> list[list[TokenLogprob] | None]:
        """Per row, each step's logprobs as the paged engine defines them: the raw logits
        `generate()` returns, through the batch's processors (not its temperature or top-k)."""
        k = max(p.logprobs for p in row_params if p.logprobs is not None)
        steps = []
        for step, step_logits in enumerate(logits):
            scores = processors(sequences[:, : prompt_len + step], step_logits.float())
            logprobs = scores.log_softmax(dim=-1)
            chosen = logprobs.gather(1, sequences[:, prompt_len + step].unsqueeze(1)).squeeze(1)
            best = logprobs.topk(k, dim=-1) if k else None
            steps.append((chosen.tolist(), best.indices.tolist() if best else None, best.values.tolist() if best else None))
        result = []
        for row, params in enumerate(row_params):
            if params.logprobs is None:
                result.append(None)
                continue
            n = params.logprobs
            result.append([
                TokenLogprob(int(sequences[row, prompt_len + step]), chosen[row],
                             list(zip(ids[row][:n], values[row][:n])) if n else [])
                for step, (chosen, ids, values) in enumerate(steps)
            ])
        return result

    def find_stop(self, tokens: list[int], stops: tuple[str, ...], min_tokens: int) -> tuple[int, str] | None:
        """The first stop string in the text of `tokens` that ends at or after token
        `min_tokens` (stop strings count from there on, as in the paged engine)."""
        since = len(self.tokenizer.decode(tokens[: min_tokens - 1], skip_special_tokens=True)) if min_tokens > 1 else 0
        return find_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), stops, since)

    def _ending(self, tokens: list[int], params: SamplingParams) -> _Ending:
        """Where a generated row ends for `params`: the earliest of EOS, a stop string and
        max_tokens (anything after it, e.g. padding of a row that ended early, is ignored)."""
        limit = min(len(tokens), params.max_tokens)
        eos_at = None
        if not params.ignore_eos:
            eos_at = next((i for i, t in enumerate(tokens[:limit]) if t in self.eos_token_ids), None)
        if eos_at is not None:
            limit = eos_at + 1
        if params.stop and limit >= params.min_tokens and self.find_stop(tokens[:limit], params.stop, params.min_tokens):
            return self._stop_string_ending(tokens[:limit], params.stop, params.min_tokens)
        if eos_at is not None:
            return _Ending(limit, "stop", tokens[eos_at])
        return _Ending(limit, "length")

    def _stop_string_ending(self, tokens: list[int], stops: tuple[str, ...], min_tokens: int) -> _Ending:
        """The shortest prefix (of at least `min_tokens`) whose text has a stop string; the text is cut before it."""
        for length in range(max(1, min_tokens), len(tokens) + 1):
            hit = self.find_stop(tokens[:length], stops, min_tokens)
            if hit is not None:
                text = self.tokenizer.decode(tokens[:length], skip_special_tokens=True)
                return _Ending(length, "stop", hit[1], text[: hit[0]])
        raise AssertionError("a stop string was found in the full text but in no prefix")

    def _completion(self, index: int, tokens: list[int], params: SamplingParams, grammar: GrammarState | None,
                    logprobs: list[TokenLogprob] | None = None) -> CompletionOutput:
        ending = self._ending(tokens, params)
        kept = tokens[: ending.length]
        text = ending.text if ending.text is not None else self.tokenizer.decode(kept, skip_special_tokens=True)
        error: RowError | None = None
        if grammar is not None:  # the matcher replays the kept tokens (the processor saw all but the last)
            if not grammar.sync(kept):
                error = grammar.dead_end()
            elif ending.finish_reason == "length":
                error = grammar.incomplete()
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=kept,
            finish_reason=ending.finish_reason,
            stop_reason=ending.stop_reason,
            error=error,
            logprobs=logprobs[: ending.length] if logprobs is not None else None,
        )
