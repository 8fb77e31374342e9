"""The fast engine: continuous batching over a paged KV cache with our own decoders.

`PagedEngine.step()` = schedule (scheduler + block manager) → encode the media the
step's prompts read (vision tower, batched, cached by content) → one forward + sampling
(runner) → append tokens, detokenise incrementally, check EOS / stop strings / length.

Decode steps are asynchronous (`EngineConfig.async_decode`; `VLMBATCH_ASYNC_DECODE=0` turns it off):
while step n runs on the GPU the host already launches
step n + 1, whose input tokens are step n's samples still on the device, and only then
reads step n's tokens and checks them. Each sequence carries a placeholder for its token
in flight, so lengths, positions and block allocation are right for the next step; a
sequence that turns out to have finished at step n wastes its slot in step n + 1, whose
token is dropped. Whenever the next step is not a pure decode of the same sequences (an
admission, a preemption, an abort), the step in flight is finished first.

Structured outputs (`SamplingParams.structured_output`, engine/structured_decoding.py): a
constrained request waits outside the scheduler until its grammar is compiled (in the
background), then runs beside free rows; after each forward the constrained rows' logits
are masked before sampling. The mask of step n + 1 needs step n's token, so a decode step
with constrained rows is launched as usual, then waits for step n's tokens, fills the
masks on the host while the forward runs, and only then queues the mask and the sampling:
the host wait a free batch does after launching its step, moved before the sampling.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field, replace

import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.attention import create_backend, resolve_backend
from vlmbatch.engine.base import Engine, EngineLoad
from vlmbatch.engine.block_manager import BlockManager
from vlmbatch.engine.gpu_images import EncodedImageDecoder
from vlmbatch.engine.kernel_choice import choose_kernels
from vlmbatch.engine.dummy_weights import dummy_hf_model
from vlmbatch.engine.loading import load_hf_model, quantization_scheme, resolve_device, resolve_dtype
from vlmbatch.engine.multimodal import place_media
from vlmbatch.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from vlmbatch.engine.runner import ModelRunner, PendingTokens
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.engine.scheduler import ScheduledBatch, Scheduler
from vlmbatch.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from vlmbatch.engine.stopping import IncrementalDetokenizer, find_stop
from vlmbatch.engine.structured_decoding import StructuredDecoding
from vlmbatch.engine.weight_loading import CheckpointTensors
from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import PreparedPrompt

log = logging.getLogger(__name__)
# Scheduler limits when the configuration leaves them unset: (sequences, tokens per step).
# On GPUs of >= 70 GiB these are vLLM's offline defaults on the same cards (its peer runs with
# them); 1024 sequences more than halved Qwen3-VL-30B-A3B's W1 decode time against 512 on the
# H200 (every MoE decode step reads nearly all experts, so its cost per step barely grows).
LARGE_GPU_LIMITS, SMALL_LIMITS, LARGE_GPU_BYTES = (1024, 16384), (256, 8192), 70 * 2**30


def scheduler_limits(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the configured values, else the device's defaults."""
    large = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
    seqs, tokens = LARGE_GPU_LIMITS if large else SMALL_LIMITS
    return config.max_num_seqs or seqs, config.max_num_batched_tokens or tokens


@dataclass
class EngineStats:
    """Counters the tests and benchmarks read to see which mechanisms actually ran."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefills: int = 0
    num_prefix_hit_tokens: int = 0
    num_forked_tokens: int = 0  # prompt tokens the samples of n > 1 requests shared instead of computing
    num_window_freed_blocks: int = 0  # blocks sliding-window KV groups freed while their sequence ran on
    num_graph_replays: int = 0
    num_encoded_media: int = 0
    num_encoder_cache_hits: int = 0
    num_staged_media: int = 0  # media items whose pixels were uploaded while an earlier step ran (`stage_media`)
    num_staged_media_used: int = 0  # of their uploaded tensors, those an encode took
    num_generated_tokens: int = 0
    num_async_decode_steps: int = 0  # decode steps launched on the previous step's tokens still on the device
    num_mixed_decode_rows: int = 0  # decoding rows that rode along in prefill steps (as a decode batch there)
    # Wall seconds per phase (benchmarks read them to see where a run's time goes).
    # `*_launch_s`: host time building inputs and launching the forward; `*_wait_s`:
    # then waiting for the GPU (sampled tokens copied back); `vision_s` is synced only
    # when `PagedEngine.time_phases` is on; `host_s`: scheduling, appending tokens,
    # detokenising and building outputs.
    vision_s: float = 0.0
    prefill_launch_s: float = 0.0
    prefill_wait_s: float = 0.0
    decode_launch_s: float = 0.0
    decode_wait_s: float = 0.0
    host_s: float = 0.0


@dataclass
class _InFlight:
    """A launched decode step whose tokens were not read yet."""

    batch: ScheduledBatch
    pending: PendingTokens
    waited_s: float = field(default=0.0)


class PagedEngine(Engine):
    name = "paged"

    def __init__(self, adapter: ModelAdapter, config: EngineConfig, hf_model: torch.nn.Module | None = None):
        """`hf_model`: an already loaded `transformers` model of the checkpoint on the target
        device (benchmarks); its language model is taken over and dropped from it.
        `config.min_admission_batch`: see `Scheduler` (1 = admit as soon as a slot is free);
        64 gave W1 72.8 / W2 45.1 req/s on the H200 against 62.6 / 22.5 with 1 (BENCHMARKS.md)."""
        super().__init__(adapter, config)
        self.device = device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.max_model_len = min(config.max_model_len or adapter.max_model_len, adapter.max_model_len)
        block_size = config.block_size or (16 if device.type == "cpu" else 256)
        max_num_seqs, max_num_batched_tokens = scheduler_limits(config, device)
        backend_name, backend_reason = resolve_backend(config.attention_backend, device)
        kernels = choose_kernels(config, device, backend_name)
        if config.kv_cache_dtype == "fp8" and backend_name == "flash-attn":
            raise JobError("kv_cache_dtype fp8 runs with the triton or torch attention backend, not flash-attn")
        scheme = quantization_scheme(adapter.model_path, config.quantization, config.quantize_vision, config.trust_remote_code)
        dummy = config.load_format == "dummy"
        prequantized = scheme is not None and scheme.prequantized and not dummy
        engine_model = adapter.family.parts().ENGINE_MODEL
        if hf_model is None and dummy:
            hf_model = dummy_hf_model(adapter.model_path, dtype, device, config.trust_remote_code)
        elif hf_model is None:  # a pre-quantized checkpoint: transformers never builds its language model (`weight_loading.py`)
            skip = (f"model.{engine_model.language_model_attr}", "lm_head") if prequantized else ()
            hf_model = load_hf_model(adapter.model_path, dtype, device, config.trust_remote_code, skip=skip)
        image_decoder = EncodedImageDecoder(adapter.model_path, device)
        checkpoint = CheckpointTensors(adapter.model_path) if prequantized else None
        self.model = engine_model.build(hf_model, device, dtype, kernels, image_decoder, scheme, checkpoint, dummy)
        self.model.encoder_cache_size = config.encoder_cache_size
        self.model.encoder_cache_bytes = config.encoder_cache_mb << 20
        self.backend = create_backend(backend_name, kernels.pdl_max_rows)
        self.runner = ModelRunner(
            self.model, self.backend, device, block_size, max_num_seqs, max_num_batched_tokens,
            self.max_model_len, config.num_kv_blocks, config.gpu_memory_utilization, config.enforce_eager,
            frozenset(adapter.eos_token_ids),
            torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else None,
        )
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size, config.enable_prefix_caching,
                                          self.runner.kv_layout.windows)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, config.min_admission_batch)
        self.capacity = self.block_manager.max_tokens_alone(max_num_batched_tokens)  # the longest sequence that runs alone
        self.tokenizer = adapter.processor.tokenizer
        self.eos_token_ids = set(adapter.eos_token_ids)
        self.structured = StructuredDecoding(self.tokenizer, self.model.decoder.embed_tokens.num_embeddings,
                                             list(adapter.eos_token_ids), device, max_num_seqs, config.mask_fill_threads)
        self._compiling: list[Sequence] = []  # constrained sequences whose grammar is still compiling
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences
        self._unforked: dict[str, list[Sequence]] = {}  # request id -> samples waiting for the first's prompt
        self.stats = EngineStats()
        self.time_phases = False  # sync after the vision tower so `stats.vision_s` is its own time
        # Launch decode step n + 1 before reading step n's tokens (module docstring).
        self.async_decode = config.async_decode
        self.stage_media = config.stage_media  # upload the next prompts' pixels during each step (`media_staging.py`)
        self.decodes_images_on_gpu = device.type == "cuda"
        self._in_flight: _InFlight | None = None
        kv_gib = self.runner.num_kv_blocks * self.runner.block_bytes / 2**30
        layout = self.runner.kv_layout
        groups = "" if layout.num_groups == 1 else (
            f" in {layout.num_groups} groups of {layout.layers_per_group} layers (windows {', '.join(map(str, layout.windows))})")
        log.info("paged engine: %s on %s in %s%s; attention %s (%s); kernels: %s; KV cache %d blocks of %d tokens%s "
                 "(%.1f GiB %s, %s); max %d sequences, %d tokens per step; %s decoding",
                 adapter.family.name, device, str(dtype).removeprefix("torch."),
                 f", weights {scheme.describe()}{'' if kernels.fp8 else ' dequantized (no FP8 GEMMs here)'}" if scheme else "",
                 backend_name, backend_reason,
                 kernels.describe(), self.runner.num_kv_blocks, block_size, groups, kv_gib, str(self.runner.kv_dtype).removeprefix("torch."),
                 "as configured" if config.num_kv_blocks else "sized from free memory", max_num_seqs,
                 max_num_batched_tokens, "asynchronous" if self.async_decode else "awaited")

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams) -> None:
        """Queue a request; n > 1 becomes n sequences (seeds seed, seed + 1, ...). Only the
        first is scheduled; the others fork from it once its prompt is computed and share
        its prompt's KV blocks (`BlockManager.fork`), with or without prefix caching."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        mm = place_media(self.model, prompt, self.runner.dtype) if prompt.media else None
        total = prompt.num_tokens + params.max_tokens
        # A prompt chunk is at most the step's budget, or one bidirectional span (`Scheduler`).
        longest_span = max((end - start for start, end in mm.bidirectional_spans), default=0) if mm is not None else 0
        capacity = (self.block_manager.max_tokens_alone(longest_span) if longest_span > self.scheduler.max_num_batched_tokens
                    else self.capacity)
        if total > min(self.max_model_len, capacity):
            raise RowError(
                ErrorType.PROMPT_TOO_LONG,
                f"prompt of {prompt.num_tokens} tokens + max_tokens {params.max_tokens} exceeds "
                f"the engine's limit of {min(self.max_model_len, capacity)} tokens",
                "prompt",
            )
        spec = params.structured_output
        group = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            seq = Sequence(request_id, list(prompt.prompt_token_ids), replace(params, n=1, seed=seed),
                           prompt=prompt.prompt, mm=copy.copy(mm), index=index,
                           detokenizer=IncrementalDetokenizer(self.tokenizer),
                           grammar=self.structured.submit(spec) if spec is not None else None)
            group.append(seq)
        first = group[0]
        if first.grammar is None:
            self.scheduler.add(first)
        else:
            self._compiling.append(first)  # the other samples fork from it, so their grammar is compiled by then
        if len(group) > 1:
            self._unforked[request_id] = group[1:]
        self.requests[request_id] = group

    def abort_request(self, request_id: str) -> None:
        self._unforked.pop(request_id, None)
        for seq in self.requests.pop(request_id, []):
            if seq in self._compiling:
                self._compiling.remove(seq)
            else:
                self.scheduler.remove(seq)
            seq.status = SequenceStatus.FINISHED

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def load(self) -> EngineLoad:
        blocks = self.block_manager.num_blocks
        used = 1.0 - self.block_manager.num_free_blocks / blocks if blocks else 0.0
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), used)

    # ---- stepping ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._admit_compiled() if self._compiling else []
        return outputs + self._step()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the sequences whose grammar is compiled to the scheduler; end those whose spec
        could not be compiled. Waits for a compile only when nothing else could run."""
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            wait([seq.grammar.future for seq in self._compiling], return_when=FIRST_COMPLETED)
        progressed = {}
        for seq in [s for s in self._compiling if s.grammar.ready()]:
            self._compiling.remove(seq)
            error = seq.grammar.start()
            if error is None:
                self.scheduler.add(seq)
                continue
            for sample in [seq, *self._unforked.pop(seq.request_id, [])]:
                sample.error = error
                self._finish(sample, "error")
            progressed[seq.request_id] = None
        return self._outputs(progressed)

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        in_flight = self._in_flight
        if in_flight is not None and not (self.async_decode and self.scheduler.decodes_next(in_flight.batch.seqs)):
            self._in_flight = None
            outputs = self._take_tokens(in_flight)
            self.stats.decode_wait_s += in_flight.waited_s
            self.stats.host_s += time.perf_counter() - started - in_flight.waited_s
            return outputs
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        scheduled = time.perf_counter()
        if self._encode_media(batch) and self.time_phases and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only after the tower ran: a decode step in flight must not be waited for here
        encoded = time.perf_counter()
        self._stage_upcoming()
        constrained = any(seq.grammar is not None for seq in batch.seqs)
        if batch.is_prefill or not self.async_decode:
            pending = self.runner.run(batch, self._mask if constrained else None)
            ran = time.perf_counter()
            self.scheduler.finish_step(batch)
            self._count(batch)
            outputs = self._take(pending.seqs, pending.wait(), pending.token_logprobs())
            self._time(batch, scheduled - started + time.perf_counter() - ran, encoded - scheduled, ran - encoded)
            return outputs
        # A decode step: launch it on the previous step's tokens, then read those (before
        # the sampling when rows are constrained: their masks need those tokens).
        outputs: list[RequestOutput] = []

        def take_then_mask(seqs: list[Sequence], logits: torch.Tensor) -> None:
            if in_flight is not None:
                outputs.extend(self._take_tokens(in_flight))
            self._mask(seqs, logits)

        pending = self.runner.launch(batch, in_flight.pending.tokens if in_flight is not None else None,
                                     take_then_mask if constrained else None)
        self.stats.num_async_decode_steps += in_flight is not None
        launched = time.perf_counter()
        if in_flight is not None and not constrained:
            outputs = self._take_tokens(in_flight)
        self.scheduler.finish_step(batch)
        self._count(batch)
        for seq in batch.seqs:
            if not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER)
        self._in_flight = _InFlight(batch, pending)
        waited = in_flight.waited_s if in_flight is not None else 0.0
        if constrained:  # that wait happened inside the launch: count it as waiting, not launching
            self.runner.last_launch_s -= waited
            waited = 0.0
        self._time(batch, scheduled - started + time.perf_counter() - launched - waited, encoded - scheduled, launched - encoded + waited)
        return outputs

    def _take_tokens(self, in_flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and take them (finished sequences' dropped)."""
        waiting = time.perf_counter()
        tokens = in_flight.pending.wait()
        in_flight.waited_s = time.perf_counter() - waiting
        pending = in_flight.pending
        live = [row for row in zip(pending.seqs, tokens, pending.token_logprobs()) if not row[0].is_finished]
        return self._take([row[0] for row in live], [row[1] for row in live], [row[2] for row in live])

    def _mask(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Structured-output masks on the logits rows of the constrained `seqs`."""
        self.structured.mask([(row, seq.grammar) for row, seq in enumerate(seqs) if seq.grammar is not None and not seq.is_finished],
                             logits)

    def _take(self, seqs: list[Sequence], tokens: list[int], logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:
        """Append each sequence's token (and its logprobs), retire finished ones, and build the outputs."""
        progressed = {}
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if seq.request_id in self._unforked and seq.num_output_tokens == 0:
                self._fork(seq)
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._append(seq, token)
            self.stats.num_generated_tokens += 1
            if seq.is_finished:
                self.scheduler.remove(seq)
                progressed[seq.request_id] = None
            elif self.stream_outputs:
                progressed[seq.request_id] = None
        return self._outputs(progressed)

    def _outputs(self, progressed: dict[str, None]) -> list[RequestOutput]:
        """The outputs of the requests that progressed; finished ones are forgotten."""
        outputs = [self._output(request_id) for request_id in progressed]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    def _fork(self, first: Sequence) -> None:
        """The request's other samples, now that `first` computed the prompt, share its blocks
        and media embeddings and are scheduled next."""
        samples = self._unforked.pop(first.request_id)
        for seq in samples:
            seq.mm = copy.copy(first.mm)
            self.block_manager.fork(first, seq)
            if seq.grammar is not None:
                seq.grammar.start()  # compiled: `first` started on the same spec
        self.scheduler.add_first(samples)

    def _time(self, batch: ScheduledBatch, host_s: float, vision_s: float, forward_s: float) -> None:
        s, launch_s = self.stats, self.runner.last_launch_s
        s.host_s += host_s
        s.vision_s += vision_s
        if batch.is_prefill:
            s.prefill_launch_s += launch_s
            s.prefill_wait_s += forward_s - launch_s
        else:
            s.decode_launch_s += launch_s
            s.decode_wait_s += forward_s - launch_s

    def _encode_media(self, batch: ScheduledBatch) -> bool:
        """Embed the media items this step's forward reads and the sequence does not hold:
        those whose placeholders end after its computed tokens. The items inside a
        prefix-cache hit are never read, so never encoded; a sequence preempted back to
        fewer computed tokens gets the ones it now reads. True when the tower ran."""
        needed = [(s.mm, s.num_computed_tokens, s.mm.missing(s.num_computed_tokens))
                  for s in batch.seqs if s.mm is not None and s.num_computed_tokens < s.mm.embeds_from]
        items = [[mm.items[i] for i in indices] for mm, _, indices in needed if indices]
        rows = iter(self.model.encode(items) if items else ())
        for mm, start, indices in needed:
            mm.hold(indices, next(rows) if indices else None, start)
        return bool(items)

    def _stage_upcoming(self) -> None:
        """With `stage_media`, once a step's media are encoded: upload (in the background) the
        media the prompts the next admission would take will encode, while the GPU runs it
        (none once the queue is empty, which drops what is still staged)."""
        if self.stage_media:
            self.model.stage([seq.mm.items[i] for seq in self.scheduler.upcoming() if seq.mm is not None
                              for i in seq.mm.missing(seq.num_computed_tokens)])

    def _append(self, seq: Sequence, token: int) -> None:
        """The sampled token in place of the placeholder (asynchronous decoding) or after
        the last token, then the checks that may end the sequence."""
        if seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids[-1] = token
        else:
            seq.token_ids.append(token)
        params, grammar = seq.params, seq.grammar
        if grammar is not None and not grammar.accept(token):  # an empty mask's forced stop token
            seq.error = grammar.dead_end()
            self._finish(seq, "stop", token)
            return
        if seq.num_output_tokens < params.min_tokens:
            if params.stop or self.stream_outputs:
                seq.text += seq.detokenizer.step(token)  # stop strings count only from min_tokens on
            return
        # A constrained row ends when its grammar does (it allows EOS only then), ignore_eos or not.
        if token in self.eos_token_ids and (not params.ignore_eos or grammar is not None):
            self._finish(seq, "stop", token)
            return
        # Without stop strings or streaming, the text is decoded once, when the sequence ends.
        if (params.stop or self.stream_outputs) and self._extend_text(seq, token):
            return
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            seq.error = grammar.incomplete() if grammar is not None else None
            self._finish(seq, "length")

    def _extend_text(self, seq: Sequence, token: int) -> bool:
        """Detokenise `token` onto the text; True when a stop string ended the sequence."""
        previous = len(seq.text)
        seq.text += seq.detokenizer.step(token)
        hit = find_stop(seq.text, seq.params.stop, previous)
        if hit is not None:
            self._finish(seq, "stop", hit[1], text=seq.text[: hit[0]])
        return hit is not None

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None, text: str | None = None) -> None:
        """The stream holds back incomplete characters; a finished text is the full decode
        (as `generate()` + `decode` give it) unless a stop string cut it."""
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        seq.text = text if text is not None else self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def _output(self, request_id: str) -> RequestOutput:
        group = self.requests[request_id]
        completions = [  # `output_token_ids` is a fresh slice: no copy needed
            CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason, s.stop_reason, s.error,
                             None if s.logprobs is None else list(s.logprobs)) for s in group
        ]
        first = group[0]
        return RequestOutput(request_id, first.prompt, first.prompt_token_ids, completions, all(s.is_finished for s in group))

    def _count(self, batch: ScheduledBatch) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_prefill_steps += batch.is_prefill
        s.num_decode_steps += not batch.is_prefill
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_chunked_prefills = self.scheduler.num_chunked_prefills
        s.num_prefix_hit_tokens = self.block_manager.num_prefix_hit_tokens
        s.num_forked_tokens = self.block_manager.num_forked_tokens
        s.num_window_freed_blocks = self.block_manager.num_window_freed_blocks
        s.num_graph_replays = self.runner.num_graph_replays
        s.num_mixed_decode_rows = self.runner.num_mixed_decode_rows
        s.num_encoded_media = self.model.num_encoded_items
        s.num_encoder_cache_hits = self.model.num_encoder_cache_hits
        s.num_staged_media, s.num_staged_media_used = self.model.media.num_staged, self.model.media.num_taken
