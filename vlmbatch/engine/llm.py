"""`LLM`: the offline Python API (media → adapter → engine), shaped like vLLM's.

`generate`/`chat` are for people; `run` is the lower level the batch runner and the server
share: it drives `add_request`/`step` until the given requests are finished.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from vlmbatch.config import EngineConfig, MediaConfig
from vlmbatch.engine.factory import create_engine
from vlmbatch.engine.outputs import RequestOutput
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.prompt import PreparedPrompt
from vlmbatch.families.registry import load_adapter
from vlmbatch.structured.spec import STRUCTURED_KEYS, parse_structured_output, resolve

PromptInput = str | dict[str, Any]
Request = tuple[str, PreparedPrompt, SamplingParams]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One `SamplingParams` for all prompts, or one each."""
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _constrained(params: list[SamplingParams], structured: dict[str, Any]) -> list[SamplingParams]:
    """`generate`/`chat`'s vLLM-like keywords (`response_format=`, `guided_json=` (a schema or a
    pydantic model class), `guided_choice=`, `guided_regex=`, `guided_grammar=`) over every
    prompt's params; then every distinct spec is checked, so a bad one raises its `RowError`
    (`invalid_row`, `param` naming the key) before anything runs."""
    from vlmbatch.structured.grammar import build_grammar

    unknown = sorted(set(structured) - set(STRUCTURED_KEYS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; structured outputs take one of {', '.join(STRUCTURED_KEYS)}")
    spec = parse_structured_output(structured)
    if spec is not None:
        params = [replace(p, structured_output=resolve(spec)) for p in params]
    for distinct in {p.structured_output for p in params if p.structured_output is not None}:
        build_grammar(distinct)
    return params


class LLM:
    """A model loaded once, with its adapter and engine.

    >>> llm = LLM("Qwen/Qwen2.5-VL-3B-Instruct")
    >>> llm.generate({"prompt": "...<|vision_start|><|image_pad|><|vision_end|>...",
    ...               "multi_modal_data": {"image": img}}, SamplingParams(max_tokens=32))

    Engine options (`engine`, `dtype`, `device`, `max_num_seqs`, `attention_backend`, ... see
    `EngineConfig`) are keywords, over `VLMBATCH_*` variables, over defaults; `config` passes
    a whole `EngineConfig` instead (the CLI and workers build one at their edge). An unknown
    option is a `ConfigError` that names it.
    """

    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        *,
        chat_template: str | None = None,
        media_io_kwargs: dict[str, Any] | None = None,
        media_config: MediaConfig | None = None,
        **engine_options: Any,
    ):
        from vlmbatch.media.loader import MediaLoader

        if config is None:
            config = EngineConfig.from_env(os.environ, **engine_options)
        elif engine_options:
            config = config.updated(**engine_options)
        self.config = config
        self.model_name = str(model)
        # chat() loads image_url/video_url parts like a batch job would: local paths allowed.
        self.media = MediaLoader(media_config or MediaConfig.from_env(os.environ), media_io_kwargs=media_io_kwargs)
        self.adapter = load_adapter(self.model_name, chat_template=chat_template, trust_remote_code=config.trust_remote_code)
        self.engine = create_engine(self.adapter, config)
        self.tokenizer = self.adapter.processor.tokenizer
        self._request_ids = itertools.count()

    def _next_request_id(self) -> str:
        return f"llm-{next(self._request_ids)}"

    def _prepare(self, prompt: PromptInput, params: SamplingParams) -> PreparedPrompt:
        params.check_vocabulary(len(self.tokenizer))
        if isinstance(prompt, str):
            return self.adapter.prepare(prompt, max_tokens=params.max_tokens)
        if not isinstance(prompt, dict) or not isinstance(prompt.get("prompt"), str):
            raise TypeError(f'a prompt is a str or {{"prompt": str, "multi_modal_data": ...}}, got {prompt!r}')
        unknown = set(prompt) - {"prompt", "multi_modal_data", "mm_processor_kwargs"}
        media = prompt.get("multi_modal_data") or {}
        unknown |= {f"multi_modal_data.{k}" for k in set(media) - {"image", "video"}}
        if unknown:
            raise ValueError(f"unknown prompt keys: {sorted(unknown)}")
        return self.adapter.prepare(
            prompt["prompt"], _as_list(media.get("image")), _as_list(media.get("video")), max_tokens=params.max_tokens,
            processor_kwargs=prompt.get("mm_processor_kwargs"),
        )

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **structured_output: Any,
    ) -> list[RequestOutput]:
        """Generate for raw prompts (the model's own format, media placeholders included);
        outputs come back in input order. A bad prompt raises its `RowError`.
        `SamplingParams(structured_output=...)` or a keyword (`_constrained`) constrains the text."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _constrained(_per_prompt(sampling_params, len(prompt_list)), structured_output)
        requests = [(self._next_request_id(), self._prepare(p, sp), sp) for p, sp in zip(prompt_list, params)]
        return self._run_in_order(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **structured_output: Any,
    ) -> list[RequestOutput]:
        """Generate for OpenAI-style conversations (one, or a list of them) through the
        model's chat template; `image_url`/`video_url` parts are loaded, `image_pil` parts
        (a PIL image under "image_pil") are used as they are. Structured outputs as in `generate`."""
        from vlmbatch.chat import parse_chat_messages

        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        params = _constrained(_per_prompt(sampling_params, len(conversations)), structured_output)
        requests = []
        for conversation, sp in zip(conversations, params):
            _, image_refs, video_refs = parse_chat_messages(conversation)
            prompt = self.adapter.apply_chat_template(conversation)
            images = [self.media.image(ref, f"image[{i}]") for i, ref in enumerate(image_refs)]
            videos = [self.media.video(ref, f"video[{i}]", convention=self.adapter.frame_convention) for i, ref in enumerate(video_refs)]
            sp.check_vocabulary(len(self.tokenizer))
            prepared = self.adapter.prepare(prompt, images, videos, max_tokens=sp.max_tokens)
            requests.append((self._next_request_id(), prepared, sp))
        return self._run_in_order(requests, use_tqdm)

    def _run_in_order(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        if not use_tqdm:
            results = self.run(requests)
        else:
            from rich.progress import Progress

            with Progress(transient=True) as progress:
                task = progress.add_task("generating", total=len(requests))
                results = self.run(requests, on_output=lambda _: progress.advance(task))
        return [results[request_id] for request_id, _, _ in requests]

    def run(
        self, requests: Sequence[Request], on_output: Callable[[RequestOutput], None] | None = None
    ) -> dict[str, RequestOutput]:
        """Add `requests` to the engine and step it until all of them are finished; returns
        their outputs by request id. `on_output` sees each one as it finishes."""
        pending = {request_id for request_id, _, _ in requests}
        for request_id, prompt, params in requests:
            self.engine.add_request(request_id, prompt, params)
        results: dict[str, RequestOutput] = {}
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped requests {sorted(pending)}")
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        if on_output is not None:
                            on_output(output)
        finally:
            for request_id in pending:  # an error or interrupt must not leave them queued
                self.engine.abort_request(request_id)
        return results
